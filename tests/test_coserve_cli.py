"""`rose serve`'s settings: a YAML file (`--config`), dotted overrides and the flags hold the same
keys, through the shared loader; every default is the executor's or the server's own."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from rose.cli import main
from rose.coserve.cli import add_arguments, serve_config
from rose.coserve.executor import ExecutorConfig, Policy
from rose.coserve.serve_config import ServeConfig, load_serve_config
from rose.coserve.server import ServerLimits


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_executor_s_and_the_server_s() -> None:
    config = ServeConfig()
    assert config.executor_config() == ExecutorConfig()
    assert config.server_limits() == ServerLimits()


def test_every_flag_is_a_key() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest for a in parser._actions} - {"help", "config", "overrides"}
    assert flags == {f.name for f in dataclasses.fields(ServeConfig)}


def test_flags_override_the_file_and_the_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSE_API_KEY", "from-env")
    monkeypatch.delenv("ROSE_LEASE_KEY", raising=False)
    path = tmp_path / "serve.yaml"
    path.write_text("model: /ckpt/serving\nport: 9000\nslo_ttft_ms: 500\npool_mb: 512\npolicy: naive\n"
                    "lease_key: from-file\n")
    config = serve_config(_parse(["--config", str(path), "--port", "9100", "slo_tpot_ms=150",
                                  "--no-profile", "--lease-key", "true"]))
    assert (config.model, config.port) == ("/ckpt/serving", 9100)
    assert (config.slo_ttft_ms, config.slo_tpot_ms) == (500, 150)
    assert config.no_profile and config.api_key == "from-env" and config.lease_key == "true"
    executor = config.executor_config()
    assert (executor.pool_bytes, executor.policy, executor.headroom) == (512 << 20, Policy.NAIVE, 0.2)
    # Flags alone, as before: a flag not given leaves the default.
    assert serve_config(_parse(["--model", "m"])) == ServeConfig(model="m", api_key="from-env")


@pytest.mark.parametrize("overrides, message", [
    ([], r"^config: model: a serving checkpoint is required"),
    (["model=m", "dtype=float16"], r"^config: dtype must be one of float32, bfloat16, got 'float16'"),
    (["model=m", "policy=greedy"], r"^config: policy must be one of rose, naive, static, got 'greedy'"),
    (["model=m", "slo_ttft=5"], r"^config: slo_ttft: Key 'slo_ttft' not in 'ServeConfig'"),
    (["model=m", "port=http"], r"^config: port: Value 'http' of type 'str' could not be converted"),
])
def test_bad_settings_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_serve_config(overrides=overrides)


def test_the_command_refuses_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nonexistent", "--slo-ttft-ms", "0"]) == 2
    assert "SLOs must be positive" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "config: model: a serving checkpoint is required" in capsys.readouterr().err
