"""The iteration-time model that dual-SLO admission predicts with.

An iteration on a co-serving device runs the serving model's batch, then the rollout model's
(two models cannot share one forward pass), so its time is the sum of two per-model terms, each
linear in (1, prefill tokens, prefill tokens^2, decode sequences, KV tokens the decodes read):
the constant is per-iteration overhead, prefill is matmul-bound (the square term is attention
within a chunk), decode is weight-bound per iteration plus KV-bound per context token. It is
profiled for a few seconds at start-up on the engine itself and refitted online from every
measured iteration, each shape (prefill only, decode only, mixed) kept in a window of its own:
serving prefill iterations are rare beside its decodes, and one window for all would soon hold
none, leaving the prefill terms (what a prompt's TTFT is predicted with) to whatever the decodes
make of them; `error` is the relative error of the predictions made before each
measurement was known, weighted by time (sum of |error| over sum of measured times), so that the
long iterations admission must get right count for more than the shortest ones.

Admission reads the model at a quantile of its error, not at its mean (`TailLatency`): each
model's prediction is scaled by the q-quantile of measured/predicted over its recent iterations
of the same shape (prefill only, decode only, mixed), an online form of split conformal
prediction. A mean fit is under the measured time about half the time, and in co-serving every
underprediction is a late serving token.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from rose.contracts import TokenLoad
from rose.coserve.serving_engine import ServingEngine
from rose.engine import LLMEngine, SamplingParams


def _features(load: TokenLoad) -> np.ndarray:
    p = load.prefill_tokens
    return np.array([1.0, p, p * p / 1024.0, load.decode_seqs, load.context_tokens / 1024.0])


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (times only grow with load): drop the most negative
    feature and refit until none is negative."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if coef.min() >= 0:
            return coef
        active.remove(int(np.argmin(coef)))


def _shape(load: TokenLoad) -> str:
    if not load.decode_seqs:
        return "prefill"
    return "mixed" if load.prefill_tokens else "decode"


class FittedLatencyModel:
    """`iteration_time(serving, rollout)` from per-model fits of measured iterations."""

    # Fewer residuals than this of one shape: the model's residuals of every shape stand in.
    min_residuals = 16

    def __init__(self, window: int = 512, refit_every: int = 32) -> None:
        self.window, self.refit_every = window, refit_every
        # (model, shape) -> the last `window` iterations of that shape: features, seconds
        self._obs: dict[tuple[str, str], collections.deque[tuple[np.ndarray, float]]] = {}
        self._coef: dict[str, np.ndarray] = {}
        self._errors: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        # (model, shape) -> measured / predicted of recent iterations, predicted beforehand
        self._ratios: dict[tuple[str, str], collections.deque[float]] = {}
        self._factors: dict[tuple[str, str, float], float] = {}
        self._since_fit = 0

    def time(self, model: str, load: TokenLoad) -> float:
        if load == TokenLoad() or model not in self._coef:
            return 0.0
        return float(_features(load) @ self._coef[model])

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        return self.time("serving", serving) + self.time("rollout", rollout)

    def observe(self, model: str, load: TokenLoad, seconds: float) -> None:
        """Record a measured iteration of `model`; refit every `refit_every` observations."""
        if load == TokenLoad():
            return
        if model in self._coef and seconds > 0:
            predicted = self.time(model, load)
            self._errors.append((abs(predicted - seconds), seconds))
            if predicted > 0:
                self._ratio(model, _shape(load)).append(seconds / predicted)
        self._obs.setdefault((model, _shape(load)), collections.deque(maxlen=self.window)).append(
            (_features(load), seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every or model not in self._coef:
            self.fit()

    def fit(self) -> None:
        for model in {m for m, _ in self._obs}:
            obs = [o for (m, _), shape in self._obs.items() if m == model for o in shape]
            x = np.stack([f for f, _ in obs])
            y = np.array([t for _, t in obs])
            self._coef[model] = nonnegative_lstsq(x, y)
        self._factors.clear()
        self._since_fit = 0

    def _ratio(self, model: str, shape: str) -> collections.deque[float]:
        return self._ratios.setdefault((model, shape), collections.deque(maxlen=self.window))

    def factor(self, model: str, load: TokenLoad, quantile: float) -> float:
        """The `quantile` of measured/predicted over `model`'s recent iterations of `load`'s
        shape (of every shape while that one has too few; 1.0 while the model has too few)."""
        key = (model, _shape(load), quantile)
        if key not in self._factors:
            ratios = self._ratios.get(key[:2], ())
            if len(ratios) < self.min_residuals:
                ratios = [r for (m, _), rs in self._ratios.items() if m == model for r in rs]
            self._factors[key] = (float(np.quantile(ratios, quantile))
                                  if len(ratios) >= self.min_residuals else 1.0)
        return self._factors[key]

    def reset_error(self) -> None:
        """Start the error count afresh, and seed the residuals with the fit's in-sample ones."""
        self._errors.clear()
        self._ratios.clear()
        for (model, _), obs in self._obs.items():
            for features, seconds in obs:
                predicted = float(features @ self._coef[model])
                if predicted > 0 and seconds > 0:
                    load = TokenLoad(int(features[1]), int(features[3]))
                    self._ratio(model, _shape(load)).append(seconds / predicted)
        self._factors.clear()

    @property
    def error(self) -> float:
        """Time-weighted relative error of recent predictions (made before the measurement)."""
        if not self._errors:
            return float("nan")
        return sum(e for e, _ in self._errors) / sum(t for _, t in self._errors)


@dataclasses.dataclass(frozen=True)
class TailLatency:
    """`fitted` read at the `quantile` of its measured error (module docstring): the
    `LatencyModel` admission predicts with."""

    fitted: FittedLatencyModel
    quantile: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"admission quantile must be in (0, 1], got {self.quantile}")

    def time(self, model: str, load: TokenLoad) -> float:
        mean = self.fitted.time(model, load)
        return mean * self.fitted.factor(model, load, self.quantile) if mean else 0.0

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        return self.time("serving", serving) + self.time("rollout", rollout)


@dataclasses.dataclass(frozen=True)
class OneForward:
    """Serving and rollout rows in one forward pass (one model serving both kinds of request: vLLM's
    engine in `rose.coserve.vllm_admission`, the executor's adapter mode): the iteration's time is
    `model`'s at their summed load, where two models take the sum of two times."""

    tail: TailLatency
    model: str

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        return self.tail.time(self.model, serving + rollout)

    def rollout_seconds(self, serving: TokenLoad, rollout: TokenLoad, seconds: float) -> float:
        """The rollout rows' part of a forward measured at `seconds`: their share of the mean fit's
        prediction for it (what the serving requests in flight waited for them)."""
        total = self.tail.fitted.time(self.model, serving + rollout)
        return seconds * (1.0 - self.tail.fitted.time(self.model, serving) / total) if total > 0 else 0.0


def profile_batches(vocab_size: int, max_len: int, prompt_lens: tuple[int, ...] = (16, 64, 256, 512),
                    batch_sizes: tuple[int, ...] = (1, 4, 16, 32), context_lens: tuple[int, ...] = (32, 256),
                    decode_steps: int = 4) -> Iterator[tuple[list[list[int]], SamplingParams]]:
    """The start-up profile's batches, each run alone on an idle engine: one prompt of each of
    `prompt_lens` (prefill chunks), then `batch_sizes` prompts at each of `context_lens` decoded
    for `decode_steps` tokens (decode batches). Random token ids, the same on any device."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    limit = max_len - decode_steps - 1
    jobs = [(1, length, 1) for length in prompt_lens]
    jobs += [(batch, ctx, decode_steps) for batch in batch_sizes for ctx in context_lens]
    for batch, length, steps in jobs:
        prompts = [torch.randint(0, vocab_size, (min(length, limit),), generator=gen).tolist()
                   for _ in range(batch)]
        yield prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)


def profile(engine: LLMEngine | ServingEngine, model: str, latency: FittedLatencyModel) -> None:
    """Measure `profile_batches` on an idle engine (a few seconds on a CPU), fit `model`'s term,
    and start the error count afresh. Leaves the engine empty."""
    for k, (prompts, params) in enumerate(profile_batches(engine.vocab_size, engine.max_model_len)):
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, f"rose-profile-{k}-{i}")
        while engine.has_unfinished():
            engine.step()
            latency.observe(model, engine.last_step.load, engine.last_step.seconds)
    engine.reset_prefix_cache()
    latency.fit()
    latency.reset_error()
