"""The sampler's math on tiny logits, against references computed by hand (vLLM's semantics)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from rose.engine import SamplingParams
from rose.engine.sampling import _process, sample
from rose.engine.sequence import Sequence

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 1.0, -3.0]])


def _seq(prompt: list[int], output: list[int], seed: int = 0, **params: object) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(max_tokens=8, **params),  # type: ignore[arg-type]
                   generator=torch.Generator().manual_seed(seed))
    for token in output:
        seq.append(token, 0.0)
    return seq


@pytest.mark.parametrize(
    ("seq", "expected"),
    [
        # Repetition: tokens in prompt (0) or output (1, 3): positive logits divided, negative multiplied.
        (_seq([0], [1, 3, 3], repetition_penalty=2.0), [1.0, -2.0, 0.5, 0.5, -3.0]),
        # Frequency and presence: output tokens only (token 0 in the prompt is untouched).
        (_seq([0], [1, 3, 3], frequency_penalty=0.5), [2.0, -1.5, 0.5, 0.0, -3.0]),
        (_seq([0], [1, 3, 3], presence_penalty=0.5), [2.0, -1.5, 0.5, 0.5, -3.0]),
        # Bias added; min_tokens masks the stop ids (4 asked, 2 the engine's end-of-sequence id).
        (_seq([0], [1], logit_bias=((1, 3.0), (4, -1.0))), [2.0, 2.0, 0.5, 1.0, -4.0]),
        (_seq([0], [1], min_tokens=2, stop_token_ids=(4,)), [2.0, -1.0, -math.inf, 1.0, -math.inf]),
        (_seq([0], [1, 3], min_tokens=2, stop_token_ids=(4,)), [2.0, -1.0, 0.5, 1.0, -3.0]),
        (_seq([0], [1], min_tokens=2, ignore_eos=True), [2.0, -1.0, 0.5, 1.0, -3.0]),
    ],
)
def test_processing_matches_the_hand_computed_logits(seq: Sequence, expected: list[float]) -> None:
    assert _process(LOGITS, [seq], eos_token_ids=(2,))[0].tolist() == expected


def test_rows_of_a_batch_keep_their_own_parameters() -> None:
    seqs = [_seq([0], [3], presence_penalty=1.0), _seq([0], [3]), _seq([2], [], repetition_penalty=4.0)]
    out = _process(LOGITS.expand(3, -1), seqs, ())
    assert out.tolist() == [[2.0, -1.0, 0.5, 0.0, -3.0], LOGITS[0].tolist(), [2.0, -1.0, 0.125, 1.0, -3.0]]


def test_greedy_takes_the_processed_argmax_and_reports_raw_logprobs() -> None:
    raw = LOGITS.log_softmax(-1)[0]
    drawn = sample(LOGITS, [_seq([0], [], temperature=0, logit_bias=((2, 5.0),), top_logprobs=2)])
    assert drawn.tokens == [2]
    assert drawn.logprobs == pytest.approx([raw[2].item()])  # raw: before the bias
    assert [t for t, _ in drawn.top[0]] == [0, 3]
    assert [v for _, v in drawn.top[0]] == pytest.approx([raw[0].item(), raw[3].item()])


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_likeliest() -> None:
    # Probabilities at temperature 1 relative to the likeliest: exp(logit - 2): token 3 keeps
    # exp(-1) = 0.37, token 2 exp(-1.5) = 0.22. min_p 0.3 leaves tokens 0 and 3.
    drawn = {sample(LOGITS, [_seq([0], [], seed=s, min_p=0.3)]).tokens[0] for s in range(200)}
    assert drawn == {0, 3}
    assert {sample(LOGITS, [_seq([0], [], seed=s, min_p=1.0)]).tokens[0] for s in range(50)} == {0}


def test_top_logprobs_per_row_and_none_when_not_asked() -> None:
    drawn = sample(LOGITS.expand(2, -1), [_seq([0], [], top_logprobs=3), _seq([0], [])])
    assert [t for t, _ in drawn.top[0]] == [0, 3, 2] and drawn.top[1] == []


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0.0, 100.0]"),
        ({"min_p": -0.1}, "min_p must be in [0.0, 1.0]"),
        ({"min_tokens": 9}, "min_tokens must be <= max_tokens (8)"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token id must be an integer >= 0"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias value must be in [-100.0, 100.0]"),
        ({"top_logprobs": -1}, "top_logprobs must be an integer >= 0"),
    ],
)
def test_bad_parameters_are_named(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(max_tokens=8, **params).validate()  # type: ignore[arg-type]
