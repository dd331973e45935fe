"""A serving spike on a co-serving executor whose freeze ends inside it, with a backlog of
handed-back turns, on a device clock: every forward pass takes what a linear cost model says
(the latency model's own form, so that its fit is exact), and `time.monotonic` and
`time.perf_counter` read that clock. Requests arrive at their times, mid-iteration too, and one
that arrives while the rollout model's forward runs interrupts it a layer later, as a server's
arrivals do. The real executor, engines and models run; nothing is timed on this machine, so
the bounds below hold exactly or not at all."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rose.contracts import Turn
from rose.coserve.executor import CoServingExecutor
from rose.coserve.settings import MB, ExecutorConfig
from rose.engine import KVSpec, RequestOutput, SamplingParams
from rose.engine.model_runner import IterationInterrupted
from rose.engine.scheduler import Batch
from rose.model import preset_config, random_model

SLO_TTFT_S, SLO_TPOT_S = 0.6, 0.2
TURN_TOKENS = 300


class DeviceClock:
    """Seconds on the simulated device: only forward passes move it (and `advance`).
    `arrivals`: when the next serving requests arrive, soonest first."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.arrivals: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def forward_s(batch: Batch, scale: float) -> float:
    """One forward's seconds: per iteration, per prefill token, per decode, per KV token read."""
    decodes = [s for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if n == 1]
    prefill = sum(batch.num_tokens) - len(decodes)
    context = sum(s.num_computed_tokens + 1 for s in decodes)
    return scale * (0.004 + 0.0005 * prefill + 0.001 * len(decodes) + 0.004 * context / 1024)


def _on_clock(ex: CoServingExecutor, clock: DeviceClock) -> None:
    """Each engine's forward advances the clock; the rollout model's, given an interrupt (the
    executor's, under `rose`), ends one layer after a serving request arrives in it."""
    for engine, scale in ((ex.serving, 1.0), (ex.rollout, 1.5)):
        run, layers = engine.runner.run, engine.model.config.num_hidden_layers

        def timed(batch: Batch, interrupt: Callable[[], bool] | None = None, run: Any = run,
                  scale: float = scale, layers: int = layers) -> Any:
            seconds = forward_s(batch, scale)
            arrival = next((a for a in clock.arrivals if a > clock.now), None)
            if interrupt is not None and arrival is not None and arrival < clock.now + seconds:
                clock.now = min(clock.now + seconds, arrival + seconds / layers)
                raise IterationInterrupted
            clock.advance(seconds)
            return run(batch, None)

        engine.runner.run = timed


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# The spike: two waves of prompts, (seconds after it begins, prompt tokens). The first takes the
# headroom and fires the burst; the RL step begins while it runs; the second arrives after the
# first has drained (the freeze ends then) while the handed-back turns are prefilled again.
WAVES = [(0.0, 300), (0.05, 300), (0.1, 250), (0.3, 300), (0.35, 200)]
SECOND_WAVE_AFTER_THAW = [(0.0, 300), (0.02, 280), (0.2, 300), (0.25, 120), (0.5, 300)]


Run = tuple[CoServingExecutor, dict[str, RequestOutput], list[dict[str, Any]], int, int]


def _run(clock: DeviceClock, rollouts: bool, **config: float) -> Run:
    """The spike on a fresh executor: it, its serving requests' outputs, its iterations' trace,
    the turns handed back (each sent back at once), the iteration at which the RL step began."""
    serving = random_model(preset_config("qwen2", "tiny"), seed=1)
    rollout = random_model(preset_config("qwen3", "tiny", num_hidden_layers=3, head_dim=8), seed=2)
    page = max(KVSpec.of(serving.config).block_bytes, KVSpec.of(rollout.config).block_bytes)
    ex = CoServingExecutor(serving, rollout, ExecutorConfig(
        pool_mb=160 * page / MB, slo_ttft_ms=SLO_TTFT_S * 1e3, slo_tpot_ms=SLO_TPOT_S * 1e3, **config))
    _on_clock(ex, clock)
    ex.profile()
    records: list[dict[str, Any]] = []
    ex.trace = records.append
    produced: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    served: dict[str, RequestOutput] = {}
    resumed = step_at = 0

    def step() -> None:
        nonlocal resumed
        for out in ex.step():
            if out.request_id.startswith("serving"):
                if out.request_id not in served:
                    served[out.request_id] = out
                else:
                    served[out.request_id].merge(out)
                continue
            produced.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason == "abort":  # handed back: its trajectory sends it again at once
                tokens = produced.pop(out.request_id)
                turn_id = f"{out.request_id}+"
                prompts[turn_id] = prompts.pop(out.request_id) + tokens
                left = TURN_TOKENS - (len(prompts[turn_id]) - 120)
                ex.submit_turn(Turn(turn_id, turn_id, prompts[turn_id], SamplingParams(
                    max_tokens=max(1, left), temperature=0, ignore_eos=True)))
                resumed += 1

    if rollouts:
        for i in range(10):
            prompts[f"t{i}"] = _ids(120, i)
            ex.submit_turn(Turn(f"t{i}", f"traj{i}", prompts[f"t{i}"],
                                SamplingParams(max_tokens=TURN_TOKENS, temperature=0, ignore_eos=True)))
        for _ in range(40):
            step()
    else:
        clock.advance(1.0)  # about what the rollouts' 40 steps take
    seeds = iter(range(100, 200))
    for wave, after in ((WAVES, "step"), (SECOND_WAVE_AFTER_THAW, None)):
        start = clock()
        pending = [(start + at, tokens) for at, tokens in wave]
        clock.arrivals = [at for at, _ in pending]
        while pending or ex.serving.has_unfinished():
            while pending and clock() >= pending[0][0]:  # arrived during the last iteration, or now
                at, tokens = pending.pop(0)
                rid = ex.add_serving(_ids(tokens, next(seeds)), SamplingParams(max_tokens=12, temperature=0,
                                                                               ignore_eos=True))
                ex.serving._seqs[rid].arrival_time = at
            if not ex.has_unfinished():
                clock.now = pending[0][0] if pending else clock.now
                continue
            step()
            if after == "step" and rollouts and ex.burst.state.name == "FROZEN":
                ex.new_rl_step()  # inside the spike: the freeze holds until serving recedes
                after, step_at = None, len(records)
        for _ in range(5):  # the first wave drained: the step's thaw
            step()
    return ex, served, records, resumed, step_at


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> DeviceClock:
    c = DeviceClock()
    monkeypatch.setattr(time, "monotonic", c)
    monkeypatch.setattr(time, "perf_counter", c)
    return c


def test_a_freeze_that_ends_inside_a_spike_keeps_every_serving_request_in_its_slo(clock: DeviceClock) -> None:
    # The SLOs alone bound rollouts here (no inflation budgets), so that the handed-back turns'
    # prefill runs beside serving's requests and the TTFT budget is what holds it.
    inf = float("inf")
    ex, served, records, resumed, step_at = _run(clock, rollouts=True, ttft_inflation=inf, tpot_inflation=inf)
    states = [r["state"] for r in records]
    assert "burst" in states and resumed >= 1  # a cut handed turns back, and they came back at once
    # The RL step began inside the first wave; the freeze held while that wave ran.
    thawed = states.index("normal", step_at)
    assert thawed > step_at + 1 and all(r["state"] != "normal" for r in records[step_at:thawed])
    assert records[step_at]["waiting"] or records[step_at]["serving"]["decodes"]
    # Serving: every request within its SLOs, none of them preempted, the prompts never short of pages.
    assert len(served) == len(WAVES) + len(SECOND_WAVE_AFTER_THAW)
    for out in served.values():
        assert out.finished and out.first_token_time is not None
        assert out.first_token_time - out.arrival_time <= SLO_TTFT_S
        assert (out.last_token_time - out.first_token_time) / (out.num_output_tokens - 1) <= SLO_TPOT_S
    assert ex.serving.num_preemptions == 0
    # Rollouts: what each iteration ran stayed within what admission granted it, and the
    # handed-back turns' prefill ran beside the second wave, under its TTFT budget.
    beside = 0
    for r in records:
        if "rollout" not in r:
            continue
        granted = r["admission"]
        ran = r["rollout"]  # (a one-token prefill chunk runs as a decode)
        assert ran["prefill"] <= granted["prefill"]
        assert ran["prefill"] + ran["decodes"] <= granted["prefill"] + granted["decodes"]
        if r["waiting"] or r["serving"]["decodes"]:
            assert granted["predicted_s"] <= granted["limit_s"]
            beside += r["rollout"]["prefill"]
    assert beside > 0 and any("rollout" in r and r["rollout"]["prefill"] for r in records[thawed:])


def test_the_spike_costs_each_request_no_more_than_its_ttft_inflation(clock: DeviceClock) -> None:
    """Against the same spike on the same device with no rollouts: rollouts add at most the
    `ttft_inflation` share of a request's own time to its time to first token."""
    _, co, *_ = _run(clock, rollouts=True)
    _, alone, *_ = _run(clock, rollouts=False)
    inflation = ExecutorConfig().ttft_inflation
    for rid, out in co.items():
        own = alone[rid].first_token_time - alone[rid].arrival_time
        assert out.first_token_time - out.arrival_time <= own * (1 + inflation) + 1e-9, rid
