"""`rose serve` as a real process exits with 0 within its drain's bound on SIGTERM and SIGINT,
whatever state it is in: requests in flight, streams nobody reads, an engine loop stuck in an
iteration. (tests/coserve/test_coserve_operations.py: what the drain lets finish.)"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from rose.model import init_model

# `rose serve`, with every iteration blocked for good once a request is in flight when asked
# (an engine loop that will never answer again).
SERVE = """
import sys, threading
from rose.cli import main
if sys.argv[1] == "stuck":
    from rose.coserve.executor import CoServingExecutor
    step = CoServingExecutor.step
    CoServingExecutor.step = lambda self: (threading.Event().wait() if self.serving.has_unfinished()
                                           else step(self))
raise SystemExit(main(sys.argv[2:]))
"""


DRAIN_S = 2.0  # --shutdown-timeout
# After the drain: the cut's grace, then at most ServerLimits.shutdown_timeout_s (5 s) for the
# engine thread to stop; the rest is start-up slack on a loaded machine.
EXIT_WITHIN_S = DRAIN_S + 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("shutdown") / "tiny", seed=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Serve = Callable[[str], tuple[subprocess.Popen, str]]


@pytest.fixture
def serve(model: Path) -> Iterator[Serve]:
    procs: list[subprocess.Popen] = []

    def start(mode: str) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-c", SERVE, mode, "serve", "--model", str(model),
                                 "--rollout-model", str(model), "--port", str(port), "--no-profile",
                                 "--pool-mb", "8", "--shutdown-timeout", str(DRAIN_S)])
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("rose serve did not start within 60 s")

    yield start
    for proc in procs:  # only what this test started
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exits_within(proc: subprocess.Popen, sig: int, timeout_s: float) -> float:
    """Seconds from `sig` to the process's exit, which is with 0."""
    start = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=timeout_s) == 0
    return time.monotonic() - start


def _hang(url: str, path: str, body: dict) -> None:
    """Send a request and leave it in flight: the socket stays open, its answer unread."""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}{path}", json=body, timeout=1)


def test_sigterm_with_a_stuck_engine_loop(serve: Serve) -> None:
    proc, url = serve("stuck")
    _hang(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4})
    assert DRAIN_S <= _exits_within(proc, signal.SIGTERM, 40) < EXIT_WITHIN_S


def test_sigint_with_streams_nobody_reads(serve: Serve) -> None:
    proc, url = serve("plain")
    long = {"max_tokens": 2000, "ignore_eos": True}
    with contextlib.ExitStack() as stack:
        turn = {"turn_id": "t", "trajectory_id": "j", "token_ids": [1], "params": long}
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True, **long}),
                           ("/v1/lease/turns", turn)):
            r = stack.enter_context(httpx.stream("POST", f"{url}{path}", json=body, timeout=60))
            assert r.status_code == 200
        assert _exits_within(proc, signal.SIGINT, 40) < EXIT_WITHIN_S
