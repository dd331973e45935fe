"""`rose bench train`: the same `rose train` job in fixed, elastic and rose modes, side by side,
and asynchronous (`train.max_staleness=1`) in fixed and rose modes: `fixed-async`, `rose-async`.

Equal dedicated resources in every mode (the config's dedicated devices); elastic adds its
devices on demand each step (paying the provisioning delay and a real start-up), rose borrows
the serving devices, which serve a real trace replay meanwhile; the asynchronous variants keep
their rollouts going while the trainer trains. The workload is the named config
`bench-train` (rose/data/configs/bench-train.yaml), which the simulator's `cpu-bench-train`
scenario reads too: its rollouts are heavier than the learning default's (longer turns), as
agentic rollouts are, the part ROSE speeds up.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rose.config import named_config
from rose.progress import bar
from rose.reporting import write_report
from rose.runtime.config import Config, Mode, load_config, validate
from rose.runtime.report import TrainStep

WORKLOAD = "bench-train"
# What each variant runs: a mode and its overrides.
ASYNC = ("train.max_staleness=1",)
VARIANTS: dict[str, tuple[Mode, tuple[str, ...]]] = {
    "fixed": (Mode.FIXED, ()), "elastic": (Mode.ELASTIC, ()), "rose": (Mode.ROSE, ()),
    "fixed-async": (Mode.FIXED, ASYNC), "rose-async": (Mode.ROSE, ASYNC),
}


def bench_config(overrides: Sequence[str] = ()) -> Config:
    """`rose train`'s embedded default under the `bench-train` workload, then `overrides`."""
    return load_config(named_config(WORKLOAD), overrides)


def add_workload_arguments(p: argparse.ArgumentParser, each: str, out_dir: str) -> None:
    """The options of a benchmark that runs the workload once for `each` of its variants."""
    p.add_argument("overrides", nargs="*", help="dotted overrides of the train config")
    p.add_argument("--quick", action="store_true", help=f"3 steps per {each} instead of the workload's 6")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--out-dir", default=out_dir)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, "mode", "runs/bench-train")
    p.add_argument("--modes", default=",".join(VARIANTS),
                   help=f"comma-separated variants to run (default: all of {', '.join(VARIANTS)})")


def run(args: argparse.Namespace) -> int:
    from rose.runtime.driver import train

    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--modes: {', '.join(unknown) or 'none given'}; expected some of "
                         f"{', '.join(VARIANTS)}")
    quick = ["train.steps=3"] if args.quick else []
    runs = {}
    with bar("bench train", len(names)) as progress:
        for name in names:
            progress.describe(name)
            mode, variant = VARIANTS[name]
            config = bench_config([*quick, f"train.out_dir={args.out_dir}/{name}", *variant, *args.overrides])
            validate(config, mode)
            result = train(config, mode)
            runs[name] = {**result.summary, **step_figures(result.steps),
                          "elastic_alloc_s": result.elastic_alloc_s,
                          "elastic_cancelled_s": result.elastic_cancelled_s}
            print(name, runs[name], flush=True)
            progress.advance()
    pairs = (("rose", "fixed"), ("rose-async", "rose"), ("rose-async", "fixed-async"),
             ("fixed-async", "fixed"))
    summary = {
        **{f"{prefix}speedup_{a}_vs_{b}".replace("-", "_"): ratio(runs, b, a, key)
           for prefix, key in (("", "mean_step_s"), ("steady_", "steady_step_s")) for a, b in pairs},
        "rollout_speedup_rose_vs_elastic": ratio(runs, "elastic", "rose", "mean_rollout_s"),
        **{f"serving_slo_attainment_{m}".replace("-", "_"): runs[m]["serving_slo_attainment"]
           for m in ("rose", "rose-async") if m in runs},
        "lost_trajectories": sum(r["lost_trajectories"] for r in runs.values()),
    }
    write_report(args.json, summary, modes=runs, workload=WORKLOAD, steps=config.train.steps)
    return 0


def ratio(runs: dict[str, dict[str, Any]], over: str, of: str, key: str) -> float | None:
    """runs[over][key] / runs[of][key] (a speedup), where both ran."""
    if over not in runs or of not in runs:
        return None
    return round(runs[over][key] / runs[of][key], 3)


def step_figures(steps: list[TrainStep]) -> dict[str, Any]:
    """The mean step time after the first (which carries a run's one-time costs: the engines'
    first batches, the first weight delta, an asynchronous run's first batch played before any
    training), generated tokens per second of the run's steps, the share of them generated while
    the trainer trained or synced (an asynchronous step's tokens ran during earlier steps'
    training), and the staleness histogram."""
    training = [(r.wall_start_s + r.eval_s + r.rollout_s,
                 r.wall_start_s + r.eval_s + r.rollout_s + r.train_s + r.sync_s) for r in steps]
    tokens = during = 0.0
    for p in (p for r in steps for p in r.placements):
        tokens += p.tokens
        inside = sum(max(0.0, min(p.end_s, b) - max(p.start_s, a)) for a, b in training)
        during += p.tokens * inside / max(p.end_s - p.start_s, 1e-9)
    wall = sum(r.step_s for r in steps)
    lags: Counter[str] = Counter()
    for r in steps:
        lags.update(r.staleness)
    later = [r.step_s for r in steps[1:]]
    return {"steady_step_s": round(sum(later) / len(later), 3) if later else None,
            "tokens_per_s": round(tokens / wall, 1) if wall else None,
            "tokens_while_training": round(during / tokens, 3) if tokens else None,
            "staleness": dict(sorted(lags.items(), key=lambda kv: int(kv[0])))}
