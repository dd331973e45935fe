"""`rose serve`: the co-serving executor behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from rose.coserve.executor import CoServingExecutor, ExecutorConfig, Policy
from rose.coserve.server import ServerLimits, build_app
from rose.engine.async_engine import EngineLoop
from rose.model import load_tokenizer

SWITCH_INTERVAL_S = 0.0005


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="serving model checkpoint (HF format)")
    p.add_argument("--rollout-model", help="rollout model checkpoint; leases are refused without one")
    p.add_argument("--served-model-name", help="model name clients use (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    e = ExecutorConfig()
    p.add_argument("--tpot-inflation", type=float, default=e.tpot_inflation,
                   help="share of a serving request's own decode time rollouts may add (inf: SLO only)")
    p.add_argument("--ttft-inflation", type=float, default=e.ttft_inflation,
                   help="share of a serving request's own time to first token rollouts may add")
    p.add_argument("--admission-quantile", type=float, default=e.admission_quantile,
                   help="quantile of the latency model's error admission predicts at")
    p.add_argument("--pool-mb", type=float, default=256.0, help="KV page pool shared by both models")
    p.add_argument("--headroom", type=float, default=0.2, help="share of the pool reserved for serving")
    p.add_argument("--policy", choices=[p.value for p in Policy], default="rose",
                   help="rollout admission: rose (dual-SLO + burst control), naive, static")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--cores", help="pin the process to these cores, e.g. '1' or '0-1'")
    p.add_argument("--no-profile", action="store_true", help="skip the start-up latency profile")
    d = ServerLimits()
    p.add_argument("--api-key", default=os.environ.get("ROSE_API_KEY") or None,
                   help="bearer key of the OpenAI API (default: $ROSE_API_KEY; none: open)")
    p.add_argument("--lease-key", default=os.environ.get("ROSE_LEASE_KEY") or None,
                   help="bearer key of the lease API, /v1/lease/* (default: $ROSE_LEASE_KEY; none: open)")
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 1024**2,
                   help="largest request body, weights excepted")
    p.add_argument("--max-weights-mb", type=float, default=d.max_weights_bytes / 1024**2,
                   help="largest body of POST /v1/lease/weights")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting_per_model,
                   help="requests per model waiting for their first token; more get a 429")
    p.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s,
                   help="a request with no first token by then is dropped (503)")
    p.add_argument("--max-rollout-turns", type=int, default=ExecutorConfig.max_rollout_turns,
                   help="lease slots: rollout turns running at once; more get a 429")
    p.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections and requests at once; more get a 503 from uvicorn")


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
    # The engine thread's Python holds the GIL between torch ops; at the default 5 ms switch
    # interval a request arriving during a rollout iteration waited tens of ms just to be parsed
    # and queued, beyond the iteration itself (coserve.md, "Admission").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = ExecutorConfig(pool_bytes=int(args.pool_mb * 1024**2), headroom=args.headroom,
                            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                            tpot_inflation=args.tpot_inflation, ttft_inflation=args.ttft_inflation,
                            admission_quantile=args.admission_quantile, policy=Policy(args.policy),
                            max_rollout_turns=args.max_rollout_turns)
    limits = ServerLimits(api_key=args.api_key, lease_key=args.lease_key,
                          max_body_bytes=int(args.max_body_mb * 1024**2),
                          max_weights_bytes=int(args.max_weights_mb * 1024**2),
                          max_waiting_per_model=args.max_waiting, queue_timeout_s=args.queue_timeout_s,
                          max_connections=args.limit_concurrency)
    executor = CoServingExecutor.from_pretrained(args.model, args.rollout_model, config,
                                                 getattr(torch, args.dtype))
    if not args.no_profile:
        executor.profile()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    tokenizer = load_tokenizer(args.model)
    app = build_app(EngineLoop(executor, name="rose-executor"), executor, tokenizer, name, limits)
    # Streams still open at shutdown (rollout turns) are cut after 5 s rather than awaited.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                limit_concurrency=limits.max_connections)
    return 0
