"""Paged attention in plain PyTorch: the `AttentionBackend` the engine plugs into the model.

Per layer: the new tokens' K/V are written to their slots in the pool's pages. One-token
queries (decodes) attend in batched SDPA calls over their gathered pages, grouped by context
length so that padding stays small; each prefill chunk attends to its cached prefix plus itself
with a bottom-right causal mask (a chunk with no prefix attends to its own K/V directly).

Pages are head-major (`KVPool`), so one `index_select` over the pool's rows gathers a group's
K and V straight into the `[seqs, kv_heads, tokens, head_dim]` layout SDPA reads fastest, and
every SDPA call is 4-D (3-D inputs fall back to its slow math path on the CPU). Two backends read
the pages in place instead: on the CPU in float32 C++ kernels (`cpu_attention`), one call for all
the decodes whatever their lengths and one per prefill chunk; on CUDA every query, decode or
prefill, goes to a Triton kernel that follows the block tables (`triton_attention`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rose.engine import cpu_attention, cpu_kernels
from rose.engine.kv_pool import KVPool, KVSpec

if TYPE_CHECKING:
    from rose.engine.triton_attention import TritonPlan


@dataclasses.dataclass
class _Segment:
    """Rows `[start, start + rows)` of the flattened batch that share one SDPA call."""

    start: int
    rows: int
    decode: bool  # one query per sequence (batched), else one sequence's prefill chunk
    kv_rows: torch.Tensor | None  # layer 0's pool rows to gather: [2 (K, V), kv_heads, seqs, pages]
    context: int  # longest context attended to
    mask: torch.Tensor | None  # True where attention is allowed; None: all (decode) or causal
    # For the in-place kernels, made once per iteration: layer 0's K rows (`[kv_heads, seqs,
    # pages]` for the decodes, `[kv_heads, pages]` for a prefill chunk), each decode's context or
    # the chunk's first position, and the threads to run on.
    kernel_args: tuple[torch.Tensor, torch.Tensor | int, int] | None = None


BACKENDS = ("triton", "cpu", "sdpa")


def default_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`triton` on CUDA (where PyTorch's build brings Triton), `cpu` (C++, in place) on the CPU
    in float32 where its kernels build, else `sdpa` (gather + SDPA)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    if device.type == "cpu" and dtype == torch.float32 and cpu_attention.available(head_dim):
        return "cpu"
    return "sdpa"


class PagedAttention:
    def __init__(self, pool: KVPool, spec: KVSpec, num_heads: int, backend: str | None = None) -> None:
        kv = pool.view(spec)  # [pages, layers, 2, kv_heads, block, D]
        self.keys = [kv[:, layer, 0] for layer in range(spec.num_layers)]  # [pages, kv_heads, block, D]
        self.values = [kv[:, layer, 1] for layer in range(spec.num_layers)]
        self.rows = pool.rows(spec)
        self.rows_per_page = pool.rows_per_page(spec)
        self.block_size, self.kv_heads, self.head_dim = spec.block_size, spec.num_kv_heads, spec.head_dim
        self.device = pool.device  # where the plan's indices and masks are built
        self.gqa = num_heads != self.kv_heads
        self.backend = backend or default_backend(pool.device, spec.dtype, spec.head_dim)
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.backend == "cpu" and not (pool.device.type == "cpu" and spec.dtype == torch.float32
                                          and cpu_attention.available(spec.head_dim)):
            raise ValueError(f"attention backend 'cpu' runs float32 on the CPU, head_dim one of "
                             f"{cpu_attention.HEAD_DIMS}, with a C++ compiler; got {spec.dtype} on "
                             f"{pool.device}, head_dim {spec.head_dim} (or use 'sdpa')")
        if self.backend == "cpu":
            cpu_kernels.load()  # now, not at the first request
        elif self.backend == "triton":  # Triton is imported only where it runs
            from rose.engine import triton_attention

            self._triton = triton_attention
            self._triton_plan: TritonPlan | None = None
        # Gathered pages land in a buffer reused across layers and iterations: allocating tens
        # of MB afresh per layer costs more (page faults) than the copy itself.
        self._gather_buffer = self.rows.new_empty(0)
        self.segments: list[_Segment] = []

    def prepare(self, block_tables: list[list[int]], computed: list[int],
                num_tokens: list[int]) -> None:
        """Plan one iteration: sequence i computes `num_tokens[i]` tokens after `computed[i]`.
        Decodes (one token) come first, sorted by context length, longest first."""
        bs = self.block_size
        pages, offsets = [], []
        for table, c, n in zip(block_tables, computed, num_tokens, strict=True):
            for pos in range(c, c + n):
                pages.append(table[pos // bs])
                offsets.append(pos % bs)
        dev = self.device
        self.slot_pages = torch.tensor(pages, device=dev)
        self.slot_offsets = torch.tensor(offsets, device=dev)

        self.segments = []
        if self.backend == "triton":
            self._triton_plan = self._triton.plan(block_tables, computed, num_tokens, dev)
            return
        decodes = num_tokens.count(1)
        start = 0
        if decodes and self.backend == "cpu":
            lengths = [c + 1 for c in computed[:decodes]]
            width = -(-lengths[0] // bs)
            tables = [t[:width] + [t[0]] * (width - len(t)) for t in block_tables[:decodes]]
            rows = self._rows(tables)
            self.segments.append(_Segment(0, decodes, True, rows, lengths[0], None,
                                          (rows[0], torch.tensor(lengths),
                                           cpu_attention.threads_for(sum(lengths), self.kv_heads))))
            start = decodes
        while start < decodes:
            # A group holds contexts within a factor of two of its longest: padding < 2x.
            width = -(-(computed[start] + 1) // bs)
            end = start + 1
            while end < decodes and 2 * (computed[end] + 1) > width * bs:
                end += 1
            lengths = [c + 1 for c in computed[start:end]]
            mask = None
            if min(lengths) < width * bs:
                mask = (torch.arange(width * bs, device=dev)[None, :]
                        < torch.tensor(lengths, device=dev)[:, None])[:, None, None, :]
            tables = [t[:width] + [t[0]] * (width - len(t)) for t in block_tables[start:end]]
            self.segments.append(_Segment(start, end - start, True, self._rows(tables), width * bs, mask))
            start = end
        for table, c, n in zip(block_tables[decodes:], computed[decodes:], num_tokens[decodes:],
                               strict=True):
            ctx = c + n
            if self.backend == "cpu":
                rows = self._rows([table[:-(-ctx // bs)]])
                self.segments.append(_Segment(start, n, False, None, ctx, None, (
                    rows[0, :, 0].contiguous(), c, cpu_attention.threads_for(n * ctx, self.kv_heads))))
            elif c == 0:
                self.segments.append(_Segment(start, n, False, None, ctx, None))
            else:
                mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(c, ctx, device=dev)[:, None]
                self.segments.append(_Segment(start, n, False, self._rows([table[:-(-ctx // bs)]]),
                                              ctx, mask))
            start += n

    def use_plan(self, slot_pages: torch.Tensor, slot_offsets: torch.Tensor, plan: TritonPlan) -> None:
        """Plan an iteration from tensors already on the device (`cuda_graphs`' static buffers):
        each query's KV slot (page, offset) and the Triton kernel's tables and tiles."""
        if self.backend != "triton":
            raise ValueError(f"a prepared plan needs the triton backend, not {self.backend!r}")
        self.slot_pages, self.slot_offsets, self._triton_plan = slot_pages, slot_offsets, plan

    def _rows(self, tables: list[list[int]]) -> torch.Tensor:
        """Layer 0's rows of these block tables' pages: `[2 (K, V), kv_heads, seqs, pages]`."""
        pages = torch.tensor(tables, device=self.device)
        heads = torch.arange(2 * self.kv_heads, device=self.device).view(2, self.kv_heads, 1, 1)
        return pages * self.rows_per_page + heads

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]  # [N, heads, D]: the batch is one flattened row
        self.keys[layer][self.slot_pages, :, self.slot_offsets] = k
        self.values[layer][self.slot_pages, :, self.slot_offsets] = v
        return self.attend(layer, q, k, v)[None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of `q` `[N, heads, D]` once this iteration's `k`, `v` `[N, kv_heads, D]` are
        in the pool (stored by `__call__`, or by the fused forward's `rope_store`)."""
        if self.backend == "triton":
            return self._triton.paged_attention(q, self.keys[layer], self.values[layer], self._triton_plan)
        outs = []
        for seg in self.segments:
            rows = slice(seg.start, seg.start + seg.rows)
            if seg.kernel_args is not None:
                pages, where, threads = seg.kernel_args
                kernel = cpu_attention.paged_decode if seg.decode else cpu_attention.paged_prefill
                outs.append(kernel(q[rows], self.rows, pages, layer * 2 * self.kv_heads, where,  # type: ignore[arg-type]
                                   self.block_size, threads))
                continue
            if seg.decode:
                keys, values = self._gather(layer, seg.kv_rows, seg.context)
                out = F.scaled_dot_product_attention(q[rows, :, None], keys, values,
                                                     attn_mask=seg.mask, enable_gqa=self.gqa)
                outs.append(out[:, :, 0])
                continue
            if seg.kv_rows is None:
                keys, values = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            else:
                keys, values = self._gather(layer, seg.kv_rows, seg.context)
            out = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values,
                                                 attn_mask=seg.mask, is_causal=seg.mask is None,
                                                 enable_gqa=self.gqa)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _gather(self, layer: int, rows: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy `layer`'s K and V rows (`rows` as `_rows` gives them) into the reused buffer, in
        one `index_select`; return keys and values as `[seqs, kv_heads, tokens, D]`."""
        n = rows.numel()
        if self._gather_buffer.shape[0] < n:
            self._gather_buffer = self.rows.new_empty(max(n, self._gather_buffer.shape[0] * 3 // 2),
                                                      self.rows.shape[1])
        out = self._gather_buffer[:n]
        torch.index_select(self.rows, 0, (rows + layer * 2 * self.kv_heads).flatten(), out=out)
        kv = out.view(2, self.kv_heads, rows.shape[2], -1, self.head_dim)[:, :, :, :tokens]
        return kv[0].transpose(0, 1), kv[1].transpose(0, 1)
