"""`rose simulate`: ROSE against resource-fixed and resource-elastic baselines, from real traces."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rose.progress import bar
from rose.sim.engine import SimRun
from rose.sim.runner import ScenarioResult, is_sweep, run_scenario, run_sweep
from rose.sim.scenarios import SWEEPS, list_scenarios, load_scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--list", action="store_true", help="list the scenarios and sweeps")
    p.add_argument("--scenario", help="a scenario or sweep name (see --list)")
    p.add_argument("--json", type=Path, help="write the full results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG figure here")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. cluster.serving_gpus=32 rl.steps=3")


def _table(res: ScenarioResult) -> Table:
    t = Table(title=f"{res.scenario.name}: {res.scenario.description}", title_justify="left")
    for col in ("system", "step s", "rollout s", "train s", "traj/h", "alloc %", "aborted", "driver cores",
                "wall s"):
        t.add_column(col, justify="right" if col != "system" else "left")
    for name, r in res.runs.items():
        train = sum(s.train_s for s in r.steps) / len(r.steps)
        t.add_row(name, f"{r.mean_step_s:.0f}", f"{r.mean_rollout_s:.0f}", f"{train:.0f}",
                  f"{r.throughput * 3600 * res.scenario.sim.slice:.0f}", f"{100 * r.allocation_overhead:.2f}",
                  str(r.aborted_turns), f"{r.driver_cores_peak:.2f}", f"{r.wall_s:.1f}")
    return t


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True, width=120)
    if args.list:
        for name, desc in list_scenarios():
            print(f"{name:20s} {desc}")
        return 0
    if not args.scenario:
        raise ValueError("give --scenario NAME (see --list)")
    if is_sweep(args.scenario):
        sweep = SWEEPS[args.scenario]
        with bar(f"simulate {args.scenario}", len(sweep.values)) as progress:
            def point_done(value: object, r: ScenarioResult) -> None:
                console.print(f"{args.scenario}: {value} done ({r.wall_s:.1f} s)")
                progress.advance()

            result = run_sweep(sweep, args.overrides, progress=point_done)
        if args.plot:
            from rose.sim.plots import plot_sweep
            plot_sweep(result, args.plot)
    else:
        sc = load_scenario(args.scenario, args.overrides)
        with bar(f"simulate {args.scenario}", len(sc.sim.systems)) as progress:
            def system_done(name: str, r: SimRun) -> None:
                console.print(f"  {name}: {r.wall_s:.1f} s")
                progress.advance()

            result = run_scenario(sc, progress=system_done)
        console.print(_table(result))
        if args.plot:
            from rose.sim.plots import plot_scenario
            plot_scenario(result, args.plot)
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    print(json.dumps(result.summary()))
    return 0
