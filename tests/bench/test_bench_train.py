"""`rose bench train`'s figures from a run's steps (rose.bench.train), without running one."""

from __future__ import annotations

import argparse

import pytest

from rose.bench import train as bench_train
from rose.rollout.manager import Placement
from rose.runtime.report import TrainStep


def _step(start: float, rollout_s: float, train_s: float, placements: list[tuple[float, float, int]],
          staleness: dict[str, int]) -> TrainStep:
    return TrainStep(
        step=0, version=1, wall_start_s=start, step_s=rollout_s + train_s, rollout_s=rollout_s,
        train_s=train_s, sync_s=0.0, sync_bytes=0, success_rate=0.0, heldout_success=None, eval_s=0.0,
        serving_token_share=0.0, serving_tokens=0, dedicated_tokens=0, serving_turns=0, dedicated_turns=0,
        resumed_turns=0, handed_back_turns=0, bursts=0, lost_trajectories=0, failed_trajectories=0,
        placements=[Placement("t", 0, 0, "d0", "dedicated", a, b, n, "done") for a, b, n in placements],
        serving={}, trainer={}, elastic_devices=0, staleness=staleness)


def test_step_figures_count_the_tokens_generated_while_the_trainer_trained() -> None:
    # Step 0: rollout 0-2 s, training 2-4 s; a turn of 10 tokens inside the rollout, one of 20
    # spanning 1-3 s (half of it during training), one of 10 at 2.5-3.5 s (all of it). Step 1
    # (asynchronous) trains on a turn of 8 generated at 3-4 s, during step 0's training, and one
    # of 40 at 4-5 s, its own rollout.
    steps = [_step(0.0, 2.0, 2.0, [(0.0, 1.0, 10), (1.0, 3.0, 20), (2.5, 3.5, 10)], {"0": 30, "1": 10}),
             _step(4.0, 1.0, 1.0, [(3.0, 4.0, 8), (4.0, 5.0, 40)], {"1": 48})]
    figures = bench_train.step_figures(steps)
    assert figures["steady_step_s"] == 2.0 and figures["tokens_per_s"] == pytest.approx(88 / 6, abs=0.05)
    assert figures["tokens_while_training"] == pytest.approx((10 + 10 + 8) / 88, abs=1e-3)
    assert figures["staleness"] == {"0": 30, "1": 58}


def test_the_variants_pair_modes_with_their_staleness() -> None:
    assert {name: (mode.value, variant) for name, (mode, variant) in bench_train.VARIANTS.items()} == {
        "fixed": ("fixed", ()), "elastic": ("elastic", ()), "rose": ("rose", ()),
        "fixed-async": ("fixed", ("train.max_staleness=1",)),
        "rose-async": ("rose", ("train.max_staleness=1",))}
    runs = {"rose": {"mean_step_s": 3.0}, "rose-async": {"mean_step_s": 2.0}}
    assert bench_train.ratio(runs, "rose", "rose-async", "mean_step_s") == 1.5
    assert bench_train.ratio(runs, "fixed-async", "rose-async", "mean_step_s") is None


def test_unknown_modes_are_refused_before_anything_runs() -> None:
    p = argparse.ArgumentParser()
    bench_train.add_arguments(p)
    with pytest.raises(ValueError, match="--modes: rose-sync; expected some of fixed, elastic, rose"):
        bench_train.run(p.parse_args(["--modes", "rose,rose-sync"]))
