"""The paged attention's test cases, shared by the CPU tests and the gpu tests: sequences whose
pages are scattered over a shared pool, checked against plain math."""

from __future__ import annotations

import torch

from rose.engine.attention import PagedAttention
from rose.engine.kv_pool import KVPool, KVSpec


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               positions: list[int]) -> torch.Tensor:
    """Softmax attention of each query `[heads, D]` over the first `position + 1` tokens of its
    sequence's `[tokens, kv_heads, D]`."""
    outs = []
    for qi, k, v, pos in zip(q, keys, values, positions, strict=True):
        group = qi.shape[0] // k.shape[1]
        k, v = k[:pos + 1].repeat_interleave(group, 1), v[:pos + 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", qi.double(), k.double()) / qi.shape[-1] ** 0.5
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v.double()))
    return torch.stack(outs).float()


# Each sequence: (tokens already in its pages, tokens it computes now); decodes first, longest first.
BATCHES = {
    "decodes": [(12, 1), (8, 1), (3, 1), (0, 1)],
    "long-decodes": [(699, 1), (499, 1), (12, 1), (0, 1)],  # the cpu kernel on all threads
    "mixed": [(30, 1), (9, 1), (0, 1), (5, 20), (0, 7), (17, 3)],  # prefill chunks after a prefix, or not
    "long-prefills": [(3, 1), (41, 70), (0, 37)],  # the cpu kernel: tiles of 16 queries, keys across pages
}


def check_backend(backend: str, batch: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  block_size: int = 4, tolerance: float = 1e-5, head_dim: int = 16) -> None:
    """Sequences of different lengths, decoding or prefilling after a cached prefix, their pages
    scattered over a pool shared with a larger model (so pages are longer than this model's
    block), GQA of three query heads per KV head: `backend` writes the new K/V in place and gives
    the math's answer."""
    work, d = BATCHES[batch], head_dim
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=d, dtype=dtype, block_size=block_size)
    big = KVSpec(num_layers=5, num_kv_heads=3, head_dim=d, dtype=dtype, block_size=block_size)
    pool = KVPool.for_specs(400 * big.block_bytes, spec, big, device=device)
    kv = pool.view(spec)  # [pages, layers, 2, kv_heads, block, D]
    kv.copy_(torch.randn(kv.shape))
    attention = PagedAttention(pool, spec, num_heads=6, backend=backend)
    pages = torch.randperm(pool.num_pages).tolist()
    tables = [[pages.pop() for _ in range(-(-(c + n) // block_size))] for c, n in work]
    attention.prepare(tables, [c for c, _ in work], [n for _, n in work])
    layer, rows = 1, sum(n for _, n in work)
    q = torch.randn(1, rows, 6, d, device=device, dtype=dtype)
    k, v = (torch.randn(1, rows, 2, d, device=device, dtype=dtype) for _ in range(2))
    out = attention(layer, q, k, v)[0]
    keys, values, positions = [], [], []
    row = 0
    for table, (c, n) in zip(tables, work, strict=True):
        seq = kv[table, layer].permute(1, 0, 3, 2, 4).reshape(2, -1, 2, d)[:, :c + n]  # [2, T, kv_heads, D]
        assert torch.equal(seq[0, c:], k[0, row:row + n]) and torch.equal(seq[1, c:], v[0, row:row + n])
        keys += [seq[0]] * n
        values += [seq[1]] * n
        positions += range(c, c + n)
        row += n
    expected = _reference(q[0].cpu(), [t.cpu() for t in keys], [t.cpu() for t in values], positions)
    torch.testing.assert_close(out.cpu().float(), expected, rtol=tolerance, atol=tolerance)
