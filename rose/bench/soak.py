"""`rose bench soak`: one `rose serve` process under long, mixed and partly hostile load.

The server (a `tiny` Qwen2 serving model and a `tiny` Qwen3 rollout model, random weights, one
8 MB page pool) is driven for `--duration` seconds by, all at once:

- the Azure conversation trace replayed over the OpenAI API (`rose loadgen`'s window and
  lengths): half streamed completions (TTFT measured as `rose loadgen` measures it), the rest
  plain completions and chat completions, streamed or not, through the official `openai` client;
- `--trajectories` multi-turn rollouts through the lease API (`LeaseClient.run_turn`);
- misbehaving clients: ones that go away mid-stream or before a plain answer comes, ones that
  open a long stream and stop reading it for seconds, and a stream of garbage (malformed JSON,
  wrong types, numbers past int64, NaN and inf, unknown routes and methods, oversize bodies,
  wrong or missing keys).

Then the load stops, in-flight work drains (at most `--drain` s) and the idle server is
inspected. Summary:

- `requests`: HTTP requests sent; `status_2xx`, `status_4xx` (429 included), `status_429`,
  `status_5xx` (and `status_5xx_by_kind`: which clients got them); `transport_errors` (no
  answer, or a stream cut before its end); `timeouts` (no byte for 60 s);
  `unanswered_at_drain_deadline`; `client_left`: exchanges the misbehaving clients abandoned
  on purpose. 4xx answers to the garbage are the expected ones;
- `rss_growth_after_warmup`: server RSS (VmRSS) at the end of the load over its RSS at the end
  of the warm-up (a quarter of the run, at most 120 s), minus 1;
- `kv_pages_leaked`: at idle, the KV pages both models map in the pool minus the pages only
  their prefix caches hold. Those cached pages belong to no request: they stay mapped so that a
  later prompt with the same prefix reuses them, and any allocation that finds the pool dry
  evicts them. Every other page is held for a request, and at idle there is none;
- `lost_turns`: lease turns submitted that got neither a finished event nor an HTTP error
  answer (the stream ended or broke early, the turn timed out, or it still ran at the drain
  deadline);
- `p99_ttft_ms`, `p50_ttft_ms`: the streamed trace requests';
- after the drain: `engine_busy_after_drain_s` (how long the engine kept iterating once every
  client was done: work nobody waits for; None if it never stopped for 2 s within 30 s),
  `idle_cpu_fraction` (the server's CPU use over 2 idle seconds), `idle_probe_ok` (a 1-token
  completion answered), `server_alive_after`, `shutdown_s`, `sigterm_ignored`, and
  `server_tracebacks` (in its log; the report lists their exceptions).

Goal: 10 minutes with 0 5xx, under 10% RSS growth, 0 pages leaked, 0 lost turns.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from rose.bench import serve_device_args
from rose.contracts import Turn, TurnOutput
from rose.coserve.lease_client import LeaseClient, LeaseError
from rose.coserve.loadgen import RequestResult, build_trace, fit_lengths, stream_completion, summarize
from rose.engine import SamplingParams
from rose.model import init_model
from rose.model.device import add_device_arguments
from rose.reporting import write_report
from rose.traces import Trace, load_trace

POOL_MB = 8  # small enough that prefix caches fill it and allocations evict
SHUTDOWN_TIMEOUT_S = 5  # the drain on SIGTERM: open requests get this long to finish
MAX_CONTEXT, MAX_OUTPUT = 1024, 64  # trace lengths clipped to these (the tiny models hold 2048)
VOCAB = (10, 500)  # token ids the clients send (the tiny vocabulary has 512)
REQUEST_TIMEOUT_S = 60.0  # a request waiting this long for its next byte counts as a timeout
TURN_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 2.0
# Mean seconds between two of each misbehaving client's requests.
DISCONNECT_EVERY_S, STALL_EVERY_S, GARBAGE_EVERY_S = 1.0, 4.0, 0.5
WORDS = ["the", "cat", "sat", "on", "a", "mat"]  # chat prompts: about two tokens a word
SERVING_KINDS = {"stream": 0.5, "complete": 0.2, "chat": 0.15, "chat_stream": 0.15}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="60 s of load instead of 600 s")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--duration", type=float, help="seconds of load")
    p.add_argument("--rate", type=float, default=3.0, help="serving requests per second (mean)")
    p.add_argument("--trajectories", type=int, default=4, help="concurrent rollout trajectories")
    p.add_argument("--drain", type=float, default=60.0, help="seconds in-flight work may take to end")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the clients' choices")
    add_device_arguments(p)


@dataclasses.dataclass(frozen=True)
class Keys:
    """The keys the soak's clients present: the server runs with both, so that the clients
    sending a wrong or missing key are refused (401) rather than served."""

    api: str
    lease: str

    @classmethod
    def generate(cls) -> Keys:
        return cls(secrets.token_urlsafe(24), secrets.token_urlsafe(24))

    def server_args(self) -> list[str]:
        return ["--api-key", self.api, "--lease-key", self.lease]

    def lease_client(self, url: str) -> LeaseClient:
        return LeaseClient(url, httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S), key=self.lease)

    def headers(self, api: str) -> dict[str, str]:
        """Bearer headers for the OpenAI API (`api="openai"`) or the lease API (`"lease"`)."""
        return {"Authorization": f"Bearer {self.api if api == 'openai' else self.lease}"}


class ServerProcess:
    """A `rose serve` subprocess: its URL, memory, CPU time and log, and a timed shutdown."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rose serve exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"rose serve did not answer /health within {timeout_s:.0f} s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS in /proc/{self.proc.pid}/status")

    def cpu_seconds(self) -> float:
        # utime and stime (fields 14 and 15) follow the parenthesised command name.
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> dict[str, Any]:
        """SIGTERM, then SIGKILL after 15 s (the server drains for SHUTDOWN_TIMEOUT_S of them): how
        long it took and whether SIGTERM sufficed."""
        start = time.monotonic()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
            killed = False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            killed = True
        return {"shutdown_s": round(time.monotonic() - start, 2), "sigterm_ignored": killed}

    def exceptions(self) -> collections.Counter[str]:
        """The last line of each traceback in the server's log (what was raised), counted."""
        lines = self.log.read_text(errors="replace").splitlines()
        found: collections.Counter[str] = collections.Counter()
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                j = i + 1
                while j < len(lines) and (lines[j].startswith(" ") or lines[j].startswith("Traceback")):
                    j += 1
                found[lines[j][:200] if j < len(lines) else "(truncated)"] += 1
        return found


@contextlib.contextmanager
def _serve(root: Path, keys: Keys, device: tuple[str, ...] = ()) -> Iterator[ServerProcess]:
    serving = init_model("qwen2", "tiny", root / "serving", seed=1)
    rollout = init_model("qwen3", "tiny", root / "rollout", seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "rose.cli", "serve", "--model", str(serving), "--rollout-model",
           str(rollout), "--port", str(port), "--threads", "1", "--pool-mb", str(POOL_MB),
           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *keys.server_args(), *device]
    server = ServerProcess(cmd, port, root / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        if server.alive():
            server.stop()


def _garbage_cases(model: str, keys: Keys) -> dict[str, tuple[str, str, bytes, dict[str, str]]]:
    """name -> (method, path, body, headers): requests a well-behaved server answers with a 4xx
    (or serves, where the input is odd but valid)."""
    api, lease = keys.headers("openai"), keys.headers("lease")

    def completion(**fields: Any) -> bytes:
        return json.dumps({"model": model, "prompt": [11, 12, 13], "max_tokens": 4, **fields}).encode()

    def turn(**fields: Any) -> bytes:
        return json.dumps({"turn_id": f"garbage-{secrets.token_hex(4)}", "trajectory_id": "garbage",
                           "token_ids": [11, 12, 13], "max_tokens": 4, **fields}).encode()

    nested = 100_000
    big = (np.arange(1_000_000) % 400 + 10).tolist()
    text = {"content-type": "text/plain"}
    return {
        "malformed_json": ("POST", "/v1/completions", b'{"model": "x", "prompt": [1, 2', api),
        "malformed_json_lease": ("POST", "/v1/lease/turns", b'{"turn_id": ', lease),
        "not_an_object": ("POST", "/v1/chat/completions", b"[1, 2, 3]", api),
        "empty_body": ("POST", "/v1/completions", b"", api),
        "text_body": ("POST", "/v1/completions", b"hello", {**api, **text}),
        "deep_nesting": ("POST", "/v1/completions",
                         b'{"prompt": ' + b"[" * nested + b"]" * nested + b"}", api),
        "wrong_types": ("POST", "/v1/completions",
                        json.dumps({"model": model, "prompt": 123, "max_tokens": "ten"}).encode(), api),
        "wrong_types_chat": ("POST", "/v1/chat/completions",
                             json.dumps({"model": model, "messages": "hi", "temperature": "hot"}).encode(),
                             api),
        "wrong_types_lease": ("POST", "/v1/lease/turns",
                              json.dumps({"turn_id": 5, "trajectory_id": None, "token_ids": ["a"]}).encode(),
                              lease),
        "huge_max_tokens": ("POST", "/v1/completions", completion(max_tokens=10**30), api),
        "int64_max_tokens": ("POST", "/v1/completions", completion(max_tokens=2**63 - 1), api),
        "negative_max_tokens": ("POST", "/v1/completions", completion(max_tokens=-1), api),
        "huge_top_k": ("POST", "/v1/completions", completion(top_k=2**70), api),
        "huge_top_k_lease": ("POST", "/v1/lease/turns", turn(top_k=1661748626853370527744), lease),
        "huge_seed": ("POST", "/v1/completions", completion(seed=2**64 + 1), api),
        "huge_token_id": ("POST", "/v1/completions", completion(prompt=[2**63]), api),
        "nan_temperature": ("POST", "/v1/completions", completion(temperature=float("nan")), api),
        "inf_top_p": ("POST", "/v1/completions", completion(top_p=float("inf")), api),
        "tiny_temperature": ("POST", "/v1/completions", completion(temperature=1e-45), api),
        "negative_temperature_lease": ("POST", "/v1/lease/turns", turn(temperature=-1.0), lease),
        "empty_stop": ("POST", "/v1/completions", completion(stop=[""]), api),
        "lone_surrogate": ("POST", "/v1/completions",
                           b'{"model": "%s", "prompt": "\\ud800 hi", "max_tokens": 2}' % model.encode(), api),
        "unknown_model": ("POST", "/v1/completions", completion(model="no-such-model"), api),
        "unknown_route": ("GET", "/v1/no-such-route", b"", api),
        "unknown_route_post": ("POST", "/admin/shutdown", b"{}", api),
        "wrong_method": ("DELETE", "/v1/completions", b"", api),
        "oversize_prompt": ("POST", "/v1/completions", completion(prompt=big), api),
        "oversize_lease": ("POST", "/v1/lease/turns", turn(token_ids=big), lease),
        "oversize_text": ("POST", "/v1/chat/completions", json.dumps(
            {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi you " * 120_000}]}
        ).encode(), api),
        "junk_weights": ("POST", "/v1/lease/weights?version=0", b"junk", lease),
        "bad_query": ("POST", "/v1/lease/weights?version=abc", b"", lease),
        "abort_unknown_turn": ("POST", "/v1/lease/turns/no-such-turn/abort", b"", lease),
        "wrong_key": ("POST", "/v1/completions", completion(), {"Authorization": "Bearer wrong"}),
        "no_key": ("POST", "/v1/completions", completion(), {}),
        "wrong_key_lease": ("GET", "/v1/lease/capacity", b"", {"Authorization": "Bearer wrong"}),
    }


def _stream_outcome(r: RequestResult) -> str:
    if r.status is None:  # no answer at all
        return "timeout" if (r.error or "").split(":")[0].endswith("Timeout") else "transport"
    return "cut" if r.status == 200 and r.error else str(r.status)


def _lease_status(exc: LeaseError) -> str | None:
    """The HTTP status a lease call was refused with; None when the server did not answer."""
    if isinstance(exc.__cause__, httpx.HTTPError):
        return None
    found = re.search(r"HTTP (\d{3})", str(exc))
    return found.group(1) if found else "refused"


class Soak:
    """The clients of one soak run, their counts, and the idle inspection after it."""

    def __init__(self, server: ServerProcess, keys: Keys, model: str, args: argparse.Namespace,
                 duration: float) -> None:
        self.server, self.url, self.keys, self.model = server, server.url, keys, model
        self.duration, self.drain = duration, args.drain
        self.warmup = min(120.0, duration / 4)
        self.trajectories = args.trajectories
        self.rng = np.random.default_rng(args.seed)
        self.run_id = secrets.token_hex(3)
        # kind of client -> outcome (an HTTP status, or transport/timeout/cut/left/deadline) -> count
        self.outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.turns: collections.Counter[str] = collections.Counter()
        self.lost_reasons: collections.Counter[str] = collections.Counter()
        self.client_exceptions: collections.Counter[str] = collections.Counter()
        self.streamed: list[RequestResult] = []
        self.samples: list[dict[str, Any]] = []
        self.pending: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(max_connections=1000)
        self.openai_http = httpx.AsyncClient(headers=keys.headers("openai"), timeout=REQUEST_TIMEOUT_S,
                                             limits=limits)
        self.lease_http = httpx.AsyncClient(headers=keys.headers("lease"), timeout=REQUEST_TIMEOUT_S)
        self.bare_http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S)
        self.openai = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=keys.api, max_retries=0,
                                         timeout=REQUEST_TIMEOUT_S)
        self.lease = keys.lease_client(self.url)
        self.garbage_cases = _garbage_cases(model, keys)
        self.t0 = self.stop_at = 0.0

    # -- bookkeeping ------------------------------------------------------------------------------

    def count(self, kind: str, outcome: str) -> None:
        self.outcomes[kind][outcome] += 1

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.client_exceptions[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1

    async def exchange(self, kind: str, send: Awaitable[int | str]) -> None:
        """Run one raw HTTP exchange and count its outcome: the status `send` returns, or how it
        failed."""
        try:
            self.count(kind, str(await send))
        except httpx.TimeoutException:
            self.count(kind, "timeout")
        except httpx.HTTPError:
            self.count(kind, "transport")
        except asyncio.CancelledError:
            self.count(kind, "deadline")  # still unanswered at the drain deadline
            raise

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(*VOCAB, n).tolist()

    def running(self) -> bool:
        return time.perf_counter() < self.stop_at

    # -- serving: the trace --------------------------------------------------------------------

    async def serving(self, trace: Trace) -> None:
        prompts, outputs = fit_lengths(trace, MAX_CONTEXT, MAX_OUTPUT)
        kinds, weights = list(SERVING_KINDS), list(SERVING_KINDS.values())
        for at, p, o in zip(trace.arrival_s, prompts, outputs, strict=True):
            await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
            if not self.running():
                return
            kind = str(self.rng.choice(kinds, p=weights))
            send = self.stream(float(at), int(p), int(o)) if kind == "stream" else self.openai_request(
                kind, int(p), int(o))
            self.spawn(self.exchange(f"serving/{kind}", send))

    async def stream(self, at: float, prompt: int, max_tokens: int) -> str:
        """A streamed completion, measured as `rose loadgen` measures it."""
        result = RequestResult(at, prompt)
        self.streamed.append(result)
        await stream_completion(self.openai_http, self.url, self.model, self.tokens(prompt), max_tokens,
                                result)
        return _stream_outcome(result)

    async def openai_request(self, kind: str, prompt: int, max_tokens: int) -> str:
        """A plain completion, or a chat completion (streamed or not), through the openai client."""
        try:
            if kind == "complete":
                await self.openai.completions.create(model=self.model, prompt=self.tokens(prompt),
                                                     max_tokens=max_tokens, temperature=0.0,
                                                     extra_body={"ignore_eos": True})
            else:
                words = " ".join(self.rng.choice(WORDS, max(1, prompt // 2)))
                answer = await self.openai.chat.completions.create(
                    model=self.model, max_tokens=max_tokens, stream=kind == "chat_stream",
                    messages=[{"role": "user", "content": words}])
                if kind == "chat_stream":
                    async for _ in answer:
                        pass
        except openai.APITimeoutError:
            return "timeout"
        except openai.APIConnectionError:
            return "transport"
        except openai.APIStatusError as exc:
            return str(exc.status_code)
        except openai.APIError:  # an error event inside a stream that had begun
            return "cut"
        return "200"

    # -- rollouts: the lease API ---------------------------------------------------------------

    async def trajectory(self, k: int) -> None:
        """Multi-turn: each turn is the trajectory so far plus a new observation."""
        history, n = self.tokens(64), 0
        while self.running():
            got = await self.turn(f"{self.run_id}-{k}-{n}", f"traj{k}", history)
            n += 1
            if got is None:
                await asyncio.sleep(0.5)  # refused (or lost): back off, as a rollout worker would
                continue
            history += got.token_ids + (self.tokens(16) if got.finish_reason != "abort" else [])
            if len(history) > MAX_CONTEXT:
                history = self.tokens(64)

    async def turn(self, turn_id: str, trajectory_id: str, history: list[int]) -> TurnOutput | None:
        """One lease turn, accounted: finished (handed back included), refused or lost."""
        params = SamplingParams(max_tokens=int(self.rng.integers(8, 65)), temperature=1.0, ignore_eos=True)
        got = TurnOutput()
        self.turns["submitted"] += 1
        try:
            await asyncio.wait_for(self.lease.run_turn(Turn(turn_id, trajectory_id, history, params), got),
                                   TURN_TIMEOUT_S)
        except LeaseError as exc:
            status = _lease_status(exc)
            if status is None:
                cause = exc.__cause__
                timeout = isinstance(cause, httpx.TimeoutException)
                return self._lost("timeout" if timeout else "transport", f"{type(cause).__name__}: {cause}")
            self.turns["refused"] += 1
            self.count("lease/turn", status)
            return None
        except asyncio.TimeoutError:
            return self._lost("timeout", f"no finished event within {TURN_TIMEOUT_S:.0f} s")
        except asyncio.CancelledError:
            self._lost("deadline", "still running at the drain deadline")
            raise
        if got.finish_reason is None:
            return self._lost("cut", "the stream ended without a finished event")
        self.count("lease/turn", "200")
        self.turns["finished"] += 1
        self.turns["handed_back"] += got.finish_reason == "abort"
        return got

    def _lost(self, outcome: str, reason: str) -> None:
        self.count("lease/turn", outcome)
        self.turns["lost"] += 1
        self.lost_reasons[re.sub(r"'[^']*'", "'...'", reason)[:160]] += 1

    # -- misbehaving clients ---------------------------------------------------------------------

    async def every(self, mean_s: float, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        while True:
            await asyncio.sleep(float(self.rng.exponential(mean_s)))
            if not self.running():
                return
            self.spawn(make())

    def _stream_target(self, lease: bool, max_tokens: int) -> tuple[httpx.AsyncClient, str, dict[str, Any]]:
        """Where and what a misbehaving client streams: a serving completion or a lease turn."""
        if lease:
            return self.lease_http, "/v1/lease/turns", {
                "turn_id": f"{self.run_id}-bad-{secrets.token_hex(4)}", "trajectory_id": "bad",
                "token_ids": self.tokens(16), "max_tokens": max_tokens, "ignore_eos": True}
        return self.openai_http, "/v1/completions", {
            "model": self.model, "prompt": self.tokens(16), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}

    async def disconnect(self) -> None:
        """Go away mid-stream (after 1-3 events), or before a plain completion's answer."""
        kind = str(self.rng.choice(["serving_stream", "lease_stream", "plain"]))
        if kind == "plain":
            body = {"model": self.model, "prompt": self.tokens(16), "max_tokens": 512, "ignore_eos": True}
            patience = float(self.rng.uniform(0.05, 0.5))

            async def send() -> int | str:
                try:
                    post = self.openai_http.post(f"{self.url}/v1/completions", json=body)
                    return (await asyncio.wait_for(post, patience)).status_code
                except asyncio.TimeoutError:
                    return "left"
        else:
            client, path, body = self._stream_target(kind == "lease_stream", 512)
            events = int(self.rng.integers(1, 4))

            async def send() -> int | str:
                async with client.stream("POST", f"{self.url}{path}", json=body) as r:
                    if r.status_code != 200:
                        return r.status_code
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= events:
                            return "left"
                    return r.status_code
        await self.exchange(f"disconnect/{kind}", send())

    async def stall(self) -> None:
        """Open a long stream, take its first bytes, then read nothing for 5-20 s (at most until the
        load ends) and close."""
        lease = bool(self.rng.random() < 0.5)
        client, path, body = self._stream_target(lease, 1500)
        pause = min(float(self.rng.uniform(5, 20)), max(1.0, self.stop_at - time.perf_counter()))

        async def send() -> int | str:
            async with client.stream("POST", f"{self.url}{path}", json=body) as r:
                if r.status_code != 200:
                    return r.status_code
                await anext(r.aiter_raw())
                await asyncio.sleep(pause)
                return "left"
        await self.exchange(f"stall/{'lease' if lease else 'serving'}", send())

    async def garbage(self) -> None:
        name = str(self.rng.choice(list(self.garbage_cases)))
        method, path, body, headers = self.garbage_cases[name]

        async def send() -> int:
            r = await self.bare_http.request(method, f"{self.url}{path}", content=body,
                                             headers={"content-type": "application/json", **headers})
            return r.status_code
        await self.exchange(f"garbage/{name}", send())

    # -- watching the server ---------------------------------------------------------------------

    async def metrics(self) -> dict[str, float] | None:
        """The server's metrics as `name/label values` -> value; None when it did not answer."""
        try:
            r = await self.bare_http.get(f"{self.url}/metrics", timeout=10)
        except httpx.HTTPError as exc:
            self.count("probe/metrics", "timeout" if isinstance(exc, httpx.TimeoutException) else "transport")
            return None
        self.count("probe/metrics", str(r.status_code))
        return {"/".join([s.name, *s.labels.values()]): s.value
                for family in text_string_to_metric_families(r.text) for s in family.samples}

    async def watch(self) -> None:
        """Every SAMPLE_EVERY_S until the load ends, and once at its end: /health, the server's
        RSS and its pool pages."""
        while True:
            await self.exchange("probe/health", self._health())
            m = await self.metrics() or {}
            self.samples.append({
                "t": round(time.perf_counter() - self.t0, 1),
                "rss_mb": round(self.server.rss_bytes() / 2**20, 1) if self.server.alive() else None,
                "pages": {o: m.get(f"rose:kv_pool_pages/{o}") for o in ("serving", "rollout", "free")},
                "served": m.get("rose:serving_requests_total")})
            if not self.running():
                return
            await asyncio.sleep(min(SAMPLE_EVERY_S, max(0.0, self.stop_at - time.perf_counter())))

    async def _health(self) -> int:
        return (await self.bare_http.get(f"{self.url}/health", timeout=10)).status_code

    # -- the run ---------------------------------------------------------------------------------

    async def run(self, trace: Trace) -> dict[str, Any]:
        self.t0 = time.perf_counter()
        self.stop_at = self.t0 + self.duration
        for loop in (self.serving(trace), *(self.trajectory(k) for k in range(self.trajectories)),
                     self.every(DISCONNECT_EVERY_S, self.disconnect), self.every(STALL_EVERY_S, self.stall),
                     self.every(GARBAGE_EVERY_S, self.garbage), self.watch()):
            self.spawn(loop)
        await asyncio.sleep(self.duration)
        # The loops stop issuing at stop_at (trajectories end their turn first): drain what runs.
        deadline = self.stop_at + self.drain
        while self.pending and time.perf_counter() < deadline:
            await asyncio.wait(set(self.pending), timeout=deadline - time.perf_counter())
        cut = list(self.pending)
        for task in cut:
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
        drained_s = time.perf_counter() - self.stop_at
        idle = await self.inspect_idle()
        for client in (self.openai_http, self.lease_http, self.bare_http):
            await client.aclose()
        await self.openai.close()
        await self.lease.close()
        return self.summary(drained_s, idle)

    async def inspect_idle(self) -> dict[str, Any]:
        """Wait for the engine to go quiet (bounded), then: CPU while idle, a probe request (whose
        iteration also re-exports the pool gauges), and the pages still held."""
        if not self.server.alive():
            return {"busy_s": None, "idle_cpu_fraction": None, "idle_probe_ok": False,
                    "kv_pages_leaked": None, "pages_cached": {}}
        start, last_change, last = time.perf_counter(), time.perf_counter(), -1.0
        while time.perf_counter() - last_change < 2.0 and time.perf_counter() < start + 30.0:
            m = await self.metrics() or {}
            now = m.get("rose:iterations_total/serving", 0.0) + m.get("rose:iterations_total/rollout", 0.0)
            if now != last:
                last, last_change = now, time.perf_counter()
            await asyncio.sleep(0.5)
        quiet = time.perf_counter() - last_change >= 2.0
        cpu0 = self.server.cpu_seconds()
        await asyncio.sleep(2.0)
        idle_cpu = (self.server.cpu_seconds() - cpu0) / 2.0
        try:
            probe = await self.openai_http.post(f"{self.url}/v1/completions", timeout=10, json={
                "model": self.model, "prompt": [11, 12], "max_tokens": 1})
            probe_ok = probe.status_code == 200
            self.count("probe/idle", str(probe.status_code))
        except httpx.HTTPError as exc:
            probe_ok = False
            self.count("probe/idle", "timeout" if isinstance(exc, httpx.TimeoutException) else "transport")
        m = await self.metrics()
        used = {o: m.get(f"rose:kv_pool_pages/{o}", 0.0) for o in ("serving", "rollout")} if m else {}
        cached = {o: m.get(f"rose:kv_cached_pages/{o}", 0.0) for o in ("serving", "rollout")} if m else {}
        return {"busy_s": round(last_change - start, 1) if quiet else None,
                "idle_cpu_fraction": round(idle_cpu, 3),
                "idle_probe_ok": probe_ok, "pages_cached": cached,
                "kv_pages_leaked": int(sum(used.values()) - sum(cached.values())) if m else None}

    def summary(self, drained_s: float, idle: dict[str, Any]) -> dict[str, Any]:
        total: collections.Counter[str] = collections.Counter()
        for outcomes in self.outcomes.values():
            total.update(outcomes)
        codes = {int(k): v for k, v in total.items() if k.isdigit()}
        rss = [(s["t"], s["rss_mb"]) for s in self.samples if s["rss_mb"] is not None]
        warm = next((mb for t, mb in rss if t >= self.warmup), None)
        end = rss[-1][1] if rss and rss[-1][0] >= self.duration - 1 else None  # None: died during the load
        ttft = summarize(self.streamed, self.duration)
        return {
            "duration_s": self.duration, "requests": sum(total.values()),
            "serving_requests": sum(sum(c.values()) for k, c in self.outcomes.items()
                                    if k.startswith("serving/")),
            "status_2xx": sum(v for c, v in codes.items() if 200 <= c < 300),
            "status_4xx": sum(v for c, v in codes.items() if 400 <= c < 500),
            "status_429": codes.get(429, 0),
            "status_5xx": sum(v for c, v in codes.items() if c >= 500),
            "transport_errors": total["transport"] + total["cut"], "timeouts": total["timeout"],
            "client_left": total["left"],
            "rss_growth_after_warmup": round(end / warm - 1, 4) if warm and end else None,
            "rss_mb_after_warmup": warm, "rss_mb_end": end,
            "rss_mb_peak": max((mb for _, mb in rss), default=None),
            "kv_pages_leaked": idle["kv_pages_leaked"],
            "kv_pages_cached_at_idle": int(sum(idle["pages_cached"].values())),
            "lost_turns": self.turns["lost"], "turns_submitted": self.turns["submitted"],
            "turns_finished": self.turns["finished"], "turns_refused": self.turns["refused"],
            "turns_handed_back": self.turns["handed_back"],
            "p50_ttft_ms": ttft["p50_ttft_ms"], "p99_ttft_ms": ttft["p99_ttft_ms"],
            "drain_s": round(drained_s, 2), "unanswered_at_drain_deadline": total["deadline"],
            "status_5xx_by_kind": {k: n for k, c in sorted(self.outcomes.items())
                                   if (n := sum(v for o, v in c.items() if o.isdigit() and int(o) >= 500))},
            "engine_busy_after_drain_s": idle["busy_s"], "idle_cpu_fraction": idle["idle_cpu_fraction"],
            "idle_probe_ok": idle["idle_probe_ok"], "client_exceptions": sum(self.client_exceptions.values()),
        }


def run(args: argparse.Namespace) -> int:
    duration = args.duration or (60.0 if args.quick else 600.0)
    keys, device = Keys.generate(), serve_device_args(args)
    with tempfile.TemporaryDirectory() as tmp, _serve(Path(tmp), keys, device) as server:
        model = httpx.get(f"{server.url}/v1/models", headers=keys.headers("openai")).json()["data"][0]["id"]
        base = load_trace("azure-conv")
        # Prompts a quarter of the trace's (mean ~290 tokens); outputs capped at MAX_OUTPUT.
        trace = build_trace("azure-conv", duration, load=args.rate / base.mean_rate, start_s=600.0,
                            prompt_scale=0.25)
        soak = Soak(server, keys, model, args, duration)
        summary = asyncio.run(soak.run(trace))
        summary["server_alive_after"] = server.alive()
        summary.update(server.stop() if server.alive() else {"shutdown_s": None, "sigterm_ignored": None})
        exceptions = server.exceptions()
        summary["server_tracebacks"] = sum(exceptions.values())
        write_report(args.json, summary,
                     config={"duration_s": duration, "rate": args.rate, "trajectories": args.trajectories,
                             "drain_s": args.drain, "seed": args.seed, "pool_mb": POOL_MB,
                             "warmup_s": soak.warmup, "trace_requests": len(trace),
                             "load_average": os.getloadavg()},
                     outcomes={k: dict(sorted(c.items())) for k, c in sorted(soak.outcomes.items())},
                     lost_turn_reasons=dict(soak.lost_reasons), server_exceptions=dict(exceptions),
                     client_exceptions=dict(soak.client_exceptions), samples=soak.samples)
    return 0
