"""Cost models (`rose.sim.costs`): shapes against published parameter counts, roofline regimes,
training and weight-sync arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from rose.contracts import TokenLoad
from rose.sim.costs import (
    DEVICES,
    MODELS,
    Efficiency,
    ForwardCost,
    RooflineLatency,
    WeightSync,
    cross_cluster_sync_time,
    kv_capacity_tokens,
    naive_sync_time,
    train_step_time,
)


@pytest.mark.parametrize(("name", "billions"), [
    # Hugging Face model cards: Qwen3-8B 8.2B, Qwen3-32B 32.8B, Qwen2.5-7B 7.61B, Qwen2.5-32B 32.5B.
    ("qwen3-8b", 8.2), ("qwen3-32b", 32.8), ("qwen2.5-7b", 7.61), ("qwen2.5-32b", 32.5),
])
def test_parameter_counts_match_model_cards(name, billions):
    assert MODELS[name].params / 1e9 == pytest.approx(billions, rel=0.02)


def test_small_preset_matches_the_projects_34m_model():
    assert MODELS["small-qwen3"].params / 1e6 == pytest.approx(34, rel=0.02)


def test_kv_bytes_per_token():
    # 2 (K and V) x layers x KV heads x head dim x 2 bytes
    assert MODELS["qwen3-8b"].kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert MODELS["qwen2.5-7b"].kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_decode_is_memory_bound_and_prefill_compute_bound():
    eff = Efficiency()
    cost = ForwardCost.of(MODELS["qwen3-8b"], DEVICES["H800"], 1, eff)
    one = cost.scalar(TokenLoad(0, 1, 1000))
    weights = MODELS["qwen3-8b"].weight_bytes / (3.35e12 * eff.decode_bw)
    assert one == pytest.approx(weights + eff.forward_overhead_s, rel=0.05)
    chunk = cost.scalar(TokenLoad(4096, 0, 0))
    flops = 2 * MODELS["qwen3-8b"].layer_params * 4096 / (989e12 * eff.prefill_mfu)
    assert chunk > flops and chunk < 1.3 * flops + eff.forward_overhead_s
    assert cost.scalar(TokenLoad()) == 0.0


def test_scalar_and_vectorised_forms_agree_exactly():
    # One formula, two ways of taking min/max: the figures must not depend on which path ran.
    loads = [TokenLoad(p, d, c) for p in (0, 1, 512, 4096) for d in (0, 1, 37) for c in (0, 999, 64_000)]
    for model, tp in (("qwen3-8b", 1), ("qwen2.5-32b", 4), ("small-qwen3", 1)):
        cost = ForwardCost.of(MODELS[model], DEVICES["H800"], tp, Efficiency())
        vector = cost.time(*(np.array([getattr(x, f) for x in loads], dtype=float)
                             for f in ("prefill_tokens", "decode_seqs", "context_tokens")))
        assert [cost.scalar(x) for x in loads] == vector.tolist()


def test_tensor_parallel_halves_streaming_and_adds_allreduce_latency():
    eff = Efficiency()
    tp1 = ForwardCost.of(MODELS["qwen3-32b"], DEVICES["H800"], 1, eff)
    tp2 = ForwardCost.of(MODELS["qwen3-32b"], DEVICES["H800"], 2, eff)
    assert tp2.s_weights == pytest.approx(tp1.s_weights / 2)
    assert tp2.fixed - tp1.fixed == pytest.approx(2 * 64 * eff.allreduce_latency_s)


def test_co_served_iteration_is_the_sum_of_both_forwards():
    eff = Efficiency()
    s = ForwardCost.of(MODELS["qwen2.5-7b"], DEVICES["H800"], 1, eff)
    r = ForwardCost.of(MODELS["qwen3-8b"], DEVICES["H800"], 1, eff)
    lat = RooflineLatency(s, r)
    a, b = TokenLoad(512, 10, 10_000), TokenLoad(0, 32, 64_000)
    assert lat.iteration_time(a, b) == pytest.approx(s.scalar(a) + r.scalar(b))


def test_kv_capacity_beside_one_or_two_models():
    eff = Efficiency()
    m = MODELS["qwen3-8b"]
    alone = kv_capacity_tokens(m, DEVICES["H800"], 1, eff)
    assert alone == int((80e9 * 0.9 - m.weight_bytes) / m.kv_bytes_per_token)
    shared = kv_capacity_tokens(MODELS["qwen3-8b"], DEVICES["H800"], 1, eff,
                                other_weights=MODELS["qwen2.5-7b"].weight_bytes)
    assert 0 < shared < alone


def test_train_step_time_is_flops_over_achieved_rate():
    eff = Efficiency()
    m = MODELS["qwen3-8b"]
    t = train_step_time(m, DEVICES["H800"], 48, 1e7, logprob_passes=2, eff=eff)
    assert t == pytest.approx(10 * m.params * 1e7 / (48 * 989e12 * 0.4))


def test_sparse_delta_payload_and_periodic_full_sync():
    m = MODELS["qwen3-8b"]
    ws = WeightSync(changed_fraction=0.05, full_every=10)
    assert ws.payload_bytes(m, 3, sparse=True) == pytest.approx(m.params * 0.05 * 6)
    assert ws.payload_bytes(m, 10, sparse=True) == m.weight_bytes
    assert ws.payload_bytes(m, 3, sparse=False) == m.weight_bytes


def test_cross_cluster_sync_is_limited_by_the_slowest_stage():
    payload = 16e9
    t = cross_cluster_sync_time(payload, cross_bw=25e9, receivers=64, tp=1, nic_bw=50e9, senders=48)
    assert t == pytest.approx(payload / 25e9 + 64e6 / 25e9)
    # Paper: 20 s or less even at 20 Gb/s for a sparse delta of an 8B model.
    delta = WeightSync().payload_bytes(MODELS["qwen3-8b"], 1, sparse=True)
    assert cross_cluster_sync_time(delta, 20e9 / 8, 64, 1, 50e9, 48) < 20
    assert cross_cluster_sync_time(payload, 25e9, 0, 1, 50e9, 48) == 0.0


def test_naive_sync_sends_every_receiving_gpu_a_full_copy_through_one_nic():
    m = MODELS["qwen3-32b"]
    # 64 serving GPUs (16 TP-4 replicas) at 200 Gb/s: 64 copies of 65.5 GB at 25 GB/s.
    assert naive_sync_time(m.weight_bytes, 25e9, 64, 50e9) == pytest.approx(64 * m.weight_bytes / 25e9)
    assert naive_sync_time(m.weight_bytes, 100e9, 64, 50e9) == pytest.approx(64 * m.weight_bytes / 50e9)


def test_smollm2_shape_has_its_135m_parameters():
    # HF's count, 134,515,008, less the 61 RMSNorm vectors of 576 that shapes leave out.
    assert MODELS["smollm2-135m"].params == 134_515_008 - 61 * 576
