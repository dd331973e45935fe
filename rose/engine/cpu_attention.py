"""Decode attention on the CPU that reads K and V in place in the pool's pages (numba).

A decode has one query per sequence, so SDPA over gathered pages is bound by memory traffic:
the gather reads every page and writes a copy, SDPA reads the copy again. This kernel reads each
page once, where it lies, for all the query heads that share its KV head (GQA), and runs the
(sequence, KV head) pairs in parallel. About twice as fast as gather + SDPA on the `small` preset
(docs/engine.md). CPU float32 only: numba has no bfloat16.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import prange

# numba's fallback threading layer (workqueue) aborts when two threads launch parallel kernels
# at once; engines may step on different threads.
_LAUNCH = threading.Lock()
# A parallel launch waits for every thread: 5 us more than one thread's on an idle machine, 130
# when another process holds a core (measured, one sequence of SmolLM2). One thread reads about
# 20 (context token x KV head) a microsecond, so below this much work it loses at most 50 us
# idle and saves the wait under load.
PARALLEL_MIN_WORK = 2048


@numba.njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _decode(q: np.ndarray, rows: np.ndarray, pages: np.ndarray, offset: int, lengths: np.ndarray,
            block_size: int, scale: float, out: np.ndarray) -> None:
    """q, out `[seqs, kv_heads, group, D]`; rows: the pool's `[rows, block_size * D]`; pages
    `[kv_heads, seqs, width]`: each page's K row for layer 0 (`offset` moves it to this layer;
    its V row follows `kv_heads` rows later); lengths `[seqs]`: tokens attended to."""
    seqs, kv_heads, group, dim = q.shape
    # Head-major jobs: the sequences come longest first, and prange hands each thread one
    # contiguous run of jobs; this way every run holds sequences of every length.
    for job in prange(seqs * kv_heads):
        h, b = job // seqs, job % seqs
        n = lengths[b]
        blocks = (n + block_size - 1) // block_size
        scaled = q[b, h] * np.float32(scale)
        scores = np.empty((group, n), np.float32)
        for w in range(blocks):
            keys = rows[pages[h, b, w] + offset]
            for j in range(min(block_size, n - w * block_size)):
                key = keys[j * dim:(j + 1) * dim]
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += scaled[g, d] * key[d]
                    scores[g, w * block_size + j] = s
        for g in range(group):  # softmax over the context
            top = scores[g].max()
            total = np.float32(0.0)
            for t in range(n):
                e = np.exp(scores[g, t] - top)
                scores[g, t] = e
                total += e
            scores[g] /= total
        acc = np.zeros((group, dim), np.float32)
        for w in range(blocks):
            values = rows[pages[h, b, w] + offset + kv_heads]
            for j in range(min(block_size, n - w * block_size)):
                value = values[j * dim:(j + 1) * dim]
                for g in range(group):
                    p = scores[g, w * block_size + j]
                    for d in range(dim):
                        acc[g, d] += p * value[d]
        out[b, h] = acc


def paged_decode(q: torch.Tensor, rows: np.ndarray, pages: np.ndarray, offset: int,
                 lengths: np.ndarray, block_size: int) -> torch.Tensor:
    """Attention of `q` `[seqs, heads, D]` (one query each) over the pages `pages` names (see
    `_decode`); returns `[seqs, heads, D]`."""
    seqs, heads, dim = q.shape
    kv_heads = pages.shape[0]
    q = q.contiguous().view(seqs, kv_heads, heads // kv_heads, dim)
    out = torch.empty_like(q)
    threads = torch.get_num_threads() if int(lengths.sum()) * kv_heads >= PARALLEL_MIN_WORK else 1
    with _LAUNCH:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        _decode(q.numpy(), rows, pages, offset, lengths, block_size, dim ** -0.5, out.numpy())
    return out.view(seqs, heads, dim)
