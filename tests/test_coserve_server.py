"""The HTTP server through the official `openai` client and raw HTTP: completions, chat,
streaming, bad requests, disconnects, the lease API and metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from safetensors.torch import save

from rose.coserve.executor import CoServingExecutor, ExecutorConfig
from rose.coserve.loadgen import build_trace, fit_lengths, replay, summarize
from rose.coserve.server import build_app
from rose.model import Tokenizer, init_model, load_tokenizer, random_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, CoServingExecutor]]:
    root = tmp_path_factory.mktemp("serve")
    serving = init_model("qwen2", "tiny", root / "serving", seed=1)
    rollout = init_model("qwen3", "tiny", root / "rollout", seed=2)
    executor = CoServingExecutor.from_pretrained(serving, rollout, ExecutorConfig(pool_bytes=8 * 1024**2))
    executor.profile()
    app = build_app(executor, load_tokenizer(serving), "tiny-serving")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    yield url, executor
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def client(server: tuple[str, CoServingExecutor]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_openai_client_models_completions_and_chat(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-serving"]
    done = client.completions.create(model="tiny-serving", prompt="Hello", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny-serving", prompt="Hello", max_tokens=6,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    ids = client.completions.create(model="tiny-serving", prompt=[5, 6, 7], max_tokens=3, logprobs=1,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert len(ids.choices[0].logprobs.token_logprobs) == 3
    assert all(lp <= 0 for lp in ids.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(model="tiny-serving", max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    chunks = list(client.chat.completions.create(
        model="tiny-serving", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "Hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    free = client.completions.create(model="tiny-serving", prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[3:5]
    assert stop.strip(), "the seeded model's text has printable characters to stop on"
    cut = client.completions.create(model="tiny-serving", prompt="abc", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.find(stop)]


def test_tokens_of_an_incomplete_character_still_stream(client: openai.OpenAI,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every prefix decodes to text ending in an incomplete UTF-8 character (random models emit
    # runs of byte tokens): the client must still get a chunk per token, not one at the end.
    decode = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, **kw: decode(self, ids, **kw) + "\ufffd")
    done = client.completions.create(model="tiny-serving", prompt="Hello", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model="tiny-serving", prompt="Hello", max_tokens=6,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) == 6
    assert "".join(c.choices[0].text for c in chunks) == done and done.endswith("\ufffd")


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "the model 'nope' does not exist"),
        ({"model": "tiny-serving", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny-serving", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny-serving", "prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"model": "tiny-serving", "prompt": "x", "n": 3}, 400, "n"),
        ({"model": "tiny-serving", "prompt": [1] * 5000}, 400, "the prompt has 5000 tokens"),
        ({"model": "tiny-serving", "prompt": [99999]}, 400, "outside the vocabulary"),
        ({"model": "tiny-serving", "prompt": ""}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(server: tuple[str, CoServingExecutor], body: dict, status: int,
                                        message: str) -> None:
    url = server[0]
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == status
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")
    ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny-serving", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_malformed_json_and_openai_client_errors(server: tuple[str, CoServingExecutor],
                                                 client: openai.OpenAI) -> None:
    r = httpx.post(f"{server[0]}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny-serving", temperature=-2,
                                       messages=[{"role": "user", "content": "x"}])


def test_client_disconnect_mid_stream_aborts(server: tuple[str, CoServingExecutor]) -> None:
    url, executor = server
    body = {"model": "tiny-serving", "prompt": "Hello", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    for _ in range(100):  # the abort lands between two iterations
        if not executor.serving.has_unfinished():
            break
        time.sleep(0.05)
    assert not executor.serving.has_unfinished()
    ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny-serving", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def _turn_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/lease/turns", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_lease_turns_capacity_weights_and_metrics(server: tuple[str, CoServingExecutor],
                                                   tmp_path: Path) -> None:
    url, executor = server
    cap = httpx.get(f"{url}/v1/lease/capacity").json()
    assert cap["free_slots"] > 0 and cap["state"] == "normal" and cap["policy_version"] == 0
    events = _turn_events(url, {"turn_id": "t1", "trajectory_id": "traj", "token_ids": [1, 2, 3],
                                "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert sum(len(e["token_ids"]) for e in events) == 7 and events[-1]["finished"]
    assert all(v == 0 for e in events for v in e["versions"])
    # New rollout weights over HTTP, then turns carry the new version.
    new_policy = random_model(executor.rollout.model.config, seed=9)
    weights = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in new_policy.named_parameters()}
    r = httpx.post(f"{url}/v1/lease/weights", params={"version": 4}, content=save(weights))
    assert r.status_code == 200 and r.json()["policy_version"] == 4
    events = _turn_events(url, {"turn_id": "t2", "trajectory_id": "traj", "token_ids": [1, 2, 3],
                                "max_tokens": 3, "policy_version": 4})
    assert all(v == 4 for e in events for v in e["versions"])
    bad = httpx.post(f"{url}/v1/lease/turns", json={"turn_id": "t3", "trajectory_id": "x",
                                                    "token_ids": [1], "policy_version": 2})
    assert bad.status_code == 400 and "expects policy version 2" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/lease/weights", params={"version": 5}, content=b"junk").status_code == 400
    assert httpx.post(f"{url}/v1/lease/turns/none/abort").status_code == 404
    assert httpx.post(f"{url}/v1/lease/heartbeat").json()["capacity"]["policy_version"] == 4
    assert httpx.post(f"{url}/v1/lease/new_rl_step").json()["state"] == "normal"
    text = httpx.get(f"{url}/metrics").text
    assert "rose_serving_ttft_seconds_bucket" in text and "rose_rollout_tokens_total" in text
    assert 'rose_kv_pool_pages{owner="rollout"}' in text and "rose_executor_state" in text


def test_loadgen_replays_a_real_trace_window(server: tuple[str, CoServingExecutor]) -> None:
    trace = build_trace("azure-conv", duration_s=4.0, load=1.0, start_s=30.0, prompt_scale=0.05,
                        output_scale=0.05)
    assert len(trace) >= 5 and trace.arrival_s[-1] < 4.0
    results = asyncio.run(replay(server[0], trace, max_context=256, max_output=8))
    summary = summarize(results, 4.0, slo_ttft_ms=1e5, slo_tpot_ms=1e5)
    assert summary["errors"] == 0 and summary["completed"] == len(trace)
    assert summary["slo_attainment"] == 1.0 and summary["p99_ttft_ms"] >= summary["p50_ttft_ms"] > 0
    _, outputs = fit_lengths(trace, 256, 8)
    assert [r.output_tokens for r in results] == outputs.tolist()
    assert all(r.tpot_s is None or r.tpot_s > 0 for r in results)
    with pytest.raises(ValueError, match="duration and load must be positive"):
        build_trace("azure-conv", duration_s=0, load=1.0)
