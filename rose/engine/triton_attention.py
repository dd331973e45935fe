"""Paged attention in Triton, the engine's attention on CUDA: each query, a decode's or a prefill
chunk's, attends to its sequence's K and V where they lie in the pool's pages, found through the
block table, with no gather copy.

Why Triton: it comes with PyTorch's CUDA builds, so a GPU machine needs nothing more; it takes the
pool's layout as it is (a page holds every layer of one model, so one layer's keys are not one
contiguous run of pages x block tokens, which PyTorch's paged flex_attention expects, and a block
is 16 tokens where flash-attn's paged KV cache wants multiples of 256); and its interpreter runs
the same kernel on the CPU (`TRITON_INTERPRET=1`), where the tests check it against plain math.

A launch runs one program per (tile, KV head). A tile is up to `block_m` consecutive queries of
one sequence; all query heads that share the KV head (GQA) go together as the rows of one matrix,
so every page is read once per tile. Softmax is online (running maximum and sum), in float32.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

PREFILL_TILE = 16  # queries per prefill tile; decodes are tiles of one
_MIN_DOT = 16  # tl.dot's smallest dimension on a GPU


@triton.jit
def _paged_attention(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tiles_ptr,
                     stride_qn, stride_qh, stride_on, stride_oh,
                     stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb,
                     stride_table, scale,
                     GROUP: tl.constexpr, ROWS_PER_QUERY: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     DIM: tl.constexpr, PRECISION: tl.constexpr):
    """q, out `[N, heads, HEAD_DIM]`; k, v one layer's pages `[pages, kv_heads, BLOCK_SIZE,
    HEAD_DIM]` (any page stride); tables `[seqs, width]`; tiles `[T, 4]`: first query's row,
    queries, first query's position, sequence. Query at position p attends to keys 0..p."""
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(tiles_ptr + tile * 4)
    queries = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    seq = tl.load(tiles_ptr + tile * 4 + 3)

    r = tl.arange(0, BLOCK_M * ROWS_PER_QUERY)  # a row: (query m, head g of the group)
    m, g = r // ROWS_PER_QUERY, r % ROWS_PER_QUERY
    valid = (m < queries) & (g < GROUP)
    d = tl.arange(0, DIM)
    in_dim = d < HEAD_DIM
    q_rows = (row0 + m).to(tl.int64)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=valid[:, None] & in_dim[None, :], other=0.0)
    q_pos = pos0 + m
    context = pos0 + queries  # keys the tile's last query attends to

    top = tl.full([BLOCK_M * ROWS_PER_QUERY], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M * ROWS_PER_QUERY], tl.float32)
    acc = tl.zeros([BLOCK_M * ROWS_PER_QUERY, DIM], tl.float32)
    n = tl.arange(0, KEYS)
    for j in range(0, tl.cdiv(context, BLOCK_SIZE)):
        page = tl.load(tables_ptr + seq * stride_table + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + n
        present = (n < BLOCK_SIZE) & (key_pos < context)
        kv_mask = present[:, None] & in_dim[None, :]
        k = tl.load(k_ptr + page * stride_kp + kv_head * stride_kh + n[:, None] * stride_kb + d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(present[None, :] & (key_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        # Every row sees key 0 in the first page, so `new_top` is finite from there on.
        new_top = tl.maximum(top, tl.max(s, 1))
        p = tl.exp(s - new_top[:, None])
        alpha = tl.exp(top - new_top)
        v = tl.load(v_ptr + page * stride_vp + kv_head * stride_vh + n[:, None] * stride_vb + d[None, :],
                    mask=kv_mask, other=0.0)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    out = acc / total[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & in_dim[None, :])


@dataclasses.dataclass
class TritonPlan:
    """One iteration's tables and tiles, on the device, made once and used by every layer."""

    tables: torch.Tensor  # [seqs, width] int32: each sequence's pages, padded
    decodes: torch.Tensor  # [T, 4] int32 tiles of one query
    prefills: torch.Tensor  # [T, 4] int32 tiles of up to PREFILL_TILE queries


def plan(block_tables: list[list[int]], computed: list[int], num_tokens: list[int],
         device: torch.device) -> TritonPlan:
    """Sequence i computes `num_tokens[i]` tokens after `computed[i]`; its queries are the rows
    that follow the previous sequences'."""
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    decodes, prefills = [], []
    row = 0
    for seq, (c, n) in enumerate(zip(computed, num_tokens, strict=True)):
        if n == 1:
            decodes.append((row, 1, c, seq))
        else:
            prefills += [(row + i, min(PREFILL_TILE, n - i), c + i, seq) for i in range(0, n, PREFILL_TILE)]
        row += n

    def tensor(rows: list, cols: int) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), cols)

    return TritonPlan(tensor(tables, width), tensor(decodes, 4), tensor(prefills, 4))


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    plan: TritonPlan) -> torch.Tensor:
    """Attention of `q` `[N, heads, D]` over one layer's pages `keys`, `values` `[pages, kv_heads,
    block, D]` as `plan` maps them; returns `[N, heads, D]`."""
    q = q.contiguous()  # the kernel steps the head dimension by one element, as the pages do
    _, heads, dim = q.shape
    kv_heads, block = keys.shape[1], keys.shape[2]
    out = torch.empty_like(q)
    for tiles, block_m in ((plan.decodes, 1), (plan.prefills, PREFILL_TILE)):
        if not len(tiles):
            continue
        _paged_attention[(len(tiles), kv_heads)](
            q, keys, values, out, plan.tables, tiles,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            plan.tables.stride(0), dim ** -0.5,
            **constants(q.dtype, heads, kv_heads, block, dim, block_m))
    return out


def constants(dtype: torch.dtype, heads: int, kv_heads: int, block: int, dim: int,
              block_m: int) -> dict[str, object]:
    """The kernel's compile-time arguments for one launch: `block_m` queries per tile."""
    group = heads // kv_heads
    return dict(GROUP=group, ROWS_PER_QUERY=max(triton.next_power_of_2(group), _MIN_DOT // block_m),
                BLOCK_M=block_m, BLOCK_SIZE=block, KEYS=max(_MIN_DOT, triton.next_power_of_2(block)),
                HEAD_DIM=dim, DIM=max(_MIN_DOT, triton.next_power_of_2(dim)),
                PRECISION="ieee" if dtype == torch.float32 else None)  # float32 stays IEEE, not TF32
