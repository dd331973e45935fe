"""Adapter mode: the rollout policy is a LoRA adapter of the serving model, its turns guest
requests of the serving engine. One forward runs both kinds of row, one pool holds both kinds of
page; each kind's tokens are what it would produce alone; admission's budget caps the rollout
rows, the burst cut hands turns back and its pages go to serving; the engine's scheduler never
lets a guest displace serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from rose.contracts import TokenLoad, Turn, TurnOutput
from rose.contracts.adapter import LoRAConfig
from rose.coserve.cli import serve_process
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_client import LeaseClient
from rose.coserve.settings import MB, ExecutorConfig, Policy
from rose.engine import EngineConfig, KVPool, KVSpec, LLMEngine, RequestOutput, SamplingParams
from rose.model import load_model, load_tokenizer, preset_config, random_model
from rose.model.decoder import CausalLM
from rose.model.lora import save_adapter

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def _model() -> CausalLM:
    return random_model(preset_config("qwen2", "tiny"), seed=1)


def _adapter(model: CausalLM, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = LORA.shapes(model.config)
    return {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}


def _executor(model: CausalLM, pages: int = 64, **config: object) -> CoServingExecutor:
    spec = KVSpec.of(model.config)
    ex = CoServingExecutor(model, None, ExecutorConfig(pool_mb=pages * spec.block_bytes / MB, **config),
                           adapter_mode=True)
    ex.load_adapter("policy", LORA, _adapter(model).items(), 1)
    return ex


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _merge(merged: dict[str, RequestOutput], outputs: list[RequestOutput]) -> dict[str, RequestOutput]:
    for out in outputs:
        if out.request_id in merged:
            merged[out.request_id].merge(out)
        else:
            merged[out.request_id] = out
    return merged


def local_text(checkpoint: Path, token_ids: list[int]) -> str:
    return load_tokenizer(checkpoint).decode(token_ids)


def _drain(ex: CoServingExecutor, merged: dict[str, RequestOutput] | None = None) -> dict[str, RequestOutput]:
    merged = {} if merged is None else merged
    while ex.has_unfinished():
        _merge(merged, ex.step())
    return merged


def test_one_forward_runs_both_kinds_of_row_each_as_it_would_alone() -> None:
    model = _model()
    ex = _executor(model, policy=Policy.NAIVE)
    assert ex.rollout is None and ex.turns is ex.serving
    ex.add_serving(_ids(12, 1), GREEDY, "s")
    ex.submit_turn(Turn("t", "traj", _ids(9, 2), GREEDY, None, "policy"))
    got = _merge({}, ex.step())  # both prompts, one forward
    step = ex.serving.last_step
    assert step.guests == TokenLoad(9) and step.load == TokenLoad(21)
    _merge(got, ex.step())
    assert ex.serving.last_step.load.decode_seqs == 2 and ex.serving.last_step.guests.decode_seqs == 1
    _drain(ex, got)
    alone = LLMEngine(_model(), EngineConfig(kv_cache_bytes=1 << 22))
    alone.load_adapter("policy", LORA, _adapter(model).items(), 1)
    want = alone.generate([_ids(12, 1), _ids(9, 2)], GREEDY, adapter=[None, "policy"])
    assert got["s"].token_ids == want[0].token_ids  # serving: the base model's tokens
    assert got["t"].token_ids == want[1].token_ids and got["t"].logprobs == pytest.approx(want[1].logprobs,
                                                                                           abs=1e-5)
    assert set(got["t"].versions) == {1}  # the adapter's version
    assert ex.served == 1 and ex.metrics.turns_finished.labels("length")._value.get() == 1


def test_admission_caps_the_rollout_rows_and_a_held_turn_waits() -> None:
    model = _model()
    ex = _executor(model, policy=Policy.STATIC, static_rollout_tokens=4)
    ex.add_serving(_ids(30, 1), LONG, "s")
    ex.submit_turn(Turn("t", "traj", _ids(20, 2), LONG, None, "policy"))
    ex.step()
    step = ex.serving.last_step
    assert step.load - step.guests == TokenLoad(30) and step.guests == TokenLoad(4)  # serving whole
    ex = _executor(model)  # rose: a serving request with no SLO room leaves rollouts nothing
    ex.add_serving(_ids(30, 1), LONG, "s")
    ex.submit_turn(Turn("t", "traj", _ids(20, 2), LONG, None, "policy"))
    ex.latency.observe("serving", TokenLoad(16), 100.0)  # any rollout row would break the TTFT SLO
    for load in (TokenLoad(64), TokenLoad(0, 4, 100)):
        ex.latency.observe("serving", load, 100.0)
    ex.latency.fit()
    ex.step()
    assert ex.serving.last_step.guests == TokenLoad() and ex.serving.last_step.load.prefill_tokens == 30


def test_the_cut_hands_turns_back_and_their_pages_go_to_serving() -> None:
    model = _model()
    ex = _executor(model, pages=64)
    for i in range(3):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(150, i), LONG, None, "policy"))
    for _ in range(3):
        ex.step()  # serving idle: the turns prefill, within the rollout budget
    held = ex.pool.used("rollout")
    assert held > 0 and ex.pool.used("serving") == 0
    # A prompt that needs most of the pool: the burst fires, the cut aborts turns.
    ex.add_serving(_ids(700, 9), GREEDY, "s")
    outputs = ex.step()
    aborted = [out for out in outputs if out.finish_reason == "abort"]
    assert aborted and all(out.request_id.startswith("t") for out in aborted)
    assert ex.burst.state.name in ("BURST", "FROZEN") and ex.pool.used("rollout") < held
    got = _drain(ex)
    assert got["s"].finish_reason == "length" and ex.served == 1


def test_the_scheduler_never_lets_a_guest_displace_serving() -> None:
    model = _model()
    spec = KVSpec.of(model.config)
    pool = KVPool.for_specs(12 * spec.block_bytes, spec)
    engine = LLMEngine(model, EngineConfig(), pool=pool, name="serving", guest="rollout")
    short = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine.add_request(_ids(100, 1), short, "guest", priority=1, guest=True)
    engine.step()
    assert pool.used("rollout") == 7 and pool.used("serving") == 0
    # Serving needs more pages than are free: the guest is preempted (recomputed later; its full
    # blocks stay in its prefix cache, which gives them up as serving needs them).
    engine.add_request(_ids(90, 2), short, "serving")
    engine.step()
    assert pool.used("serving") == 6 and engine.num_preemptions == 1
    assert engine.guest_blocks is not None and engine.guest_blocks.num_active_pages == 0
    # With serving holding the pool the guest waits; it never takes serving's pages.
    for _ in range(40):
        engine.step()
        assert engine.last_step.guests == TokenLoad()
    assert pool.used("serving") == 9  # 130 tokens' KV: 3 pages taken from the guest's cache
    assert pool.used("rollout") == 3
    with pytest.raises(ValueError, match="takes no guest requests"):
        LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20)).add_request([1, 2], GREEDY, guest=True)


def test_weights_and_a_foreign_adapter_are_refused() -> None:
    model = _model()
    ex = _executor(model, typical_rollout_context=64)
    with pytest.raises(ValueError, match="ride the serving model"):
        ex.load_weights(model.named_parameters(), 2)
    other = random_model(preset_config("qwen3", "tiny", num_hidden_layers=3, head_dim=8), seed=2)
    with pytest.raises(ValueError, match="q_proj"):
        ex.load_adapter("other", LORA, _adapter(other).items(), 1)
    with pytest.raises(ValueError, match="adapter mode"):
        CoServingExecutor(model, other, ExecutorConfig(), adapter_mode=True)
    cap = ex.capacity()
    assert cap.policy_version == 1 and cap.free_slots > 0


def test_rose_serve_with_only_a_rollout_adapter_runs_turns_on_the_serving_model(tiny_qwen2: Path,
                                                                                 tmp_path: Path) -> None:
    tensors = _adapter(load_model(tiny_qwen2))
    directory = save_adapter(tmp_path / "policy", LORA, tensors, str(tiny_qwen2))
    prompt = _ids(9, 2)
    argv = ["--model", str(tiny_qwen2), "--rollout-adapter", str(directory), "--device", "cpu",
            "--no-profile", "--threads", "1", "--pool-mb", "8"]

    async def turn(url: str) -> TurnOutput:
        client = LeaseClient(url)
        try:
            return await client.run_turn(Turn("t", "traj", prompt, GREEDY, 0, "policy"))
        finally:
            await client.close()

    with serve_process(argv, startup_s=120) as (url, _):
        got = asyncio.run(turn(url))
        served = httpx.post(f"{url}/v1/completions", json={"model": tiny_qwen2.name, "prompt": prompt,
                                                             "max_tokens": 6, "temperature": 0})
    local = LLMEngine.from_pretrained(tiny_qwen2)
    local.load_adapter("policy", LORA, tensors.items(), 0)
    want = local.generate([prompt, prompt], GREEDY, adapter=["policy", None])
    assert got.token_ids == want[0].token_ids and got.logprobs == pytest.approx(want[0].logprobs, abs=1e-5)
    assert served.status_code == 200
    assert served.json()["choices"][0]["text"] == local_text(tiny_qwen2, want[1].token_ids)


def test_an_arrival_interrupts_only_a_forward_of_rollout_rows_alone() -> None:
    model = _model()
    turn = Turn("t", "traj", _ids(40, 2), GREEDY, None, "policy")
    clean = _executor(model)
    clean.submit_turn(turn)
    want = _drain(clean)["t"]
    ex = _executor(model)
    ex.submit_turn(turn)
    arrivals = iter([False, True])  # before each layer: the first forward is given up at its 2nd
    ex.serving_arrived = lambda: next(arrivals, False)
    ex.step()
    assert ex.serving.last_step.interrupted and ex.metrics.rollout_interrupted._value.get() == 1
    assert ex.metrics.iterations.labels("rollout")._value.get() == 1  # rollout rows alone: rollout's
    got = _drain(ex)["t"]  # the same tokens, recomputed
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
    # With a serving request in flight its rows are in the forward: nothing interrupts it.
    ex.add_serving(_ids(12, 1), LONG, "s")
    ex.step()
    ex.serving_arrived = lambda: True
    ex.submit_turn(Turn("t2", "traj", _ids(20, 3), GREEDY, None, "policy"))
    ex.step()
    assert not ex.serving.last_step.interrupted and ex.metrics.rollout_interrupted._value.get() == 1


@pytest.mark.parametrize("adapter_mode", [True, False])
def test_turns_whose_prefix_cache_filled_the_budget_leave_room_for_more(adapter_mode: bool) -> None:
    """Pages only the turns' prefix cache holds are reclaimed as new turns need them: counted as
    taken, a device whose finished turns' cache had filled its rollout budget would report no
    free slot again, and no turn would be routed to it."""
    model = _model()
    rollout = None if adapter_mode else random_model(preset_config("qwen2", "tiny"), seed=2)
    config = ExecutorConfig(pool_mb=64 * KVSpec.of(model.config).block_bytes / MB, typical_rollout_context=64)
    ex = CoServingExecutor(model, rollout, config, adapter_mode=adapter_mode)
    for i in range(12):
        ex.submit_turn(Turn(f"t{i}", "traj", _ids(100, i), GREEDY))
        _drain(ex)
    blocks = ex._turn_blocks()
    assert blocks.num_active_pages == 0 and blocks.num_cached_pages >= ex.pool.budget("rollout") - 1
    assert ex.capacity().free_slots > 0
    ex.submit_turn(Turn("next", "traj", _ids(100, 99), GREEDY))
    assert _drain(ex)["next"].finish_reason == "length"  # it runs: the cache gave its pages back
