"""Chunked token log-probabilities and entropies: the unchunked results, values and gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rose.rl.logprobs import token_logprobs


def _unchunked(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer computed before: the full `[B, T, V]` log-softmax."""
    logp = (head(hidden).float() / temperature).log_softmax(-1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g))
    hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    return hidden, head, torch.randint(0, 50, (3, 7), generator=g)


@pytest.mark.parametrize("chunk", [1, 4, 7, 21, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_give_the_unchunked_values_and_gradients(chunk: int, temperature: float) -> None:
    hidden, head, targets = _inputs()
    weights = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))  # a loss of every token

    ref_lp, ref_entropy = _unchunked(hidden, head, targets, temperature)
    (ref_lp * weights).sum().backward()
    ref_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    lp, entropy = token_logprobs(hidden, head, targets, temperature, chunk)
    assert lp.dtype == entropy.dtype == torch.float32 and lp.shape == entropy.shape == targets.shape
    assert not entropy.requires_grad
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-6, atol=1e-6)
    (lp * weights).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, ref_grads[1], rtol=1e-5, atol=1e-6)


def _saved_shapes(compute: Callable[[], object]) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd saves for backward while `compute` runs."""
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        compute()
    return saved


def test_no_logits_are_kept_for_backward() -> None:
    """Only the hidden states are saved: the backward recomputes each chunk's logits, so no
    `[tokens, vocab]` tensor outlives its chunk's forward."""
    hidden, head, targets = _inputs()
    assert any(s[-1] == 50 for s in _saved_shapes(lambda: _unchunked(hidden, head, targets, 1.0)))
    assert not any(s[-1] == 50 for s in _saved_shapes(lambda: token_logprobs(hidden, head, targets,
                                                                               chunk_tokens=4)))


def test_without_gradients_and_without_tokens() -> None:
    hidden, head, targets = _inputs()
    with torch.no_grad():
        lp, _ = token_logprobs(hidden, head, targets, chunk_tokens=5)
    torch.testing.assert_close(lp, _unchunked(hidden, head, targets, 1.0)[0].detach())
    lp, entropy = token_logprobs(hidden[:, :0], head, targets[:, :0])
    assert lp.shape == entropy.shape == (3, 0)
