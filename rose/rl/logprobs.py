"""Per-token log-probabilities and entropies from hidden states, a chunk of tokens at a time.

The output head's float32 logits are a training step's largest tensor: at Qwen3's 151,936-token
vocabulary, 0.6 MB per token, about 20 GB for 32 sequences of 1,024 tokens, and the log-softmax
over them keeps another copy for backward. Here the head runs on `chunk_tokens` tokens at a time,
each chunk under activation checkpointing: the forward keeps only the hidden states and the
chosen tokens' log-probabilities, the backward recomputes one chunk's logits at a time. The
`[tokens, vocab]` float32 tensors never exist for more than one chunk, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]


def token_logprobs(hidden: torch.Tensor, head: Head, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each target `[B, T]` (with gradients) and the entropy of each
    position's distribution `[B, T]` (without), float32, under the softmax of
    `head(hidden) / temperature`; `hidden` is `[B, T, H]`."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    logprobs, entropies = [], []
    for start in range(0, max(flat_targets.numel(), 1), chunk_tokens):  # no tokens: one empty chunk
        args = (flat_hidden[start:start + chunk_tokens], flat_targets[start:start + chunk_tokens], head,
                temperature)
        logprob, entropy = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
        logprobs.append(logprob)
        entropies.append(entropy)
    return torch.cat(logprobs).view_as(targets), torch.cat(entropies).view_as(targets)


def _chunk(hidden: torch.Tensor, targets: torch.Tensor, head: Head,
           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = (head(hidden).float() / temperature).log_softmax(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None])[:, 0], entropy
