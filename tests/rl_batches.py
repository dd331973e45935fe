"""Trajectories of random tokens for the trainer's tests (CPU and gpu)."""

from __future__ import annotations

import random

from rose.rl import Trajectory, TurnRecord


def random_batch(groups: int = 3, size: int = 4, seed: int = 0, vocab: int = 512) -> list[Trajectory]:
    """Multi-turn trajectories of random tokens; behaviour logprobs near a uniform policy's
    (ln 1/512 = -6.24), so ratios are near 1 and some get clipped."""
    rng = random.Random(seed)
    batch = []
    for g in range(groups):
        for _ in range(size):
            turns = []
            for _ in range(rng.randint(1, 3)):
                out = rng.randint(1, 4)
                turns.append(TurnRecord([rng.randrange(vocab) for _ in range(rng.randint(2, 6))],
                                        [rng.randrange(vocab) for _ in range(out)],
                                        [rng.uniform(-6.6, -5.9) for _ in range(out)], [0] * out,
                                        reward=float(rng.random() < 0.5)))
            batch.append(Trajectory(("g", g), turns, done=True))
    return batch
