"""The engine against `transformers`: greedy tokens and logprobs, in every scheduling situation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from hf_parity import assert_matches_hf, chosen_logprobs, hf_logits

from rose.engine import InFlight, LLMEngine, SamplingParams
from rose.model import load_model, preset_config, random_model, save_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _checkpoint(root: Path, arch: str, seed: int, **overrides: object) -> Path:
    config = preset_config(arch, "tiny", **overrides)
    save_model(random_model(config, seed, std=0.15), root)
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=11)


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape, other weights: the target of load_weights."""
    return _checkpoint(tmp_path_factory.mktemp("qwen3b"), "qwen3", seed=12)


@pytest.fixture(scope="module")
def hf_models() -> dict[Path, transformers.PreTrainedModel]:
    return {}


def _hf(cache: dict, path: Path) -> transformers.PreTrainedModel:
    if path not in cache:
        cache[path] = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return cache[path]


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def test_greedy_ragged_batch_matches_hf(ckpt: Path, hf_models: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    prompts = _prompts(7, [1, 5, 17, 33, 70, 2, 16])
    outs = engine.generate(prompts, GREEDY)
    hf = _hf(hf_models, ckpt)
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        assert_matches_hf(hf, prompt, out.token_ids, out.logprobs)
    # And the exact tokens of HF's own generate() for one of them.
    ref = hf.generate(torch.tensor([prompts[3]]), max_new_tokens=24, min_new_tokens=24,
                      do_sample=False)[0, len(prompts[3]):].tolist()
    assert outs[3].token_ids == ref
    assert len({tuple(o.token_ids) for o in outs}) > 3  # a peaky model: varied continuations


def test_chunked_prefill_small_budget_matches_hf(ckpt: Path, hf_models: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt, chunk_size=8, max_num_batched_tokens=20)
    prompts = _prompts(4, [45, 3, 29, 64], seed=1)
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(_hf(hf_models, ckpt), prompt, out.token_ids, out.logprobs)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_triton_attention_matches_hf(ckpt: Path, hf_models: dict, cuda_graphs: bool) -> None:
    """The Triton kernel (the engine's attention on CUDA; here in Triton's interpreter) over
    decodes and prefill chunks after cached prefixes; with `cuda_graphs`, the decode-only
    iterations through the static, padded inputs that CUDA graphs replay (eager off CUDA)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("with CUDA the Triton kernel runs compiled, in the gpu tests")
    engine = LLMEngine.from_pretrained(ckpt, chunk_size=8, max_num_batched_tokens=20,
                                       attention_backend="triton", cuda_graphs=cuda_graphs)
    assert engine.runner.attention.backend == "triton"
    assert (engine.runner.graphs is not None) == cuda_graphs
    sizes: list[int] = []
    if cuda_graphs:
        graphs, run = engine.runner.graphs, engine.runner.graphs.run
        graphs.run = lambda seqs: sizes.append(len(seqs)) or run(seqs)  # type: ignore[method-assign]
    prompts = _prompts(3, [21, 3, 12], seed=2)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(_hf(hf_models, ckpt), prompt, out.token_ids, out.logprobs)
    if cuda_graphs:
        assert 3 in sizes  # three decodes padded to the graph of four


def test_prefix_cache_multi_turn_hits_and_matches_hf(ckpt: Path, hf_models: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    turn1 = _prompts(3, [40, 35, 50], seed=2)
    outs1 = engine.generate(turn1, GREEDY)
    # Turn 2 of each trajectory: everything so far plus a new observation.
    turn2 = [p + o.token_ids + obs for p, o, obs in zip(turn1, outs1, _prompts(3, [7], 3), strict=True)]
    outs2 = engine.generate(turn2, GREEDY)
    for prompt, out in zip(turn2, outs2, strict=True):
        assert out.num_cached_tokens >= 48  # at least the full blocks of turn 1's prompt
        assert_matches_hf(_hf(hf_models, ckpt), prompt, out.token_ids, out.logprobs)
    assert engine.stats()["prefix_cache_hit_rate"] > 0.3


def test_preemption_by_recomputation_matches_hf(ckpt: Path, hf_models: dict) -> None:
    config = load_model(ckpt).config
    page = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * 16
    engine = LLMEngine.from_pretrained(ckpt, kv_cache_bytes=12 * page)  # 192 tokens for 5 x ~70
    prompts = _prompts(5, [30, 41, 25, 38, 33], seed=4)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert engine.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 40
        assert_matches_hf(_hf(hf_models, ckpt), prompt, out.token_ids, out.logprobs)


@pytest.mark.parametrize("in_flight", list(InFlight))
def test_load_weights_between_iterations(ckpt: Path, ckpt2: Path, hf_models: dict,
                                         in_flight: InFlight) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    prompts = _prompts(2, [20, 33], seed=5)
    engine.generate(prompts, GREEDY)  # fills the prefix cache with old-weight KV
    rid = engine.add_request(prompts[0], GREEDY)
    outs = [o for _ in range(3) for o in engine.step()]
    new = load_model(ckpt2)
    engine.load_weights(new.named_parameters(), version=7, in_flight=in_flight)
    while engine.has_unfinished():
        outs += engine.step()
    out, *later = [o for o in outs if o.request_id == rid]
    for o in later:
        out.merge(o)
    versions = out.versions
    if in_flight is InFlight.FINISH_OLD:
        assert set(versions) == {0}  # it finished under the old weights; then they swapped
        assert_matches_hf(_hf(hf_models, ckpt), prompts[0], out.token_ids, out.logprobs)
    elif in_flight is InFlight.CONTINUE:  # later tokens attend to KV of the old weights
        assert set(versions) == {0} and engine.policy_version == 7
    else:  # recomputed from scratch under the new weights
        assert versions[0] == 0 and versions[-1] == 7 and sorted(versions) == versions
    assert engine.policy_version == 7
    # New requests see only the new weights (the stale prefix cache was dropped).
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert set(out.versions) == {7}
        assert_matches_hf(_hf(hf_models, ckpt2), prompt, out.token_ids, out.logprobs)


def test_bf16_weights_load_into_fp32_engine(ckpt: Path, ckpt2: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    bf16 = {n: p.to(torch.bfloat16) for n, p in load_model(ckpt2).named_parameters()}
    engine.load_weights(bf16.items(), version=1)
    got = dict(engine.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert got.dtype == torch.float32
    assert torch.equal(got, bf16["model.layers.0.mlp.up_proj.weight"].float())
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))], version=2)


@pytest.mark.parametrize(("arch", "overrides"), [
    ("qwen2", dict(num_key_value_heads=1)),
    ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)),
])
def test_other_architectures_engine_matches_hf(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = _checkpoint(tmp_path, arch, seed=13, **overrides)
    engine = LLMEngine.from_pretrained(path, chunk_size=16)
    prompts = _prompts(3, [9, 40, 23], seed=6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        assert_matches_hf(hf, prompt, out.token_ids, out.logprobs)


def test_sampled_logprobs_are_raw_softmax(ckpt: Path, hf_models: dict) -> None:
    """Logprobs are under the temperature-1 softmax whatever temperature/top-p sampled them."""
    engine = LLMEngine.from_pretrained(ckpt)
    prompt = _prompts(1, [12], seed=7)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.7, top_p=0.9,
                                                   seed=3, ignore_eos=True))[0]
    ref = chosen_logprobs(hf_logits(_hf(hf_models, ckpt), prompt, out.token_ids), out.token_ids)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
