"""`rose bench rollout`: the same `rose train` job with its dedicated rollouts on the native
engine and on vLLM (`rollout.backend`), one after the other on the same cores.

Fixed mode (the dedicated device alone does the rollouts: no serving device shares them), the
`bench-train` workload (rose/data/configs/bench-train.yaml: its turns of up to 24 tokens), its
policy the tiny Qwen3 with head_dim 32, written at start: the preset's 16 has no kernel in
vLLM's CPU attention. A checkpoint policy would take a pretrained model's learning rate; the
workload's random preset's (3e-3, no warmup) is kept. Run from the venv with vLLM
(`make install-vllm`: .venv-vllm/bin/rose bench rollout).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rose.bench.train import add_workload_arguments, bench_config
from rose.model import init_model
from rose.progress import bar
from rose.reporting import write_report
from rose.runtime.config import BACKENDS, Mode, validate


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, "backend", "runs/bench-rollout")


def run(args: argparse.Namespace) -> int:
    from rose.runtime.driver import train

    out = Path(args.out_dir)
    policy = init_model("qwen3", "tiny", out / "policy", head_dim=32)
    quick = ["train.steps=3"] if args.quick else []
    configs = {backend: bench_config([*quick, f"model.path={policy}", "train.lr=3e-3", "train.warmup_steps=0",
                                      f"rollout.backend={backend}", f"train.out_dir={out / backend}",
                                      *args.overrides])
               for backend in BACKENDS}  # both validated before either runs
    for config in configs.values():
        validate(config, Mode.FIXED)
    runs: dict[str, dict[str, Any]] = {}
    with bar("bench rollout", len(BACKENDS)) as progress:
        for backend, config in configs.items():
            progress.describe(backend)
            result = train(config, Mode.FIXED)
            # From the second step: the first carries each engine's first-batch costs.
            later = result.steps[1:] or result.steps
            tokens, seconds = sum(s.dedicated_tokens for s in later), sum(s.rollout_s for s in later)
            runs[backend] = {**result.summary, "rollout_tokens_per_s": round(tokens / seconds, 1),
                             "first_rollout_s": round(result.steps[0].rollout_s, 3)}
            print(backend, runs[backend], flush=True)
            progress.advance()
    native, vllm = runs["native"], runs["vllm"]
    rates = native["rollout_tokens_per_s"], vllm["rollout_tokens_per_s"]
    summary = {
        "rollout_tokens_per_s_native": rates[0],
        "rollout_tokens_per_s_vllm": rates[1],
        "rollout_speedup_vllm_vs_native": round(rates[1] / rates[0], 3),
        "mean_step_s_native": native["mean_step_s"],
        "mean_step_s_vllm": vllm["mean_step_s"],
        "lost_trajectories": sum(r["lost_trajectories"] for r in runs.values()),
    }
    write_report(args.json, summary, backends=runs, workload="bench-train",
                 steps=configs["native"].train.steps)
    return 0
