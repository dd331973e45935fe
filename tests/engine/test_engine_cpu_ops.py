"""The fused forward's C++ steps (`csrc/cpu_ops.cpp`) against the PyTorch ops they replace, and
the engine's choice of forward. Token-for-token parity with `transformers` through the fused
forward is tests/engine/test_engine_parity.py's (CPU float32 runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rose.contracts import SamplingParams
from rose.engine import LLMEngine, cpu_kernels, sampling
from rose.engine.cpu_linear import PackedLinear
from rose.engine.sequence import Sequence
from rose.model.decoder import RMSNorm, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler")
ops = torch.ops.rose


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    cpu_kernels.load()


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def test_add_rms_norm_is_the_residual_add_then_rmsnorm() -> None:
    norm, x, residual = _norm(96), torch.randn(5, 96), torch.randn(5, 96) * 3
    with torch.no_grad():
        expected = norm(residual + x)
    expected_residual = residual + x
    ops.add_rms_norm(x, residual, norm.weight, norm.eps, x)  # in place, as the forward runs it
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(x, expected)


def test_rope_store_norms_rotates_and_stores_k_and_v() -> None:
    heads, kv_heads, dim, block = 4, 2, 32, 4
    tokens = 6
    rope, q_norm, k_norm = RotaryEmbedding(dim, 10000.0), _norm(dim), _norm(dim)
    positions = torch.tensor([0, 3, 7, 8, 20, 21])
    cos, sin = (t[0].contiguous() for t in rope(positions[None], torch.float32))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.view(tokens, -1, dim).split((heads, kv_heads, kv_heads), 1)
    with torch.no_grad():
        want_q = apply_rotary(q_norm(q)[None], cos[None], sin[None])[0]
        want_k = apply_rotary(k_norm(k)[None], cos[None], sin[None])[0]
    want_v = v.clone()
    rows = torch.zeros(40, block * dim)
    slot_rows = torch.tensor([0, 4, 8, 12, 16, 20]) + 2  # layer offset 2 rows into each page
    offsets = torch.tensor([0, 1, 2, 3, 0, 3])
    ops.rope_store(qkv, heads, kv_heads, cos, sin, q_norm.weight, k_norm.weight, 1e-6, rows, slot_rows,
                   offsets)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    for t in range(tokens):
        slot = rows.view(40, block, dim)[:, offsets[t]]
        torch.testing.assert_close(slot[slot_rows[t]:slot_rows[t] + kv_heads], want_k[t])
        torch.testing.assert_close(slot[slot_rows[t] + kv_heads:slot_rows[t] + 2 * kv_heads], want_v[t])
    # Without q/k norms (Llama, Qwen2): RoPE only.
    qkv2 = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    want = apply_rotary(qkv2.view(1, tokens, -1, dim)[:, :, :heads + kv_heads], cos[None], sin[None])[0]
    ops.rope_store(qkv2, heads, kv_heads, cos, sin, None, None, 1e-6, rows, slot_rows, offsets)
    torch.testing.assert_close(qkv2.view(tokens, -1, dim)[:, :heads + kv_heads], want)


def test_rope_store_refuses_slots_outside_the_pool() -> None:
    qkv, cos, sin = torch.randn(1, 4 * 16), torch.ones(1, 16), torch.zeros(1, 16)
    rows = torch.zeros(8, 4 * 16)
    with pytest.raises(RuntimeError, match="outside the pool's 8 rows of 4 tokens"):
        ops.rope_store(qkv, 2, 1, cos, sin, None, None, 1e-6, rows, torch.tensor([7]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="outside the pool's 8 rows of 4 tokens"):
        ops.rope_store(qkv, 2, 1, cos, sin, None, None, 1e-6, rows, torch.tensor([0]), torch.tensor([4]))


def test_silu_mul_is_silu_of_gate_times_up() -> None:
    gate_up, out = torch.randn(70, 2 * 48) * 4, torch.empty(70, 48)
    ops.silu_mul(gate_up, out)
    torch.testing.assert_close(out, F.silu(gate_up[:, :48]) * gate_up[:, 48:])


def test_logsumexp_argmax_takes_the_first_largest_and_the_scaled_normaliser() -> None:
    logits = torch.randn(4, 1000) * 5
    logits[1, [10, 500]] = 50.0  # a tie: the first index, as torch.argmax
    logits[2, ::3] = -torch.inf  # masked tokens
    scale = torch.tensor([1.0, 0.5, 1.0, 2.0])
    lse, argmax = torch.empty(4), torch.empty(4, dtype=torch.long)
    ops.logsumexp_argmax(logits, scale, lse, argmax)
    assert argmax.tolist() == logits.argmax(-1).tolist() and argmax[1] == 10
    torch.testing.assert_close(lse, (logits / scale[:, None]).logsumexp(-1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, seed=3, top_logprobs=3),
    SamplingParams(temperature=0.7, seed=3, logprobs_at_temperature=True),
    SamplingParams(temperature=0, logit_bias=[(5, 100.0)]),
])
def test_sampler_draws_the_same_with_and_without_the_kernel(params: SamplingParams,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 300) * 3

    def draw() -> sampling.Sampled:
        seqs = [Sequence(f"r{i}", [1, 2, 3], params) for i in range(3)]
        for seq in seqs:
            seq.generator = torch.Generator().manual_seed(7)
        return sampling.sample(logits, seqs)

    fast = draw()
    monkeypatch.setattr(cpu_kernels, "ready", lambda: False)
    slow = draw()
    assert fast.tokens == slow.tokens
    torch.testing.assert_close(torch.tensor(fast.logprobs), torch.tensor(slow.logprobs))
    assert [[t for t, _ in row] for row in fast.top] == [[t for t, _ in row] for row in slow.top]


def test_unsampleable_rows_are_those_with_nan_or_positive_inf() -> None:
    logits = torch.randn(5, 50)
    logits[1, 3] = torch.nan
    logits[2, 4] = torch.inf
    logits[3, :10] = -torch.inf  # masked, still sampleable
    logits[4] = 3e37  # finite, though the row's sum overflows
    assert sampling.unsampleable_rows(logits) == [1, 2]


def test_packed_linears_side_by_side_follow_each_weight() -> None:
    torch.manual_seed(0)
    q, k = torch.nn.Linear(32, 24), torch.nn.Linear(32, 8)
    fused = PackedLinear(q, k)
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), torch.cat([q(x), k(x)], -1))
        k.weight.mul_(3)
        torch.testing.assert_close(fused(x), torch.cat([q(x), k(x)], -1))
        q.bias.add_(1)  # a sparse weight update may change a bias alone
        torch.testing.assert_close(fused(x), torch.cat([q(x), k(x)], -1))
    assert fused(x).requires_grad  # a forward that records gradients goes through each linear


@pytest.mark.parametrize(("dtype", "fused"), [("float32", True), ("bfloat16", False)])
def test_the_engine_runs_the_fused_forward_on_cpu_float32(tiny_qwen3: Path, dtype: str, fused: bool) -> None:
    engine = LLMEngine.from_pretrained(tiny_qwen3, dtype=dtype, device="cpu")
    assert (engine.runner.fused is not None) == fused
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
