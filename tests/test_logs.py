"""Diagnostic logging (rose.logs): the level from `--log-level` (before or after the command),
each line naming its role, the level handed on to Ray workers."""

from __future__ import annotations

import logging
import os

import pytest

import rose.runtime.driver
from rose import logs
from rose.cli import main


def test_lines_name_their_role_at_the_chosen_level(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    logs.configure("warning", role="serving-0")
    assert os.environ[logs.LEVEL_ENV] == "warning"  # what the run's Ray workers start with
    log = logging.getLogger("rose.runtime.actors")
    log.info("not shown")
    log.warning("shown")
    err = capsys.readouterr().err
    assert "not shown" not in err
    assert "WARNING [serving-0] rose.runtime.actors: shown" in err
    logs.configure(role="dedicated-0")  # an actor: the level it was handed
    log.warning("again")
    assert capsys.readouterr().err.count("again") == 1  # one handler, not one per configure
    with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error"):
        logs.configure("loud")


@pytest.mark.parametrize("argv, shown", [
    (["train", "train.steps=1"], True),
    (["--log-level", "warning", "train", "train.steps=1"], False),
    (["train", "--log-level", "warning", "train.steps=1"], False),
])
def test_log_level_before_or_after_the_command(argv: list[str], shown: bool, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    def stop(*_: object) -> None:  # the driver, stopped before Ray starts
        raise SystemExit(0)

    monkeypatch.setattr(rose.runtime.driver, "train", stop)
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)  # main exports the level: undone after the test
    with pytest.raises(SystemExit):
        main(argv)
    line = "INFO [driver] rose.runtime.cli: rose train: mode rose, 1 steps"
    assert (line in capsys.readouterr().err) is shown
