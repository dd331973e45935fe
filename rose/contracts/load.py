"""The load of one model in one engine iteration: what the engine reports it computed and what
admission and the simulator's cost models predict a time for."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenLoad:
    """One model's share of one iteration."""

    prefill_tokens: int = 0      # prompt tokens computed this iteration (chunked prefill)
    decode_seqs: int = 0         # sequences producing one token each
    context_tokens: int = 0      # KV tokens attention reads (sum over the decode sequences)

    def __add__(self, other: TokenLoad) -> TokenLoad:
        """Both loads in one forward pass (one model serving two kinds of request)."""
        return TokenLoad(self.prefill_tokens + other.prefill_tokens, self.decode_seqs + other.decode_seqs,
                         self.context_tokens + other.context_tokens)

    def __sub__(self, other: TokenLoad) -> TokenLoad:
        """The load left when `other`, a part of this one, is taken out."""
        return TokenLoad(self.prefill_tokens - other.prefill_tokens, self.decode_seqs - other.decode_seqs,
                         self.context_tokens - other.context_tokens)
