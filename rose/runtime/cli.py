"""`rose train`: agentic RL on the elastic rollout scheduler, on the embedded default or a YAML config."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from rose.reporting import write_report
from rose.runtime.config import Mode, chosen_defaults, load_config, resume_checkpoint, validate
from rose.runtime.loggers import METRICS_FILE
from rose.runtime.report import describe, outcome

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (default: the embedded one)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 rollout.groups=4")
    p.add_argument("--mode", choices=[m.value for m in Mode], default="rose",
                   help="fixed: dedicated devices only; elastic: add devices on demand; "
                        "rose: borrow serving devices")
    p.add_argument("--json", help="write the summary and per-step records here")
    p.add_argument("--resume", help="a checkpoint directory (or a run's out_dir) to go on from")
    p.add_argument("--address", help="an existing Ray cluster (same as ray_address=...; default: "
                                     "$RAY_ADDRESS, else a local Ray started on demand)")


def run(args: argparse.Namespace) -> int:
    from rose.runtime.driver import train

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
    log.info("rose train: mode %s, %d steps, out %s, loggers %s", mode.value, config.train.steps,
             config.train.out_dir, ", ".join(config.train.logger) or "none")
    defaults = chosen_defaults(config)
    if defaults:
        chosen = ", ".join(f"{k} {v:g}" for k, v in defaults.items() if k != "why")
        log.info("defaults: %s (%s; set them in the config to choose)", chosen, defaults["why"])
    for line in describe(config, mode):
        log.info(line)
    result = train(config, mode, resume)
    for line in outcome(result.steps, result.serving):
        log.info(line)
    log.info("report: %s; metrics: %s; checkpoints: %s", result.plot,
             Path(config.train.out_dir) / METRICS_FILE, ", ".join(result.checkpoints))
    write_report(args.json, result.summary, mode=mode.value, serving=result.serving,
                 elastic_alloc_s=result.elastic_alloc_s, elastic_cancelled_s=result.elastic_cancelled_s,
                 checkpoints=result.checkpoints, defaults=defaults, steps=[r.record() for r in result.steps])
    return 0
