"""Requests at the edges: what the KV pool can never hold, budgets that shrink, an engine with
nothing admissible, numeric fields out of range, tiny temperatures, NaN logits, and the cost
of streaming (outputs and text carry only what is new)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path

import pytest
import torch

from rose.engine import KVPool, KVSpec, LLMEngine, SamplingParams
from rose.engine.detokenize import IncrementalDetokenizer
from rose.engine.scheduler import Batch
from rose.model import load_model, load_tokenizer
from rose.steploop import StepLoop


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(ckpt: Path, pages: int) -> LLMEngine:
    spec = KVSpec.of(load_model(ckpt).config)
    return LLMEngine.from_pretrained(ckpt, kv_cache_bytes=pages * spec.block_bytes)


def _run(engine: LLMEngine, max_steps: int = 500) -> dict[str, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finished
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError(f"still unfinished after {max_steps} steps")


# -- what can never fit ---------------------------------------------------------------------------

def test_requests_the_pool_can_never_hold_are_refused_with_the_numbers(ckpt: Path) -> None:
    engine = _engine(ckpt, pages=4)  # 64 tokens of KV
    assert engine.max_request_tokens == 65  # the last token needs no KV
    with pytest.raises(ValueError, match=r"prompt \(100 tokens\) and max_tokens \(4\) need KV for 103 "
                                         r"tokens, 7 pages of 16; the KV pool holds 4 pages, so a "
                                         r"request may reach 65 tokens \(the model's context is 2048\)"):
        engine.add_request(_prompt(100), SamplingParams(max_tokens=4), "big")
    with pytest.raises(ValueError, match=r"request 'long': the prompt \(30 tokens\) and max_tokens \(40\)"):
        engine.add_request(_prompt(30), SamplingParams(max_tokens=40), "long")
    assert not engine.has_unfinished()
    engine.add_request(_prompt(30), SamplingParams(max_tokens=35, ignore_eos=True), "exact")
    engine.add_request(_prompt(5, 1), SamplingParams(max_tokens=4, ignore_eos=True), "small")
    done = _run(engine)
    assert done["exact"].num_output_tokens == 35 and done["small"].num_output_tokens == 4
    # max_tokens past the context is capped by it, not refused, when the pool holds the context.
    roomy = _engine(ckpt, pages=200)
    roomy.add_request(_prompt(5), SamplingParams(max_tokens=10**12))


def test_a_request_whose_budget_shrank_is_aborted_and_the_queue_moves_on(ckpt: Path) -> None:
    engine = _engine(ckpt, pages=16)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request(_prompt(47), params, "big")  # 3 pages; its 49th token needs a 4th
    engine.step()
    engine.pool.set_budget(engine.name, 2)  # the co-serving executor does this on a burst
    engine.add_request(_prompt(5, 1), params, "small")  # 1 page, then 3: over the new budget too
    engine.add_request(_prompt(5, 2), SamplingParams(max_tokens=4, ignore_eos=True), "tiny")
    done = _run(engine)
    assert done["big"].finish_reason == "abort"
    assert "its 49 tokens need 4 KV pages; 'model' may now hold 2" in done["big"].error
    assert done["small"].finish_reason == "abort"  # admitted, then outgrew the budget
    assert done["tiny"].finish_reason == "length" and done["tiny"].num_output_tokens == 4
    assert engine.blocks.num_active_pages == 0


def test_an_engine_with_nothing_admissible_idles_then_resumes(ckpt: Path) -> None:
    spec = KVSpec.of(load_model(ckpt).config)
    pool = KVPool.for_specs(8 * spec.block_bytes, spec)
    mine = LLMEngine(load_model(ckpt), pool=pool, name="mine")
    other = LLMEngine(load_model(ckpt), pool=pool, name="other")
    other.add_request(_prompt(100), SamplingParams(max_tokens=10), "hog")
    other.step()  # it maps 7 of the 8 pages, then is never stepped again
    assert pool.num_free == 1
    steps = 0
    step = mine.step

    def counted() -> list:
        nonlocal steps
        steps += 1
        return step()

    mine.step = counted  # type: ignore[method-assign]
    loop = StepLoop(mine)

    async def main() -> list[int]:
        stream = loop.stream("wait", lambda: mine.add_request(
            _prompt(40), SamplingParams(max_tokens=4, ignore_eos=True), "wait"))
        reader = asyncio.ensure_future(_collect(stream))
        await asyncio.sleep(1.0)
        assert not reader.done()
        assert steps < 100, f"{steps} iterations in 1 s with nothing admissible: spinning"
        await asyncio.to_thread(lambda: loop.submit(lambda: other.abort("hog")).result())
        return await asyncio.wait_for(reader, 60)

    try:
        assert len(asyncio.run(main())) == 4
    finally:
        loop.shutdown()


async def _collect(stream: object) -> list[int]:
    return [t async for out in stream for t in out.token_ids]  # type: ignore[attr-defined]


# -- numeric fields and sampling --------------------------------------------------------------------

@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(top_k=1661748626853370527744), "top_k must be an integer >= -1 and < 2\\*\\*63"),
        (SamplingParams(seed=2**64), "seed must be an integer >= -2\\*\\*63 and < 2\\*\\*63"),
        (SamplingParams(max_tokens=2**63), "max_tokens must be an integer >= 1"),
        (SamplingParams(max_tokens=True), "max_tokens must be an integer"),
        (SamplingParams(temperature=math.nan), "temperature must be >= 0 and finite, got nan"),
        (SamplingParams(temperature=math.inf), "temperature must be >= 0 and finite, got inf"),
        (SamplingParams(top_p=math.nan), "top_p must be in \\(0, 1\\], got nan"),
        (SamplingParams(stop_token_ids=(5, -1)), "stop_token_ids\\[\\] must be an integer >= 0"),
    ],
)
def test_numeric_fields_out_of_range_are_refused(ckpt: Path, params: SamplingParams, message: str) -> None:
    engine = _engine(ckpt, pages=64)
    with pytest.raises(ValueError, match=f"request 'bad': {message}"):
        engine.add_request([1, 2, 3], params, "bad")
    assert not engine.has_unfinished()


def test_top_k_beyond_the_vocabulary_is_the_whole_vocabulary(ckpt: Path) -> None:
    engine = _engine(ckpt, pages=64)
    params = [SamplingParams(max_tokens=5, top_k=k, top_p=0.9, seed=3, ignore_eos=True)
              for k in (2**63 - 1, 0)]
    huge, off = engine.generate([_prompt(6), _prompt(6)], params)
    assert huge.token_ids == off.token_ids


def test_tiny_temperatures_are_greedy(ckpt: Path) -> None:
    engine = _engine(ckpt, pages=64)
    prompts = [_prompt(7, 1), _prompt(3, 2)]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for temperature in (1e-45, 1e-6):
        tiny = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=temperature, seed=1,
                                                       ignore_eos=True))
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_nan_logits_fail_their_request_instead_of_sampling(ckpt: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(ckpt, pages=64)
    params = SamplingParams(max_tokens=5, seed=7, ignore_eos=True)
    clean = engine.generate([_prompt(6)], params)[0].token_ids
    run = engine.runner.run

    def nan_for_poison(batch: Batch, interrupt: object = None) -> tuple:
        sampling, logits = run(batch, interrupt)
        logits = logits.clone()
        for i, seq in enumerate(sampling):
            if seq.request_id == "poison":
                logits[i, 7] = math.nan
        return sampling, logits

    monkeypatch.setattr(engine.runner, "run", nan_for_poison)
    engine.add_request(_prompt(6), params, "ok")
    engine.add_request(_prompt(9, 1), params, "poison")
    tokens: dict[str, list[int]] = {"ok": [], "poison": []}
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            finished[out.request_id] = out
    assert finished["poison"].finish_reason == "error" and "NaN" in finished["poison"].error
    assert tokens["poison"] == [] and tokens["ok"] == clean
    assert engine.blocks.num_active_pages == 0


# -- streaming costs O(new) -----------------------------------------------------------------------

def test_step_outputs_carry_only_their_new_tokens(ckpt: Path) -> None:
    engine = _engine(ckpt, pages=64)
    rid = engine.add_request(_prompt(100), SamplingParams(max_tokens=400, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    carried = sum(len(o.token_ids) + len(o.logprobs) + len(o.versions) for o in outputs)
    assert len(outputs) == 400 and carried == 3 * 400  # the old outputs copied 280,600 elements
    merged, *later = outputs
    for out in later:
        merged.merge(out)
    assert merged.request_id == rid and merged.num_output_tokens == 400
    assert len(merged.token_ids) == len(merged.logprobs) == len(merged.versions) == 400


def test_incremental_detokenization_matches_a_full_decode(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    rng = random.Random(0)
    for _ in range(200):  # random ids: many byte tokens that split UTF-8 characters
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        full = tok.decode(ids)
        text, pushed = IncrementalDetokenizer(tok.decode), 0
        out = ""
        while pushed < len(ids):
            n = rng.randint(1, 3)
            out += text.push(ids[pushed:pushed + n], pushed + n >= len(ids))
            pushed += n
        assert out == full.rstrip("\ufffd")  # an incomplete character at the end is never sent
        if len(full.rstrip("\ufffd")) < 6:
            continue
        start = rng.randrange(len(full) - 4)
        stop = full[start:start + rng.randint(1, 4)]
        if "\ufffd" in stop:
            continue
        text, out = IncrementalDetokenizer(tok.decode, [stop, "never-seen"]), ""
        for i, t in enumerate(ids):  # one token a step: the stop string spans boundaries
            out += text.push([t], i == len(ids) - 1)
            if text.stopped:
                break
        assert text.stopped and out == full[:full.find(stop)]


def test_incremental_detokenization_decodes_only_a_window(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    decoded = 0

    def counting(ids: list[int]) -> str:
        nonlocal decoded
        decoded += len(ids)
        return tok.decode(ids)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 60)
    text = IncrementalDetokenizer(counting, ["zebra"])
    start = time.perf_counter()
    out = "".join(text.push([t], i == len(ids) - 1) for i, t in enumerate(ids))
    assert out == tok.decode(ids) and not text.stopped
    assert decoded < 6 * len(ids), f"{decoded} tokens decoded for {len(ids)}: not incremental"
    assert time.perf_counter() - start < 30
