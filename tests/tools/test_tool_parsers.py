"""vLLM's tool-call formats (hermes, llama3_json, pythonic): a reply read whole, and read as it
arrives, split at every character: what a stream sends, piece after piece, adds up to the whole
reading."""

from __future__ import annotations

import json

import pytest

from rose.tools.tool_parsers import TOOL_PARSERS, Scan, check_tool_parser, tool_parser


def streamed(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a stream of `text`, cut at `cuts`, sends: each scan must only add
    to what the last one gave (the pieces sent never change), and a call goes out once named."""
    parser = TOOL_PARSERS[parser_name]
    bounds = [0, *cuts, len(text)]
    last = Scan("")
    names: list[str] = []
    for k in range(1, len(bounds)):
        scan = parser.scan(text[:bounds[k]], final=k == len(bounds) - 1)
        assert scan.content.startswith(last.content), (text[:bounds[k]], scan.content, last.content)
        for i, call in enumerate(scan.calls[:len(names)]):
            assert call.name == names[i] and call.arguments.startswith(last.calls[i].arguments)
        for call in scan.calls[len(names):]:
            if call.name is None:
                break
            names.append(call.name)
        last = Scan(scan.content, scan.calls[:len(names)])
    return last.content, [(c.name or "", c.arguments) for c in last.calls]


def whole(parser_name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = TOOL_PARSERS[parser_name].parse(text)
    if parsed is None:
        return text, []
    return parsed.content or "", parsed.calls


def same(got: tuple[str, list[tuple[str, str]]], expected: tuple[str, list[tuple[str, str]]]) -> bool:
    """Equal, the arguments as JSON (a stream sends the model's text of them, the whole reading
    its JSON re-written, as vLLM's do)."""
    return got[0] == expected[0] and [(n, json.loads(a)) for n, a in got[1]] == \
        [(n, json.loads(a)) for n, a in expected[1]]


REPLIES = {
    "hermes": [
        ('I will compute it.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7", '
         '"nested": [1, {"brace": "}"}]}}\n</tool_call>\n'
         '<tool_call>{"arguments": {}, "name": "b"}</tool_call>',
         "I will compute it.\n", ["calculator", "b"]),
        ('<tool_call>\n{"name": "python", "arguments": {"code": "print(\'</tool\')"}}\n</tool_call>', "",
         ["python"]),
        ('a <tool_call>{"name": "f"}</tool_call>', "a ", ["f"]),  # no arguments: {}
        ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "", ["f"]),  # left open at the end
        ("no call, though <tool_ appears", "no call, though <tool_ appears", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}', "", ["get_weather"]),
        ('<|python_tag|>{"name": "f", "arguments": {"a": "x;y"}}; {"name": "g", "parameters": {}}', "",
         ["f", "g"]),
        ('\n {"name": "f", "parameters": {"a": true}}', "", ["f"]),
        ("The answer is 42.", None, []),
        ('{"answer": 42}', None, []),  # JSON, but no call
    ],
    "pythonic": [
        ('[get_weather(city="San Francisco", metric=True, days=[1, 2], extra={"a": None}), '
         "x.lookup(q='it\\'s', n=null)]", "", ["get_weather", "x.lookup"]),
        ("[f()]", "", ["f"]),
        (" [f(a=(1, 2), b='x, y)')]", "", ["f"]),
        ("[1, 2] are numbers", None, []),
        ("Paris is sunny.", None, []),
    ],
}
CASES = [(name, *case) for name, cases in REPLIES.items() for case in cases]


@pytest.mark.parametrize(("parser_name", "text", "content", "names"), CASES)
def test_a_reply_streamed_at_every_split_adds_up_to_its_whole_reading(
        parser_name: str, text: str, content: str | None, names: list[str]) -> None:
    expected = whole(parser_name, text)
    assert expected[0] == (text if content is None else content)
    assert [n for n, _ in expected[1]] == names
    for calls in expected[1]:
        assert isinstance(json.loads(calls[1]), dict)
    for cut in range(1, len(text)):
        assert same(streamed(parser_name, text, [cut]), expected), cut
    assert same(streamed(parser_name, text, list(range(1, len(text)))), expected)


def test_arguments_stream_as_they_are_written() -> None:
    """A call goes out once its name is whole, with the arguments so far; they then grow."""
    hermes = TOOL_PARSERS["hermes"]
    text = 'Hi <tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>'
    early = hermes.scan(text[:text.index('"arguments"')], final=False)
    assert early.content == "Hi " and [(c.name, c.arguments) for c in early.calls] == [("calc", "")]
    mid = hermes.scan(text[:text.index("6*7") + 2], final=False)
    assert mid.calls[0].arguments == '{"expression": "6*'
    # A tag's first characters are held back until they are known not to open a call.
    assert hermes.scan("Hi <tool_c", final=False).content == "Hi "
    assert hermes.scan("Hi <tool_c", final=True).content == "Hi <tool_c"
    pythonic = TOOL_PARSERS["pythonic"]
    assert pythonic.scan("[get_weather", final=False) == Scan("")  # may still open a call
    partial = pythonic.scan('[f(a=1, b="x', final=False)
    assert [(c.name, c.arguments) for c in partial.calls] == [("f", '{"a": 1')]


def test_auto_picks_the_template_s_format_and_unknown_names_are_refused() -> None:
    qwen = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n{\"name\": ...}\n</tool_call>"
    llama31 = ('{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
               'argument name and its value}.\' }}{% if tools %}{% endif %}')
    pythonic = "{% if tools %}[func_name1(params_name1=params_value1), func_name2(params)]{% endif %}"
    chatml = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert [tool_parser("auto", t).name for t in (qwen, llama31, pythonic, chatml)] == \
        ["hermes", "llama3_json", "pythonic", "hermes"]
    assert tool_parser("pythonic", qwen).name == "pythonic"
    with pytest.raises(ValueError, match="unknown parser 'mistral'; the known ones are auto, hermes, "
                                         "llama3_json, pythonic"):
        check_tool_parser("mistral")


def test_a_malformed_call_is_content_whole_but_already_sent_streamed() -> None:
    """As in vLLM: read whole, a reply whose call is not valid JSON is all content; streamed, the
    call went out once named, before the text showed it malformed (its arguments as written)."""
    text = '<tool_call>{"name": "f", "arguments": {"x": </tool_call>'
    assert whole("hermes", text) == (text, [])
    assert streamed("hermes", text, list(range(1, len(text)))) == ("", [("f", '{"x": ')])
    # Cut before any call had a name: nothing went out as a call, and all of it goes as content.
    assert streamed("hermes", '<tool_call>{"na', [5]) == ('<tool_call>{"na', [])
