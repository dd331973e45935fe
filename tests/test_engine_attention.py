"""The paged attention's two decode paths (numba in place, gather + SDPA) against plain math."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rose.cli import main
from rose.engine import cpu_attention
from rose.engine.attention import PagedAttention
from rose.engine.kv_pool import KVPool, KVSpec


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Softmax attention of each sequence's one query `[heads, D]` over its `[tokens, kv_heads, D]`."""
    outs = []
    for qi, k, v in zip(q, keys, values, strict=True):
        group = qi.shape[0] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [T, heads, D]
        scores = torch.einsum("hd,thd->ht", qi.double(), k.double()) / qi.shape[-1] ** 0.5
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v.double()))
    return torch.stack(outs).float()


@pytest.mark.parametrize("lengths", [[13, 9, 4, 1], [700, 500, 13, 1]], ids=["one-thread", "parallel"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gather-sdpa"])
def test_decode_attention_reads_each_sequences_pages(in_place: bool, lengths: list[int]) -> None:
    """Sequences of different lengths, their pages scattered over a pool shared with a larger
    model (so pages are longer than this model's block), GQA: both paths give the math's answer
    (the in-place kernel on one thread for little work, on all for more)."""
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4)
    big = KVSpec(num_layers=5, num_kv_heads=3, head_dim=16, block_size=4)
    pool = KVPool.for_specs(400 * big.block_bytes, spec, big)
    kv = pool.view(spec)  # [pages, layers, 2, kv_heads, block, D]
    kv.copy_(torch.randn(kv.shape))
    attention = PagedAttention(pool, spec, num_heads=6)
    assert attention.in_place  # float32 on the CPU
    attention.in_place = in_place
    # `lengths`: tokens each sequence attends to, its new one included.
    assert (sum(lengths) * 2 >= cpu_attention.PARALLEL_MIN_WORK) == (lengths[0] > 100)
    pages = torch.randperm(pool.num_pages).tolist()
    tables = [[pages.pop() for _ in range(-(-n // 4))] for n in lengths]
    attention.prepare(tables, [n - 1 for n in lengths], [1] * len(lengths))
    layer = 1
    q = torch.randn(1, len(lengths), 6, 16)
    k, v = torch.randn(1, len(lengths), 2, 16), torch.randn(1, len(lengths), 2, 16)
    out = attention(layer, q, k, v)[0]
    keys, values = [], []
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        seq = kv[table, layer].permute(1, 0, 3, 2, 4).reshape(2, -1, 2, 16)[:, :n]  # [2, T, kv_heads, D]
        assert torch.equal(seq[0, -1], k[0, i]) and torch.equal(seq[1, -1], v[0, i])  # written in place
        keys.append(seq[0])
        values.append(seq[1])
    torch.testing.assert_close(out, _reference(q[0], keys, values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_profile_accounts_for_each_iteration(ckpt: Path, tmp_path: Path, dtype: str) -> None:
    """`rose bench profile` names where a decode and a prefill iteration spend their time: in
    float32 the decodes' in-place kernel, in bfloat16 the page gathers and SDPA."""
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--model", str(ckpt), "--batch", "4", "--context", "40",
                 "--chunk", "64", "--iterations", "2", "--threads", "1", "--dtype", dtype,
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    decode, prefill = report["decode"], report["prefill"]
    for parts in (decode, prefill):
        assert parts["wall_ms"] > 0 and all(ms >= 0 for ms in parts.values())
        assert {"matmuls", "norms", "rope", "LM head", "sampling", "KV writes"} <= parts.keys()
    assert ("in-place decode attention" in decode) == (dtype == "float32")
    assert ("page gathers" in decode) == (dtype != "float32")
    assert "SDPA" in prefill and report["summary"]["decode_tokens_per_s"] > 0
