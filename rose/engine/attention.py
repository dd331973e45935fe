"""Paged attention in plain PyTorch: the `AttentionBackend` the engine plugs into the model.

Per layer: the new tokens' K/V are written to their slots in the pool's pages. One-token
queries (decodes) attend in batched SDPA calls over their gathered pages, grouped by context
length so that padding stays small; each prefill chunk attends to its cached prefix plus itself
with a bottom-right causal mask (a chunk with no prefix attends to its own K/V directly).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class _Segment:
    """Rows `[start, start + rows)` of the flattened batch that share one SDPA call."""

    start: int
    rows: int
    decode: bool  # one query per sequence (batched), else one sequence's prefill chunk
    pages: torch.Tensor | None  # pages to gather: [seqs, width] for decodes, [blocks] for a chunk
    context: int  # longest context attended to
    mask: torch.Tensor | None  # True where attention is allowed; None: all (decode) or causal


class PagedAttention:
    def __init__(self, kv: torch.Tensor, num_heads: int) -> None:
        """`kv`: the pool viewed as `[pages, layers, 2, block_size, kv_heads, head_dim]`."""
        self.keys = [kv[:, layer, 0] for layer in range(kv.shape[1])]  # [pages, block, kv_heads, D]
        self.values = [kv[:, layer, 1] for layer in range(kv.shape[1])]
        self.block_size, self.kv_heads, self.head_dim = kv.shape[3:]
        self.device = kv.device  # where the plan's indices and masks are built
        self.gqa = num_heads != self.kv_heads
        # Gathered pages land in buffers reused across layers and iterations: allocating tens
        # of MB afresh per layer costs more (page faults) than the copy itself.
        self._gather_buffers = (kv.new_empty(0), kv.new_empty(0))
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
        decodes = num_tokens.count(1)
        start = 0
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
            self.segments.append(_Segment(start, end - start, True, torch.tensor(tables, device=dev),
                                          width * bs, mask))
            start = end
        for table, c, n in zip(block_tables[decodes:], computed[decodes:], num_tokens[decodes:],
                               strict=True):
            ctx = c + n
            if c == 0:
                self.segments.append(_Segment(start, n, False, None, ctx, None))
            else:
                mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(c, ctx, device=dev)[:, None]
                pages = torch.tensor(table[:-(-ctx // bs)], device=dev)
                self.segments.append(_Segment(start, n, False, pages, ctx, mask))
            start += n

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]  # [N, heads, D]: the batch is one flattened row
        self.keys[layer][self.slot_pages, self.slot_offsets] = k
        self.values[layer][self.slot_pages, self.slot_offsets] = v
        outs = []
        for seg in self.segments:
            rows = slice(seg.start, seg.start + seg.rows)
            if seg.decode:
                keys, values = self._gather(layer, seg.pages, (seg.rows, seg.context))
                out = F.scaled_dot_product_attention(q[rows, :, None], keys, values,
                                                     attn_mask=seg.mask, enable_gqa=self.gqa)
                outs.append(out[:, :, 0])
                continue
            if seg.pages is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                keys, values = self._gather(layer, seg.pages, (seg.context,))
            out = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values,
                                                 attn_mask=seg.mask, is_causal=seg.mask is None,
                                                 enable_gqa=self.gqa)
            outs.append(out.transpose(0, 1))
        return (torch.cat(outs) if len(outs) > 1 else outs[0])[None]

    def _gather(self, layer: int, pages: torch.Tensor,
                lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy `pages` of one layer into the reused buffers; return keys and values as
        `[*lead_batch, kv_heads, tokens, D]`, where `lead` is `(*batch, tokens)`."""
        n = pages.numel()
        keys, values = self._gather_buffers
        if keys.shape[0] < n:
            shape = (max(n, keys.shape[0] * 3 // 2), self.block_size * self.kv_heads * self.head_dim)
            keys, values = keys.new_empty(shape), values.new_empty(shape)
            self._gather_buffers = keys, values
        flat = pages.flatten()
        out = []
        for cache, buffer in ((self.keys[layer], keys), (self.values[layer], values)):
            torch.index_select(cache.flatten(1), 0, flat, out=buffer[:n])
            per_seq = buffer[:n].view(*lead[:-1], -1, self.kv_heads, self.head_dim)
            out.append(per_seq[..., :lead[-1], :, :].transpose(-3, -2))
        return out[0], out[1]
