"""`rose loadgen`: replay a real serving trace against any OpenAI-compatible server.

Arrival times come from the trace, time-scaled by `--load` (2.0: twice the requests per second,
the same burst shape); prompt and output lengths from the trace, scaled and clipped to the
model's context. Each request streams from `/v1/completions` with token-id prompts and
`ignore_eos` (vLLM's extension, which ROSE's server takes too), so lengths are exact. Measured
per request from the stream, as vLLM's serving benchmark does: TTFT (send to first token),
ITL (between streamed chunks), TPOT = (latency - TTFT) / (output tokens - 1), and goodput
(requests per second meeting both SLOs, when given).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from typing import Any

import httpx
import numpy as np

from rose.reporting import write_report
from rose.traces import TRACE_NAMES, Trace, densest, gamma_trace, load_trace


@dataclasses.dataclass
class RequestResult:
    scheduled_s: float
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    status: int | None = None  # the HTTP status, when the server answered

    @property
    def tpot_s(self) -> float | None:
        if self.latency_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def build_trace(name: str, duration_s: float, load: float, start_s: float = 0.0,
                prompt_scale: float = 1.0, output_scale: float = 1.0, seed: int = 0) -> Trace:
    """The requests to send: a window of the trace at `load` times its rate, lengths scaled."""
    if duration_s <= 0 or load <= 0:
        raise ValueError(f"duration and load must be positive, got {duration_s} and {load}")
    if name == "gamma":
        base = load_trace("azure-conv")
        trace = gamma_trace(base.mean_rate * load, cv=2.0, duration_s=duration_s, lengths=base, seed=seed)
        return trace.scaled(prompt_tokens=prompt_scale, output_tokens=output_scale)
    trace = load_trace(name).scaled(rate=load, prompt_tokens=prompt_scale, output_tokens=output_scale)
    return trace.window(start_s, duration_s)


def fit_lengths(trace: Trace, max_context: int, max_output: int) -> tuple[np.ndarray, np.ndarray]:
    """Clip lengths so every request fits the model's context."""
    outputs = np.clip(trace.output_tokens, 1, max_output)
    prompts = np.clip(trace.prompt_tokens, 1, max_context - outputs - 1)
    return prompts, outputs


def kv_tokens(trace: Trace, max_context: int, max_output: int) -> np.ndarray:
    """Each request's KV tokens at its end as `replay` sends it: prompt and output."""
    prompts, outputs = fit_lengths(trace, max_context, max_output)
    return prompts + outputs


def spike(trace: Trace, max_context: int, max_output: int, span_s: float) -> tuple[float, float]:
    """The `span_s` seconds of `trace` in which the most KV tokens arrive, as replayed: their
    start and those tokens."""
    return densest(trace.arrival_s, kv_tokens(trace, max_context, max_output), span_s)


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                            max_tokens: int, result: RequestResult) -> None:
    """Send one streamed completion and fill `result` from its chunks (errors are recorded, not raised)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def replay(url: str, trace: Trace, max_context: int = 4096, max_output: int = 256,
                 model: str | None = None, vocab: tuple[int, int] = (10, 256),
                 seed: int = 0, api_key: str | None = None) -> list[RequestResult]:
    """Send every request of `trace` at its arrival time; return one result per request.
    `api_key`: the server's bearer key, if it has one."""
    url = url.rstrip("/")
    rng = np.random.default_rng(seed)
    prompts, outputs = fit_lengths(trace, max_context, max_output)
    limits = httpx.Limits(max_connections=1000)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as c:
        if model is None:
            r = await c.get(f"{url}/v1/models")
            if r.status_code != 200:
                raise ValueError(f"GET {url}/v1/models to find the served model: HTTP {r.status_code}: "
                                 f"{r.text[:200]} (a server with a key needs --api-key)")
            model = r.json()["data"][0]["id"]
        results, tasks = [], []
        t0 = time.perf_counter()
        for at, p, o in zip(trace.arrival_s, prompts, outputs, strict=True):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            result = RequestResult(float(at), int(p))
            results.append(result)
            ids = rng.integers(*vocab, int(p)).tolist()
            tasks.append(asyncio.create_task(stream_completion(c, url, model, ids, int(o), result)))
        await asyncio.gather(*tasks)
    return results


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Latency percentiles (ms), throughput, and SLO attainment / goodput when SLOs are given."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    itl = [x for r in ok for x in r.itl_s]
    out: dict[str, Any] = {
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "duration_s": round(duration_s, 2),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration_s, 2),
        "mean_ttft_ms": round(float(np.mean(ttft)) * 1e3, 2) if ttft else None,
        "p50_ttft_ms": _pct(ttft, 50), "p99_ttft_ms": _pct(ttft, 99),
        "mean_tpot_ms": round(float(np.mean(tpot)) * 1e3, 2) if tpot else None,
        "p50_tpot_ms": _pct(tpot, 50), "p99_tpot_ms": _pct(tpot, 99),
        "p50_itl_ms": _pct(itl, 50), "p99_itl_ms": _pct(itl, 99),
    }
    if slo_ttft_ms is not None and slo_tpot_ms is not None:
        good = [r for r in ok if r.ttft_s * 1e3 <= slo_ttft_ms
                and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)]
        out["slo_attainment"] = round(len(good) / len(results), 4) if results else None
        out["goodput_req_per_s"] = round(len(good) / duration_s, 3)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", choices=TRACE_NAMES, default="azure-conv")
    p.add_argument("--duration", type=float, required=True, help="seconds of trace to replay")
    p.add_argument("--load", type=float, default=1.0, help="request-rate multiplier (burst shape kept)")
    p.add_argument("--start", type=float, default=0.0, help="offset into the trace, seconds")
    p.add_argument("--prompt-scale", type=float, default=1.0)
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("ROSE_API_KEY") or None,
                   help="the server's bearer key (default: $ROSE_API_KEY; none: no header)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--json", help="write per-request results and the summary here")


def run(args: argparse.Namespace) -> int:
    trace = build_trace(args.trace, args.duration, args.load, args.start, args.prompt_scale,
                        args.output_scale)
    start = time.perf_counter()
    results = asyncio.run(replay(args.url, trace, args.max_context, args.max_output, args.model,
                                 api_key=args.api_key))
    summary = summarize(results, time.perf_counter() - start, args.slo_ttft_ms, args.slo_tpot_ms)
    write_report(args.json, summary, requests=[{**dataclasses.asdict(r), "tpot_s": r.tpot_s}
                                               for r in results])
    return 0
