"""Byte-level BPE tokenizer files (`tokenizer.json` + `tokenizer_config.json`) and a thin wrapper.

Random-initialised checkpoints need a real tokenizer so that the server, the environments and
HF `transformers` all see the same ids. `build_tokenizer` trains a small byte-level BPE with the
`tokenizers` library on an embedded corpus (words of the built-in environments and of chat), with
Qwen's ChatML special tokens. Byte-level means any text round-trips, whatever the vocabulary.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rose.model.config import CheckpointError
from rose.tools.parsing import with_tools

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, "<think>", "</think>", "<tool_call>", "</tool_call>"]

# ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS_LINES = [
    "You are playing FrozenLake. The agent starts at S and must reach the goal G without "
    "falling into a hole H. Frozen tiles are F. Actions: Left, Down, Right, Up.",
    "You are playing Sokoban. Push every box onto a target. Walls are #, boxes are X, targets "
    "are O, the player is P. Actions: Up, Down, Left, Right.",
    "Answer with one action in brackets, for example <action>Right</action>.",
    "The current map is shown below. Row 0 is the top row and column 0 is the left column.",
    "You reached the goal. You fell into a hole. The box is on the target. Invalid action.",
    "system user assistant tool observation reward done step turn episode success failure",
    "Let me think step by step about where to move next before I answer.",
    "The quick brown fox jumps over the lazy dog. Hello, how can I help you today?",
    "Please write a short answer. Thank you! Sure, here is the result of the calculation.",
    "def main(): return 0  # import numpy as np; for i in range(10): print(i)",
]


def _corpus() -> list[str]:
    grids = []
    for n in (4, 8):
        row = "F" * n
        grids.append("\n".join(["S" + row[1:], *[row] * (n - 2), row[:-1] + "G"]))
    numbers = [" ".join(str(i) for i in range(k, k + 20)) for k in range(0, 200, 20)]
    return (_CORPUS_LINES + grids + numbers) * 4


def build_tokenizer(vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` ids (fewer if the corpus runs out of merges)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


# Appended to a message continued (`continue_final_message`), to find where its content ends.
_CONTINUE_TAG = "ROSE_CONTINUE_FINAL_MESSAGE "


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    """Encode, decode and render chat prompts the way the checkpoint's files say."""

    def __init__(self, tok: HFTokenizer, chat_template: str = CHAT_TEMPLATE,
                 eos_token: str = IM_END, pad_token: str = ENDOFTEXT,
                 bos_token: str | None = None) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        self.bos_token_id = None if bos_token is None else self._id(bos_token)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # As transformers renders templates: `tojson` without HTML escaping (Qwen's templates
        # write tool schemas with it), `raise_exception` for a template's own refusals,
        # `strftime_now` for templates that date their system prompt.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(chat_template)

    def _id(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise CheckpointError(f"tokenizer: special token {token!r} is not in the vocabulary")
        return idx

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (structured output reads its vocabulary and encoding)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: a text of n characters takes at least
        n / max_token_chars tokens, a bound known before encoding it."""
        return max(len(token) for token in self._tok.get_vocab(with_added_tokens=True))

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end an assistant turn: end-of-message and end-of-text."""
        return sorted({self.eos_token_id, self.pad_token_id})

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (Qwen's do; SmolLM2's and ChatML do not)."""
        return "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation rendered, with the `tools` (and past calls and results) as the template
        writes them; a template that knows no tools gets them in Qwen's (Hermes) format, in the
        system message (`rose.tools.parsing.with_tools`). `continue_final_message`: the text ends
        where the last message's content does, for the model to go on writing it (as transformers
        does it: the content is tagged, the render cut at the tag). `template_kwargs` are more
        variables for the template (e.g. Qwen3's `enable_thinking`). Raises `TemplateError` where
        the template refuses the conversation, ValueError where the last message cannot be
        continued."""
        if not self.supports_tools:
            messages, tools = with_tools(messages, tools), None
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message: the last message has no text to continue")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        # The special tokens are template variables too, as transformers passes them (`{{ bos_token }}`).
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        # A request's variables add to these, never replace them.
        text = self._template.render({**(template_kwargs or {}), "messages": messages,
                                      "add_generation_prompt": add_generation_prompt, "tools": tools,
                                      **{k: v for k, v in special.items() if v is not None}})
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0:
                raise ValueError("continue_final_message: the chat template does not write the last "
                                 "message's content as it is, so it cannot be continued")
            # A template that strips the content's trailing space lost the tag's: cut the same.
            kept = text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
            text = text[:at] if kept else text[:at].rstrip()
        return text

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer rendering chats with another template (`rose serve --chat-template`)."""
        return Tokenizer(self._tok, chat_template, self.eos_token, self.pad_token, self.bos_token)

    def save(self, path: str | Path, model_max_length: int) -> None:
        """`tokenizer.json`, `tokenizer_config.json` and the `generation_config.json` that names
        the stop tokens (transformers and ROSE's engine both read it)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "chat_template": self.chat_template,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": self.bos_token_id, "eos_token_id": self.stop_token_ids,
                      "pad_token_id": self.pad_token_id, "do_sample": False}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read `tokenizer.json` and the chat template / special tokens of `tokenizer_config.json`."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json; expected a Hugging Face tokenizer file")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template_file = path / "chat_template.jinja"  # where transformers 5 writes the template
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")

    def token(key: str, default: str | None) -> str | None:
        value = config.get(key) or default
        return value["content"] if isinstance(value, dict) else value

    return Tokenizer(HFTokenizer.from_file(str(file)), template or CHAT_TEMPLATE,
                     token("eos_token", IM_END), token("pad_token", ENDOFTEXT), token("bos_token", None))
