"""`rose serve`'s settings: a YAML file (`--config`), dotted overrides and the flags hold the same
keys, through the shared loader; every default is the executor's or the server's own. And the
command itself serving a real model (SmolLM2-135M-Instruct) to the official `openai` client."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import openai
import pytest
import torch
import transformers

from rose.cli import main
from rose.coserve import serve_config as serve_config_module
from rose.coserve.cli import add_arguments, serve_config, serve_process
from rose.coserve.serve_config import ServeConfig, load_serve_config
from rose.coserve.settings import Engine, ExecutorConfig, Policy, ServerLimits


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_executor_s_and_the_server_s() -> None:
    config = ServeConfig()
    assert config.executor == ExecutorConfig()
    assert config.server_limits() == ServerLimits()


def test_every_flag_is_a_key() -> None:
    """A flag for each key but the executor's section, and one for each of its settings."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest for a in parser._actions} - {"help", "config", "overrides"}
    assert flags == ({f.name for f in dataclasses.fields(ServeConfig)} - {"executor"}
                     | {f"executor.{f.name}" for f in dataclasses.fields(ExecutorConfig)})
    assert parser.parse_args(["--pool-mb", "64", "--policy", "static"]).__dict__ == {
        "overrides": [], "config": None, "executor.pool_mb": 64.0, "executor.policy": "static"}


def test_flags_override_the_file_and_the_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSE_API_KEY", "from-env")
    monkeypatch.delenv("ROSE_LEASE_KEY", raising=False)
    path = tmp_path / "serve.yaml"
    path.write_text("model: /ckpt/serving\nport: 9000\nlease_key: from-file\n"
                    "executor:\n  slo_ttft_ms: 500\n  pool_mb: 512\n  policy: naive\n  headroom: 0.3\n")
    config = serve_config(_parse(["--config", str(path), "--port", "9100", "executor.slo_tpot_ms=150",
                                  "--no-profile", "--lease-key", "true", "--headroom", "0.25"]))
    assert (config.model, config.port) == ("/ckpt/serving", 9100)
    assert config.no_profile and config.api_key == "from-env" and config.lease_key == "true"
    executor = config.executor
    assert (executor.slo_ttft_ms, executor.slo_tpot_ms) == (500, 150)
    assert (executor.pool_bytes, executor.policy, executor.headroom) == (512 << 20, Policy.NAIVE, 0.25)
    # Flags alone, as before: a flag not given leaves the default.
    assert serve_config(_parse(["--model", "m"])) == ServeConfig(model="m", api_key="from-env")


@pytest.mark.parametrize("overrides, message", [
    ([], r"^config: model: a serving checkpoint is required"),
    (["model=m", "dtype=float16"], r"^config: dtype must be one of float32, bfloat16, got 'float16'"),
    (["model=m", "executor.policy=greedy"], r"^config: executor\.policy: Invalid value 'greedy'"),
    (["model=m", "slo_ttft=5"], r"^config: slo_ttft: Key 'slo_ttft' not in 'ServeConfig'$"),
    # The executor's settings moved into its section: a key of the old place says where.
    (["model=m", "pool_mb=5"], r"^config: pool_mb: Key 'pool_mb' not in 'ServeConfig' \(did you mean "
                               r"executor\.pool_mb\?\)$"),
    (["model=m", "executor.admission_quantile=0"],
     r"^config: executor\.admission_quantile must be in \(0, 1\], got 0\.0$"),
    (["model=m", "port=http"], r"^config: port: Value 'http' of type 'str' could not be converted"),
    (["model=m", "engine=sglang"], r"^config: engine: Invalid value 'sglang'"),
])
def test_bad_settings_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_serve_config(overrides=overrides)


def test_engine_vllm_needs_vllm_installed_and_a_rollout_model(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = ["model=m", "engine=vllm", "rollout_model=r"]
    monkeypatch.setattr(serve_config_module, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"^config: engine: vllm is not installed in this Python"):
        load_serve_config(overrides=vllm)
    monkeypatch.setattr(serve_config_module, "find_spec", lambda name: object())
    with pytest.raises(ValueError, match=r"^config: engine: vllm serves beside a rollout model"):
        load_serve_config(overrides=vllm[:2])
    assert load_serve_config(overrides=vllm).engine is Engine.VLLM
    flags = _parse(["--model", "m", "--engine", "vllm", "--rollout-model", "r"])
    assert serve_config(flags).engine is Engine.VLLM
    assert load_serve_config(overrides=["model=m"]).engine is Engine.NATIVE


def test_the_command_refuses_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nonexistent", "--slo-ttft-ms", "0"]) == 2
    assert "config: executor.slo_ttft_ms must be positive, got 0.0" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "config: model: a serving checkpoint is required" in capsys.readouterr().err


def test_serves_smollm2_chat_as_transformers_answers(
        smollm2: Path, smollm2_hf: transformers.PreTrainedModel,
        smollm2_hf_tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """`rose serve --model DIR` on the imported SmolLM2: the chat rendered with the model's own
    template (as many prompt tokens as HF's `apply_chat_template` gives) and answered greedily
    as transformers answers on the same weights."""
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    conversation = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": "Hi! Can you explain what a hash table is?"},
                    {"role": "assistant", "content": "A hash table maps keys to values."},
                    {"role": "user", "content": "And what happens when two keys collide?"}]

    def hf_ids(chat: list[dict[str, str]]) -> list[int]:
        text = smollm2_hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return smollm2_hf_tokenizer.encode(text, add_special_tokens=False)

    prompt = hf_ids(question)
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    expected = smollm2_hf_tokenizer.decode(ref, skip_special_tokens=True)
    assert "Paris" in expected
    with serve_process(["--model", str(smollm2), "--no-profile", "--threads", "1", "--pool-mb", "64"],
                       startup_s=120) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        answer = client.chat.completions.create(model=model, messages=question, max_tokens=16, temperature=0)
        other = client.chat.completions.create(model=model, messages=conversation, max_tokens=1,
                                               temperature=0)
    assert model == smollm2.name
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "stop"  # at <|im_end|>, the template's end of turn
    assert answer.usage.prompt_tokens == len(prompt)
    assert other.usage.prompt_tokens == len(hf_ids(conversation))
