"""Adapter mode (`serving.rollout=adapter`): the policy a LoRA adapter of the serving model, its
rollout rows in serving's forward, one set of weights and one KV pool per serving replica."""

from __future__ import annotations

import numpy as np
import pytest

from rose.contracts import TokenLoad
from rose.sim.coserving import pool_bytes
from rose.sim.costs import (
    ForwardCost,
    OneForwardLatency,
    RooflineLatency,
    device_by_name,
    efficiency_for,
    forward_cost,
    model_by_name,
)
from rose.sim.engine import sync_payload
from rose.sim.runner import run_scenario
from rose.sim.scenarios import load_scenario

SEVEN_B = ["models.policy=qwen2.5-7b"]      # paper-8b's policy as its serving model, Qwen2.5-7B
ADAPTER = [*SEVEN_B, "serving.rollout=adapter"]
H800 = device_by_name("H800")
EFF = efficiency_for(H800)
QWEN7B = model_by_name("qwen2.5-7b")


def test_the_adapter_s_bytes_are_rank_r_factors_on_every_attention_and_mlp_projection():
    m, r = QWEN7B, 16
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    per_layer = r * (2 * (m.hidden + q) + 2 * (m.hidden + kv) + 3 * (m.hidden + m.intermediate))
    assert m.adapter_params(r) == m.layers * per_layer == 40_370_176
    assert m.adapter_bytes(r) == 2 * m.adapter_params(r)      # bf16, as the model


def test_the_pool_gains_the_second_model_s_weights_less_the_adapter():
    model, adapter = load_scenario("paper-8b", SEVEN_B), load_scenario("paper-8b", ADAPTER)
    gain = pool_bytes(adapter, H800, EFF) - pool_bytes(model, H800, EFF)
    assert gain == pytest.approx(QWEN7B.weight_bytes - QWEN7B.adapter_bytes(16), abs=2)
    # Serving alone holds no rollout weights in either mode.
    assert pool_bytes(adapter, H800, EFF, alone=True) == pool_bytes(model, H800, EFF, alone=True)


def _latencies() -> tuple[RooflineLatency, OneForwardLatency]:
    serving = forward_cost(QWEN7B, H800, 1, EFF)
    return (RooflineLatency(serving, serving),
            OneForwardLatency(serving, ForwardCost.of_adapter(QWEN7B, 16, H800, 1, EFF)))


@pytest.mark.parametrize("serving, rollout", [
    (TokenLoad(0, 32, 32 * 2000), TokenLoad(0, 16, 16 * 6000)),            # decode beside decode
    (TokenLoad(2048, 32, 32 * 2000), TokenLoad(0, 16, 16 * 6000)),         # a serving chunk
    (TokenLoad(4096, 8, 8 * 2000), TokenLoad(4096, 0, 0)),                 # two prompts' chunks
])
def test_one_forward_is_below_two_and_equal_without_rollout_load(serving: TokenLoad, rollout: TokenLoad):
    two, one = _latencies()
    assert one.iteration_time(serving, rollout) < two.iteration_time(serving, rollout)
    assert one.iteration_time(serving, TokenLoad()) == two.iteration_time(serving, TokenLoad())


def test_decode_rows_add_their_kv_reads_not_a_second_weight_read():
    two, one = _latencies()
    serving, rollout = TokenLoad(0, 32, 32 * 2000), TokenLoad(0, 16, 16 * 6000)
    alone = one.iteration_time(serving, TokenLoad())
    added = one.iteration_time(serving, rollout) - alone
    kv = one.model.s_kv * (rollout.context_tokens + rollout.decode_seqs)
    assert added == pytest.approx(kv + one.adapter.s_weights, rel=1e-9)   # memory-bound: reads only
    assert two.iteration_time(serving, rollout) - alone > one.model.s_weights + kv
    # With no serving work the forward is the rollout's own, and the adapter's kernels on top.
    assert one.iteration_time(TokenLoad(), rollout) == pytest.approx(
        two.iteration_time(TokenLoad(), rollout) + one.adapter.s_weights, rel=1e-12)


def test_arrays_and_numbers_give_the_same_time():
    _, one = _latencies()
    serving = TokenLoad(np.array([0, 2048, 4096]), np.array([32, 32, 8]), np.array([64000, 64000, 16000]))
    rollout = TokenLoad(np.array([0, 0, 4096]), np.array([16, 16, 0]), np.array([96000, 96000, 0]))
    each = [one.iteration_time(TokenLoad(*(int(x[i]) for x in (serving.prefill_tokens, serving.decode_seqs,
                                                               serving.context_tokens))),
                               TokenLoad(*(int(x[i]) for x in (rollout.prefill_tokens, rollout.decode_seqs,
                                                              rollout.context_tokens))))
            for i in range(3)]
    np.testing.assert_allclose(one.iteration_time(serving, rollout), each, rtol=1e-12)


def test_each_sync_moves_the_adapter_s_bytes():
    model, adapter = load_scenario("paper-8b", SEVEN_B), load_scenario("paper-8b", ADAPTER)
    for step in (0, 1, 10):
        assert sync_payload(adapter, step, sparse=True) == QWEN7B.adapter_bytes(16)
        assert sync_payload(adapter, step, sparse=False) == QWEN7B.adapter_bytes(16)
    assert sync_payload(model, 0, sparse=True) == QWEN7B.weight_bytes       # the first load: all of it
    assert sync_payload(model, 1, sparse=True) > 20 * QWEN7B.adapter_bytes(16)


def test_a_policy_other_than_the_serving_model_is_refused_naming_the_keys():
    refused = r"models\.policy \(qwen3-8b\) must be models\.serving \(qwen2\.5-7b\)"
    with pytest.raises(ValueError, match=refused):
        load_scenario("paper-8b", ["serving.rollout=adapter"])
    with pytest.raises(ValueError, match=r"serving\.rollout must be model or adapter"):
        load_scenario("paper-8b", ["serving.rollout=lora"])
    with pytest.raises(ValueError, match=r"serving\.adapter_rank: rank 128 is larger"):
        load_scenario("cpu-bench-train", ["models.policy=tiny-qwen2", "serving.rollout=adapter",
                                          "serving.adapter_rank=128"])


def test_a_short_adapter_run_completes_with_serving_attainment():
    sc = load_scenario("paper-8b", [*ADAPTER, "rl.steps=1", "sim.slice=1", "cluster.train_gpus=4",
                                    "cluster.serving_gpus=4", "rl.trajectories=256",
                                    "sim.systems=[fixed-sync,rose]", "serving.target_p99_tpot_ms=0",
                                    "serving.engine_overhead_ms=57.5"])
    result = run_scenario(sc)
    summary, served = result.summary(), result.to_json()["serving"]
    assert result.runs["rose"].routes["serving"] > 0                # turns rode the serving replicas
    assert 0.99 < served["rose"]["slo_attainment"] <= 1.0
    assert summary["weight_sync_mb"]["adapter"] == pytest.approx(QWEN7B.adapter_bytes(16) / 1e6, abs=0.05)
    assert summary["serving_kv_pool_gb"] == pytest.approx(pool_bytes(sc, H800, EFF) / 1e9, abs=0.005)
