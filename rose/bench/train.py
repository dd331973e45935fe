"""`rose bench train`: the same `rose train` job in fixed, elastic and rose modes, side by side.

Equal dedicated resources in every mode (the config's dedicated devices); elastic adds its
devices on demand each step (paying the provisioning delay and a real start-up), rose borrows
the serving devices, which serve a real trace replay meanwhile. The workload is the named config
`bench-train` (rose/data/configs/bench-train.yaml), which the simulator's `cpu-bench-train`
scenario reads too: its rollouts are heavier than the learning default's (longer turns), as
agentic rollouts are, the part ROSE speeds up.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rose.config import named_config
from rose.progress import bar
from rose.reporting import write_report
from rose.runtime.config import Config, Mode, load_config, validate

WORKLOAD = "bench-train"


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


def run(args: argparse.Namespace) -> int:
    from rose.runtime.driver import train

    quick = ["train.steps=3"] if args.quick else []
    runs = {}
    with bar("bench train", len(Mode)) as progress:
        for mode in Mode:
            progress.describe(mode.value)
            config = bench_config([*quick, f"train.out_dir={args.out_dir}/{mode.value}", *args.overrides])
            validate(config, mode)
            result = train(config, mode)
            runs[mode.value] = {**result.summary, "elastic_alloc_s": result.elastic_alloc_s,
                                "elastic_cancelled_s": result.elastic_cancelled_s}
            print(mode.value, runs[mode.value], flush=True)
            progress.advance()
    fixed, elastic, rose = runs["fixed"], runs["elastic"], runs["rose"]
    summary = {
        "speedup_rose_vs_fixed": round(fixed["mean_step_s"] / rose["mean_step_s"], 3),
        "rollout_speedup_rose_vs_elastic": round(elastic["mean_rollout_s"] / rose["mean_rollout_s"], 3),
        "serving_slo_attainment_rose": rose["serving_slo_attainment"],
        "lost_trajectories": sum(r["lost_trajectories"] for r in runs.values()),
    }
    write_report(args.json, summary, modes=runs, workload=WORKLOAD, steps=config.train.steps)
    return 0
