"""`rose serve`: the co-serving executor behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

import httpx
import torch

from rose.coserve.executor import CoServingExecutor
from rose.coserve.serve_config import ServeConfig, load_serve_config, sampling_defaults
from rose.coserve.server import build_app
from rose.coserve.settings import Engine, ExecutorConfig, Policy
from rose.coserve.turn_stream import MAX_MESSAGE_BYTES
from rose.model import load_tokenizer
from rose.model.device import DEVICE_HELP, DTYPE_HELP, DTYPES
from rose.model.lora import load_adapter
from rose.steploop import StepLoop

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0005


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per key of `ServeConfig`, the executor's settings included (`--pool-mb` sets
    `executor.pool_mb`); a flag given overrides `--config` and the dotted overrides."""
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides of the config's keys (e.g. port=9000 executor.slo_ttft_ms=500)")
    p.add_argument("--config", help="YAML file of these settings, keyed as the flags, the executor's under "
                                    "executor: (executor: {pool_mb: 512})")
    defaults = ServeConfig()

    def flag(name: str, text: str = "", key: str = "", group: Any = p, **kwargs: Any) -> None:
        # Not given: absent from the namespace, so the file or the dataclass default holds.
        key = key or name.removeprefix("--").replace("-", "_")
        default = functools.reduce(getattr, key.split("."), defaults)
        default = default.value if isinstance(default, enum.Enum) else default
        shown = f" (default: {default})" if default is not None and not isinstance(default, bool) else ""
        group.add_argument(name, dest=key, default=argparse.SUPPRESS, help=f"{text}{shown}".strip(), **kwargs)

    flag("--model", "serving model checkpoint (HF format); required, here or in --config")
    flag("--rollout-model", "rollout model checkpoint; leases are refused without one (or --rollout-adapter)")
    flag("--rollout-adapter", "a PEFT LoRA adapter directory of the rollout model, loaded at start as "
         "version 0; turns that name it (Turn.adapter) run with it. Without --rollout-model, an adapter "
         "of --model: turns ride the serving model (adapter mode: one forward, one KV pool)")
    flag("--rollout-adapter-name", "the name turns give --rollout-adapter by (default: its directory's name)")
    flag("--engine", "what serves the serving model (vllm: vLLM's engine, which needs --rollout-model)",
         choices=[engine.value for engine in Engine])
    flag("--served-model-name", "model name clients use (default: the directory name)")
    flag("--host")
    flag("--port", type=int)
    flag("--device", DEVICE_HELP)
    flag("--dtype", DTYPE_HELP, choices=list(DTYPES))
    flag("--threads", "torch threads (default: one per core of --cores, else torch's)", type=int)
    flag("--cores", "pin the process to these cores, e.g. '1' or '0-1'")
    flag("--no-profile", "skip the start-up latency profile", action="store_true")
    flag("--iteration-log", "append one JSON line per executor iteration to this file: what admission and "
         "the burst state machine saw and decided, what each model ran (for diagnosis)")
    flag("--chat-template", "the chat template (Jinja), as text or a file (default: the model's)")
    flag("--tool-call-parser", "the tool-call format read from chat replies: hermes, llama3_json, "
         "pythonic (auto: the one the chat template writes)")
    flag("--generation-config", "default sampling: auto (the model's generation_config.json, as vLLM), "
         "vllm (OpenAI's defaults), or a directory holding a generation_config.json")
    flag("--reasoning-parser", "split the model's reasoning off into `reasoning`: qwen3, deepseek_r1")
    flag("--api-key", "bearer key of the OpenAI API (default: $ROSE_API_KEY; none: open)")
    flag("--lease-key", "bearer key of the lease API, /v1/lease/* (default: $ROSE_LEASE_KEY; none: open, "
         "which only a loopback --host allows)")
    flag("--allow-open-lease", "serve the lease API (rollout turns, weight pushes) with no key on a "
         "non-loopback --host", action="store_true")
    flag("--shutdown-timeout", "on SIGTERM, seconds the open serving requests may take to finish; new "
         "ones are refused (0: cut them at once)", type=float)
    flag("--disable-uvicorn-access-log", "no access log (uvicorn's line per HTTP request, on stdout)",
         action="store_true")
    flag("--max-body-mb", "largest request body, weights excepted", type=float)
    flag("--max-weights-mb", "largest body of POST /v1/lease/weights", type=float)
    flag("--max-waiting", "requests per model waiting for their first token; more get a 429", type=int)
    flag("--queue-timeout-s", "a request with no first token by then is dropped (503)", type=float)
    flag("--limit-concurrency", "open connections and requests at once; more get a 503 from uvicorn",
         type=int)
    executor = p.add_argument_group("co-serving executor", "its settings, executor.KEY in --config "
                                                           "(rose.coserve.settings.ExecutorConfig)")
    types = typing.get_type_hints(ExecutorConfig)
    for field in dataclasses.fields(ExecutorConfig):
        kind = types[field.name]
        value = ({"choices": [policy.value for policy in Policy]} if kind is Policy
                 else {"type": kind, "metavar": field.name.upper()})
        flag(f"--{field.name.replace('_', '-')}", field.metadata["help"], f"executor.{field.name}", executor,
             **value)


def _cores(spec: str) -> set[int]:
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `--config` file, the dotted overrides, then the flags given (a flag not given is absent
    from `args`; each is stored under its config key)."""
    keys = {f.name for f in dataclasses.fields(ServeConfig)}
    keys |= {f"executor.{f.name}" for f in dataclasses.fields(ExecutorConfig)}
    flags = {key: value for key, value in vars(args).items() if key in keys}
    return load_serve_config([args.config] if args.config else [], args.overrides, flags)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rose.coserve.drain import DrainingServer

    serve = serve_config(args)
    limits = serve.server_limits()  # bad values fail before models load
    defaults = sampling_defaults(serve)
    if defaults:
        log.info("default sampling from the model's generation_config.json (as vLLM's; "
                 "--generation-config vllm for none): %s", defaults)
    if serve.cores:
        os.sched_setaffinity(0, _cores(serve.cores))
    # Pinned here, after torch sized its pool for every core: more threads than cores would
    # wait on each other at every parallel op.
    if serve.threads or serve.cores:
        torch.set_num_threads(serve.threads or len(_cores(serve.cores)))
    # The engine thread's Python holds the GIL between torch ops; at the default 5 ms switch
    # interval a request arriving during a rollout iteration waited tens of ms just to be parsed
    # and queued, beyond the iteration itself (coserve.md, "Admission").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    executor = CoServingExecutor.from_pretrained(serve.model, serve.rollout_model, serve.executor,
                                                 serve.device, serve.dtype, serve.engine, serve.adapter_mode)
    if serve.rollout_adapter:
        config, tensors, _ = load_adapter(serve.rollout_adapter)
        executor.load_adapter(serve.adapter_name(), config, tensors.items(), 0)
    if not serve.no_profile:
        executor.profile()
    name = serve.served_model_name or os.path.basename(os.path.normpath(serve.model))
    app = build_app(StepLoop(executor, name="rose-executor"), executor, load_tokenizer(serve.model),
                    name, limits, serve.chat_options(), defaults)
    with contextlib.ExitStack() as stack:
        if serve.iteration_log:  # line-buffered: a reader sees each iteration as it ends
            trace = stack.enter_context(open(serve.iteration_log, "a", buffering=1))
            executor.trace = lambda record: trace.write(json.dumps(record) + "\n")
        access_log = not serve.disable_uvicorn_access_log
        config = uvicorn.Config(app, host=serve.host, port=serve.port, log_level="warning",
                                access_log=access_log, limit_concurrency=limits.max_connections,
                                ws_max_size=MAX_MESSAGE_BYTES)
        if access_log:  # its lines are at info; uvicorn's others stay at warning
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        DrainingServer(config, app.state.server).run()
    return 0


@contextlib.contextmanager
def http_process(command: Callable[[int], list[str]], name: str, startup_s: float,
                 env: Mapping[str, str] | None = None, log: IO[Any] | None = None
                 ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server process, `command(port)`, on a free local port (its stdout and stderr to `log`,
    None: this process's): its URL and the process once `/health` answers; on exit it is
    terminated (killed if it has not stopped within 15 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(command(port), env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up within {startup_s:g} s")
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_process(argv: Sequence[str], startup_s: float = 600.0, env: Mapping[str, str] | None = None
                  ) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen]]:
    """`rose serve ARGV` in a process of its own (`http_process`). `startup_s` allows for the
    latency profile, which takes far longer on a real model than on the presets."""
    return http_process(lambda port: [sys.executable, "-m", "rose.cli", "serve", *argv, "--port", str(port)],
                        "rose serve", startup_s, env)
