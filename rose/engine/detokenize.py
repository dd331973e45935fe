"""Incremental detokenization: a stream's text, a delta per step, in O(new tokens) per step.

Only a window of the latest tokens is decoded each step: the tokens read last step (context, so
that a tokenizer that drops leading spaces decodes the same) and the unread ones. Text is held
back while it may still change (it ends in an incomplete UTF-8 character, decoded as U+FFFD: never
sent if the stream ends so, as in vLLM) or may be the start of a stop string; a stop string is
found across token boundaries, only in the text not yet sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 include_stop: bool = False) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop  # the text ends after the stop string, not before it
        self._hold = max((len(s) - 1 for s in self._stop), default=0)
        self._window: list[int] = []  # context tokens, then unread ones
        self._context = 0  # context tokens at the window's start
        self._read_chars = 0  # characters of the window's text already read
        self._pending = ""  # text read but not yet sent: a stop string may start in it
        self.stopped = False  # a stop string was found: the text ends before it
        self.stopped_at: str | None = None  # that stop string

    def push(self, token_ids: list[int], finished: bool, check_stop: bool = True) -> str:
        """Take a step's new tokens; the text that may be sent now (once finished, all of it but
        an incomplete UTF-8 character at its end, which vLLM's detokenizer never sends either).
        Without `check_stop` (before min_tokens, as vLLM) stop strings are not looked for; the
        text that may begin one is still held back."""
        self._window += token_ids
        text = self._decode(self._window) if self._window else ""
        complete = not text.endswith(INCOMPLETE)
        readable = text if complete else text.rstrip(INCOMPLETE)
        if len(readable) > self._read_chars:
            self._pending += readable[self._read_chars:]
            self._read_chars = len(readable)
        if complete and self._context:  # slide: the tokens just read become the context
            self._window = self._window[self._context:]
            self._read_chars = len(self._decode(self._window))
        if complete:
            self._context = len(self._window)
        return self._emit(finished, check_stop)

    def _emit(self, finished: bool, check_stop: bool) -> str:
        stops = self._stop if check_stop else []
        found = [(i, s) for s in stops if (i := self._pending.find(s)) >= 0]
        if found:
            cut, self.stopped_at = min(found, key=lambda f: f[0])
            cut += len(self.stopped_at) if self._include_stop else 0
            self.stopped = True
            text, self._pending = self._pending[:cut], ""
            return text
        keep = 0 if finished else min(self._hold, len(self._pending))
        text = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(text):]
        return text
