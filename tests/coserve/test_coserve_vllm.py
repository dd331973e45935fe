"""Co-serving on vLLM (`rose.coserve.vllm_admission`, docs/vllm.md): ROSE's dual-SLO admission as
vLLM's scheduler, on one vLLM engine serving both kinds of request.

vLLM is not in the default venv: `make test-vllm` runs this file from `.venv-vllm` (made
first if need be)."""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this file")

from vllm_checkpoints import tiny_qwen3_for_vllm

from rose.contracts import SamplingParams, TokenLoad
from rose.coserve.settings import ExecutorConfig
from rose.coserve.vllm_admission import MODEL, ROLLOUT_PRIORITY, SERVING_PRIORITY, VllmCoServing
from rose.engine import RequestOutput

pytestmark = pytest.mark.vllm

# SLOs of 10 s and no inflation budgets: admission bounded by nothing but its own rules.
LOOSE = ExecutorConfig(pool_mb=64, slo_ttft_ms=10_000, slo_tpot_ms=10_000, tpot_inflation=math.inf,
                       ttft_inflation=math.inf)

@pytest.fixture(scope="module")
def coserving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCoServing]:
    ckpt = tiny_qwen3_for_vllm(tmp_path_factory.mktemp("qwen3"), seed=11)
    c = VllmCoServing.from_pretrained(ckpt, "dual_slo", LOOSE)
    yield c
    del c
    gc.collect()  # vLLM tears its process-wide state down when the engine is freed


def _run(c: VllmCoServing, serving_tokens: int, turns: int, turn_prompt: int = 64,
         turn_tokens: int = 8) -> list[list[RequestOutput]]:
    """One serving request (40-token prompt) and `turns` rollout turns added before it; every
    step's outputs until all are done."""
    engine = c.engine
    for k in range(turns):
        engine.add_request([5 + k] * turn_prompt, SamplingParams(max_tokens=turn_tokens, ignore_eos=True),
                           f"turn-{k}", priority=ROLLOUT_PRIORITY)
    serve = SamplingParams(max_tokens=serving_tokens, temperature=0, ignore_eos=True)
    engine.add_request(list(range(10, 50)), serve, "serve", priority=SERVING_PRIORITY)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    return steps


def _serving_span(steps: list[list[RequestOutput]]) -> tuple[int, int]:
    """The steps from serving's first token to its last."""
    with_serving = [i for i, outs in enumerate(steps) if any(o.request_id == "serve" and o.token_ids
                                                             for o in outs)]
    return with_serving[0], with_serving[-1]


def test_the_start_up_profile_fits_the_latency_model(coserving: VllmCoServing) -> None:
    latency = coserving.scheduler.latency
    assert latency.time(MODEL, TokenLoad(512)) > latency.time(MODEL, TokenLoad(16))
    # Iterations of a few ms on the tiny model (tens under a loaded machine): the engine's
    # warm-up (2-3 s) is not in the fit.
    for load in (TokenLoad(16), TokenLoad(512), TokenLoad(0, 1, 32), TokenLoad(0, 32, 32 * 256)):
        assert 1e-4 < latency.time(MODEL, load) < 0.5
    assert coserving.scheduler.tail.fitted is latency


def test_serving_goes_first_and_decodes_every_iteration(coserving: VllmCoServing) -> None:
    coserving.scheduler.configure(LOOSE)
    steps = _run(coserving, serving_tokens=12, turns=4, turn_prompt=400)
    first, last = _serving_span(steps)
    assert first == 0  # four 400-token rollout prompts queued ahead of it did not delay it
    assert last - first == 11  # one token each iteration
    turns = [o for outs in steps for o in outs if o.request_id.startswith("turn")]
    assert sum(len(o.token_ids) for o in turns) == 4 * 8


def test_a_serving_prompt_goes_before_a_rollout_prompt_already_being_prefilled(
        coserving: VllmCoServing) -> None:
    coserving.scheduler.configure(LOOSE)
    engine = coserving.engine
    engine.add_request([7] * 1500, SamplingParams(max_tokens=4, ignore_eos=True), "long-turn",
                       priority=ROLLOUT_PRIORITY)
    assert engine.step() == []  # its first chunk: the turn is running, most of its prompt to go
    engine.add_request(list(range(60, 100)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                       "serve", priority=SERVING_PRIORITY)
    assert [o.request_id for o in engine.step() if o.token_ids] == ["serve"]
    while engine.has_unfinished():
        engine.step()


def test_rollouts_run_beside_serving_when_the_slos_leave_room(coserving: VllmCoServing) -> None:
    coserving.scheduler.configure(LOOSE)
    steps = _run(coserving, serving_tokens=16, turns=4)
    first, last = _serving_span(steps)
    beside = sum(len(o.token_ids) for outs in steps[first + 1:last] for o in outs if o.request_id != "serve")
    assert beside > 0


def test_a_tight_tpot_slo_holds_rollouts_until_serving_is_done(coserving: VllmCoServing) -> None:
    scheduler = coserving.scheduler
    # No room for anything beside a serving decode.
    scheduler.configure(dataclasses.replace(LOOSE, slo_tpot_ms=0.1))
    held = scheduler.held_iterations
    steps = _run(coserving, serving_tokens=16, turns=4)
    first, last = _serving_span(steps)
    beside = [o for outs in steps[first + 1:last + 1] for o in outs
              if o.request_id != "serve" and o.token_ids]
    assert beside == []
    assert scheduler.held_iterations - held >= last - first
    # Once serving is done the device is idle: the held turns run to their end.
    turns = [o for outs in steps for o in outs if o.request_id.startswith("turn")]
    assert sum(len(o.token_ids) for o in turns) == 4 * 8
    assert sum(o.finished for o in turns) == 4


def test_an_unknown_policy_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="policy 'lifo': expected one of dual_slo, priority, fcfs"):
        VllmCoServing.from_pretrained(tmp_path, "lifo")
