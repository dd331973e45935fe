"""Structured output on the native engine: a request's constraint (`rose.contracts.StructuredOutput`)
compiled into a grammar over the engine's vocabulary, a matcher per constrained sequence
(`Constraint`, held by the sequence), and the mask it puts on that sequence's logits before each
draw (`mask_logits`, applied by the sampler).

The grammars are xgrammar's: it is vLLM's default structured-output backend, so a constraint
allows here what it allows under `vllm serve` (the same JSON-schema conversion with any
whitespace, the same regex and EBNF dialects, a choice as an alternation of literals, the same
stop tokens at the grammar's end). xgrammar (and transformers with it) is imported on the first
constrained request, a one-time cost of seconds on a CPU, as under vLLM: an engine that never
sees one, such as a rollout engine, pays nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from rose.contracts import StructuredKind, StructuredOutput
from rose.model import Tokenizer

if TYPE_CHECKING:
    import xgrammar

# xgrammar's JSON-schema converter recurses on the schema's nesting (thousands of levels crash the
# process): objects and arrays may nest this deep, vLLM's bound.
MAX_JSON_NESTING = 64
_ERROR_CHARS = 300  # of a compiler's message in the error (it may quote the whole spec)
_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")  # "[12:00:00] file.cc:12: "


def _nesting(value: Any) -> int:
    """How deep objects and arrays nest in a parsed JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _parse_json(spec: str, expected: str) -> Any:
    try:
        value = json.loads(spec)
    except RecursionError:
        value = None
        depth = MAX_JSON_NESTING + 1
    except ValueError as exc:
        raise ValueError(f"the spec is not JSON ({exc}); expected {expected}") from None
    else:
        depth = _nesting(value)
    if depth > MAX_JSON_NESTING:
        raise ValueError(f"the spec nests objects and arrays more than {MAX_JSON_NESTING} levels deep")
    return value


def _literal(text: str) -> str:
    """`text` as a string literal of xgrammar's EBNF (the escapes it reads, as JSON writes them)."""
    return json.dumps(text, ensure_ascii=False)


def choice_list(spec: str) -> list[str]:
    """A choice's strings; ValueError (what is wrong with the spec) unless `spec` is a non-empty
    JSON list of strings."""
    choices = _parse_json(spec, "a JSON list of strings")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"the spec must be a non-empty JSON list of strings, got {spec[:100]!r}")
    return choices


def choice_grammar(spec: str) -> str:
    """The EBNF grammar of a choice: one of the listed strings, whole."""
    return "root ::= " + " | ".join(_literal(c) for c in choice_list(spec))


class Constraint:
    """One sequence's position in its grammar: the tokens it may draw next, and whether the
    grammar has ended (it accepted one of its stop tokens)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past a drawn token; False if the grammar does not allow it here."""
        return self._matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


class Grammars:
    """The constraints of one vocabulary (an engine's tokenizer, `vocab_size` the model's rows,
    which may exceed the tokenizer's), compiled on first use. xgrammar's compiler caches what
    it compiled, keyed by the grammar's text: a constraint that recurs is compiled once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids) or tokenizer.stop_token_ids
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import transformers
            import xgrammar

            # xgrammar reads a vocabulary's encoding (byte-level, byte fallback) from a
            # transformers tokenizer; ROSE's wraps the same `tokenizers` object.
            fast = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
            info = xgrammar.TokenizerInfo.from_huggingface(
                fast, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def constraint(self, structured: StructuredOutput, stop_token_ids: Collection[int]) -> Constraint:
        """A fresh matcher of `structured`, whose grammar ends with one of `stop_token_ids`
        (none: the tokenizer's). Raises ValueError naming the kind and what is wrong."""
        import xgrammar

        kind = structured.kind
        try:
            compiled = self._compile(structured)
        except ValueError as exc:
            raise ValueError(f"structured output ({kind.value}): {exc}") from None
        except RuntimeError as exc:  # xgrammar's refusal of a schema, regex or grammar
            message = _SOURCE.sub("", str(exc).strip())
            if len(message) > _ERROR_CHARS:
                message = message[:_ERROR_CHARS] + "..."
            raise ValueError(f"structured output ({kind.value}): xgrammar cannot compile it: "
                             f"{message}") from None
        stops = sorted(stop_token_ids) or None
        return Constraint(xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops))

    def _compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler, spec = self.compiler(), structured.spec
        match structured.kind:
            case StructuredKind.JSON:
                schema = _parse_json(spec, "a JSON schema")
                if not isinstance(schema, dict | bool):
                    raise ValueError(f"the spec is a JSON {type(schema).__name__}; expected a JSON schema "
                                     "(an object)")
                return compiler.compile_json_schema(spec)
            case StructuredKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}')
            case StructuredKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(spec))
        if "\x00" in spec:  # xgrammar's parsers read C strings
            raise ValueError("the spec holds a NUL character")
        if structured.kind is StructuredKind.REGEX:
            return compiler.compile_regex(spec)
        # GBNF rules are written `name ::= ...`; Lark's `name: ...` (vLLM takes either).
        return compiler.compile_grammar(spec) if "::=" in spec else compiler.compile_lark(spec)


def mask_logits(logits: torch.Tensor, constraints: Mapping[int, Constraint]) -> None:
    """Set to -inf, in place, the logits of each row in `constraints` that its constraint does
    not allow next."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, constraint in constraints.items():
        constraint.fill(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                         indices=list(constraints))
