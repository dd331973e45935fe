"""Decode iterations replayed as CUDA graphs.

On a GPU a decode iteration of a small model is mostly kernel launches, tens per layer, each
costing the CPU microseconds; a graph replays them all at once. One graph per padded batch size
(1, 2, 4, then multiples of 8 up to the engine's `max_num_seqs`), captured the first time an
iteration of that size comes. The inputs (token ids, positions, KV slots, block tables, the Triton
kernel's tiles) live in buffers that every iteration fills in place. A batch is padded to its
graph's size by repeating its first decode: the same token at the same position writes the same
K/V into the same slot, and the padded rows' outputs are dropped.

Only iterations of decodes alone, with no interrupt, use them: prefill chunks vary in shape, and
a graph cannot stop between layers. Off CUDA (`capture=False`) the same padded, static forward
runs eagerly: that is what the CPU tests check.
"""

from __future__ import annotations

import torch

from rose.engine.attention import PagedAttention
from rose.engine.sequence import Sequence
from rose.engine.triton_attention import TritonPlan
from rose.model.decoder import CausalLM


class DecodeGraphs:
    def __init__(self, model: CausalLM, attention: PagedAttention, max_seqs: int, max_pages: int,
                 capture: bool) -> None:
        self.model, self.attention, self.capture = model, attention, capture
        self.sizes = [size for size in (1, 2, 4) if size < max_seqs] + list(range(8, max_seqs + 8, 8))
        rows, dev = self.sizes[-1], attention.device
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot_pages = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tables = torch.zeros(rows, max_pages, dtype=torch.int32, device=dev)
        self.tiles = torch.zeros(rows, 4, dtype=torch.int32, device=dev)
        self.no_prefills = torch.zeros(0, 4, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_seqs(self) -> int:
        return self.sizes[-1]

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """The final hidden states `[len(seqs), hidden]` of one decode per sequence."""
        n = len(seqs)
        size = next(s for s in self.sizes if s >= n)
        self._fill(seqs, size)
        self.attention.use_plan(self.slot_pages[:size], self.slot_offsets[:size],
                                TritonPlan(self.tables, self.tiles[:size], self.no_prefills))
        if not self.capture:
            return self._forward(size)[:n]
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]

    def _fill(self, seqs: list[Sequence], size: int) -> None:
        bs, dev = self.attention.block_size, self.attention.device
        padded = seqs + [seqs[0]] * (size - len(seqs))
        computed = [s.num_computed_tokens for s in padded]
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                              dtype=torch.int32, device=dev)
        inputs = torch.tensor([
            [s.token_ids[c] for s, c in zip(padded, computed, strict=True)],
            computed,
            [s.block_table[c // bs] for s, c in zip(padded, computed, strict=True)],
            [c % bs for c in computed],
        ], device=dev)
        # Tiles: (query row, one query, its position, its table row); padding reads row 0's table.
        tiles = torch.tensor([(row, 1, c, row if row < len(seqs) else 0) for row, c in enumerate(computed)],
                             dtype=torch.int32, device=dev)
        self.tables[:len(seqs), :width].copy_(tables)
        for buffer, values in zip((self.ids, self.positions, self.slot_pages, self.slot_offsets), inputs,
                                  strict=True):
            buffer[:size].copy_(values)
        self.tiles[:size].copy_(tiles)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model.model(self.ids[None, :size], self.positions[None, :size], self.attention)[0]

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # One eager run first, on a side stream as capture requires: Triton compiles its kernel
        # and the allocator settles outside the graph. It computes this very iteration, so the
        # K/V it writes are the ones the replay writes again.
        stream = torch.cuda.Stream(self.attention.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            hidden = self._forward(size)
        return graph, hidden
