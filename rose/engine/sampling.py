"""The sampler: logit bias, min_tokens, presence, frequency and repetition penalties, then
greedy or temperature, min-p, top-k and top-p, with per-request seeds (its parameters are
`rose.contracts.SamplingParams`), in vLLM's order. Logprobs (the sampled token's and the top
ones) come from the raw logits, as with vLLM's default (`logprobs_mode="raw_logprobs"`).

Everything runs on the logits' device, each row drawing from its request's own generator on that
device. A seed gives the same tokens on the same device type whatever else shares the batch; the
CPU's and CUDA's random streams differ, so a seed gives other tokens on the other device type.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import torch

from rose.engine import cpu_kernels
from rose.engine.sequence import Sequence
from rose.engine.structured_output import mask_logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude, row by row, in one sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    device = logits.device
    ranks = torch.arange(vocab, device=device).expand_as(sorted_logits)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], device=device)[:, None]
    drop = ranks >= k
    p = torch.tensor(top_p, dtype=logits.dtype, device=device)[:, None]
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(-1)
    # Drop a token once the mass strictly before it already reaches top_p (the top one stays).
    drop |= (probs.cumsum(-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def unsampleable_rows(logits: torch.Tensor) -> list[int]:
    """Rows that no token can be drawn from: a NaN or +inf logit (a numerical fault upstream)."""
    # A row's sum is NaN or +inf where the row holds a NaN or a +inf (or, rarely, where its
    # finite logits overflow): one pass over the batch, then only those rows checked exactly.
    suspect = (~(logits.sum(-1) < math.inf)).nonzero()[:, 0]
    if not len(suspect):
        return []
    rows = logits[suspect]
    return suspect[(rows.isnan() | rows.isposinf()).any(-1)].tolist()


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[rows, vocab]`: how often each token occurs in each row's list."""
    width = max(map(len, token_lists), default=0)
    index = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.long,
                         device=device).reshape(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)  # column `vocab`: the padding
    return counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device)[:, None]


def _process(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> torch.Tensor:
    """The logits a token is drawn (or taken greedily) from, before temperature: the bias,
    min_tokens' mask, then the penalties (vLLM's order). Untouched (not copied) when no row asks
    for any: the common case, and a batch's logits are large."""
    vocab, device = logits.shape[-1], logits.device
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        edits = list(p.logit_bias)
        if seq.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            edits += [(token, -math.inf) for token in stops if token < vocab]
        for token, value in edits:
            rows.append(i)
            cols.append(token)
            values.append(value)
    penalized = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty
                 or s.params.repetition_penalty != 1]
    if not rows and not penalized:
        return logits
    logits = logits.clone()
    if rows:
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(values, device=device), accumulate=True)
    if not penalized:
        return logits
    params = [seqs[i].params for i in penalized]
    out = _counts([seqs[i].output_token_ids for i in penalized], vocab, device)
    prompt = _counts([seqs[i].token_ids[:seqs[i].num_prompt_tokens] for i in penalized], vocab, device)
    rep = _column([p.repetition_penalty for p in params], device)
    x = logits[penalized]
    x = torch.where((out > 0) | (prompt > 0), torch.where(x > 0, x / rep, x * rep), x)
    x -= _column([p.frequency_penalty for p in params], device) * out
    x -= _column([p.presence_penalty for p in params], device) * (out > 0)
    logits[penalized] = x
    return logits


@dataclasses.dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row, its `top_logprobs` likeliest (id, logprob)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int] = ()) -> Sampled:
    """Pick one token per row, for the sequence of that row; return them with their
    log-probability: under the raw softmax, or with `logprobs_at_temperature` under the softmax
    of logits / temperature, the policy the token was drawn from (RL's behaviour policy; over the
    whole vocabulary: bias, penalties, min-p, top-k and top-p shape the draw, not the recorded
    policy, as the trainer recomputes it). The top logprobs are under the same softmax.

    Each row draws from its sequence's own generator, so a seeded request gives the same tokens
    whatever else shares its batch. Rows must be sampleable (see `unsampleable_rows`): a NaN
    would silently pick token 0.

    A row with a structured output's constraint is first masked, in place, to the tokens its
    grammar allows next (as vLLM masks the logits before its sampler: its logprobs are under the
    mask too); a batch without one pays nothing for it.
    """
    logits = logits.float()
    constraints = {i: s.constraint for i, s in enumerate(seqs) if s.constraint is not None}
    if constraints:
        mask_logits(logits, constraints)
    device = logits.device
    params = [s.params for s in seqs]
    scale = _column([p.temperature if p.logprobs_at_temperature and not p.greedy else 1.0
                     for p in params], device)
    processed = _process(logits, seqs, eos_token_ids)
    if logits.device.type == "cpu" and cpu_kernels.ready():
        # One C++ pass per row for both (csrc/cpu_ops.cpp): PyTorch's CPU log_softmax and argmax
        # took 5 ms of a 32-sequence decode iteration of SmolLM2 (a 49,152-token vocabulary).
        lse, greedy = logits.new_empty(len(seqs)), torch.empty(len(seqs), dtype=torch.long)
        torch.ops.rose.logsumexp_argmax(logits, scale[:, 0].contiguous(), lse, greedy)
        tokens = greedy if processed is logits else processed.argmax(-1)
    else:
        lse, tokens = (logits / scale).logsumexp(-1), processed.argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = processed[sampled] / _column([params[i].temperature for i in sampled], device)
        if any(params[i].min_p > 0 for i in sampled):
            probs = rows.softmax(-1)
            min_p = _column([params[i].min_p for i in sampled], device)
            rows = rows.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in sampled):
            rows = _filter_top_k_top_p(rows, [params[i].top_k for i in sampled],
                                       [params[i].top_p for i in sampled])
        probs = rows.softmax(-1)
        # Exponential race (Gumbel-max in another guise): argmax p / E with E ~ Exp(1).
        noise = torch.stack([torch.empty(probs.shape[-1], device=device).exponential_(
            generator=seqs[i].generator) for i in sampled])
        tokens[sampled] = (probs / noise).argmax(-1)
    chosen = logits.gather(-1, tokens[:, None])[:, 0] / scale[:, 0] - lse
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    k = min(max((p.top_logprobs for p in params), default=0), logits.shape[-1])
    if k:
        values, ids = (logits / scale - lse[:, None]).topk(k, dim=-1)
        for i, (row_ids, row_values) in enumerate(zip(ids.tolist(), values.tolist(), strict=True)):
            n = params[i].top_logprobs
            top[i] = list(zip(row_ids[:n], row_values[:n], strict=True))
    return Sampled(tokens.tolist(), chosen.tolist(), top)
