"""The sandboxed Python runner: good programs, failing ones, and ones that try to get out."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from rose.tools.sandbox import CALCULATOR_TOOL, PYTHON_TOOL, SandboxLimits, run_python, run_tool

FAST = SandboxLimits(timeout_s=2.0)


def test_a_good_program_and_the_calculator() -> None:
    result = run_python("x = sum(range(10))\nprint('sum', x)\nx * 2", FAST)
    assert result.ok and result.stdout == "sum 45\n90\n" and result.observation() == "sum 45\n90"
    assert run_tool("calculator", {"expression": "(3 + 4) ** 2 / 7 + math.sqrt(16)"}, FAST) == "11.0"
    assert run_tool("python", {"code": "print('hi')"}, FAST) == "hi"
    assert {t["function"]["name"] for t in (CALCULATOR_TOOL, PYTHON_TOOL)} == {"calculator", "python"}


def test_errors_are_observations() -> None:
    syntax = run_python("def f(:", FAST)
    assert not syntax.ok and syntax.observation().startswith("error: SyntaxError")
    assert run_python("1 / 0", FAST).observation() == "error: ZeroDivisionError: division by zero"
    assert run_tool("calculator", {"expr": "1"}, FAST).startswith("error: calculator needs")
    assert run_tool("shell", {}, FAST).startswith("error: unknown tool 'shell'")
    assert "longer than" in run_python("1" * 70_000, FAST).stderr


def test_an_endless_loop_times_out_within_the_limit() -> None:
    start = time.monotonic()
    result = run_python("while True: pass", SandboxLimits(timeout_s=1.0))
    assert result.timed_out and result.killed and not result.ok
    assert time.monotonic() - start < 3.0
    assert result.observation() == "error: timed out"


def test_a_memory_bomb_is_stopped() -> None:
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)
    assert not result.ok and "allocated" not in result.stdout
    assert "MemoryError" in result.observation() or result.killed


def test_an_output_flood_is_truncated() -> None:
    result = run_python("while True: print('a' * 1000)", SandboxLimits(timeout_s=5.0, max_output_bytes=4096))
    assert result.truncated and result.killed and len(result.stdout) <= 4096
    assert result.observation().endswith("(output truncated)")


@pytest.mark.parametrize("program", [
    "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')",
    "import subprocess\nsubprocess.run(['true'])",
    "import os\nos.system('true')",
    "import ctypes",
])
def test_the_network_and_other_processes_are_refused(program: str) -> None:
    result = run_python(program, FAST)
    assert not result.ok and "PermissionError: sandbox:" in result.observation(), result


@pytest.mark.parametrize("program", [
    "open('{path}', 'w').write('x')",
    "open('{path}', 'a')",
    "import os\nos.open('{path}', os.O_WRONLY | os.O_CREAT)",
    "import pathlib\npathlib.Path('{path}').write_text('x')",
    "import os\nos.mkdir('{path}')",
    "import os\nos.remove('{path}')",
    "import os\nos.mkfifo('{path}')",  # no audit event: removed from os and posix
    "import posix\nposix.mknod('{path}')",
    "from multiprocessing import shared_memory\nshared_memory.SharedMemory(create=True, size=8)",
])
def test_file_system_writes_are_refused(tmp_path: Path, program: str) -> None:
    target = tmp_path / "x"
    result = run_python(program.format(path=target), FAST)
    seen = result.observation()
    assert not result.ok and ("PermissionError: sandbox:" in seen or "has no attribute" in seen), result
    assert not target.exists()


def test_reading_is_allowed_and_the_working_directory_is_empty() -> None:
    assert run_python("import os\nos.listdir('.')", FAST).observation() == "[]"
    assert run_python("import math\nmath.pi", FAST).observation().startswith("3.14")


def test_limits_hold_and_runs_from_threads_are_independent() -> None:
    limits = SandboxLimits(timeout_s=2.0, memory_bytes=300 * 1024**2)
    program = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"
    assert "ValueError" in run_python(program, limits).observation()  # a hard limit cannot be raised
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"{i} * 2", limits).observation(), range(8)))
    assert results == [str(i * 2) for i in range(8)]
