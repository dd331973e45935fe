"""The trainer with a LoRA adapter: only the adapter trains, the KL reference is the base, the
checkpoint is a PEFT adapter that `peft` loads on the HF model as it is, and a run resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_parity import assert_matches_hf
from rl_batches import random_batch

from rose.cli import main
from rose.contracts.adapter import LoRAConfig
from rose.engine import LLMEngine, SamplingParams
from rose.model import load_model
from rose.model.export import export
from rose.model.lora import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from rose.rl import Objective, Trainer, TrainerConfig
from rose.rl.trainer import STATE_FILE

LORA = LoRAConfig(rank=4, alpha=8)


def _trainer(policy: Path, objective: Objective | None = None, lora: LoRAConfig = LORA) -> Trainer:
    return Trainer(policy, objective, TrainerConfig(lr=1e-2, lora=lora))


def _base(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not n.startswith("lora.")}


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.export_weights(torch.float32)}


def test_only_the_adapter_trains_and_holds_optimizer_state(tiny_qwen3: Path) -> None:
    trainer = _trainer(tiny_qwen3)
    base, adapter = _base(trainer), _adapter(trainer)
    # 7 projections per layer, an A and a B each
    assert len(adapter) == 2 * 7 * trainer.model.config.num_hidden_layers
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in adapter)
    metrics = trainer.step(random_batch())
    assert metrics["updates"] == 1 and metrics["grad_norm"] > 0
    for name, p in _base(trainer).items():
        assert torch.equal(p, base[name]), name
    after = _adapter(trainer)
    assert all(not torch.equal(after[n], t) for n, t in adapter.items() if ".lora_B." in n)
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(adapter)  # AdamW's moments are the adapter's alone
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(t.numel() for t in adapter.values())


def test_the_kl_reference_is_the_base_with_the_adapter_off(tiny_qwen3: Path) -> None:
    trainer = _trainer(tiny_qwen3, Objective.grpo(kl_coef=0.1))
    assert trainer.ref_model is None  # no second copy of the model
    ids = random_batch()[0].flatten()[0].token_ids[None]
    base = load_model(tiny_qwen3)
    trainer.step(random_batch())
    assert trainer.step(random_batch(seed=1))["kl"] > 0  # the adapter moved the policy off the base
    assert trainer.reference is not None
    with torch.no_grad():
        ref = trainer.reference(ids[:, :-1], ids[:, 1:])[0]
        want = base(ids[:, :-1]).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        policy = trainer.policy(ids[:, :-1], ids[:, 1:])[0]
    torch.testing.assert_close(ref, want, rtol=0, atol=1e-5)
    assert not torch.allclose(policy, want, atol=1e-4)


def test_the_checkpoint_is_a_peft_adapter_peft_loads_on_the_hf_model(tiny_qwen3: Path,
                                                                      tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    trainer = _trainer(tiny_qwen3)
    trainer.step(random_batch())
    path = trainer.save(tmp_path / "ckpt")
    assert {CONFIG_FILE, WEIGHTS_FILE, STATE_FILE} <= {f.name for f in path.iterdir()}
    assert not (path / "model.safetensors").exists()  # the adapter alone, not the base again
    config, tensors, base = load_adapter(path)
    assert config == LORA and Path(base) == tiny_qwen3.resolve()
    assert all(torch.equal(t, _adapter(trainer)[n]) for n, t in tensors.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, path).eval()
    ids = random_batch()[1].flatten()[0].token_ids[None]
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer.model(ids), rtol=0, atol=1e-4)
    # The rollout engine on the same adapter, as a run's replicas load it, samples peft's logprobs.
    engine = LLMEngine.from_pretrained(tiny_qwen3, dtype="float32", device="cpu")
    engine.load_adapter("policy", config, tensors.items(), version=1)
    prompt = ids[0, :8].tolist()
    [out] = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            adapter="policy")
    assert out.versions == [1] * 10
    assert_matches_hf(model, prompt, out.token_ids, out.logprobs)


def test_a_lora_run_resumes_as_it_would_have_gone_on(tiny_qwen3: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_qwen3)
    trainer.step(random_batch())
    trainer.save(tmp_path / "ckpt")
    resumed = _trainer(tiny_qwen3)
    resumed.load_state(tmp_path / "ckpt")
    assert (resumed.version, resumed.steps) == (1, 1)
    batch = random_batch(seed=1)
    trainer.step(batch)
    resumed.step(batch)
    for name, t in _adapter(trainer).items():
        torch.testing.assert_close(t, _adapter(resumed)[name])
    with pytest.raises(ValueError, match=r"its adapter is .*rank=4.* model\.lora is .*rank=8"):
        _trainer(tiny_qwen3, lora=LoRAConfig(rank=8)).load_state(tmp_path / "ckpt")
    full = Trainer(tiny_qwen3, config=TrainerConfig(lr=1e-2))
    with pytest.raises(ValueError, match=r"saved with a LoRA adapter; resume with model\.lora set"):
        full.load_state(tmp_path / "ckpt")


@pytest.mark.parametrize(("lora", "message"), [
    (dict(rank=0), r"rank must be an integer >= 1, got 0"),
    (dict(targets=("q_proj", "qkv")), r"targets: 'qkv' names no module of the model"),
    (dict(rank=100_000), r"rank 100000 is larger than the smallest targeted layer's \d+ features"),
])
def test_bad_adapter_settings_are_refused_before_anything_runs(tiny_qwen3: Path, lora: dict,
                                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _trainer(tiny_qwen3, lora=LoRAConfig(**lora))


def test_fsdp_with_an_adapter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sharding fsdp with a LoRA adapter is not supported"):
        TrainerConfig(lora=LORA, sharding="fsdp")


def test_export_merge_folds_the_adapter_into_an_hf_checkpoint(tiny_qwen3: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    trainer = _trainer(tiny_qwen3)
    trainer.step(random_batch())
    path = trainer.save(tmp_path / "ckpt", assets=[tiny_qwen3 / "tokenizer.json"])
    assert main(["export", str(path), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = random_batch()[2].flatten()[0].token_ids[None]
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, trainer.model(ids), rtol=0, atol=1e-4)
    assert main(["export", str(path), "--out", str(tmp_path / "adapter")]) == 0
    assert load_adapter(tmp_path / "adapter")[0] == LORA
    full = Trainer(tiny_qwen3).save(tmp_path / "full")
    with pytest.raises(ValueError, match=r"--merge: .* holds the whole model .*no adapter to merge"):
        export(full, tmp_path / "out", merge=True)
