"""Progress bars: drawn only on a terminal, nested as lines of one display, gone on any exit."""

from __future__ import annotations

import pytest

from rose import progress


def test_no_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    with progress.bar("train (rose)", 3) as b:
        b.describe("step 0")
        b.advance()
    assert capsys.readouterr().err == ""


def test_bars_on_a_terminal_nest_and_end(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    with progress.bar("bench train", 2) as outer:
        for mode in ("fixed", "rose"):
            outer.describe(mode)
            with progress.bar(f"train ({mode})", 3) as inner:  # rich allows one display: a line of it
                for _ in range(3):
                    inner.advance()
            outer.advance()
    assert progress._shown is None
    err = capsys.readouterr().err
    assert "bench train: rose" in err and "2/2" in err


def test_an_error_in_the_block_ends_the_display(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    with pytest.raises(RuntimeError, match="step failed"), progress.bar("train (rose)", 3):
        raise RuntimeError("step failed")
    assert progress._shown is None
    with progress.bar("train (rose)", 1) as b:  # and a new one can start
        b.advance()
    assert progress._shown is None
