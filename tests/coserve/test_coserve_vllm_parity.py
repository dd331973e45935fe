"""`rose serve --engine vllm` answers as vLLM's own OpenAI server does: both run here on one
checkpoint (so one tokenizer and chat template), and the same requests, through the official
`openai` client, must give the same text, token logprobs, top logprobs, streamed chunks, finish
reasons and usage.

vLLM is not in the default venv: `make test-vllm` runs this file from `.venv-vllm`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this file")
import openai  # vLLM's dependency
from vllm_checkpoints import tiny_qwen3_for_vllm

from rose.contracts import SamplingParams, StructuredKind, StructuredOutput
from rose.coserve.cli import http_process, serve_process
from rose.engine import LLMEngine
from rose.model import load_tokenizer, preset_config, random_model, save_model

pytestmark = pytest.mark.vllm

MODEL = "serving"
MAX_MODEL_LEN = 1024
# Both run vLLM's fp32 CPU kernels on one batch of one request: the same arithmetic, so the same
# logprobs up to float32 rounding (a logprob of about -3 is held to ~3e-7; 1e-4 leaves room for
# a different kernel order, and is still far below the gaps between top tokens, ~1e-2 here).
LOGPROB_TOL = 1e-4
# Fields that name or date one response, and differ by construction.
UNIQUE = {"id", "created", "system_fingerprint"}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi there, what is 2+2?"}]


# The tokenizer's ChatML, with Qwen3's switch: `enable_thinking: false` (a request's
# chat_template_kwargs) opens the reply with an empty thought. Both servers take it as --chat-template.
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


def vllm_server(model: Path, startup_s: float = 300.0, *flags: str
                ) -> contextlib.AbstractContextManager[tuple[str, Any]]:
    """vLLM's own OpenAI server on a free local port, on the CPU with a small KV cache, the
    engine settings `rose serve --engine vllm` gives vLLM (fp32, eager, seed 0), and `flags`;
    stopped on exit."""
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-model-len", str(MAX_MODEL_LEN),
                "--kv-cache-memory-bytes", str(64 << 20), *flags]
    return http_process(command, "vLLM's server", startup_s, dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("parity")
    serving = tiny_qwen3_for_vllm(root / "serving", seed=11)
    save_model(random_model(preset_config("qwen3", "tiny", head_dim=8), seed=3), root / "rollout")
    (root / "template.jinja").write_text(TEMPLATE)
    return serving, root / "rollout"


@pytest.fixture(scope="module")
def clients(checkpoints: tuple[Path, Path]) -> Iterator[tuple[Any, Any]]:
    """(vLLM's server, `rose serve --engine vllm`), each behind an `openai.OpenAI` client; one at
    a time would double the wait, both at once share the two cores only while starting."""
    serving, rollout = checkpoints
    template = ["--chat-template", str(serving.parent / "template.jinja")]
    argv = ["--engine", "vllm", "--model", str(serving), "--rollout-model", str(rollout),
            "--served-model-name", MODEL, "--device", "cpu", "--no-profile", "--pool-mb", "4", *template]
    with vllm_server(serving, 300.0, *template) as (vllm_url, _), \
            serve_process(argv, startup_s=300) as (rose_url, _):
        yield (openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="-", max_retries=0),
               openai.OpenAI(base_url=f"{rose_url}/v1", api_key="-", max_retries=0))


def _plain(value: Any) -> Any:
    """A response as JSON, less the fields that differ by construction and those left unset
    (None: vLLM's extensions, such as `stop_reason` and `token_ids`, that ROSE does not send)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in UNIQUE and v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _logprobs_of(value: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every logprob in a response, by where it is."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, float) and ("logprob" in k or "top_logprobs" in path):
                yield f"{path}.{k}", v
            else:
                yield from _logprobs_of(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _logprobs_of(v, f"{path}[{i}]")


def _without_logprobs(value: Any, path: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _without_logprobs(v, f"{path}.{k}") for k, v in value.items()
                if not (isinstance(v, float) and ("logprob" in k or "top_logprobs" in path))}
    if isinstance(value, list):
        return [_without_logprobs(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def assert_same(vllm: Any, rose: Any) -> None:
    """The same answer: every field equal, logprobs within LOGPROB_TOL (the same tokens at the
    same places: the paths must match)."""
    vllm, rose = _plain(vllm), _plain(rose)
    assert _without_logprobs(rose) == _without_logprobs(vllm)
    expected, got = dict(_logprobs_of(vllm)), dict(_logprobs_of(rose))
    assert got.keys() == expected.keys()
    for path, value in expected.items():
        assert got[path] == pytest.approx(value, abs=LOGPROB_TOL), path


def _folded(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream as one answer: its choices' text and logprobs concatenated, the last finish and
    stop reasons, chat's opening role, the usage chunk. How tokens group into chunks is timing:
    vLLM's server sends in one chunk what its engine produced while the last was being sent."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            into = choices.setdefault(c["index"], {"text": "", "logprobs": {}})
            delta = c.get("delta")
            if delta and delta.get("role"):
                into.setdefault("role", delta["role"])
            into["text"] += (delta.get("content") or "") if delta is not None else c["text"]
            for key, values in (c.get("logprobs") or {}).items():
                into["logprobs"].setdefault(key, []).extend(values or [])
            for key in ("finish_reason", "stop_reason"):
                if c.get(key) is not None:
                    into[key] = c[key]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage,
            "objects": sorted({chunk["object"] for chunk in chunks})}


def _both(clients: tuple[Any, Any], chat: bool, **request: Any) -> tuple[Any, Any]:
    """The request's answer from each server, as JSON (a stream: its chunks)."""
    def ask(client: Any) -> Any:
        api = client.chat.completions if chat else client.completions
        answer = api.create(model=MODEL, **request)
        if request.get("stream"):
            return [chunk.model_dump() for chunk in answer]
        return answer.model_dump()

    return ask(clients[0]), ask(clients[1])


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


GREEDY = dict(temperature=0, seed=1234)
IDS = [5, 17, 200, 31, 9, 402, 77, 12, 90, 3]


# The first runs to max_tokens; the second's greedy path samples the end-of-sequence token.
@pytest.mark.parametrize(("prompt", "finish", "tokens"), [
    ("hello world, the", "length", 12), (IDS, "stop", 11)], ids=["text-to-length", "token-ids-to-eos"])
def test_a_greedy_completion_is_vllms_with_its_logprobs(clients: tuple[Any, Any], prompt: str | list[int],
                                                       finish: str, tokens: int) -> None:
    vllm, rose = _both(clients, False, prompt=prompt, max_tokens=12, logprobs=3, **GREEDY)
    assert vllm["choices"][0]["finish_reason"] == finish
    assert len(vllm["choices"][0]["logprobs"]["tokens"]) == vllm["usage"]["completion_tokens"] == tokens
    assert_same(vllm, rose)


def test_a_greedy_chat_completion_is_vllms_with_its_top_logprobs(clients: tuple[Any, Any]) -> None:
    vllm, rose = _both(clients, True, messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=3, **GREEDY)
    assert len(vllm["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    assert vllm["usage"]["prompt_tokens"] > 10  # the template's rendering, counted alike
    assert_same(vllm, rose)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_greedy_stream_is_vllms(clients: tuple[Any, Any], chat: bool) -> None:
    request: dict[str, Any] = dict(max_tokens=8, stream=True, stream_options={"include_usage": True},
                                   **GREEDY)
    if chat:
        request.update(messages=CHAT, logprobs=True, top_logprobs=2)
    else:
        request.update(prompt="hello world, the", logprobs=2)
    vllm, rose = _both(clients, chat, **request)
    assert vllm[-1]["usage"]["completion_tokens"] == 8 and vllm[-1]["choices"] == []
    assert rose[-1]["choices"] == []
    assert_same(_folded(vllm), _folded(rose))
    # ROSE sends a chunk per engine iteration: one per token here (after chat's role chunk).
    assert len(rose) == 8 + 1 + chat
    whole = _both(clients, chat, **{k: v for k, v in request.items()
                                    if k not in ("stream", "stream_options")})
    streamed = "".join(c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"]
                       for c in rose if c["choices"])
    assert streamed == _text(whole[0]) == _text(whole[1])


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stop_string_ends_both_alike(clients: tuple[Any, Any], chat: bool) -> None:
    request: dict[str, Any] = dict(max_tokens=16, **GREEDY)
    request.update(messages=CHAT) if chat else request.update(prompt=IDS)
    text = _text(_both(clients, chat, **request)[0])
    stop = text[len(text) // 2:len(text) // 2 + 2]  # from the middle of what vLLM generates
    assert stop.strip(), f"no stop string to take from {text!r}"
    for stream in (False, True):
        vllm, rose = _both(clients, chat, stop=[stop], stream=stream,
                           stream_options={"include_usage": True} if stream else None, **request)
        if not stream:
            assert vllm["choices"][0]["finish_reason"] == "stop"
            assert stop not in _text(vllm) and len(_text(vllm)) < len(text)
            assert vllm["usage"]["completion_tokens"] < 16 and vllm["choices"][0]["stop_reason"] == stop
            assert_same(vllm, rose)
        else:
            assert_same(_folded(vllm), _folded(rose))


def test_a_stop_token_id_ends_both_alike(clients: tuple[Any, Any]) -> None:
    request: dict[str, Any] = dict(prompt="hello world, the", max_tokens=12, logprobs=0, **GREEDY)
    tokens = _both(clients, False, **request)[0]["choices"][0]["logprobs"]["tokens"]
    # A generated token whose text is one token (the tokenizer's), not the first.
    vllm_url = str(clients[0].base_url).removesuffix("/v1/")
    for i, text in enumerate(tokens[1:], 1):
        ids = httpx.post(f"{vllm_url}/tokenize", json={"model": MODEL, "prompt": text,
                                                      "add_special_tokens": False}).json()["tokens"]
        if text and len(ids) == 1 and text not in tokens[:i]:
            break
    else:
        pytest.fail(f"no generated token to stop at in {tokens}")
    vllm, rose = _both(clients, False, extra_body={"stop_token_ids": ids}, **{**request, "logprobs": 1})
    assert vllm["choices"][0]["finish_reason"] == "stop" and vllm["usage"]["completion_tokens"] == i + 1
    assert vllm["choices"][0]["stop_reason"] == ids[0]
    assert_same(vllm, rose)


def test_a_seeded_sample_at_temperature_one_is_vllms(clients: tuple[Any, Any]) -> None:
    """The same seed draws the same tokens: both hand it to vLLM's sampler, per request."""
    for seed in (1, 2):
        vllm, rose = _both(clients, False, prompt="hello world, the", max_tokens=12, temperature=1.0,
                           seed=seed, logprobs=1)
        assert_same(vllm, rose)


def test_n_seeded_samples_are_vllms(clients: tuple[Any, Any]) -> None:
    """`n` samples of one seed: sample i draws with seed + i on both."""
    vllm, rose = _both(clients, False, prompt="hello world, the", max_tokens=8, temperature=1.0, seed=7, n=2,
                       logprobs=0)
    assert vllm["choices"][0]["text"] != vllm["choices"][1]["text"]
    assert_same(vllm, rose)


# vLLM's extensions to OpenAI's API, which the `openai` client sends as `extra_body`.
EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "min_tokens"}
SAMPLED = dict(prompt="hello world, the", max_tokens=12, logprobs=2, temperature=1.0, seed=3)
PENALISED = {**SAMPLED, "temperature": 0}  # greedy repeats itself here: what penalties change
# Each field vLLM's server takes that shapes the draw, at a value that changes this model's answer
# to the request beside it (checked, or the comparison would show nothing).
SHAPED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "temperature": (SAMPLED, dict(temperature=0.7)),
    "top-p": (SAMPLED, dict(top_p=0.8)),
    "top-k": (SAMPLED, dict(top_k=3)),
    "min-p": (SAMPLED, dict(min_p=0.3)),
    "presence-penalty": (PENALISED, dict(presence_penalty=1.0)),
    "frequency-penalty": (PENALISED, dict(frequency_penalty=1.0)),
    "repetition-penalty": (PENALISED, dict(repetition_penalty=1.2)),
    "logit-bias": (SAMPLED, dict(logit_bias={"42": 6.0})),
    # the greedy path samples the end-of-sequence token at its 11th
    "min-tokens": ({**PENALISED, "prompt": IDS, "max_tokens": 16}, dict(min_tokens=14)),
}
# Every field at once, seeded.
ALL = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
           repetition_penalty=1.1, logit_bias={"42": 3.0}, min_tokens=4, seed=3)


def _body(request: dict[str, Any]) -> dict[str, Any]:
    """The request as the `openai` client takes it: vLLM's extensions in `extra_body`."""
    body = {k: v for k, v in request.items() if k not in EXTENSIONS}
    extra = {k: v for k, v in request.items() if k in EXTENSIONS}
    return {**body, "extra_body": extra} if extra else body


def _tokens(answer: dict[str, Any]) -> list[Any]:
    return [(c["text"], c["logprobs"]["tokens"]) for c in answer["choices"]]


@pytest.mark.parametrize(("base", "shaping"), SHAPED.values(), ids=list(SHAPED))
def test_shaped_sampling_is_vllms(clients: tuple[Any, Any], base: dict[str, Any],
                                  shaping: dict[str, Any]) -> None:
    """vLLM's sampler shapes the draw on both (each field handed to it as its server hands it),
    and both return raw logprobs, vLLM's default."""
    unshaped = _both(clients, False, **_body(base))[0]
    vllm, rose = _both(clients, False, **_body({**base, **shaping}))
    assert _tokens(vllm) != _tokens(unshaped)
    assert_same(vllm, rose)


def test_every_shaping_field_at_once_is_vllms(clients: tuple[Any, Any]) -> None:
    """Completion and chat, whole and streamed, and `n` samples (sample i seeded seed + i)."""
    completion = dict(prompt="hello world, the", max_tokens=12, logprobs=3, **ALL)
    chat = dict(messages=CHAT, max_tokens=12, logprobs=True, top_logprobs=3, **ALL)
    vllm, rose = _both(clients, False, **_body(completion))
    assert _tokens(vllm) != _tokens(_both(clients, False, **_body({**completion, "seed": 4}))[0])
    assert_same(vllm, rose)
    assert_same(*_both(clients, True, **_body(chat)))
    assert_same(*_both(clients, False, **_body({**completion, "n": 3})))
    for is_chat, request in ((False, completion), (True, chat)):
        vllm, rose = _both(clients, is_chat, stream=True, stream_options={"include_usage": True},
                           **_body(request))
        assert_same(_folded(vllm), _folded(rose))


@pytest.mark.parametrize("request_", [dict(temperature=2.5), dict(logit_bias={"100000": 1.0}),
                                      dict(max_tokens=4, min_tokens=5)],
                         ids=["temperature-above-2", "bias-outside-the-vocabulary", "min-tokens-above-max"])
def test_what_vllm_refuses_both_refuse(clients: tuple[Any, Any], request_: dict[str, Any]) -> None:
    for client in clients:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, **_body({"prompt": "hello", "seed": 3, **request_}))


# -- what vLLM's clients send beyond OpenAI's core: the same answer from both -------------------

def test_the_checkpoints_other_end_of_sequence_id_is_the_stop_reason_on_both(
        clients: tuple[Any, Any], checkpoints: tuple[Path, Path]) -> None:
    """The checkpoint ends sequences at two ids (generation_config.json); vLLM names the one that
    is not the tokenizer's end-of-sequence token as the reply's stop reason."""
    tok = load_tokenizer(checkpoints[0])
    (other,) = [t for t in tok.stop_token_ids if t != tok.eos_token_id]
    for chat in (False, True):
        request: dict[str, Any] = dict(max_tokens=4, logit_bias={str(other): 100.0}, **GREEDY)
        request.update(messages=CHAT) if chat else request.update(prompt="hello world, the")
        vllm, rose = _both(clients, chat, **request)
        assert vllm["choices"][0]["stop_reason"] == other and vllm["usage"]["completion_tokens"] == 1
        assert_same(vllm, rose)


def test_unknown_fields_are_ignored_by_both(clients: tuple[Any, Any]) -> None:
    unknown = {"metadata": {"team": "search"}, "store": False, "service_tier": "auto"}
    plain = _both(clients, False, prompt="hello world, the", max_tokens=6, **GREEDY)
    vllm, rose = _both(clients, False, prompt="hello world, the", max_tokens=6, extra_body=unknown, **GREEDY)
    assert_same(plain[0], vllm)
    assert_same(vllm, rose)
    assert_same(*_both(clients, True, messages=CHAT, max_tokens=6, extra_body=unknown, **GREEDY))


def test_chat_template_kwargs_reach_both_templates(clients: tuple[Any, Any]) -> None:
    plain = _both(clients, True, messages=CHAT, max_tokens=8, **GREEDY)[0]
    vllm, rose = _both(clients, True, messages=CHAT, max_tokens=8,
                       extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY)
    assert vllm["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the empty thought
    assert_same(vllm, rose)


def test_a_continued_message_and_chat_echo_are_vllms(clients: tuple[Any, Any]) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Four, and"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    vllm, rose = _both(clients, True, messages=messages, max_tokens=8, extra_body=extra, **GREEDY)
    assert _text(vllm).startswith("Four, and")
    # A difference on purpose: vLLM's chat echo also scores the prompt (`prompt_logprobs`, unasked
    # for); ROSE computes no prompt logprobs.
    assert vllm.pop("prompt_logprobs") and "prompt_logprobs" not in rose
    assert_same(vllm, rose)
    assert_same(*(_folded(answer) for answer in _both(
        clients, True, messages=messages, max_tokens=8, extra_body=extra, stream=True, **GREEDY)))


def test_special_tokens_are_skipped_or_kept_alike(clients: tuple[Any, Any]) -> None:
    think = httpx.post(f"{str(clients[0].base_url).removesuffix('/v1/')}/tokenize", json={
        "model": MODEL, "prompt": "<think>", "add_special_tokens": False}).json()["tokens"]
    assert len(think) == 1
    forced = dict(prompt="hello world, the", max_tokens=4, logit_bias={str(think[0]): 50.0}, **GREEDY)
    for skip in (True, False):
        vllm, rose = _both(clients, False, extra_body={"skip_special_tokens": skip}, **forced)
        assert ("<think>" in _text(vllm)) != skip
        assert_same(vllm, rose)


def test_echo_is_vllms(clients: tuple[Any, Any]) -> None:
    for prompt in ("hello world, the", IDS):
        vllm, rose = _both(clients, False, prompt=prompt, max_tokens=6, echo=True, **GREEDY)
        assert_same(vllm, rose)
        streamed = _both(clients, False, prompt=prompt, max_tokens=6, echo=True, stream=True, **GREEDY)
        assert_same(*(_folded(answer) for answer in streamed))


def test_a_list_of_prompts_is_vllms(clients: tuple[Any, Any]) -> None:
    """Prompt i's sample j is choice i * n + j on both; sample j is seeded seed + j."""
    request = dict(max_tokens=6, n=2, temperature=1.0, seed=5, logprobs=1)
    for prompts in (["hello world, the", "hi there"], [IDS, IDS[:4]]):
        vllm, rose = _both(clients, False, prompt=prompts, **request)
        assert [c["index"] for c in vllm["choices"]] == [0, 1, 2, 3]
        assert_same(vllm, rose)


def test_the_stop_string_kept_is_vllms(clients: tuple[Any, Any]) -> None:
    request: dict[str, Any] = dict(prompt=IDS, max_tokens=16, **GREEDY)
    text = _text(_both(clients, False, **request)[0])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    kept = {"include_stop_str_in_output": True}
    vllm, rose = _both(clients, False, stop=[stop], extra_body=kept, **request)
    assert _text(vllm).endswith(stop)
    assert_same(vllm, rose)


# Tool calling. The template renders the tools (their names and the call's format) for both
# alike; `rose serve`'s auto parser reads it as Hermes, and vLLM's server is told so.
TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\\nCall one of:{% for t in tools %} {{ t.function.name }}"
                 "{% endfor %}, as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n"
                 "{% endif %}") + TEMPLATE
FLIP = {"type": "function", "function": {"name": "flip", "parameters": {
    "type": "object", "properties": {"side": {"enum": ["heads", "tails"]}}, "required": ["side"],
    "additionalProperties": False}}}


@pytest.fixture
def tool_clients(checkpoints: tuple[Path, Path]) -> Iterator[tuple[Any, Any]]:
    """`clients`, the servers started for tool calls: vLLM's with its auto tool choice and Hermes
    parser. A difference on purpose: vLLM 0.32 holds a Hermes call forced by `tool_choice` to
    its `<tool_call>` envelope (xgrammar's structural tags, the arguments free unless the tool
    is `strict`); ROSE holds the reply to the function's JSON schema, as vLLM does for parsers
    without structural tags and with VLLM_ENFORCE_STRICT_TOOL_CALLING=0, which vLLM gets here."""
    serving, rollout = checkpoints
    path = serving.parent / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    argv = ["--engine", "vllm", "--model", str(serving), "--rollout-model", str(rollout),
            "--served-model-name", MODEL, "--device", "cpu", "--no-profile", "--pool-mb", "4",
            "--chat-template", str(path)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
        with vllm_server(serving, 300.0, "--chat-template", str(path), "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes") as (vllm_url, _), \
                serve_process(argv, startup_s=300) as (rose_url, _):
            yield (openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="-", max_retries=0),
                   openai.OpenAI(base_url=f"{rose_url}/v1", api_key="-", max_retries=0))


def _calls_folded(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's tool calls: each one's first delta (its id left out: ids are random on both)
    and its arguments joined, and how many of its deltas carried an id (one)."""
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        for c in chunk["choices"]:
            for call in (c.get("delta") or {}).get("tool_calls") or []:
                if call["index"] == len(calls):
                    calls.append({"type": call["type"], "name": call["function"]["name"], "arguments": "",
                                  "ids": 0})
                into = calls[call["index"]]
                into["arguments"] += call["function"].get("arguments") or ""
                into["ids"] += call.get("id") is not None
    return calls


def test_a_streamed_call_of_a_named_tool_is_vllms(tool_clients: tuple[Any, Any]) -> None:
    named = {"type": "function", "function": {"name": "flip"}}
    # Sampled, seeded alike: greedy, this model pads the JSON with whitespace to max_tokens. This
    # seed's call ends at the template's end of turn.
    request = dict(messages=CHAT, tools=[FLIP], tool_choice=named, max_tokens=64, logprobs=True,
                   temperature=1.0, seed=23)
    vllm, rose = _both(tool_clients, True, stream=True, stream_options={"include_usage": True}, **request)
    calls = _calls_folded(vllm)
    assert [(c["type"], c["name"], c["ids"]) for c in calls] == [("function", "flip", 1)]
    assert json.loads(calls[0]["arguments"])["side"] in ("heads", "tails")  # held to the schema
    assert _calls_folded(rose) == calls
    assert_same(_folded(vllm), _folded(rose))
    assert _folded(vllm)["choices"][0]["finish_reason"] == "stop"  # a named call's, as OpenAI's
    assert_same(*_both(tool_clients, True, **request))  # and whole


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                       "population": {"type": "integer", "minimum": 0}}}


def test_a_greedy_json_schema_answer_is_vllms(clients: tuple[Any, Any],
                                              checkpoints: tuple[Path, Path]) -> None:
    """Both constrain through vLLM's structured-output backend: the same JSON, token for token.
    The native engine (xgrammar too, with its own arithmetic) writes valid JSON under the same
    constraint, not necessarily the same."""
    tok = load_tokenizer(checkpoints[0])
    # Greedy, a random model's likeliest token is often whitespace, which JSON allows without end.
    bias = {str(i): -100 for i in range(tok.vocab_size) if tok.decode([i]).isspace()}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    vllm, rose = _both(clients, True, messages=CHAT, max_tokens=200, response_format=fmt, logit_bias=bias,
                       logprobs=True, **GREEDY)
    assert vllm["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(_text(vllm)), CITY)
    assert_same(vllm, rose)
    native = LLMEngine.from_pretrained(checkpoints[0], dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=200, temperature=0.0,
                            logit_bias=tuple((int(i), -100.0) for i in bias),
                            structured=StructuredOutput(StructuredKind.JSON, json.dumps(CITY)))
    out = native.generate([tok.encode(tok.apply_chat_template(CHAT))], params)[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(out.token_ids)), CITY)
