"""One physical pool of KV pages, sized in bytes, that several models draw from.

A page holds one block (`block_size` tokens) of K and V for every layer of one model. Models
with different KV shapes share the pool: a page is `page_bytes` long and each model views the
first `spec.block_bytes` of it as `[layers, 2, kv_heads, block_size, head_dim]`: head-major, so
that one head's block is one contiguous row the attention gathers whole. Each model
keeps its own block tables (its own "virtual" KV space) in a `BlockManager`; the pool only
knows which pages are free, who maps the others, and each owner's page budget.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import mmap
from collections.abc import Callable

import torch

from rose.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """The KV shape of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    block_size: int = 16

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype = torch.float32,
           block_size: int = 16) -> KVSpec:
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype,
                   block_size)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def row_bytes(self) -> int:
        """One head's K (or V) for one block: the unit the attention gathers."""
        return self.block_size * self.head_dim * self.dtype.itemsize


HUGE_PAGE = 2 << 20


def host_pages(num_bytes: int) -> torch.Tensor:
    """`num_bytes` of zeroed host memory on transparent huge pages where the OS lends them (Linux,
    `madvise` mode): the decode kernel reads pages scattered over the pool, and on 4 KB OS pages
    each page row it reads costs a TLB miss (SmolLM2, the engine benchmark's mixed workload, one
    thread: 153 -> 159-162 tokens/s with PyTorch's THP_MEM_ALLOC_ENABLE, which does the same for
    every allocation). Touched here, so that no iteration pays the page faults."""
    # Private (shared anonymous memory is shmem, which THP leaves alone by default); the tensor
    # keeps the mapping alive.
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE  # huge pages map 2 MB-aligned ranges
    return whole[start:start + num_bytes].fill_(0)


class KVPool:
    """Free pages, pages mapped per owner, and per-owner budgets (in pages)."""

    def __init__(self, total_bytes: int, page_bytes: int, device: str | torch.device = "cpu") -> None:
        if page_bytes <= 0 or total_bytes < page_bytes:
            raise ValueError(f"KV pool of {total_bytes} bytes cannot hold one page of {page_bytes} bytes")
        self.page_bytes = page_bytes
        self.num_pages = total_bytes // page_bytes
        if torch.device(device).type == "cpu":
            self.buffer = host_pages(self.num_pages * page_bytes).view(self.num_pages, page_bytes)
        else:
            self.buffer = torch.zeros(self.num_pages, page_bytes, dtype=torch.uint8, device=device)
        self._free: collections.deque[int] = collections.deque(range(self.num_pages))
        self._used: collections.Counter[str] = collections.Counter()
        self._budget: dict[str, int] = {}
        # Owners hand back pages that only their prefix cache holds, when the pool runs dry.
        self._reclaimers: dict[str, Callable[[], bool]] = {}

    @classmethod
    def for_specs(cls, total_bytes: int, *specs: KVSpec, device: str | torch.device = "cpu") -> KVPool:
        """A pool on `device` whose page fits the largest block among `specs`, rounded up to a
        whole number of every spec's rows (`rows` needs it)."""
        row = math.lcm(*(s.row_bytes for s in specs))
        return cls(total_bytes, -(-max(s.block_bytes for s in specs) // row) * row, device)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def register(self, owner: str, reclaim: Callable[[], bool]) -> None:
        if owner in self._reclaimers:
            raise ValueError(f"KV pool owner {owner!r} is already registered")
        self._reclaimers[owner] = reclaim

    def view(self, spec: KVSpec) -> torch.Tensor:
        """The pool as `[pages, layers, 2, kv_heads, block_size, head_dim]` for one model."""
        if spec.block_bytes > self.page_bytes:
            raise ValueError(f"a block of {spec.block_bytes} bytes does not fit a page of "
                             f"{self.page_bytes} bytes")
        raw = self.buffer[:, :spec.block_bytes].view(spec.dtype)
        return raw.view(self.num_pages, spec.num_layers, 2, spec.num_kv_heads, spec.block_size,
                        spec.head_dim)

    def rows(self, spec: KVSpec) -> torch.Tensor:
        """The pool as `[rows, block_size * head_dim]` for one model: the row of (page, layer,
        K or V, head) is `page * rows_per_page(spec) + (layer * 2 + kv) * kv_heads + head`. One
        `index_select` over it gathers any set of heads' blocks, of any layer, in one copy."""
        self.view(spec)  # the block fits
        if self.page_bytes % spec.row_bytes:
            raise ValueError(f"a page of {self.page_bytes} bytes is not a whole number of rows of "
                             f"{spec.row_bytes} bytes (use KVPool.for_specs)")
        return self.buffer.view(spec.dtype).view(-1, spec.block_size * spec.head_dim)

    def rows_per_page(self, spec: KVSpec) -> int:
        return self.page_bytes // spec.row_bytes

    def set_budget(self, owner: str, pages: int | None) -> None:
        """Cap what `owner` may map (None: the whole pool)."""
        if pages is None:
            self._budget.pop(owner, None)
        else:
            self._budget[owner] = max(0, pages)

    def budget(self, owner: str) -> int:
        return self._budget.get(owner, self.num_pages)

    def used(self, owner: str) -> int:
        return self._used[owner]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, owner: str) -> int | None:
        """A free page for `owner`, reclaiming cached pages if needed; None when none can be had."""
        reclaim_own = self._reclaimers.get(owner, lambda: False)
        if self._used[owner] >= self.budget(owner) and not reclaim_own():
            return None
        # Reclaim from the owner itself first, then from the others.
        while not self._free:
            if not any(r() for r in (reclaim_own, *(r for o, r in self._reclaimers.items() if o != owner))):
                return None
        self._used[owner] += 1
        return self._free.popleft()

    def release(self, owner: str, page: int) -> None:
        self._used[owner] -= 1
        self._free.append(page)

    def copy_page(self, src: int, dst: int) -> None:
        self.buffer[dst].copy_(self.buffer[src])
