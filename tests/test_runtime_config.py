"""`rose train`'s configuration: bad input fails before anything starts, naming the key and what
was expected; YAML files and dotted overrides compose."""

from __future__ import annotations

from pathlib import Path

import pytest

from rose.cli import main
from rose.runtime.config import Config, Mode, load_config, resume_checkpoint, validate
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
    (["train.steps=0"], r"train\.steps and train\.checkpoint_every must be >= 1"),
    (["train.data_parallel=0"], r"train\.data_parallel must be >= 1, got 0"),
    (["train.objective=ppo"], r"train\.objective must be grpo or dapo, got 'ppo'"),
    (["train.lr_schedule=linear"], r"train\.lr_schedule must be constant or cosine, got 'linear'"),
    (["train.discount=1.5"], r"train\.discount must be in \[0, 1\], got 1\.5"),
    (["train.step_advantage_weight=-1"], r"train\.step_advantage_weight must be >= 0, got -1"),
    (["env.name=chess"], r"env\.name must be one of .*frozenlake.*got 'chess'"),
    (["model.preset=huge"], r"model\.preset must be one of .*got 'huge'"),
    (["model.path=/nonexistent/ckpt"], r"model\.path /nonexistent/ckpt is not an HF-format checkpoint"),
    (["devices.dedicated=[[0],[999]]"], r"devices\.dedicated uses core\(s\) \[999\], but this machine"),
    (["devices.trainer=[]"], r"devices\.trainer: a device needs at least one core"),
])
def test_bad_config_is_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_missing_config_file_and_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config file .*nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=r"--resume .*: no checkpoint there"):
        resume_checkpoint(tmp_path)


def test_mode_needs_its_devices() -> None:
    config = load_config(None, ["devices.serving=[]"])
    validate(config, Mode.FIXED)  # fixed never borrows
    with pytest.raises(ValueError, match=r"mode rose needs at least one serving device"):
        validate(config, Mode.ROSE)


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
