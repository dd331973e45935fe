"""Serving request traces: load the shipped real traces, scale them to a target load, build a day.

One loader for everyone who replays serving traffic: the cluster simulator (`rose.sim`) and the
load generator (`rose loadgen`). A trace is three aligned arrays (arrival time, prompt tokens,
output tokens). Scaling to a target load compresses or stretches time, so the burst *shape*
(inter-arrival CV, peak-to-mean per window) is kept while the mean rate changes; token lengths
scale separately. Traces shipped in `rose/data/traces/` (see its README for sources and licences):

- `azure-conv`, `azure-code`: Azure LLM inference trace 2023 (CC-BY 4.0; Patel et al.,
  "Splitwise", ISCA 2024).
- `mooncake`: Mooncake FAST'25 conversation trace (Apache-2.0).
- `gamma`: a synthetic gamma-renewal process (`gamma_trace`), lengths borrowed from a real trace.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
from importlib import resources
from pathlib import Path

import numpy as np

DAY_S = 86_400.0
# name -> (file in rose/data/traces, format)
TRACE_FILES: dict[str, tuple[str, str]] = {
    "azure-conv": ("azure_llm_2023_conv.csv", "azure"),
    "azure-code": ("azure_llm_2023_code.csv", "azure"),
    "mooncake": ("mooncake_conversation.jsonl", "mooncake"),
}
TRACE_NAMES = (*TRACE_FILES, "gamma")


@dataclasses.dataclass(frozen=True)
class TraceStats:
    requests: int
    mean_rate: float              # requests/s over the trace's span
    interarrival_cv: float
    peak_to_mean_1s: float        # busiest 1 s window against the mean, as the traces' README
    peak_to_mean_60s: float
    prompt_p50: float
    prompt_mean: float
    prompt_p99: float
    output_p50: float
    output_mean: float
    output_p99: float


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """Requests sorted by arrival; `arrival_s` starts at 0. `period_s` is the span used to tile it."""

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if n < 2 or len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError(f"trace {self.name!r}: needs at least 2 requests and aligned columns")
        if np.any(np.diff(self.arrival_s) < 0):
            raise ValueError(f"trace {self.name!r}: arrivals must be sorted")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def period_s(self) -> float:
        # One mean inter-arrival after the last request, so a tiled trace has no seam.
        span = float(self.arrival_s[-1] - self.arrival_s[0])
        return span * len(self) / (len(self) - 1)

    @property
    def mean_rate(self) -> float:
        return len(self) / self.period_s

    def stats(self) -> TraceStats:
        gaps = np.diff(self.arrival_s)

        def peak(window: float) -> float:
            counts = np.bincount((self.arrival_s // window).astype(np.int64))
            return float(counts.max() / counts.mean())

        p, o = self.prompt_tokens, self.output_tokens
        return TraceStats(
            requests=len(self), mean_rate=self.mean_rate,
            interarrival_cv=float(gaps.std() / gaps.mean()),
            peak_to_mean_1s=peak(1.0), peak_to_mean_60s=peak(60.0),
            prompt_p50=float(np.median(p)), prompt_mean=float(p.mean()),
            prompt_p99=float(np.percentile(p, 99)),
            output_p50=float(np.median(o)), output_mean=float(o.mean()),
            output_p99=float(np.percentile(o, 99)),
        )

    def scaled(self, rate: float = 1.0, tokens: float = 1.0, prompt_tokens: float | None = None,
               output_tokens: float | None = None) -> Trace:
        """Time compressed by `rate` (2.0 = twice the requests/s, same burst shape); lengths times
        `tokens` (or separately `prompt_tokens` / `output_tokens`), rounded, at least 1."""
        for label, value in (("rate", rate), ("tokens", tokens), ("prompt_tokens", prompt_tokens),
                             ("output_tokens", output_tokens)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"trace scale {label} must be a positive number, got {value!r}")
        ps = tokens if prompt_tokens is None else prompt_tokens
        os_ = tokens if output_tokens is None else output_tokens
        return Trace(self.name, self.arrival_s / rate, _scale_lengths(self.prompt_tokens, ps),
                     _scale_lengths(self.output_tokens, os_))

    def window(self, start_s: float, duration_s: float) -> Trace:
        """Requests in [start_s, start_s + duration_s) of the trace tiled end to end, shifted to 0.
        Raises when the window holds fewer than 2 requests."""
        a, p, o = tile(self, start_s, start_s + duration_s)
        if len(a) < 2:
            # The window that holds 2 (a tiled trace has every request once per period).
            needed = math.floor(tile(self, start_s, start_s + 2 * self.period_s)[0][1] - start_s) + 1
            raise ValueError(
                f"trace {self.name!r}: the {duration_s:g} s window from {start_s:g} s holds {len(a)} "
                f"request(s) at this load ({self.mean_rate:.3g} requests/s on average); a replay needs "
                f"at least 2: take a longer window (--duration {needed} or more), a "
                f"higher --load or another --start")
        return Trace(self.name, a - start_s, p, o)


def _scale_lengths(x: np.ndarray, factor: float) -> np.ndarray:
    if factor == 1.0:
        return x
    return np.maximum(1, np.rint(x * factor)).astype(np.int64)


def tile(trace: Trace, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrivals (and lengths) of `trace` repeated with its period, within [t0, t1)."""
    period = trace.period_s
    k0, k1 = math.floor(t0 / period), math.floor(t1 / period)
    parts = []
    for k in range(k0, k1 + 1):
        a = trace.arrival_s + k * period
        lo, hi = np.searchsorted(a, [t0, t1])
        parts.append((a[lo:hi], trace.prompt_tokens[lo:hi], trace.output_tokens[lo:hi]))
    return (np.concatenate([x[0] for x in parts]), np.concatenate([x[1] for x in parts]),
            np.concatenate([x[2] for x in parts]))


def densest(arrival_s: np.ndarray, weight: np.ndarray, span_s: float) -> tuple[float, float]:
    """The `span_s`-long stretch that starts at an arrival and holds the most `weight` (a spike
    of requests, of tokens): its start and its weight."""
    ends = np.searchsorted(arrival_s, arrival_s + span_s)
    cumulative = np.concatenate([[0.0], np.cumsum(weight, dtype=np.float64)])
    held = cumulative[ends] - cumulative[np.arange(len(arrival_s))]
    best = int(np.argmax(held))
    return float(arrival_s[best]), float(held[best])


def _trace_path(filename: str) -> Path:
    return Path(str(resources.files("rose") / "data" / "traces" / filename))


@functools.lru_cache(maxsize=8)
def load_trace(name: str) -> Trace:
    """A shipped trace by name (`azure-conv`, `azure-code`, `mooncake`) or a path to a file in
    one of their formats (Azure CSV, Mooncake JSONL)."""
    if name in TRACE_FILES:
        filename, fmt = TRACE_FILES[name]
        path = _trace_path(filename)
    else:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"no trace named {name!r}; expected one of "
                                    f"{', '.join(TRACE_FILES)} or a .csv/.jsonl file")
        fmt = "mooncake" if path.suffix == ".jsonl" else "azure"
    arrival, prompt, output = (_read_mooncake if fmt == "mooncake" else _read_azure)(path)
    order = np.argsort(arrival, kind="stable")
    arrival = arrival[order] - arrival[order][0]
    return Trace(name, arrival, prompt[order], output[order])


def _read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = [h.strip() for h in next(rows)]
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: expected columns TIMESTAMP,ContextTokens,GeneratedTokens, "
                             f"got {','.join(header)}")
        stamps, prompt, output = [], [], []
        for i, row in enumerate(rows, start=2):
            try:
                # Timestamps carry 7 fractional digits; numpy takes at most 6 for microseconds.
                stamps.append(np.datetime64(row[0].strip()[:26].replace(" ", "T"), "us"))
                prompt.append(int(row[1]))
                output.append(int(row[2]))
            except (ValueError, IndexError) as exc:
                raise ValueError(f"{path}:{i}: bad row {row!r}: {exc}") from None
    t = np.array(stamps, dtype="datetime64[us]")
    seconds = (t - t.min()).astype(np.int64) / 1e6
    return seconds, np.array(prompt, np.int64), np.maximum(1, np.array(output, np.int64))


def _read_mooncake(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, prompt, output = [], [], []
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t.append(float(d["timestamp"]) / 1000.0)     # milliseconds in the file
                prompt.append(int(d["input_length"]))
                output.append(int(d["output_length"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: bad record: {exc}") from None
    return np.array(t), np.array(prompt, np.int64), np.maximum(1, np.array(output, np.int64))


def gamma_trace(rate: float, cv: float, duration_s: float, lengths: Trace, seed: int = 0) -> Trace:
    """A gamma-renewal arrival process (CV 1 is Poisson) with `rate` requests/s over `duration_s`,
    prompt/output lengths drawn with replacement from the real trace `lengths`."""
    if rate <= 0 or cv <= 0 or duration_s <= 0:
        raise ValueError("gamma trace: rate, cv and duration_s must be positive")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    n = int(rate * duration_s * 1.2 + 20 * math.sqrt(rate * duration_s) + 10)
    arrival = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))
    arrival = arrival[arrival < duration_s]
    pick = rng.integers(0, len(lengths), size=len(arrival))
    return Trace("gamma", arrival - arrival[0], lengths.prompt_tokens[pick],
                 lengths.output_tokens[pick])


@dataclasses.dataclass(frozen=True)
class Diurnal:
    """Rate multiplier m(t) = 1 + amplitude * cos(2 pi (t - peak) / 24 h), mean 1 over a day.

    A cosine is the simplest shape with one daily peak and trough, the pattern production LLM
    services show (Azure LLM inference traces; Splitwise, ISCA 2024, and DynamoLLM, HPCA 2025)."""

    amplitude: float = 0.0
    peak_hour: float = 14.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.amplitude < 1.0:
            raise ValueError(f"diurnal amplitude must be in [0, 1), got {self.amplitude}")

    def multiplier(self, t: np.ndarray | float) -> np.ndarray | float:
        return 1.0 + self.amplitude * np.cos(2 * np.pi * (np.asarray(t) / 3600.0 - self.peak_hour) / 24.0)

    def cumulative(self, t: np.ndarray) -> np.ndarray:
        """Integral of the multiplier from 0 to t, in seconds."""
        w = 2 * np.pi / DAY_S
        tp = self.peak_hour * 3600.0
        return t + self.amplitude / w * (np.sin(w * (t - tp)) + np.sin(w * tp))


def day_arrivals(trace: Trace, mean_rate: float, diurnal: Diurnal, t0: float, t1: float,
                 phase_s: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrivals in day time [t0, t1) of `trace` at a day-mean of `mean_rate` requests/s shaped by
    `diurnal`, as (arrival_s, prompt_tokens, output_tokens).

    Time warping: the trace, tiled and started `phase_s` into itself, runs in "unit" time u at
    rate `mean_rate`; request u happens at the day time t with cumulative(t) = u. Within any
    minute the trace's own bursts are kept; across hours the rate follows the diurnal curve."""
    scale = trace.mean_rate / mean_rate
    grid = np.linspace(t0, t1, max(2, int((t1 - t0) / 10.0) + 2))      # 10 s grid, monotone
    u_grid = diurnal.cumulative(grid)
    a, p, o = tile(trace, phase_s + u_grid[0] / scale, phase_s + u_grid[-1] / scale)
    t = np.interp((a - phase_s) * scale, u_grid, grid)
    keep = (t >= t0) & (t < t1)
    return t[keep], p[keep], o[keep]


@functools.lru_cache(maxsize=16)
def diurnal_for_peak(trace_name: str, minute_peak_to_mean: float, peak_hour: float = 14.0) -> Diurnal:
    """The diurnal amplitude that gives a built day the per-minute peak-to-mean ratio asked for
    (bisection over the day built from the trace at its own mean rate). Amplitude 0 when the
    trace's own minute-scale bursts already reach it."""
    trace = load_trace(trace_name)
    # The day's request stream in "unit" time is the same for every amplitude; only the warp
    # to day time changes (see day_arrivals, phase 0, the trace's own rate).
    u, _, _ = tile(trace, 0.0, DAY_S)
    grid = np.linspace(0.0, DAY_S, 8641)

    def ratio(amplitude: float) -> float:
        t = np.interp(u, Diurnal(amplitude, peak_hour).cumulative(grid), grid)
        counts = np.bincount((t // 60).astype(np.int64), minlength=1440)[:1440]
        return float(counts.max() / counts.mean())

    if ratio(0.0) >= minute_peak_to_mean:
        return Diurnal(0.0, peak_hour)
    lo, hi = 0.0, 0.95
    if ratio(hi) < minute_peak_to_mean:
        raise ValueError(f"trace {trace_name!r} cannot reach a per-minute peak of "
                         f"{minute_peak_to_mean}x with a diurnal amplitude below 0.95")
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < minute_peak_to_mean else (lo, mid)
    return Diurnal(round(hi, 4), peak_hour)
