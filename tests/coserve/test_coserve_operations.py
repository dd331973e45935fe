"""What a serving team runs `rose serve` on: the lease API's key on a non-loopback bind, /health
during a weight push and for a dead or stuck engine loop, the drain on SIGTERM, access logs,
and KV usage per model in /metrics."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save
from servers import running

from rose.cli import main
from rose.contracts import SamplingParams, Turn
from rose.coserve.cli import http_process
from rose.coserve.drain import CUT_GRACE_S
from rose.coserve.executor import CoServingExecutor
from rose.coserve.serve_config import load_serve_config
from rose.coserve.server import build_app, build_lease_app
from rose.coserve.settings import Engine, ExecutorConfig, ServerLimits
from rose.coserve.turn_stream import EngineHost
from rose.engine import LLMEngine
from rose.engine.async_engine import AsyncLLMEngine
from rose.model import init_model, load_tokenizer
from rose.runtime.actors import _HttpReplica, on_loop
from rose.steploop import StepLoop

HEALTH_TIMEOUT_S = 0.5
PACE_S = HEALTH_TIMEOUT_S / 4  # per tensor of a paced weight push: well within the health timeout


# -- the lease API's key ---------------------------------------------------------------------------

@pytest.fixture
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROSE_API_KEY", "ROSE_LEASE_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "203.0.113.7"])
def test_a_public_bind_without_a_lease_key_is_refused(host: str, no_keys: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Refused as the config loads, before any model does (the checkpoint does not exist), in one
    line that names the flags; the OpenAI API's key does not stand in for the lease key."""
    assert main(["serve", "--model", "/nonexistent", "--host", host, "--api-key", "openai-key"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"rose serve: error: config: host {host!r} is not a loopback")
    for named in ("--lease-key", "$ROSE_LEASE_KEY", "--allow-open-lease"):
        assert named in err


def test_a_lease_key_or_the_opt_in_opens_a_public_bind(no_keys: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    public = {"model": "m", "host": "0.0.0.0"}
    assert load_serve_config(flags={**public, "lease_key": "k"}).server_limits().lease_key == "k"
    opened = load_serve_config(flags={**public, "allow_open_lease": True}).server_limits()
    assert opened.lease_key is None and opened.allow_open_lease
    for loopback in ("127.0.0.1", "localhost", "::1"):  # the default's kind needs neither
        assert load_serve_config(flags={"model": "m", "host": loopback}).lease_key is None
    monkeypatch.setenv("ROSE_LEASE_KEY", "from-env")
    assert load_serve_config(flags=public).server_limits().lease_key == "from-env"


def test_a_ray_replica_serves_the_lease_api_off_the_loopback_only_with_a_key() -> None:
    """A run's replicas on a cluster bind their node's address; the run gives them its key."""
    replica = _HttpReplica()
    replica.host = "0.0.0.0"
    with pytest.raises(ValueError, match="--lease-key"):
        replica._serve(FastAPI(), ServerLimits(api_key="openai-key"))


# -- /health: answered on the event loop, from the engine loop's progress -----------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("operations")
    return (init_model("qwen2", "tiny", root / "serving", seed=1),
            init_model("qwen3", "tiny", root / "rollout", seed=2))


def _paced(load: Callable[..., None]) -> Callable[..., None]:
    """`load`, taking each tensor PACE_S after the last: a push that holds the engine thread for
    (tensors x PACE_S), progressing all along."""
    def paced(named: Iterable[tuple[str, torch.Tensor]], *args: object) -> None:
        load(((time.sleep(PACE_S), item)[1] for item in named), *args)

    return paced


def _health_while(url: str, work: concurrent.futures.Future) -> list[int]:
    """/health's answers, every 50 ms, until `work` is done."""
    codes = []
    while not work.done():
        codes.append(httpx.get(f"{url}/health", timeout=5).status_code)
        time.sleep(0.05)
    return codes


def _engine_dead(url: str) -> bool:
    r = httpx.get(f"{url}/health", timeout=5)
    return r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def _eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_health_answers_during_a_weight_push_of_a_whole_model(checkpoints: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    executor = CoServingExecutor.from_pretrained(*checkpoints, ExecutorConfig(pool_mb=8))
    rollout = executor.rollout
    assert rollout is not None
    monkeypatch.setattr(rollout, "load_weights", _paced(rollout.load_weights))
    weights = {name: p.detach().clone() for name, p in rollout.model.named_parameters()}
    assert len(weights) * PACE_S > 4 * HEALTH_TIMEOUT_S
    loop = StepLoop(executor)
    app = build_app(loop, executor, load_tokenizer(checkpoints[0]), "tiny-serving",
                    ServerLimits(health_timeout_s=HEALTH_TIMEOUT_S))
    with running(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        push = pool.submit(httpx.post, f"{url}/v1/lease/weights", params={"version": 1},
                           content=save(weights), timeout=60)
        codes = _health_while(url, push)
        assert push.result().json() == {"policy_version": 1, "tensors": len(weights)}
        assert time.monotonic() - start > 4 * HEALTH_TIMEOUT_S and rollout.policy_version == 1
        assert len(codes) > 10 and set(codes) == {200}

        # A command that never returns is a stuck loop; one that does, a loop that goes on.
        release = threading.Event()
        loop.submit(release.wait)
        assert _eventually(lambda: _engine_dead(url))
        release.set()
        assert _eventually(lambda: httpx.get(f"{url}/health").status_code == 200)

        def die() -> None:
            raise SystemExit  # not an Exception: it ends the loop's thread

        loop.submit(die)
        assert _eventually(lambda: _engine_dead(url))


def test_a_dedicated_worker_s_health_is_the_same(checkpoints: tuple[Path, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_lease_app` over a worker's engine: 200 through a weight sync applied on its loop
    (as `rose.runtime.actors` applies one), 503 once the engine says it can no longer run."""
    engine = AsyncLLMEngine(LLMEngine.from_pretrained(checkpoints[1]))
    weights = {name: p.detach().clone() for name, p in engine.engine.model.named_parameters()}
    apply = on_loop(engine, _paced(engine.engine.load_weights))
    limits = ServerLimits(health_timeout_s=HEALTH_TIMEOUT_S)
    app = build_lease_app(engine, EngineHost(engine.engine, 4), limits)
    with running(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        sync = pool.submit(apply, weights.items(), 3)
        codes = _health_while(url, sync)
        sync.result()
        assert engine.engine.policy_version == 3 and len(codes) > 10 and set(codes) == {200}

        def failed() -> None:
            raise RuntimeError("an iteration failed")

        monkeypatch.setattr(engine.engine, "check_health", failed)
        assert _engine_dead(url)
    engine.shutdown()


# -- the drain on SIGTERM, and access logs: `rose serve` as a process -----------------------------

# `rose serve` with each iteration slowed by `sys.argv[1]` seconds, so that a request is still
# being generated when the test signals.
SLOWED = """
import sys, time
from rose.cli import main
from rose.coserve.cli import http_process
from rose.coserve.drain import CUT_GRACE_S
from rose.coserve.executor import CoServingExecutor
step = CoServingExecutor.step
CoServingExecutor.step = lambda self: (time.sleep(float(sys.argv[1])), step(self))[1]
raise SystemExit(main(sys.argv[2:]))
"""
STEP_S = 0.05
MAX_TOKENS = 60  # about 3 s of decoding at STEP_S
DRAIN_S = 20.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("drain") / "tiny", seed=3)


@contextlib.contextmanager
def _serving(model: Path, log: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rose serve` (iterations slowed by STEP_S) with these flags, its output in `log`."""
    def command(port: int) -> list[str]:
        return [sys.executable, "-c", SLOWED, str(STEP_S), "serve", "--model", str(model), "--rollout-model",
                str(model), "--no-profile", "--pool-mb", "8", "--port", str(port), *flags]

    with log.open("w") as output, http_process(command, "rose serve", 120, log=output) as served:
        yield served


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def test_sigterm_drains_a_streamed_request_and_refuses_new_ones(model: Path, tmp_path: Path) -> None:
    log = tmp_path / "output"
    with _serving(model, log, "--shutdown-timeout", str(DRAIN_S)) as (url, proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with httpx.Client(base_url=url, timeout=10) as kept:  # a keep-alive connection, open at SIGTERM
            assert kept.get("/v1/models").status_code == 200
            stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=MAX_TOKENS,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            chunks = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert _eventually(lambda: _refused(url), 5)  # no new connections
            late = kept.get("/v1/models")  # nor new requests on an open one
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["length"]
        assert proc.wait(timeout=DRAIN_S + 15) == 0
        assert time.monotonic() - signalled < DRAIN_S
    # vLLM's default: a line per request (uvicorn's, on stdout), uvicorn's other lines at warning.
    access = [line for line in log.read_text().splitlines() if '"POST /v1/completions HTTP/1.1" 200' in line]
    assert len(access) == 1, log.read_text()


def _events(lines: Iterator[str]) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in lines
            if line.startswith("data: {")]


def test_what_outlasts_the_drain_is_cut_at_its_bound(model: Path, tmp_path: Path) -> None:
    """A serving request longer than the drain and a rollout turn (which the driver resumes
    elsewhere, from the tokens it was handed back) are aborted when it ends: each stream ends
    with finish_reason "abort". The process still exits with 0. No access log, as asked."""
    log = tmp_path / "output"
    drain_s = 1.0
    long = {"max_tokens": 2000, "ignore_eos": True}
    turn = {"turn_id": "t", "trajectory_id": "j", "token_ids": [1, 2], "params": long}
    flags = ("--shutdown-timeout", str(drain_s), "--disable-uvicorn-access-log")
    with _serving(model, log, *flags) as (url, proc), contextlib.ExitStack() as streams:
        serving = streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x", "stream": True, **long}))
        leased = streams.enter_context(httpx.stream("POST", f"{url}/v1/lease/turns", json=turn, timeout=60))
        lines = [serving.iter_lines(), leased.iter_lines()]
        assert [next(each) for each in lines] and serving.status_code == leased.status_code == 200
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        completion, turn_events = (_events(each) for each in lines)
        cut = time.monotonic() - signalled
        assert proc.wait(timeout=60) == 0
    assert drain_s <= cut < drain_s + CUT_GRACE_S + 1
    assert completion[-1]["choices"][0]["finish_reason"] == "abort"
    assert turn_events[-1]["finish_reason"] == "abort"
    assert sum(len(e["token_ids"]) for e in turn_events) < long["max_tokens"]
    assert '"POST /v1/' not in log.read_text()


# -- KV usage per model ----------------------------------------------------------------------------

def _gauges(executor: CoServingExecutor) -> tuple[float, float]:
    """What /metrics says: (serving's KV usage, the rollouts')."""
    values = {s.name: s.value for f in text_string_to_metric_families(executor.metrics.expose().decode())
              for s in f.samples}
    return values["vllm:kv_cache_usage_perc"], values["rose:rollout_kv_cache_usage_perc"]


def _kv_usage_per_model(executor: CoServingExecutor, serving_usage: Callable[[], float]) -> None:
    """A rollout turn alone: serving's usage stays 0 (the pages are the rollouts'); then a
    serving request: its own usage, `serving_usage()`, as its engine counts it."""
    rollout = executor.rollout
    assert rollout is not None
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    executor.submit_turn(Turn("t", "traj", list(range(1, 100)), params))
    executor.step()
    held = rollout.blocks.num_active_pages
    assert held > 0 and _gauges(executor) == (0.0, held / executor.pool.num_pages)
    executor.add_serving(list(range(1, 80)), params)
    for _ in range(2):
        executor.step()
    serving, rolling = _gauges(executor)
    assert serving > 0 and serving == pytest.approx(serving_usage())
    assert rolling == rollout.blocks.num_active_pages / executor.pool.num_pages


def test_kv_usage_per_model_on_the_native_engine(checkpoints: tuple[Path, Path]) -> None:
    executor = CoServingExecutor.from_pretrained(*checkpoints, ExecutorConfig(pool_mb=8))
    blocks = executor.serving.blocks  # type: ignore[attr-defined]
    # Serving may use the whole shared pool: the burst cut takes the rollouts' pages back for it.
    _kv_usage_per_model(executor, lambda: blocks.num_active_pages / executor.pool.num_pages)


@pytest.mark.vllm
def test_kv_usage_per_model_with_vllm_serving(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this test")
    from vllm_checkpoints import tiny_qwen3_for_vllm

    serving = tiny_qwen3_for_vllm(tmp_path / "serving", seed=11)
    executor = CoServingExecutor.from_pretrained(serving, checkpoints[1], ExecutorConfig(pool_mb=8),
                                                 device="cpu", dtype="float32", engine=Engine.VLLM)
    try:  # serving's usage is vLLM's own count of its KV cache
        _kv_usage_per_model(executor, executor.serving.block_pool.get_usage)  # type: ignore[attr-defined]
    finally:
        del executor
        gc.collect()  # vLLM tears its process-wide state down when the engine is freed
