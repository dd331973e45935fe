"""LoRA adapters in the native engine against `peft` on the HF model: one adapter, several and the
base model in one batch (the fused CPU forward and the model's own), loads, replaces and removals
between iterations, the prefix cache kept apart per adapter version, and bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import peft
import pytest
import torch
import transformers
from hf_parity import assert_matches_hf, chosen_logprobs, hf_logits

from rose.contracts.adapter import LoRAConfig
from rose.engine import LLMEngine, RequestOutput, SamplingParams
from rose.engine.async_engine import AsyncLLMEngine
from rose.model import preset_config, random_model, save_model
from rose.model.lora import load_adapter, save_adapter

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CONFIG = preset_config("qwen3", "tiny")
# Two adapters of other shapes: every linear at rank 4; three linears (k of q/k/v left out, so a
# packed product is only partly adapted) at rank 2.
CONFIGS = {"a": LoRAConfig(rank=4, alpha=8), "b": LoRAConfig(rank=2, alpha=3, targets=("q_proj", "v_proj",
                                                                                          "down_proj"))}


def _tensors(config: LoRAConfig, seed: int, model_config: object = CONFIG) -> dict[str, torch.Tensor]:
    """Random A and B (B nonzero, unlike a fresh adapter's: the product changes the outputs)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.1
            for name, shape in config.shapes(model_config).items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    save_model(random_model(CONFIG, 11, std=0.15), path)
    return path


@pytest.fixture(scope="module")
def adapters(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter directories by name, as `save_adapter` writes them; `a2`: `a` with other B's."""
    root = tmp_path_factory.mktemp("adapters")
    new_b = {n: t for n, t in _tensors(CONFIGS["a"], 3).items() if ".lora_B." in n}
    tensors = {"a": _tensors(CONFIGS["a"], 1), "b": _tensors(CONFIGS["b"], 2)}
    tensors["a2"] = {**tensors["a"], **new_b}
    return {name: save_adapter(root / name, CONFIGS[name[0]], t, str(ckpt)) for name, t in tensors.items()}


@pytest.fixture(scope="module")
def oracles(ckpt: Path, adapters: dict[str, Path]) -> dict[str | None, transformers.PreTrainedModel]:
    """The HF model (None) and `peft.PeftModel` over a fresh HF model per adapter directory."""
    def hf() -> transformers.PreTrainedModel:
        return transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()

    out: dict[str | None, transformers.PreTrainedModel] = {None: hf()}
    for name, path in adapters.items():
        out[name] = peft.PeftModel.from_pretrained(hf(), str(path)).eval()
    return out


def _load(engine: LLMEngine, name: str, path: Path, version: int) -> None:
    config, tensors, _ = load_adapter(path)
    engine.load_adapter(name, config, tensors.items(), version)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _run(engine: LLMEngine, outs: dict[str, RequestOutput], steps: int | None = None) -> None:
    """Step `steps` times (None: until done), merging each request's outputs into `outs`."""
    while engine.has_unfinished() and (steps is None or steps > 0):
        for out in engine.step():
            if out.request_id in outs:
                outs[out.request_id].merge(out)
            else:
                outs[out.request_id] = out
        steps = None if steps is None else steps - 1


def test_one_adapter_matches_peft(ckpt: Path, adapters: dict[str, Path], oracles: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    _load(engine, "a", adapters["a"], version=5)
    prompts = _prompts([7, 30, 1])
    outs = engine.generate(prompts, GREEDY, adapter="a")
    base = engine.generate(prompts, GREEDY)
    for prompt, out, plain in zip(prompts, outs, base, strict=True):
        assert out.versions == [5] * 12
        assert_matches_hf(oracles["a"], prompt, out.token_ids, out.logprobs)
        assert out.token_ids != plain.token_ids  # the adapter changes what the model says
        assert plain.versions == [0] * 12


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_mixed_batch_each_row_matches_its_oracle(ckpt: Path, adapters: dict[str, Path], oracles: dict,
                                                 backend: str) -> None:
    """Two adapters and the base model in every iteration, prefill chunks beside decodes (the
    runner puts decodes first): `cpu` runs the fused forward, `sdpa` the model's own."""
    engine = LLMEngine.from_pretrained(ckpt, attention_backend=backend, chunk_size=8,
                                       max_num_batched_tokens=24)
    assert (engine.runner.fused is not None) == (backend == "cpu")
    _load(engine, "a", adapters["a"], version=1)
    _load(engine, "b", adapters["b"], version=2)
    names = ["b", None, "a", "a", None, "b"]
    prompts = _prompts([21, 3, 12, 40, 9, 17], seed=1)
    outs = engine.generate(prompts, GREEDY, adapter=names)
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        assert out.versions == [{"a": 1, "b": 2, None: 0}[name]] * 12
        assert_matches_hf(oracles[name], prompt, out.token_ids, out.logprobs)


def test_cuda_graphs_replay_only_iterations_without_adapter_rows(ckpt: Path, adapters: dict[str, Path],
                                                                 oracles: dict) -> None:
    """With the Triton backend (its interpreter here) and CUDA graphs (eager off CUDA): an
    iteration with an adapter row runs the model's own forward with the products, one without
    replays the base model's graph."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("with CUDA the Triton kernel runs compiled, in the gpu tests")
    engine = LLMEngine.from_pretrained(ckpt, attention_backend="triton", cuda_graphs=True)
    _load(engine, "a", adapters["a"], version=1)
    replayed: list[list[str | None]] = []
    graphs, run = engine.runner.graphs, engine.runner.graphs.run
    graphs.run = lambda seqs: replayed.append([s.adapter for s in seqs]) or run(seqs)  # type: ignore[method-assign]
    prompts = _prompts([9, 5], seed=6)
    short, long = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), GREEDY
    outs = engine.generate(prompts, [short, long], adapter=["a", None])
    assert_matches_hf(oracles["a"], prompts[0], outs[0].token_ids, outs[0].logprobs)
    assert_matches_hf(oracles[None], prompts[1], outs[1].token_ids, outs[1].logprobs)
    assert replayed and all(row == [None] for row in replayed)  # after the adapter's request ended


def test_prefix_cache_is_kept_apart_per_adapter_and_version(ckpt: Path, adapters: dict[str, Path],
                                                             oracles: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt)  # blocks of 16 tokens: a 40-token prompt caches 32
    _load(engine, "a", adapters["a"], version=1)
    _load(engine, "b", adapters["b"], version=1)
    prompt = _prompts([40], seed=2)[0]

    def run(name: str | None, cached: int, oracle: str | None) -> None:
        out = engine.generate([prompt], GREEDY, adapter=name)[0]
        assert out.num_cached_tokens == cached, name
        assert_matches_hf(oracles[oracle], prompt, out.token_ids, out.logprobs)

    run(None, 0, None)
    run("a", 0, "a")  # not the base model's KV
    run("a", 32, "a")
    run("b", 0, "b")  # nor another adapter's
    run(None, 32, None)
    _load(engine, "a", adapters["a2"], version=2)
    run("a", 0, "a2")  # nor an older version's
    run("a", 32, "a2")


def test_load_replace_remove_while_requests_run(ckpt: Path, adapters: dict[str, Path], oracles: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    _load(engine, "a", adapters["a"], version=1)
    p1, p2, p3 = _prompts([10, 14, 6], seed=3)
    outs: dict[str, RequestOutput] = {}
    engine.add_request(p1, GREEDY, "r1", adapter="a")
    engine.add_request(p3, GREEDY, "base")
    _run(engine, outs, steps=3)
    # A new version that gives only the tensors that changed (every B), and a second adapter.
    config, a2, _ = load_adapter(adapters["a2"])
    engine.load_adapter("a", config, [(n, t) for n, t in a2.items() if ".lora_B." in n], version=2)
    _load(engine, "b", adapters["b"], version=7)
    engine.add_request(p2, GREEDY, "r2", adapter="a")
    engine.add_request(p2, GREEDY, "r3", adapter="b")
    with pytest.raises(ValueError, match="adapter 'a': request 'r1' uses it"):
        engine.remove_adapter("a")
    _run(engine, outs, steps=2)
    with pytest.raises(ValueError, match="adapter 'b': request 'r3' uses it"):
        engine.remove_adapter("b")
    _run(engine, outs)
    assert outs["r1"].versions == [1] * 12  # its later tokens attend to KV of version 1
    assert outs["r2"].versions == [2] * 12 and outs["r3"].versions == [7] * 12
    assert_matches_hf(oracles["a2"], p2, outs["r2"].token_ids, outs["r2"].logprobs)
    assert_matches_hf(oracles["b"], p2, outs["r3"].token_ids, outs["r3"].logprobs)
    assert_matches_hf(oracles[None], p3, outs["base"].token_ids, outs["base"].logprobs)
    # Version 2 is not version 1: its logprobs differ from version 1's on the same tokens.
    old = chosen_logprobs(hf_logits(oracles["a"], p2, outs["r2"].token_ids), outs["r2"].token_ids)
    assert (old - torch.tensor(outs["r2"].logprobs)).abs().max() > 1e-2
    engine.remove_adapter("a")
    with pytest.raises(ValueError, match="request 'r4': adapter 'a' is not loaded; loaded: b"):
        engine.add_request(p1, GREEDY, "r4", adapter="a")
    assert not engine.has_unfinished()


def test_the_engine_keeps_its_own_copy_in_its_dtype(ckpt: Path, adapters: dict[str, Path],
                                                    oracles: dict) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    config, tensors, _ = load_adapter(adapters["a"])
    engine.load_adapter("a", config, tensors.items(), version=1)
    for tensor in tensors.values():
        tensor.zero_()  # the caller's: the engine's are its own
    prompt = _prompts([9], seed=4)[0]
    out = engine.generate([prompt], GREEDY, adapter="a")[0]
    assert_matches_hf(oracles["a"], prompt, out.token_ids, out.logprobs)
    _, b_tensors, _ = load_adapter(adapters["b"])
    bf16 = {n: t.to(torch.bfloat16) for n, t in b_tensors.items()}
    engine.load_adapter("b", CONFIGS["b"], bf16.items(), version=1)
    name = "model.layers.1.mlp.down_proj.lora_B.weight"
    got = engine.adapters.get("b").tensors[name]  # type: ignore[union-attr]
    assert got.dtype == torch.float32 and torch.equal(got, bf16[name].float())


def test_async_engine_passes_the_adapter_through(ckpt: Path, adapters: dict[str, Path],
                                                 oracles: dict) -> None:
    front = AsyncLLMEngine(LLMEngine.from_pretrained(ckpt))
    config, tensors, _ = load_adapter(adapters["b"])
    prompt = _prompts([11], seed=5)[0]

    async def main() -> RequestOutput:
        await front.load_adapter("b", config, tensors.items(), 3)
        merged = None
        async for out in front.generate(prompt, GREEDY, adapter="b"):
            merged = out if merged is None else merged.merge(out) or merged
        await front.remove_adapter("b")
        return merged

    try:
        out = asyncio.run(main())
    finally:
        front.shutdown()
    assert out.versions == [3] * 12
    assert_matches_hf(oracles["b"], prompt, out.token_ids, out.logprobs)
    assert front.engine.adapters.get("b") is None


def test_bad_adapters_are_refused_and_change_nothing(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    with pytest.raises(ValueError, match="request 'r': adapter 'nope' is not loaded; loaded: none"):
        engine.add_request([1, 2, 3], GREEDY, "r", adapter="nope")
    assert not engine.has_unfinished()
    config = CONFIGS["a"]
    # Adapters of other bases: a wider model's shapes, a deeper model's layers.
    wider = _tensors(config, 1, preset_config("qwen3", "tiny", hidden_size=32))
    with pytest.raises(ValueError, match=r"adapter 'x': 'model.layers.0.self_attn.q_proj.lora_A.weight' "
                                         r"has shape \(4, 32\), expected \(4, 64\)"):
        engine.load_adapter("x", config, wider.items(), 1)
    deeper = _tensors(config, 1, preset_config("qwen3", "tiny", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"adapter 'x': tensor 'model\.layers\.2\..* another base"):
        engine.load_adapter("x", config, deeper.items(), 1)
    with pytest.raises(ValueError, match=r"rank must be an integer >= 1, got 0"):
        engine.load_adapter("x", LoRAConfig(rank=0), {}.items(), 1)
    with pytest.raises(ValueError, match=r"adapter 'x': .*rank 33 is larger than the smallest targeted"):
        engine.load_adapter("x", LoRAConfig(rank=33), {}.items(), 1)
    with pytest.raises(ValueError, match=r"adapter 'x': config is a dict; expected a LoRAConfig"):
        engine.load_adapter("x", {"rank": 4}, {}.items(), 1)  # type: ignore[arg-type]
    first = _tensors(config, 1)
    some = [(n, t) for n, t in first.items() if ".lora_B." in n]
    with pytest.raises(ValueError, match=r"adapter 'x': 14 adapter tensor\(s\) missing"):
        engine.load_adapter("x", config, some, 1)  # a first load needs every tensor
    assert engine.adapters.get("x") is None
    engine.load_adapter("x", config, first.items(), 1)
    # A replace with other settings needs every tensor too; refused, the loaded one stays.
    with pytest.raises(ValueError, match="missing"):
        engine.load_adapter("x", LoRAConfig(rank=4, alpha=16), some, 2)
    loaded = engine.adapters.get("x")
    assert loaded is not None and loaded.version == 1 and loaded.config == config
    with pytest.raises(ValueError, match="adapter 'y' is not loaded; loaded: x"):
        engine.remove_adapter("y")
