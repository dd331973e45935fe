"""What `vllm serve`'s clients send, `rose serve` takes, through the official `openai` client:
fields it does not know (ignored, with a warning), vLLM's completion and chat extensions (lists of
prompts, echo, special tokens, stop strings kept, chat template variables, a continued message),
and `--chat-template`. (The same requests against `vllm serve` itself: test_coserve_vllm_parity.py.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import running

from rose.coserve.executor import CoServingExecutor
from rose.coserve.serve_config import load_serve_config, sampling_defaults
from rose.coserve.server import build_app
from rose.coserve.settings import ChatOptions, ExecutorConfig
from rose.model import init_model, load_tokenizer
from rose.steploop import StepLoop

MODEL = "tiny"
# ChatML with one more variable: `shout` (a request's chat_template_kwargs) adds a line.
TEMPLATE = ("{% if shout %}{{ 'SHOUT\\n' }}{% endif %}{% for m in messages %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    path = init_model("qwen2", "tiny", tmp_path_factory.mktemp("compat") / "serving", seed=1)
    executor = CoServingExecutor.from_pretrained(path, None, ExecutorConfig(pool_mb=8))
    # As if the checkpoint's generation_config.json recommended top_k 1 and 5 new tokens.
    app = build_app(StepLoop(executor), executor, load_tokenizer(path), MODEL, chat=ChatOptions(TEMPLATE),
                    sampling_defaults={"top_k": 1, "max_tokens": 5})
    with running(app) as url:
        yield url, path


@pytest.fixture
def client(served: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


GREEDY: dict[str, Any] = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
USER = [{"role": "user", "content": "hello there"}]


def test_unknown_fields_are_ignored_with_a_warning(client: openai.OpenAI, caplog: pytest.LogCaptureFixture
                                                   ) -> None:
    plain = client.completions.create(prompt="hello", **GREEDY).choices[0].text
    unknown = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto", "ignore_eos": True}
    with caplog.at_level(logging.WARNING, logger="rose.coserve.protocol"):
        text = client.completions.create(prompt="hello", **{**GREEDY, "extra_body": unknown}).choices[0].text
        chat = client.chat.completions.create(messages=[{**USER[0], "refusal": None}], **{
            **GREEDY, "extra_body": unknown})
    assert text == plain and chat.choices[0].message.content
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "metadata, service_tier, store" in logged and "refusal" in logged


@pytest.mark.parametrize(("field", "value", "message"), [
    ("skip_special_tokens", "sometimes", "valid boolean"),
    ("use_beam_search", True, "does not implement use_beam_search"),
    ("prompt_logprobs", 2, "does not implement prompt_logprobs"),
    ("echo", True, "echo with logprobs"),
])
def test_fields_it_knows_stay_strict(served: tuple[str, Path], field: str, value: Any, message: str) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "logprobs": 1, field: value}
    r = httpx.post(f"{served[0]}/v1/completions", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_list_of_prompts_gets_n_choices_each_numbered_as_vllm(client: openai.OpenAI) -> None:
    prompts = ["hello", "the quick brown fox"]
    alone = [client.completions.create(prompt=p, **GREEDY) for p in prompts]
    both = client.completions.create(prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 4 * 6
    ids = client.completions.create(prompt=[[5, 17, 200], [31, 9]], **GREEDY)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}


def test_echo_starts_each_choice_with_its_prompt(client: openai.OpenAI, served: tuple[str, Path]) -> None:
    plain = client.completions.create(prompt="hello", **GREEDY).choices[0].text
    assert client.completions.create(prompt="hello", echo=True, **GREEDY).choices[0].text == "hello" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt="hello", echo=True, stream=True, **GREEDY) if c.choices)
    assert streamed == "hello" + plain
    ids = load_tokenizer(served[1]).encode("hello")
    assert client.completions.create(prompt=ids, echo=True, **GREEDY).choices[0].text == "hello" + plain


def test_special_tokens_are_skipped_unless_asked_for(client: openai.OpenAI, served: tuple[str, Path]) -> None:
    think = load_tokenizer(served[1]).encode("<think>")
    assert len(think) == 1  # a special token of the tiny tokenizer
    forced = {**GREEDY, "logit_bias": {str(think[0]): 100}}
    assert "<think>" not in client.completions.create(prompt="hello", **forced).choices[0].text
    kept = client.completions.create(prompt="hello", **{**forced, "extra_body": {
        "ignore_eos": True, "skip_special_tokens": False}}).choices[0].text
    assert kept == "<think>" * 6


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    request = {**GREEDY, "max_tokens": 16}
    text = client.completions.create(prompt="hello", **request).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(prompt="hello", stop=[stop], **request).choices[0]
    kept = client.completions.create(prompt="hello", stop=[stop], **{**request, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and text.startswith(kept.text)


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, served: tuple[str, Path]) -> None:
    plain = client.chat.completions.create(messages=USER, **GREEDY).usage.prompt_tokens
    shout = client.chat.completions.create(messages=USER, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "chat_template_kwargs": {"shout": True}}}).usage.prompt_tokens
    tokenized = httpx.post(f"{served[0]}/tokenize", json={"messages": USER, "chat_template_kwargs": {
        "shout": True}, "return_token_strs": True}).json()
    assert shout > plain and tokenized["count"] == shout
    assert "".join(tokenized["token_strs"]).startswith("SHOUT")


def test_the_last_message_is_continued_and_echoed(client: openai.OpenAI, served: tuple[str, Path]) -> None:
    messages = [*USER, {"role": "assistant", "content": "Sure, the"}]
    body = {**GREEDY, "extra_body": {"ignore_eos": True, "continue_final_message": True,
                                     "add_generation_prompt": False}}
    reply = client.chat.completions.create(messages=messages, **body)
    # The prompt ends where the assistant's content does: no end of turn, no new turn.
    rendered = TEMPLATE.replace("{% if shout %}{{ 'SHOUT\\n' }}{% endif %}", "")
    tokenizer = load_tokenizer(served[1]).with_chat_template(rendered)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert expected.endswith("<|im_end|>\n")
    assert reply.usage.prompt_tokens == len(tokenizer.encode(expected.removesuffix("<|im_end|>\n")))
    echoed = client.chat.completions.create(messages=messages, **{**body, "extra_body": {
        **body["extra_body"], "echo": True}}).choices[0].message.content
    assert echoed == "Sure, the" + reply.choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **{**body, "extra_body": {
        **body["extra_body"], "echo": True}}))
    assert chunks[1].choices[0].delta.content == "Sure, the"  # after the role's chunk, as vLLM
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(messages=messages, **{**GREEDY, "extra_body": {
            "continue_final_message": True}})


def test_chat_template_is_a_file_or_the_template_checked_at_load(tmp_path: Path) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    assert load_serve_config(flags={"model": "m", "chat_template": str(file)}).chat_template == TEMPLATE
    assert load_serve_config(flags={"model": "m", "chat_template": TEMPLATE}).chat_template == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_serve_config(flags={"model": "m", "chat_template": str(tmp_path / "missing.jinja")})
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_serve_config(flags={"model": "m", "chat_template": "{% for m in messages %}"})


def test_the_models_recommended_sampling_fills_what_a_request_leaves_unset(client: openai.OpenAI) -> None:
    """top_k 1 (the fixture's default) makes a request that sets no top_k greedy at any
    temperature; one that sets it samples; max_tokens comes from the defaults too."""
    greedy = client.completions.create(prompt="hello", **GREEDY).choices[0].text
    hot = dict(model=MODEL, prompt="hello", temperature=1.0, seed=3)
    unset = client.completions.create(**hot, extra_body={"ignore_eos": True})
    assert unset.choices[0].text == greedy[:len(unset.choices[0].text)] and unset.usage.completion_tokens == 5
    drawn = client.completions.create(**hot, max_tokens=5, extra_body={"ignore_eos": True, "top_k": 0})
    assert drawn.choices[0].text != unset.choices[0].text


def test_generation_config_is_the_models_vllms_or_a_directory(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 128, "do_sample": true}')
    config = load_serve_config(flags={"model": str(model)})
    assert sampling_defaults(config) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 128}
    vllms = load_serve_config(flags={"model": str(model), "generation_config": "vllm"})
    assert sampling_defaults(vllms) == {}
    elsewhere = load_serve_config(flags={"model": str(tmp_path), "generation_config": str(model)})
    assert sampling_defaults(elsewhere)["top_k"] == 20
    assert sampling_defaults(load_serve_config(flags={"model": str(tmp_path)})) == {}  # none: OpenAI's
    with pytest.raises(ValueError, match=r"no generation_config\.json in"):
        sampling_defaults(load_serve_config(flags={"model": str(model), "generation_config": str(tmp_path)}))
