"""The engine's greedy tokens and logprobs against `transformers`, shared by the parity tests."""

from __future__ import annotations

import torch
import transformers

TIE = 1e-5  # a greedy mismatch is only excused where HF's top two logits are this close


def assert_matches_hf(hf: transformers.PreTrainedModel, prompt: list[int], tokens: list[int],
                      logprobs: list[float]) -> None:
    """Tokens equal HF's greedy choice (up to a near-tie) and logprobs equal HF's
    teacher-forced log-softmax on the same tokens within 1e-4."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    ref = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), ref, atol=1e-4, rtol=0), (logprobs, ref.tolist())
    for i, token in enumerate(tokens):
        top2 = logits[i].topk(2).values
        if token != int(logits[i].argmax()):
            assert float(top2[0] - top2[1]) < TIE, f"token {i}: {token} is not HF's greedy choice"
            break  # after a legitimate tie the two continuations differ
