"""Held-out layouts: generated maps and levels split into a training set and an evaluation set.

A layout (its rows of text) belongs to the evaluation split when a checksum of its text is 0
modulo `HELDOUT_EVERY`, so a fifth of all layouts are held out, the split needs no shared state,
and no layout can be in both: an environment drawing for one split redraws any layout of the
other. Splitting by layout, not by seed, matters where layouts repeat: a 4x4 FrozenLake has few
enough maps that distinct seeds often draw the same one.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence

SPLITS = ("train", "eval")
HELDOUT_EVERY = 5
MAX_DRAWS = 10_000  # a split with no layout in reach fails instead of looping


def is_heldout(layout: Sequence[str]) -> bool:
    return zlib.crc32("\n".join(layout).encode()) % HELDOUT_EVERY == 0


def check_split(owner: str, split: object, generated: bool) -> str | None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"{owner}: split must be one of {', '.join(SPLITS)} or None, got {split!r}")
    if split is not None and not generated:
        raise ValueError(f"{owner}: split needs generated layouts; a fixed one has nothing to hold out")
    return split


def draw(owner: str, generate: Callable[[int], tuple[str, ...]], rng: random.Random,
         split: str | None) -> tuple[str, ...]:
    """`generate(seed)` for seeds from `rng` until the layout is in `split` (None: any)."""
    for _ in range(MAX_DRAWS):
        layout = generate(rng.getrandbits(63))
        if split is None or is_heldout(layout) == (split == "eval"):
            return layout
    raise ValueError(f"{owner}: no {split} layout in {MAX_DRAWS} draws; these settings give too few "
                     "distinct layouts to hold some out (a larger size gives more)")
