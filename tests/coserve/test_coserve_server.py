"""The HTTP server through the official `openai` client and raw HTTP: completions, chat,
streaming, bad requests, disconnects, the lease API and metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save
from servers import running

from rose.contracts import Turn
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_client import LeaseClient
from rose.coserve.loadgen import build_trace, fit_lengths, replay, summarize
from rose.coserve.server import build_app
from rose.coserve.settings import ExecutorConfig, ServerLimits
from rose.engine import SamplingParams
from rose.model import Tokenizer, init_model, load_tokenizer, random_model
from rose.steploop import StepLoop


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    return (init_model("qwen2", "tiny", root / "serving", seed=1),
            init_model("qwen3", "tiny", root / "rollout", seed=2))


def executor_of(checkpoints: tuple[Path, Path], **config: Any) -> CoServingExecutor:
    return CoServingExecutor.from_pretrained(*checkpoints, ExecutorConfig(pool_mb=8, **config))


def app_of(executor: CoServingExecutor, checkpoints: tuple[Path, Path],
           limits: ServerLimits | None = None) -> FastAPI:
    return build_app(StepLoop(executor), executor, load_tokenizer(checkpoints[0]), "tiny-serving", limits)


@pytest.fixture(scope="module")
def server(checkpoints: tuple[Path, Path]) -> Iterator[tuple[str, CoServingExecutor]]:
    executor = executor_of(checkpoints)
    executor.profile()
    with running(app_of(executor, checkpoints)) as url:
        yield url, executor


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
    # Before min_tokens no stop string is looked for (vLLM's rule).
    late = client.completions.create(model="tiny-serving", prompt="abc", max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 12})
    assert late.choices[0].finish_reason == "length" and late.choices[0].text == free


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
    # The text before it is sent; an incomplete character at the end never is (vLLM's rule).
    assert "".join(c.choices[0].text for c in chunks) == done and done and "\ufffd" not in done


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "the model 'nope' does not exist"),
        ({"model": "tiny-serving", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny-serving", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny-serving", "prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"model": "tiny-serving", "prompt": "x", "n": 17}, 400, "n"),
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
                                "params": {"max_tokens": 7, "temperature": 0, "ignore_eos": True}})
    assert sum(len(e["token_ids"]) for e in events) == 7 and events[-1]["finish_reason"] == "length"
    assert all(e["finish_reason"] is None for e in events[:-1])
    assert all(v == 0 for e in events for v in e["versions"])
    # New rollout weights over HTTP, then turns carry the new version.
    new_policy = random_model(executor.rollout.model.config, seed=9)
    weights = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in new_policy.named_parameters()}
    r = httpx.post(f"{url}/v1/lease/weights", params={"version": 4}, content=save(weights))
    assert r.status_code == 200 and r.json()["policy_version"] == 4
    events = _turn_events(url, {"turn_id": "t2", "trajectory_id": "traj", "token_ids": [1, 2, 3],
                                "params": {"max_tokens": 3}, "policy_version": 4})
    assert all(v == 4 for e in events for v in e["versions"])
    # A turn that may run on an older version runs on this one (an asynchronous run's trajectory
    # goes on with newer weights); one that needs a newer version is refused.
    events = _turn_events(url, {"turn_id": "t3", "trajectory_id": "traj", "token_ids": [1, 2, 3],
                                "params": {"max_tokens": 3}, "policy_version": 2})
    assert all(v == 4 for e in events for v in e["versions"])
    bad = httpx.post(f"{url}/v1/lease/turns", json={"turn_id": "t4", "trajectory_id": "x",
                                                    "token_ids": [1], "policy_version": 5})
    assert bad.status_code == 400 and "expects policy version 5 or later" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/lease/weights", params={"version": 5}, content=b"junk").status_code == 400
    assert httpx.post(f"{url}/v1/lease/turns/none/abort").status_code == 404
    assert httpx.post(f"{url}/v1/lease/heartbeat").json()["capacity"]["policy_version"] == 4
    assert httpx.post(f"{url}/v1/lease/new_rl_step").json()["state"] == "normal"
    samples = scrape(url)
    assert samples[("rose:rollout_tokens_total", ())] >= 10
    assert samples[("rose:rollout_turns_finished_total", (("finished_reason", "length"),))] >= 2
    assert ("rose:kv_pool_pages", (("owner", "rollout"),)) in samples and ("rose:burst_state", ()) in samples


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics: sample (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in f.samples}


def test_metrics_carry_vllm_names_with_the_model_label(server: tuple[str, CoServingExecutor]) -> None:
    url, _ = server
    before = scrape(url)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-serving", "prompt": [5, 6, 7],
                                                  "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    after = scrape(url)
    model = (("model_name", "tiny-serving"),)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("vllm:prompt_tokens_total") == 3 and grew("vllm:generation_tokens_total") == 4
    assert grew("vllm:request_success_total", (("finished_reason", "length"), *model)) == 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                      "vllm:e2e_request_latency_seconds"):
        assert grew(f"{histogram}_count") == 1
        assert (f"{histogram}_bucket", (("le", "+Inf"), *model)) in after
    assert after[("vllm:num_requests_running", model)] == after[("vllm:num_requests_waiting", model)] == 0
    assert 0 <= after[("vllm:kv_cache_usage_perc", model)] <= 1


DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "rose-dashboard.json"


def test_the_grafana_dashboard_queries_only_what_the_server_exports(
        server: tuple[str, CoServingExecutor]) -> None:
    url, _ = server
    httpx.post(f"{url}/v1/completions", json={"model": "tiny-serving", "prompt": [5], "max_tokens": 2})
    exported = {name for name, _ in scrape(url)}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queried = {name for p in panels for t in p["targets"]
               for name in re.findall(r"\b(?:vllm|rose):[A-Za-z0-9_:]+", t["expr"])}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_waiting", "rose:burst_state",
            "rose:admission_slack_seconds"} <= queried
    assert queried <= exported, queried - exported


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


# -- bad input, limits, keys and faults ---------------------------------------------------------


def _still_serving(url: str, headers: dict[str, str] | None = None) -> None:
    """A normal completion still completes and /health says ok (a short timeout: a dead
    engine loop makes both hang)."""
    ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny-serving", "prompt": "x", "max_tokens": 2},
                    headers=headers, timeout=30)
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}


TURN = {"trajectory_id": "traj", "token_ids": [1, 2, 3], "params": {"max_tokens": 2}}


def _leased(turn_id: str, **params: object) -> dict:
    """A turn with these sampling parameters."""
    return {**TURN, "turn_id": turn_id, "params": params}


COMPLETION = {"model": "tiny-serving", "prompt": "x", "max_tokens": 2}
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Found by fuzzing on main: this top_k overflowed in the sampler and killed the engine thread.
        ("/v1/lease/turns", _leased("k", top_k=1661748626853370527744), "params.top_k"),
        ("/v1/lease/turns", _leased("s", seed=2**64), "params.seed"),
        ("/v1/lease/turns", _leased("s", seed=-(2**63) - 1), "params.seed"),
        ("/v1/lease/turns", _leased("m", max_tokens=2**70), "params.max_tokens"),
        ("/v1/lease/turns", {**TURN, "turn_id": "v", "policy_version": -5}, "policy_version"),
        ("/v1/lease/turns", {**TURN, "turn_id": "v", "policy_version": 2**63}, "policy_version"),
        ("/v1/lease/turns", {**TURN, "turn_id": "i", "token_ids": [1, 2**40]}, "token_ids"),
        ("/v1/lease/turns", {**TURN, "turn_id": "i", "token_ids": [-1]}, "token_ids"),
        ("/v1/lease/turns", _leased("e", stop_token_ids=[2**70]), "params.stop_token_ids"),
        ("/v1/lease/turns", {**TURN, "turn_id": "e", "extra": 1}, "extra"),
        ("/v1/lease/turns", _leased("b", logit_bias=[[5, 101.0]]), "params.logit_bias"),
        ("/v1/lease/turns", _leased("b", logit_bias=[[-1, 1.0]]), "params.logit_bias"),
        ("/v1/lease/turns", _leased("r", repetition_penalty=0.0), "params.repetition_penalty"),
        ("/v1/lease/turns", _leased("p", min_p=float("nan")), "params.min_p"),
        ("/v1/lease/turns", _leased("l", top_logprobs=21), "params.top_logprobs"),
        ("/v1/completions", {**COMPLETION, "top_k": 2**31}, "top_k"),
        ("/v1/completions", {**COMPLETION, "temperature": float("nan")}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": float("inf")}, "top_p"),
        ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed"),
        ("/v1/completions", {**COMPLETION, "prompt": [3, 2**63]}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny-serving", "messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 2**64}, "max_completion_tokens"),
    ],
)
def test_out_of_range_numbers_are_refused_at_the_edge(server: tuple[str, CoServingExecutor], path: str,
                                                      body: dict, param: str) -> None:
    url = server[0]
    # json.dumps writes NaN and Infinity, which Python's JSON parser (and the server's) reads.
    r = httpx.post(f"{url}{path}", content=json.dumps(body), timeout=30, headers=JSON)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # A leased turn's sampling field is named by its path (params.top_k), its param the first part.
    assert error["param"] == param.split(".")[0] and error["message"].startswith(param), error
    _still_serving(url)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"stop": ""}, "stop", "at least 1 character"),
        ({"stop": ["a", ""]}, "stop", "at least 1 character"),
        ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16 items"),
        ({"logit_bias": {"x": 10}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"-1": 10}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}, "structured_outputs",
         "does not implement structured_outputs.disable_any_whitespace"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "does not implement"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"best_of": 3}, "best_of", "does not implement"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"suffix": "tail"}, "suffix", "does not implement suffix"),
        # Valid JSON, not valid Unicode: on main the tokenizer raised and the server answered 500.
        ({"prompt": "x\ud800"}, "prompt", "unable to parse raw data as a unicode string"),
        ({"stop": ["\udfff"]}, "stop", "unable to parse raw data as a unicode string"),
    ],
)
def test_unimplemented_parameters_are_refused_by_name(server: tuple[str, CoServingExecutor], extra: dict,
                                                      param: str, message: str) -> None:
    # json.dumps escapes lone surrogates (\\ud800), as a client's JSON encoder may.
    r = httpx.post(f"{server[0]}/v1/completions", content=json.dumps({**COMPLETION, **extra}), headers=JSON)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_a_text_too_long_for_any_tokenization_is_refused_before_encoding(
        server: tuple[str, CoServingExecutor]) -> None:
    # 840,000 characters (under the 4 MB body cap): main tokenized them all (a second of the event
    # loop and ~100 MB of the server's memory) before the engine refused the request.
    messages = [{"role": "user", "content": "hi you " * 120_000}]
    r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=30,
                   json={"model": "tiny-serving", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "characters cannot fit in the" in r.json()["error"]["message"]
    _still_serving(server[0])


def test_neutral_values_of_unimplemented_parameters_pass(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny-serving", prompt="x", max_tokens=2, n=1, presence_penalty=0,
                                     frequency_penalty=0, logit_bias={}, best_of=1, user="u", stop=["zz"],
                                     extra_body={"response_format": {"type": "text"}})
    assert done.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny-serving", max_tokens=2, top_logprobs=3,
                                       messages=[{"role": "user", "content": "x"}])


def test_every_client_error_has_the_openai_shape(server: tuple[str, CoServingExecutor]) -> None:
    url = server[0]
    replies = [httpx.get(f"{url}/v1/nowhere"), httpx.get(f"{url}/v1/completions"),
               httpx.post(f"{url}/v1/completions", content=b"[1,", headers=JSON),
               httpx.post(f"{url}/v1/completions", json=["not", "an", "object"]),
               httpx.post(f"{url}/v1/lease/weights", params={"version": "x"}, content=b"")]
    assert [r.status_code for r in replies] == [404, 405, 400, 400, 400]
    for r in replies:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert replies[1].headers["allow"] == "POST"


@pytest.fixture(scope="module")
def guarded(checkpoints: tuple[Path, Path]) -> Iterator[tuple[str, CoServingExecutor]]:
    """A server with both keys and small caps: one turn slot, one waiting request per model,
    a 1 s queue deadline, one running sequence per engine (so that a second one waits), and
    iterations slowed to 10 ms so that a long request is still running when a test looks."""
    executor = executor_of(checkpoints, max_rollout_turns=1, max_num_seqs=1)
    step = executor.step
    executor.step = lambda: (time.sleep(0.01), step())[1]
    limits = ServerLimits(api_key="api-secret", lease_key="lease-secret", max_body_bytes=4096,
                          max_weights_bytes=64 * 1024, max_waiting_per_model=1, queue_timeout_s=1.0)
    with running(app_of(executor, checkpoints, limits)) as url:
        yield url, executor


API = {"Authorization": "Bearer api-secret"}
LEASE = {"Authorization": "Bearer lease-secret"}


def test_keys_guard_the_openai_and_lease_apis(guarded: tuple[str, CoServingExecutor]) -> None:
    url, _ = guarded
    for headers in ({}, {"Authorization": "Bearer wrong"}, LEASE, {"Authorization": "api-secret"}):
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
    for headers in ({}, API):
        assert httpx.get(f"{url}/v1/lease/capacity", headers=headers).status_code == 401
        assert httpx.post(f"{url}/v1/lease/weights", params={"version": 9}, content=b"x",
                          headers=headers).status_code == 401
    assert httpx.get(f"{url}/v1/lease/capacity", headers=LEASE).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    _still_serving(url, API)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="api-secret", max_retries=0)
    assert [m.id for m in keyed.models.list().data] == ["tiny-serving"]

    async def lease() -> None:
        client = LeaseClient(url, key="lease-secret")
        try:
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            done = await client.run_turn(Turn("keyed", "traj", [1, 2], params))
            assert len(done.token_ids) == 3
            assert (await client.heartbeat()).free_slots == 1
        finally:
            await client.close()

    asyncio.run(lease())


def test_the_trace_replay_presents_its_key(checkpoints: tuple[Path, Path]) -> None:
    """`rose loadgen`'s replay (and `rose train`'s serving devices') with the server's key; on a
    server of default caps, so that overlapping requests of the trace are not refused as over
    `guarded`'s one-request queue."""
    executor = executor_of(checkpoints)
    with running(app_of(executor, checkpoints, ServerLimits(api_key="api-secret"))) as url:
        trace = build_trace("azure-conv", duration_s=2.0, load=1.0, start_s=30.0, prompt_scale=0.05,
                            output_scale=0.05)
        served = asyncio.run(replay(url, trace, max_context=256, max_output=4, api_key="api-secret"))
        assert all(r.status == 200 and r.error is None for r in served) and served
        refused = asyncio.run(replay(url, trace, max_context=256, max_output=4, model="tiny-serving",
                                     api_key="wrong"))
        assert all(r.status == 401 for r in refused) and refused
        with pytest.raises(ValueError, match=r"HTTP 401.*needs --api-key"):
            asyncio.run(replay(url, trace, max_context=256, max_output=4))


def test_body_caps_from_content_length_and_while_streaming(guarded: tuple[str, CoServingExecutor]) -> None:
    url, _ = guarded
    big = {**COMPLETION, "prompt": "y" * 5000}
    r = httpx.post(f"{url}/v1/completions", json=big, headers=API)
    assert r.status_code == 413 and "at most 4096 bytes" in r.json()["error"]["message"]
    # No Content-Length: the body comes chunked and is cut once past the cap.
    chunks = (json.dumps(big)[i:i + 1000].encode() for i in range(0, 6000, 1000))
    r = httpx.post(f"{url}/v1/completions", content=chunks, headers={**API, **JSON})
    assert r.status_code == 413 and "streamed" in r.json()["error"]["message"]
    # The weights take their own, larger cap.
    r = httpx.post(f"{url}/v1/lease/weights", params={"version": 1}, content=b"z" * 10_000, headers=LEASE)
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/lease/weights", params={"version": 1}, content=b"z" * 70_000, headers=LEASE)
    assert r.status_code == 413
    _still_serving(url, API)


def test_weight_versions_only_move_forward(server: tuple[str, CoServingExecutor]) -> None:
    url, executor = server
    weights = save({n: p.detach().contiguous() for n, p in executor.rollout.model.named_parameters()})
    current = httpx.get(f"{url}/v1/lease/capacity").json()["policy_version"]
    assert httpx.post(f"{url}/v1/lease/weights", params={"version": current + 1},
                      content=weights).status_code == 200
    for version in (current, 0):
        r = httpx.post(f"{url}/v1/lease/weights", params={"version": version}, content=weights)
        assert r.status_code == 409 and "only move forward" in r.json()["error"]["message"], r.text
    # The same version again is a re-sync, not a step back.
    assert httpx.post(f"{url}/v1/lease/weights", params={"version": current + 1},
                      content=weights).status_code == 200
    r = httpx.post(f"{url}/v1/lease/weights", params={"version": -5}, content=weights)
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"
    assert httpx.get(f"{url}/v1/lease/capacity").json()["policy_version"] == current + 1


def _wait(condition: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_the_lease_api_cannot_abort_serving_requests(guarded: tuple[str, CoServingExecutor]) -> None:
    url, executor = guarded
    body = {**COMPLETION, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=API) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        (rid,) = executor.serving._seqs  # the serving request's engine id
        assert httpx.post(f"{url}/v1/lease/turns/{rid}/abort", headers=LEASE).status_code == 404
        assert executor.serving.has_request(rid)
        assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"]
    assert _wait(lambda: not executor.has_unfinished())


def test_the_lease_api_aborts_a_running_turn(guarded: tuple[str, CoServingExecutor]) -> None:
    """The abort answers with the turn's last event, which also ends the turn's stream (the
    route used to abort the turn, then fail with a 500 before ending the stream)."""
    url, executor = guarded
    body = {**TURN, "turn_id": "stopped", "params": {"max_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/v1/lease/turns", json=body, headers=LEASE) as r:
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
        assert next(events)["finish_reason"] is None
        aborted = httpx.post(f"{url}/v1/lease/turns/stopped/abort", headers=LEASE)
        assert aborted.status_code == 200, aborted.text
        assert aborted.json()["finish_reason"] == "abort" and aborted.json()["token_ids"] == []
        # The stream's last event ends it with the abort, after the tokens made since the event
        # before it (a turn's stream gathers them: TURN_CHUNK_S).
        last = list(events)[-1]
        assert last["finish_reason"] == "abort" and len(last["versions"]) == len(last["token_ids"])
    assert _wait(lambda: not executor.has_unfinished())


def test_lease_slots_are_enforced(guarded: tuple[str, CoServingExecutor]) -> None:
    url, executor = guarded
    body = {**TURN, "turn_id": "long", "params": {"max_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/v1/lease/turns", json=body, headers=LEASE) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the turn
        assert r.status_code == 200 and next(lines).startswith("data: ")
        full = httpx.post(f"{url}/v1/lease/turns", json={**TURN, "turn_id": "more"}, headers=LEASE)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "lease_slots_full"
    assert _wait(lambda: not executor.has_unfinished())


def test_waiting_queues_are_bounded_and_have_a_deadline(guarded: tuple[str, CoServingExecutor]) -> None:
    url, executor = guarded
    # One running sequence per engine: a streaming request holds it, so the next one waits.
    long = {**COMPLETION, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=API) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=COMPLETION, headers=API,
                                  timeout=30)
            assert _wait(lambda: len(executor.serving._seqs) == 2)
            refused = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=API)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "max_waiting_per_model 1" in refused.json()["error"]["message"]
            late = waiting.result()
        assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
        assert _wait(lambda: len(executor.serving._seqs) == 1)  # the late one was aborted
    assert _wait(lambda: not executor.has_unfinished() and executor.serving.blocks.num_active_pages == 0)


def test_a_non_streaming_client_that_leaves_has_its_request_aborted(
        guarded: tuple[str, CoServingExecutor]) -> None:
    url, executor = guarded
    body = json.dumps({**COMPLETION, "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer api-secret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert _wait(lambda: executor.serving.has_unfinished())
        time.sleep(0.3)
    # 2,000 tokens at 10 ms an iteration would take 20 s.
    assert _wait(lambda: not executor.serving.has_unfinished(), timeout_s=10)
    assert _wait(lambda: executor.serving.blocks.num_active_pages == 0)
    _still_serving(url, API)


class _Stuck:
    """An executor step that blocks until released: an engine loop that no longer answers."""

    def __init__(self, executor: CoServingExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        step = executor.step
        monkeypatch.setattr(executor, "step", lambda: (self.release.wait(), step())[1])


def test_health_and_heartbeat_report_a_stuck_engine_loop(checkpoints: tuple[Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    executor = executor_of(checkpoints)
    stuck = _Stuck(executor, monkeypatch)
    limits = ServerLimits(health_timeout_s=0.5)
    with running(app_of(executor, checkpoints, limits)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            hung = pool.submit(httpx.post, f"{url}/v1/completions", json=COMPLETION, timeout=60)
            assert _wait(lambda: executor.has_unfinished())
            time.sleep(limits.health_timeout_s)  # stuck: no progress for that long
            for r in (httpx.get(f"{url}/health", timeout=10),
                      httpx.post(f"{url}/v1/lease/heartbeat", timeout=10)):
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            stuck.release.set()
            assert hung.result().status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


def test_shutdown_is_bounded_with_a_stuck_engine_loop(checkpoints: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    executor = executor_of(checkpoints)
    stuck = _Stuck(executor, monkeypatch)
    limits = ServerLimits(shutdown_timeout_s=1.0)
    start = 0.0
    try:
        with running(app_of(executor, checkpoints, limits)) as url:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=1)
            start = time.monotonic()
        assert time.monotonic() - start < 20  # graceful 2 s, then at most 1 s for the engine thread
    finally:
        stuck.release.set()


def test_a_serving_request_interrupts_rollouts_from_its_first_byte_until_queued(
        guarded: tuple[str, CoServingExecutor]) -> None:
    """`serving_arrived` (what a rose rollout iteration is given up for) holds from the moment an
    authorized serving request starts to arrive until the engine has it, whatever becomes of it:
    queued, refused or abandoned by its client. Unauthorized requests never count."""
    url, executor = guarded
    arrived = executor.serving_arrived
    assert not arrived()
    start = b'{"model": "tiny-serving", '

    def post(rest: bytes, sent: threading.Event, go: threading.Event) -> int:
        def body() -> Iterator[bytes]:
            yield start
            sent.set()
            go.wait(30)
            yield rest

        with httpx.stream("POST", f"{url}/v1/completions", content=body(), headers={**API, **JSON},
                          timeout=30) as r:
            if r.status_code == 200:
                assert next(r.iter_lines()).startswith("data: ")
                assert _wait(lambda: not arrived())  # queued, and still generating
                assert executor.serving.has_unfinished()
            return r.status_code

    good = b'"prompt": "Hello", "max_tokens": 400, "ignore_eos": true, "stream": true}'
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for rest, status in ((good, 200), (b'"prompt": ', 400)):
            sent, go = threading.Event(), threading.Event()
            done = pool.submit(post, rest, sent, go)
            assert sent.wait(30) and _wait(arrived)
            go.set()
            assert done.result(timeout=60) == status
            assert _wait(lambda: not arrived())
    address = httpx.URL(url)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n")
    with socket.create_connection((address.host, address.port)) as s:  # answered before its body
        s.sendall(head + b"Authorization: Bearer wrong\r\n\r\n" + start)
        assert s.recv(64).startswith(b"HTTP/1.1 401") and not arrived()
    with socket.create_connection((address.host, address.port)) as s:  # leaves half-way through
        s.sendall(head + b"Authorization: Bearer api-secret\r\n\r\n" + start)
        assert _wait(arrived)
    assert _wait(lambda: not arrived())
    assert _wait(lambda: not executor.has_unfinished())
    _still_serving(url, API)


# -- the fuller OpenAI API: as vLLM answers it --------------------------------------------------

def test_text_parts_developer_role_tokenize_detokenize_version(server: tuple[str, CoServingExecutor],
                                                                client: openai.OpenAI) -> None:
    url = server[0]
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    chats = [client.chat.completions.create(model="tiny-serving", max_tokens=4, temperature=0, messages=m)
             for m in (parts, plain)]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
    assert chats[0].usage.prompt_tokens == chats[1].usage.prompt_tokens
    rendered = httpx.post(f"{url}/tokenize", json={"model": "tiny-serving", "messages": parts}).json()
    assert rendered["count"] == chats[0].usage.prompt_tokens == len(rendered["tokens"])
    text = httpx.post(f"{url}/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>developer\nBe brief.<|im_end|>") and "Hi\nthere" in text
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert "".join(ids["token_strs"]) == "Hello world" and ids["max_model_len"] > 0
    assert httpx.post(f"{url}/tokenize", json={}).status_code == 400
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{url}/version").json()["version"]
    with pytest.raises(openai.BadRequestError, match="content"):
        client.chat.completions.create(model="tiny-serving", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def _first_token(url: str, text: str) -> tuple[int, str]:
    """The first token of `text`: its id and its text."""
    reply = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    return reply["tokens"][0], reply["token_strs"][0]


def _completion_ids(client: openai.OpenAI, prompt: list[int], **kw: Any) -> list[list[str]]:
    """Each choice's tokens (as text), greedily unless told: logit biases of 100 make the random
    model's own logits (far below 1) matter only between tokens of equal bias."""
    kw.setdefault("temperature", 0)
    done = client.completions.create(model="tiny-serving", prompt=prompt, logprobs=0,
                                     extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw)
    return [c.logprobs.tokens for c in done.choices]


def test_penalties_bias_and_min_tokens_act_as_vllm_s(server: tuple[str, CoServingExecutor],
                                                     client: openai.OpenAI) -> None:
    url = server[0]
    (a, sa), (b, sb), (c, _) = (_first_token(url, w) for w in ("Hello", " world", " fox"))
    assert len({a, b, c}) == 3
    bias = {str(a): 100, str(b): 99}
    prompt = [c, c]
    assert _completion_ids(client, prompt, max_tokens=4, logit_bias=bias) == [[sa] * 4]
    # Presence: once seen, `a` falls to 98 < 99; `b` too, then `a` leads again for good.
    assert _completion_ids(client, prompt, max_tokens=4, logit_bias=bias, presence_penalty=2) == \
        [[sa, sb, sa, sa]]
    # Frequency: each occurrence costs 2 more, so they alternate.
    assert _completion_ids(client, prompt, max_tokens=4, logit_bias=bias, frequency_penalty=2) == \
        [[sa, sb, sa, sb]]
    # Repetition counts the prompt: `a` in it divides 100 by 1.1 (90.9 < 99).
    assert _completion_ids(client, [a], max_tokens=2, logit_bias=bias,
                           extra_body={"repetition_penalty": 1.1}) == [[sb, sa]]
    # min_tokens: the stop token (here the likeliest) cannot come before 3 tokens.
    stopped = client.completions.create(model="tiny-serving", prompt=prompt, max_tokens=8, temperature=0,
                                        logit_bias={str(a): 100}, logprobs=0, extra_body={
                                            "stop_token_ids": [a], "min_tokens": 3, "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 4
    assert stopped.choices[0].logprobs.tokens[3] == sa != stopped.choices[0].logprobs.tokens[2]
    # Clamped to 100, as vLLM does: 1e9 ties with 100 and the model's own logit decides.
    assert _completion_ids(client, prompt, max_tokens=1, logit_bias={str(a): 1e9, str(b): 100}) == \
        _completion_ids(client, prompt, max_tokens=1, logit_bias={str(a): 100, str(b): 100})
    # min_p of 1 keeps the likeliest token alone: sampling then draws what greedy picks.
    greedy = _completion_ids(client, prompt, max_tokens=3)
    assert _completion_ids(client, prompt, max_tokens=3, temperature=1.5, seed=1,
                           extra_body={"min_p": 1.0}) == greedy
    for body, message in (({"logit_bias": {"99999": 1}}, "logit_bias token id 99999 is outside the vocab"),
                          ({"min_tokens": 5}, "min_tokens must be <= max_tokens")):
        r = httpx.post(f"{url}/v1/completions", json={**COMPLETION, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_top_logprobs_are_the_raw_likeliest(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny-serving", max_tokens=4, temperature=1.0, seed=3,
                                          logprobs=True, top_logprobs=5, frequency_penalty=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    for entry in chat.choices[0].logprobs.content:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True) and sum(math.exp(v) for v in top) <= 1
        # Raw (unpenalized) logprobs: the sampled token's is at most the likeliest one's.
        assert entry.logprob <= top[0] + 1e-6
    done = client.completions.create(model="tiny-serving", prompt="Hello", max_tokens=3, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob == max(top.values()) and len(top) == 2  # greedy: the top one


def test_n_choices_each_seeded_as_vllm_seeds_them(server: tuple[str, CoServingExecutor],
                                                  client: openai.OpenAI) -> None:
    blocks = server[1].serving.blocks
    prompt = [5 + i % 40 for i in range(3 * blocks.block_size + 1)]  # no other test's prompt
    hits = blocks.hit_tokens
    many = client.completions.create(model="tiny-serving", prompt=prompt, max_tokens=2, n=4)
    assert len(many.choices) == 4
    assert blocks.hit_tokens - hits == 3 * 3 * blocks.block_size  # the 3 others reuse its 3 full blocks
    kw: dict[str, Any] = {"model": "tiny-serving", "prompt": "Hello", "max_tokens": 6, "temperature": 1.0,
                          "extra_body": {"ignore_eos": True}}
    three = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 18
    singles = [client.completions.create(seed=11 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in three.choices] == singles and len(set(singles)) > 1
    chunks = list(client.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True},
                                            **kw))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts == singles and chunks[-1].usage.completion_tokens == 18
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]
    chat = client.chat.completions.create(model="tiny-serving", max_tokens=3, n=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert [c.index for c in chat.choices] == [0, 1]
