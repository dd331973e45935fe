"""`rose serve`: the co-serving executor behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os

import torch

from rose.coserve.executor import CoServingExecutor, ExecutorConfig, Policy
from rose.coserve.server import build_app
from rose.model import load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="serving model checkpoint (HF format)")
    p.add_argument("--rollout-model", help="rollout model checkpoint; leases are refused without one")
    p.add_argument("--served-model-name", help="model name clients use (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--pool-mb", type=float, default=256.0, help="KV page pool shared by both models")
    p.add_argument("--headroom", type=float, default=0.2, help="share of the pool reserved for serving")
    p.add_argument("--policy", choices=[p.value for p in Policy], default="rose",
                   help="rollout admission: rose (dual-SLO + burst control), naive, static")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--cores", help="pin the process to these cores, e.g. '1' or '0-1'")
    p.add_argument("--no-profile", action="store_true", help="skip the start-up latency profile")


def _cores(spec: str) -> set[int]:
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.cores:
        os.sched_setaffinity(0, _cores(args.cores))
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ExecutorConfig(pool_bytes=int(args.pool_mb * 1024**2), headroom=args.headroom,
                            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                            policy=Policy(args.policy))
    executor = CoServingExecutor.from_pretrained(args.model, args.rollout_model, config,
                                                 getattr(torch, args.dtype))
    if not args.no_profile:
        executor.profile()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = build_app(executor, load_tokenizer(args.model), name)
    # Streams still open at shutdown (rollout turns) are cut after 5 s rather than awaited.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
