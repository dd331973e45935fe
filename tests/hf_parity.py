"""The engine's greedy tokens and logprobs against `transformers`, shared by the parity tests."""

from __future__ import annotations

import torch
import transformers

TIE = 1e-5  # a greedy mismatch is only excused where HF's top two logits are this close


def hf_logits(hf: transformers.PreTrainedModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's float32 logits `[len(tokens), V]` (on the CPU) before each of `tokens`, teacher-forced."""
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens], device=hf.device)
        return hf(ids).logits[0, len(prompt) - 1:-1].float().cpu()


def chosen_logprobs(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The log-probability of each of `tokens` under its row of `logits`."""
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_matches_hf(hf: transformers.PreTrainedModel, prompt: list[int], tokens: list[int],
                      logprobs: list[float]) -> None:
    """Tokens equal HF's greedy choice (up to a near-tie) and logprobs equal HF's
    teacher-forced log-softmax on the same tokens within 1e-4."""
    logits = hf_logits(hf, prompt, tokens)
    ref = chosen_logprobs(logits, tokens)
    assert torch.allclose(torch.tensor(logprobs), ref, atol=1e-4, rtol=0), (logprobs, ref.tolist())
    for i, token in enumerate(tokens):
        top2 = logits[i].topk(2).values
        if token != int(logits[i].argmax()):
            assert float(top2[0] - top2[1]) < TIE, f"token {i}: {token} is not HF's greedy choice"
            break  # after a legitimate tie the two continuations differ
