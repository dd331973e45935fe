"""Turns a scheduled batch into one forward pass and returns the logits to sample from."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from rose.engine import fused_forward
from rose.engine.attention import PagedAttention
from rose.engine.cpu_linear import pack_linears
from rose.engine.kv_pool import KVPool, KVSpec
from rose.engine.lora import AdapterSlots
from rose.engine.scheduler import Batch
from rose.engine.sequence import Sequence
from rose.model.decoder import CausalLM


class IterationInterrupted(Exception):
    """The forward was given up between two layers; nothing about any sequence changed."""


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, spec: KVSpec, attention_backend: str | None = None,
                 cuda_graphs: bool = False, max_num_seqs: int = 64) -> None:
        """`cuda_graphs`: decode-only iterations through `DecodeGraphs` (with the triton backend
        only; captured on CUDA, eager elsewhere)."""
        self.model = model
        self.adapters = AdapterSlots(model)
        self.attention = PagedAttention(pool, spec, model.config.num_attention_heads, attention_backend)
        # CPU float32: the fused forward (fused_forward.py); elsewhere the model's own, its
        # linears on oneDNN where they are CPU float32 (cpu_linear.py).
        self.fused = (fused_forward.FusedForward(model, self.attention)
                      if fused_forward.available(model, self.attention) else None)
        if self.fused is None:
            pack_linears(model)
        self.lm_head = model.lm_head if self.fused is None else self.fused.lm_head
        self.graphs = None
        if cuda_graphs and self.attention.backend == "triton":
            from rose.engine.cuda_graphs import DecodeGraphs

            max_pages = -(-model.config.max_position_embeddings // spec.block_size)
            self.graphs = DecodeGraphs(model, self.attention, max_num_seqs, max_pages,
                                       capture=pool.device.type == "cuda")

    @torch.inference_mode()
    def run(self, batch: Batch, interrupt: Callable[[], bool] | None = None
            ) -> tuple[list[Sequence], torch.Tensor]:
        """Compute the batch's tokens; return the sequences that reached their last token (and
        so sample next) with their logits `[S, vocab]` in float32. Raises IterationInterrupted
        when `interrupt()` turns true before a layer. Rows of sequences with a LoRA adapter
        gain its products (rose/engine/lora.py); the CUDA graphs replay the base model alone."""
        with_adapters = bool(self.adapters.adapters) and any(s.adapter is not None for s in batch.seqs)
        if (self.graphs is not None and interrupt is None and len(batch.seqs) <= self.graphs.max_seqs
                and not with_adapters and all(n == 1 for n in batch.num_tokens)):
            hidden = self.graphs.run(batch.seqs)
            # A one-token step samples unless it is a one-token chunk of a longer prompt.
            rows = [i for i, s in enumerate(batch.seqs) if s.num_computed_tokens + 1 == len(s.token_ids)]
            return [batch.seqs[i] for i in rows], self.lm_head(hidden[rows]).float()
        # Decodes first, longest context first: the attention batches them in length groups.
        work = sorted(zip(batch.seqs, batch.num_tokens, strict=True),
                      key=lambda w: (w[1] != 1, -w[0].num_computed_tokens))
        ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        sampling: list[Sequence] = []
        for seq, n in work:
            c = seq.num_computed_tokens
            ids += seq.token_ids[c:c + n]
            positions += range(c, c + n)
            if c + n == len(seq.token_ids):
                last_rows.append(len(ids) - 1)
                sampling.append(seq)
        self.attention.prepare([s.block_table for s, _ in work],
                               [s.num_computed_tokens for s, _ in work], [n for _, n in work])
        def between_layers() -> None:
            if interrupt is not None and interrupt():
                raise IterationInterrupted

        device = self.attention.device
        ids_t, positions_t = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
        lora = self.adapters.rows([s.adapter for s, _ in work], [n for _, n in work]) if with_adapters \
            else None
        if self.fused is not None:
            hidden = self.fused(ids_t, positions_t, between_layers, lora)
        else:
            with lora.hooked(self.adapters.linears) if lora is not None else contextlib.nullcontext():
                hidden = self.model.model(ids_t[None], positions_t[None], self.attention, between_layers)[0]
        logits = self.lm_head(hidden[last_rows]) if sampling else hidden.new_empty(0, 0)
        return sampling, logits.float()
