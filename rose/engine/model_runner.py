"""Turns a scheduled batch into one forward pass and returns the logits to sample from."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rose.engine.attention import PagedAttention
from rose.engine.kv_pool import KVPool, KVSpec
from rose.engine.scheduler import Batch
from rose.engine.sequence import Sequence
from rose.model.decoder import CausalLM


class IterationInterrupted(Exception):
    """The forward was given up between two layers; nothing about any sequence changed."""


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, spec: KVSpec,
                 attention_backend: str | None = None) -> None:
        self.model = model
        self.attention = PagedAttention(pool, spec, model.config.num_attention_heads, attention_backend)

    @torch.inference_mode()
    def run(self, batch: Batch, interrupt: Callable[[], bool] | None = None
            ) -> tuple[list[Sequence], torch.Tensor]:
        """Compute the batch's tokens; return the sequences that reached their last token (and
        so sample next) with their logits `[S, vocab]` in float32. Raises IterationInterrupted
        when `interrupt()` turns true before a layer."""
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
        hidden = self.model.model(torch.tensor([ids], device=device),
                                  torch.tensor([positions], device=device), self.attention, between_layers)[0]
        logits = self.model.lm_head(hidden[last_rows]) if sampling else hidden.new_empty(0, 0)
        return sampling, logits.float()
