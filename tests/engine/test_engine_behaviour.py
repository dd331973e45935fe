"""Engine mechanisms one by one: pool accounting, prefix cache, CoW, scheduling, sampling,
bad input, abort, streaming."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rose.contracts import TokenLoad
from rose.engine import KVPool, KVSpec, LLMEngine, SamplingParams
from rose.engine.async_engine import AsyncLLMEngine
from rose.engine.block_manager import BlockManager
from rose.engine.sequence import Sequence


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- KV pool and block manager ----------------------------------------------------------------

def test_one_pool_two_kv_shapes_accounting() -> None:
    serving = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    rollout = KVSpec(num_layers=3, num_kv_heads=1, head_dim=32)
    pool = KVPool.for_specs(10 * max(serving.block_bytes, rollout.block_bytes), serving, rollout)
    assert pool.num_pages == 10 and pool.page_bytes == rollout.block_bytes
    a, b = BlockManager(pool, serving, "serving"), BlockManager(pool, rollout, "rollout")
    s1 = Sequence("s", _prompt(40), SamplingParams())
    r1 = Sequence("r", _prompt(20, 1), SamplingParams())
    assert a.ensure_slots(s1, 40) and b.ensure_slots(r1, 20)
    assert (pool.used("serving"), pool.used("rollout"), pool.num_free) == (3, 2, 5)
    # Each model writes through its own view; pages never overlap.
    pool.view(serving)[s1.block_table] = 1.0
    pool.view(rollout)[r1.block_table] = 2.0
    assert torch.all(pool.view(serving)[s1.block_table] == 1.0)
    assert set(s1.block_table).isdisjoint(r1.block_table)
    pool.set_budget("rollout", 3)
    r2 = Sequence("r2", _prompt(33, 2), SamplingParams())
    assert not b.ensure_slots(r2, 33)  # 3 pages more would exceed the budget of 3
    assert pool.used("rollout") == 2 and not r2.block_table  # all or nothing
    a.free(s1)
    assert pool.used("serving") == 0 and pool.num_free == 8


def _manager(pages: int, head_dim: int = 8, owner: str = "m") -> tuple[KVPool, BlockManager]:
    """A block manager of 4-token blocks on a pool of `pages`."""
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=head_dim, block_size=4)
    pool = KVPool(pages * spec.block_bytes, spec.block_bytes)
    return pool, BlockManager(pool, spec, owner)


def test_prefix_cache_reclaim_and_reset() -> None:
    pool, bm = _manager(4)
    first = Sequence("a", list(range(10)), SamplingParams())
    bm.match_prefix(first)
    assert first.num_cached_tokens == 0 and bm.ensure_slots(first, 10)
    first.num_computed_tokens = 10
    bm.commit(first)
    bm.free(first)
    assert bm.num_cached_pages == 2 and pool.num_free == 2  # two full blocks stay cached
    again = Sequence("b", [*range(10), 99], SamplingParams())
    bm.match_prefix(again)
    assert again.num_cached_tokens == 8 and bm.hit_rate == 8 / 21
    bm.free(again)
    other = Sequence("c", list(range(50, 66)), SamplingParams())
    assert bm.ensure_slots(other, 16)  # needs all 4 pages: the cache is reclaimed
    assert bm.num_cached_pages == 0
    bm.free(other)
    bm.reset_prefix_cache()
    assert pool.num_free == 4


def test_a_cached_prefix_is_taken_back_only_within_the_budget() -> None:
    """A burst cut a turn (its pages went to the cache) and halved the budget: the turn resumed
    maps no more of its cached prefix than the budget holds; the rest is computed again."""
    pool, bm = _manager(8, owner="rollout")
    cut = Sequence("a", list(range(24)), SamplingParams())
    assert bm.ensure_slots(cut, 24)
    cut.num_computed_tokens = 24
    bm.commit(cut)
    bm.free(cut)  # (its pages stay cached)
    assert bm.num_cached_pages == 6 and bm.num_active_pages == 0
    pool.set_budget("rollout", 2)
    resumed = Sequence("a+", [*range(24), 7], SamplingParams())
    bm.match_prefix(resumed)
    assert resumed.num_cached_tokens == 8 and bm.num_active_pages == 2


def test_fork_shares_pages_and_copies_on_write() -> None:
    pool, bm = _manager(8, head_dim=4)
    spec = bm.spec
    parent = Sequence("p", list(range(6)), SamplingParams())
    assert bm.ensure_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv = pool.view(spec)
    kv[parent.block_table[-1]] = 5.0
    child = Sequence("c", list(range(6)), SamplingParams())
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and pool.used("m") == 2
    assert bm.ensure_slots(child, 1)  # writes into the shared partial block: copy first
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert torch.equal(kv[child.block_table[1]], kv[parent.block_table[1]])
    assert pool.used("m") == 3


# -- scheduling ---------------------------------------------------------------------------------

def test_serving_priority_displaces_rollouts(ckpt: Path) -> None:
    spec_bytes = LLMEngine.from_pretrained(ckpt).blocks.spec.block_bytes
    engine = LLMEngine.from_pretrained(ckpt, kv_cache_bytes=8 * spec_bytes)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    rollouts = [engine.add_request(_prompt(40, i), params, f"r{i}", priority=1) for i in range(2)]
    engine.step()
    serving = engine.add_request(_prompt(60, 9), params, "serve", priority=0)
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert serving in running and not set(rollouts) <= running
    assert engine.num_preemptions >= 1
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert all(done[r].num_output_tokens == 20 for r in [*rollouts, serving])  # nothing lost


# -- sampling -----------------------------------------------------------------------------------

def test_seeds_reproduce_whatever_the_batch(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([_prompt(9)], sampled)[0].token_ids
    crowd = engine.generate([_prompt(30, 1), _prompt(9), _prompt(4, 2)],
                            [SamplingParams(max_tokens=5, temperature=0.7, seed=1), sampled,
                             SamplingParams(max_tokens=20, temperature=0)])
    assert crowd[1].token_ids == alone
    other = engine.generate([_prompt(9)], SamplingParams(max_tokens=12, temperature=1.0, top_k=50,
                                                         seed=99, ignore_eos=True))[0]
    assert other.token_ids != alone
    greedy = engine.generate([_prompt(9)], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))[0].token_ids
    top1 = engine.generate([_prompt(9)], SamplingParams(max_tokens=12, temperature=1.0, top_k=1,
                                                        seed=5, ignore_eos=True))[0].token_ids
    assert top1 == greedy


def test_the_device_named_is_where_the_engine_runs(ckpt: Path) -> None:
    """device="cpu" named (`--device cpu`) gives the default's tokens here, seeded sampling
    included, with the pool, the attention's indices and each request's generator on it; a
    pool on another device than the model is refused."""
    named = LLMEngine.from_pretrained(ckpt, dtype="float32", device="cpu")
    assert named.device == named.pool.device == named.runner.attention.device == torch.device("cpu")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=3, ignore_eos=True)
    prompts = [_prompt(9), _prompt(30, 1)]
    default = LLMEngine.from_pretrained(ckpt).generate(prompts, params)
    assert [o.token_ids for o in named.generate(prompts, params)] == [o.token_ids for o in default]
    rid = named.add_request(_prompt(5), params)
    assert named._seqs[rid].generator.device == named.device
    with pytest.raises(ValueError, match=r"its model is on cpu, the KV pool on meta"):
        LLMEngine(named.model, pool=KVPool(1 << 20, 1 << 16, device="meta"))


def test_an_interrupted_iteration_changes_nothing(ckpt: Path) -> None:
    """Iterations given up between layers (at the first layer or part way) leave every
    sequence as it was: the same tokens come out, seeded sampling included, and no page leaks."""
    engine = LLMEngine.from_pretrained(ckpt)
    prompts = [_prompt(40), _prompt(40)[:33] + _prompt(7, 1), _prompt(5, 2)]  # a shared prefix
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    clean = [o.token_ids for o in engine.generate(prompts, params)]
    engine.blocks.reset_prefix_cache()
    calls = 0

    def every_third_layer() -> bool:
        nonlocal calls
        calls += 1
        return calls % 3 == 0

    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step(token_budget=16, interrupt=every_third_layer):
            got[out.request_id] += out.token_ids
        if engine.last_step.interrupted:
            assert engine.last_step.load == TokenLoad()
    assert [got[i] for i in ids] == clean
    assert engine.num_interrupted > 3 and engine.blocks.num_active_pages == 0


def test_logprobs_at_the_sampling_temperature(ckpt: Path) -> None:
    """RL's behaviour policy: with `logprobs_at_temperature` each token's logprob is under
    softmax(logits / T); by default under the raw softmax, as OpenAI-style clients expect."""
    engine = LLMEngine.from_pretrained(ckpt)
    prompt = _prompt(9)
    tempered, raw = engine.generate([prompt, prompt], [
        SamplingParams(max_tokens=4, temperature=0.5, seed=3, ignore_eos=True, logprobs_at_temperature=True),
        SamplingParams(max_tokens=4, temperature=0.5, seed=3, ignore_eos=True)])
    assert tempered.token_ids == raw.token_ids
    ids = torch.tensor([prompt + tempered.token_ids[:-1]])
    with torch.no_grad():
        logits = engine.model(ids)[0, len(prompt) - 1:].float()
    chosen = torch.tensor(tempered.token_ids)[:, None]
    at_t = (logits / 0.5).log_softmax(-1).gather(-1, chosen)[:, 0]
    at_1 = logits.log_softmax(-1).gather(-1, chosen)[:, 0]
    torch.testing.assert_close(torch.tensor(tempered.logprobs), at_t, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(raw.logprobs), at_1, atol=1e-4, rtol=0)
    assert not torch.allclose(at_t, at_1, atol=1e-3)


def test_top_p_keeps_only_the_nucleus(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    prompt = _prompt(7, 3)
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt]))[0, -1]
    probs = logits.softmax(-1).sort(descending=True)
    nucleus = set(probs.indices[: int((probs.values.cumsum(0) < 0.5).sum()) + 1].tolist())
    firsts = {engine.generate([prompt], SamplingParams(max_tokens=1, top_p=0.5, seed=s))[0].token_ids[0]
              for s in range(40)}
    assert firsts <= nucleus and len(firsts) > 1


def test_stop_tokens_eos_and_context_limit(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    prompt = _prompt(5, 4)
    free = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop_at = free.token_ids[6]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                       stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    engine.eos_token_ids = frozenset({stop_at})
    eos = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert eos.token_ids == stopped.token_ids and eos.finish_reason == "stop"
    long = engine.generate([_prompt(engine.max_model_len - 3)],
                           SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert len(long.token_ids) == 3 and long.finish_reason == "length"


# -- bad input and abort ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "request 'bad': the prompt is empty"),
        ([1] * 2048, SamplingParams(), "request 'bad': the prompt has 2048 tokens"),
        ([1, 512], SamplingParams(), "request 'bad': token id 512 is outside the vocabulary"),
        ([1, -1], SamplingParams(), "request 'bad': token id -1 is outside"),
        ([1, 2], SamplingParams(max_tokens=0), "request 'bad': max_tokens must be"),
        ([1, 2], SamplingParams(temperature=-0.5), "request 'bad': temperature must be >= 0"),
        ([1, 2], SamplingParams(top_p=0.0), "request 'bad': top_p must be in"),
    ],
)
def test_bad_requests_are_refused_and_others_keep_running(ckpt: Path, prompt: list[int],
                                                         params: SamplingParams, message: str) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    good = engine.add_request(_prompt(8), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params, request_id="bad")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].request_id == good and outs[-1].num_output_tokens == 6


def test_abort_returns_partial_output_and_frees_pages(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    rid = engine.add_request(_prompt(20), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    partial = engine.abort(rid)
    assert partial is not None and partial.finish_reason == "abort" and partial.finished
    # The first step prefills and samples, so five steps made five tokens (streamed already).
    assert partial.num_output_tokens == 5 and partial.token_ids == []
    assert engine.blocks.num_active_pages == 0 and not engine.has_unfinished()
    assert engine.abort(rid) is None


# -- asyncio front and the command line ---------------------------------------------------------

def test_async_engine_streams_aborts_and_swaps_weights(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    front = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main() -> None:
        streamed = [o async for o in front.generate(_prompt(10), params)]
        assert [len(o.token_ids) for o in streamed] == [1] * 8 and streamed[-1].finished
        assert [o.num_output_tokens for o in streamed] == list(range(1, 9))
        offline = await front.call(lambda: engine.generate([_prompt(10)], params))
        assert [t for o in streamed for t in o.token_ids] == offline[0].token_ids

        async def take(n: int) -> None:
            async for o in front.generate(_prompt(12), SamplingParams(max_tokens=500, ignore_eos=True),
                                          request_id="long"):
                if o.num_output_tokens == n:
                    return
            raise AssertionError("stream ended early")

        await take(3)  # leaving the stream early aborts the request
        await front.call(lambda: None)
        assert "long" not in await front.call(lambda: {s.request_id for s in engine.scheduler.running})
        with pytest.raises(ValueError, match="the prompt is empty"):
            async for _ in front.generate([], params):
                pass
        await front.load_weights([], version=3)
        last = [o async for o in front.generate(_prompt(10), params)][-1]
        assert set(last.versions) == {3}

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


def test_rose_generate_command(ckpt: Path, tiny_qwen3: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "rose.cli", "generate", "--model", str(tiny_qwen3),
                          "--prompt", "Hello", "--max-tokens", "5", "--chat"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.startswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    bad = subprocess.run([sys.executable, "-m", "rose.cli", "generate", "--model", str(tiny_qwen3),
                          "--prompt", "Hi", "--max-tokens", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "max_tokens must be an integer >= 1" in bad.stderr


def _huge_page_kb() -> int:
    lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    line = next(x for x in lines if x.startswith("AnonHugePages"))
    return int(line.split()[1])


def test_the_host_pool_lies_on_huge_pages() -> None:
    """The CPU pool is zeroed, 2 MB-aligned, and where Linux lends transparent huge pages to
    those who ask (madvise or always), mostly on them: the decode kernel's scattered reads
    would otherwise miss the TLB at every page row."""
    spec = KVSpec(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    before = _huge_page_kb() if thp.exists() else 0
    pool = KVPool.for_specs(64 << 20, spec)
    assert pool.buffer.data_ptr() % (2 << 20) == 0 and not pool.buffer.any()
    pool.view(spec).fill_(1.5)
    assert pool.view(spec).eq(1.5).all()
    if thp.exists() and "[never]" not in thp.read_text():
        assert _huge_page_kb() - before >= 32 << 10
