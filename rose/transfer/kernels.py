"""The codec's two per-element loops, compiled (numba): finding changed elements and scattering
gap-coded ones.

numpy needs several passes and temporaries for each (compare, nonzero, gather; then cumsum and a
fancy-index scatter), and at RL densities (0.6-5% of elements changed) those passes, not memory
bandwidth, bound a sync on CPU. Each loop here is one pass. Both release the GIL, so the sync
threads of senders and receivers run them in parallel.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def find_changed(base: np.ndarray, new: np.ndarray, base_words: np.ndarray, new_words: np.ndarray,
                 lanes: int, idx: np.ndarray, vals: np.ndarray, advance: bool) -> int:
    """Writes the flat positions where `base` and `new` (same-width integer views) differ, in
    order, to `idx` and `new`'s values there to `vals` (both at least `base.size` long); returns
    how many. `*_words` are the same arrays' leading whole 8-byte words, of `lanes` (4 or 2)
    elements each (views made by the caller: numba's own views index slower). With `advance`,
    `base` takes `new`'s values too.

    Compares words first (most are equal at RL densities) and stores branch-free inside a word
    that differs: the position is always written and the count moves on only on a change.
    """
    k = 0
    for w in range(base_words.size):
        if base_words[w] != new_words[w]:
            for j in range(4):  # a constant trip count, unrolled: 1.4x faster than range(lanes)
                if j < lanes:
                    i = w * lanes + j
                    idx[k] = i
                    vals[k] = new[i]
                    k += base[i] != new[i]
            if advance:
                base_words[w] = new_words[w]
    for i in range(base_words.size * lanes, base.size):
        idx[k] = i
        vals[k] = new[i]
        k += base[i] != new[i]
        if advance:
            base[i] = new[i]
    return k


@numba.njit(nogil=True, cache=True)
def scatter_gaps(target: np.ndarray, gaps: np.ndarray, escapes: np.ndarray, vals: np.ndarray) -> None:
    """`target[i_k] = vals[k]` where `i_k` advances by `gaps[k]` from -1, a gap of 0 taking the
    next of `escapes` (int64: an unsigned one would make the position a float) instead. The
    caller has checked that the positions stay in range."""
    pos, e = -1, 0
    for k in range(gaps.size):
        g = gaps[k]
        if g == 0:
            pos += escapes[e]
            e += 1
        else:
            pos += g
        target[pos] = vals[k]
