"""A `rose serve` process started on its own (a serving team's replica), attached to `rose train`
by URL and lease key: the run's turns run there and its weights reach it, and the server keeps
serving, its rollout turns ended, after the job is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rose.coserve.cli import serve_process
from rose.model import init_model
from rose.runtime.loggers import METRICS_FILE

pytest.importorskip("ray")


def _gauge(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in {url}/metrics")


@pytest.mark.slow
def test_an_attached_server_takes_turns_and_weights_and_outlives_the_job(tmp_path: Path) -> None:
    policy = init_model("qwen3", "tiny", tmp_path / "policy", seed=0)  # also the server's rollout model
    serving = init_model("qwen2", "tiny", tmp_path / "serving", seed=1)
    lease_key, api_key = "the-serving-team-lease-key", "the-serving-team-api-key"
    metrics, err = tmp_path / "run" / METRICS_FILE, tmp_path / "stderr.txt"
    with serve_process(["--model", str(serving), "--rollout-model", str(policy), "--threads", "1",
                        "--pool-mb", "64", "--lease-key", lease_key, "--api-key", api_key]) as (url, server):
        with err.open("w") as stderr:  # its own session: the kill takes the driver and its Ray
            run = subprocess.Popen(
                [sys.executable, "-m", "rose.cli", "train", "--mode", "rose", f"model.path={policy}",
                 f"serving.endpoints=[{url}]", f"serving.endpoint_key={lease_key}", "devices.serving=[]",
                 "train.steps=100", "rollout.groups=2", "rollout.group_size=2",
                 "rollout.dedicated_concurrency=1",  # the dedicated worker full: turns spill there
                 f"train.out_dir={tmp_path / 'run'}"],
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        try:
            deadline, steps = time.monotonic() + 300, []
            while len(steps) < 2 and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
                lines = metrics.read_text().splitlines() if metrics.is_file() else []
                steps = [json.loads(line) for line in lines]
            assert len(steps) >= 2, err.read_text()[-3000:]
            capacity = httpx.post(f"{url}/v1/lease/heartbeat",
                                  headers={"Authorization": f"Bearer {lease_key}"}).json()["capacity"]
        finally:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        assert sum(s["serving_turns"] for s in steps) > 0  # the run's turns ran on the attached server
        assert capacity["policy_version"] >= 2  # and each step's weights reached it
        # Killed, the job leaves the server serving, its rollout turns ended.
        deadline = time.monotonic() + 60
        while _gauge(url, "rose:rollout_turns_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _gauge(url, "rose:rollout_turns_running") == 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key)
        reply = client.chat.completions.create(model="serving", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.choices[0].finish_reason in ("length", "stop") and server.poll() is None
