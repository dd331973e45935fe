"""One model's block tables over the shared `KVPool`: allocation, prefix cache, copy-on-write.

A full block is named by a hash chained over every token up to its end, so equal hashes mean
equal prefixes and the KV can be shared (turn N+1 of a trajectory reuses turn N's blocks). The
chain of a sequence with a LoRA adapter starts from the adapter's seed, so its KV is shared only
with sequences of the same adapter load.
Pages whose last user finished stay mapped, evictable in LRU order, until the pool needs them.
"""

from __future__ import annotations

import collections
from array import array

import xxhash

from rose.engine.kv_pool import KVPool, KVSpec
from rose.engine.sequence import Sequence


def block_hash(parent: int, tokens: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + array("q", tokens).tobytes())


class BlockManager:
    def __init__(self, pool: KVPool, spec: KVSpec, owner: str) -> None:
        self.pool, self.spec, self.owner = pool, spec, owner
        self.block_size = spec.block_size
        self._ref: dict[int, int] = {}  # mapped page -> number of sequences using it
        self._hash_of: dict[int, int] = {}  # page -> hash of the full block it holds
        self._page_of: dict[int, int] = {}  # hash -> page
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.queried_tokens = 0
        self.hit_tokens = 0
        pool.register(owner, self._evict_one)

    # -- accounting ----------------------------------------------------------------------------

    @property
    def num_active_pages(self) -> int:
        """Pages some sequence uses (cached-only pages excluded)."""
        return len(self._ref) - len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._evictable)

    @property
    def max_pages(self) -> int:
        """The most pages one sequence could hold now: the pool, or this owner's budget in it
        (which the co-serving executor moves at run time)."""
        return min(self.pool.num_pages, self.pool.budget(self.owner))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # -- sequence lifecycle --------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> None:
        """Map the longest cached prefix of a sequence that holds no blocks yet.

        At least one token is left to compute, since the step that computes it yields the logits.
        A cached page joins only while the owner's active pages stay within its budget: a turn
        handed back in a burst must not take back, through the cache, the pages the cut freed.
        """
        assert not seq.block_table, "match_prefix on a sequence that holds blocks"
        seq.block_hashes = []
        # Its KV is computed from now on, under the adapter as loaded now.
        seq.hash_seed = 0 if seq.adapter is None else seq.adapter.hash_seed
        bs, parent = self.block_size, seq.hash_seed
        for i in range((len(seq.token_ids) - 1) // bs):
            h = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            page = self._page_of.get(h)
            if page is None or (page in self._evictable and self.num_active_pages >= self.max_pages):
                break
            self._take(page)
            seq.block_table.append(page)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs
        self.queried_tokens += len(seq.token_ids)
        self.hit_tokens += seq.num_cached_tokens

    def ensure_slots(self, seq: Sequence, num_new: int) -> bool:
        """Map pages for `num_new` more tokens (copying a shared last block before writing into
        it); all or nothing: False, with nothing changed, when the pool cannot give enough."""
        bs = self.block_size
        need = -(-(seq.num_computed_tokens + num_new) // bs) - len(seq.block_table)
        last = seq.block_table[-1] if seq.block_table else None
        cow = last is not None and seq.num_computed_tokens % bs != 0 and self._ref[last] > 1
        fresh: list[int] = []
        for _ in range(need + cow):
            page = self.pool.allocate(self.owner)
            if page is None:
                for p in fresh:
                    self.pool.release(self.owner, p)
                return False
            fresh.append(page)
        for page in fresh:
            self._ref[page] = 1
        if cow:
            copy = fresh.pop()
            self.pool.copy_page(last, copy)
            self._drop(last)
            seq.block_table[-1] = copy
        seq.block_table.extend(fresh)
        return True

    def commit(self, seq: Sequence) -> None:
        """Publish the blocks that the last step filled, so later sequences can share them."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_seed
            h = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            page = seq.block_table[i]
            if h not in self._page_of and page not in self._hash_of:
                self._page_of[h] = page
                self._hash_of[page] = h

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so that the LRU evicts them before the more shareable heads.
        for page in reversed(seq.block_table):
            self._drop(page)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent`; the first write to a shared partial block
        copies it (`ensure_slots`)."""
        for page in parent.block_table:
            self._take(page)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.hash_seed = parent.hash_seed
        child.num_computed_tokens = parent.num_computed_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every hash (new weights make old KV stale); cached-only pages go back."""
        while self._evict_one():
            pass
        self._page_of.clear()
        self._hash_of.clear()

    # -- pages ---------------------------------------------------------------------------------

    def _take(self, page: int) -> None:
        self._ref[page] += 1
        self._evictable.pop(page, None)

    def _drop(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page]:
            return
        if page in self._hash_of:
            self._evictable[page] = None
        else:
            del self._ref[page]
            self.pool.release(self.owner, page)

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        del self._ref[page]
        self.pool.release(self.owner, page)
        return True
