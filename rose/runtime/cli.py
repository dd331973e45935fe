"""`rose train`: agentic RL on the elastic rollout scheduler, on the embedded default or a YAML config."""

from __future__ import annotations

import argparse

from rose.reporting import write_report
from rose.runtime.config import Mode, chosen_defaults, load_config, resume_checkpoint, validate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (default: the embedded one)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 rollout.groups=4")
    p.add_argument("--mode", choices=[m.value for m in Mode], default="rose",
                   help="fixed: dedicated devices only; elastic: add devices on demand; "
                        "rose: borrow serving devices")
    p.add_argument("--json", help="write the summary and per-step records here")
    p.add_argument("--resume", help="a checkpoint directory (or a run's out_dir) to go on from")
    p.add_argument("--address", help="an existing Ray cluster (same as ray_address=...; default: a "
                                     "local Ray started on demand)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.runtime.driver import train
    from rose.runtime.report import TrainStep

    # A lone key=value given where the config file goes is an override.
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:
        path, overrides = None, [path, *overrides]
    mode = Mode(args.mode)
    if args.address:
        overrides.append(f"ray_address={args.address}")
    config = load_config(path, overrides)
    validate(config, mode)
    resume = resume_checkpoint(args.resume)
    console = Console()

    def show(r: TrainStep) -> None:
        s, h = r.serving, r.heldout_success
        serving = (f" | serving p99 TTFT {s.get('p99_ttft_ms')} / {config.serving.slo_ttft_ms:g} ms, "
                   f"TPOT {s.get('p99_tpot_ms')} / {config.serving.slo_tpot_ms:g} ms, "
                   f"SLO {s.get('slo_attainment')}") if s else ""
        heldout = "" if h is None else f" held-out {h:.2f} ({r.eval_s:.1f}s)"
        console.print(f"[bold]step {r.step}[/] reward {r.reward:+.3f} success {r.success_rate:.2f}{heldout} "
                      f"| rollout {r.rollout_s:.1f}s train {r.train_s:.1f}s step {r.step_s:.1f}s | "
                      f"on serving {r.serving_token_share:.0%} resumed {r.resumed_turns} | "
                      f"sync {r.sync_bytes / 1e6:.2f} MB {r.sync_s:.2f}s{serving}")
        for restart in r.restarts:
            console.print(f"  [yellow]{restart}[/]")

    console.print(f"rose train: mode {mode.value}, {config.train.steps} steps, out {config.train.out_dir}")
    defaults = chosen_defaults(config)
    if defaults:
        chosen = ", ".join(f"{k} {v:g}" for k, v in defaults.items() if k != "why")
        console.print(f"defaults: {chosen} ({defaults['why']}; set them in the config to choose)")
    result = train(config, mode, resume, show)
    console.print(f"report: {result.plot}; checkpoints: {', '.join(result.checkpoints)}")
    write_report(args.json, result.summary, mode=mode.value, serving=result.serving,
                 elastic_alloc_s=result.elastic_alloc_s, elastic_cancelled_s=result.elastic_cancelled_s,
                 checkpoints=result.checkpoints, defaults=defaults,
                 steps=[{k: v for k, v in vars(r).items() if k != "placements"} for r in result.steps])
    return 0
