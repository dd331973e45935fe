"""The `rose` command (rose.cli): `--version`, and every `rose` command README.md shows, each
parsed by the command's own parser and run as written (paths under /tmp/ moved to a test
directory, the server's port to a free one)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rose.cli import parser_for

README = Path(__file__).parents[1] / "README.md"
ROSE = [sys.executable, "-m", "rose.cli"]
# Seconds each at most on a 2-core CPU; the others (a pretrained model, a benchmark, a 30 s trace
# replay) run in the slow test.
CHEAP = ("--version", "init-model --arch", "generate --model /tmp/x ")
PLACEHOLDER_INPUT = "import-gguf model.gguf"  # needs a GGUF file of the reader's own


def readme_commands() -> list[str]:
    """The `rose` command lines of README.md's shell blocks, continuations joined, comments cut
    (the leading `.venv/bin/` is dropped: the test runs this interpreter's rose)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    words = [shlex.split(line, comments=True) for line in lines]
    return [shlex.join(w[1:]) for w in words if w and w[0] in ("rose", ".venv/bin/rose")]


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser_for(["--version"]).parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"rose {importlib.metadata.version('rose-rl')}"


def test_every_readme_command_parses() -> None:
    commands = readme_commands()
    assert len(commands) >= 10 and any(c.startswith("loadgen ") for c in commands)
    for command in commands:
        argv = shlex.split(command)
        if argv == ["--version"]:
            continue  # parsing it exits (the test above)
        parser_for(argv).parse_args(argv)  # an unknown command or option exits: the test fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"rose serve did not come up at {url} (exit code {server.poll()})")


def run_as_written(commands: list[str], tmp: Path) -> None:
    """Each command in order, to exit code 0; `serve` stays up in the background for the rest."""
    port = _free_port()
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for command in commands:
            argv = [*ROSE, *shlex.split(re.sub(r"\b8000\b", str(port), command.replace("/tmp/", f"{tmp}/")))]
            if command.startswith("serve "):
                servers.append(subprocess.Popen(argv))
                _wait_healthy(f"http://127.0.0.1:{port}", servers[-1])
                continue
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"rose {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)


def test_the_cheap_readme_commands_run(tmp_path: Path) -> None:
    cheap = [c for c in readme_commands() if c.startswith(CHEAP)]
    assert len(cheap) >= 4
    run_as_written(cheap, tmp_path)


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path: Path) -> None:
    run_as_written([c for c in readme_commands() if not c.startswith(PLACEHOLDER_INPUT)], tmp_path)
