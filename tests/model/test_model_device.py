"""Device and dtype settings: defaults, and one clear error wherever a model would run on a
device that is not there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rose.cli import main
from rose.coserve.executor import CoServingExecutor
from rose.model.device import resolve_device, resolve_dtype
from rose.rl import TrainerConfig
from rose.runtime.config import load_config

NO_CUDA = r"device 'cuda': no CUDA device is available here .*name cpu instead"


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_defaults() -> None:
    assert resolve_device(None) == torch.device("cpu")  # the suite's default (conftest), as without CUDA
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    assert resolve_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize(("device", "error"), [
    ("cuda", NO_CUDA),
    ("cuda:1", r"device 'cuda:1': no CUDA device is available"),
    ("gpu", r"device 'gpu' is not a device; expected cpu, cuda or cuda:N"),
    ("meta", r"device 'meta': ROSE runs on cpu or cuda, not meta"),
])
def test_a_device_that_cannot_be_used_is_named(no_cuda: None, device: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        resolve_device(device)


def test_a_dtype_outside_the_choices_is_named() -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, got 'float16'"):
        resolve_dtype("float16", torch.device("cpu"))


@pytest.mark.parametrize("make", [
    lambda: TrainerConfig(device="cuda"),
    lambda: CoServingExecutor.from_pretrained("unread", device="cuda"),
    lambda: load_config(None, ["train.device=cuda"]),
    lambda: load_config(None, ["rollout.device=cuda"]),
    lambda: load_config(None, ["serving.device=cuda"]),
], ids=["trainer", "executor", "train.device", "rollout.device", "serving.device"])
def test_every_config_refuses_cuda_without_it(no_cuda: None, make: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match=NO_CUDA):
        make()


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"],
    ["serve"],
    ["bench", "engine", "--quick"],
])
def test_every_command_refuses_cuda_without_it(no_cuda: None, tiny_qwen3: Path, command: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--model", str(tiny_qwen3), "--device", "cuda"]) == 2
    assert "device 'cuda': no CUDA device is available here" in capsys.readouterr().err
