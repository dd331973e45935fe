"""The relay: a key-value store trainers push buckets to and receivers pull from.

Receivers find everything by key (see `versions`), so they join and leave without any
collective group being formed or re-formed. Two backends with one interface:

- `RayRelay` (the default): bucket payloads live in Ray's object store, written once by the
  sender's `ray.put` and read zero-copy on the same node (or fetched across nodes by Ray); a
  named async actor holds the key -> object directory and wakes waiting readers.
- `LocalRelay`: a dict behind a condition variable, for unit tests and single-process runs.

`get` blocks until the key exists (or `timeout` passes: TimeoutError); `flush` returns once
every process sees this one's puts (a `RayRelay.put` returns before). Values are small
records or bucket payloads (a list of bytes / uint8 arrays); payload arrays handed to a reader
are read-only views.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Protocol

import numpy as np


class Relay(Protocol):
    def put(self, key: str, value: Any) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> Any: ...

    def scan(self, prefix: str) -> dict[str, Any]: ...

    def delete(self, prefix: str) -> None: ...

    def flush(self) -> None:
        """Return once every `put` this process made is visible to every reader."""


def _frozen(value: Any) -> Any:
    """A private read-only copy of payload arrays, so a store never aliases a sender's live tensors."""
    if isinstance(value, list):
        return [_frozen(v) for v in value]
    if isinstance(value, np.ndarray):
        copy = value.copy()
        copy.flags.writeable = False
        return copy
    return value


class LocalRelay:
    """In-process relay for tests: same semantics as `RayRelay`, no serialisation."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._changed = threading.Condition()

    def put(self, key: str, value: Any) -> None:
        value = _frozen(value)
        with self._changed:
            self._items[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout: float | None = None) -> Any:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._items, timeout):
                raise TimeoutError(f"relay: no {key!r} after {timeout} s")
            return self._items[key]

    def scan(self, prefix: str) -> dict[str, Any]:
        with self._changed:
            return {k: v for k, v in self._items.items() if k.startswith(prefix)}

    def delete(self, prefix: str) -> None:
        with self._changed:
            for k in [k for k in self._items if k.startswith(prefix)]:
                del self._items[k]

    def flush(self) -> None:
        """Puts are visible when they return."""


# Payloads at least this large go to the object store; smaller records stay in the directory.
_INLINE_LIMIT = 64 << 10


def _nbytes(value: Any) -> int:
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    return value.nbytes if isinstance(value, np.ndarray) else len(value) if isinstance(value, bytes) else 0


class _Directory:
    """Key -> value or [ObjectRef]; readers wait on an event per missing key."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._waiting: dict[str, asyncio.Event] = {}

    async def put(self, key: str, item: Any) -> None:
        self._items[key] = item
        if key in self._waiting:
            self._waiting.pop(key).set()

    async def get(self, key: str, timeout: float | None) -> tuple[bool, Any]:
        if key not in self._items:
            event = self._waiting.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return False, None
        return True, self._items[key]

    async def scan(self, prefix: str) -> dict[str, Any]:
        return {k: v for k, v in self._items.items() if k.startswith(prefix)}

    async def delete(self, prefix: str) -> None:
        for k in [k for k in self._items if k.startswith(prefix)]:
            del self._items[k]


def get_objects(refs: list[Any]) -> list[Any]:
    """`ray.get(refs)` through the completion callbacks that `await ref` uses (`ObjectRef.future`).
    Ray warns of a `ray.get` anywhere in an async actor's process, whichever thread makes it; the
    rollout replicas are async actors that call the relay only from threads off their event loop
    (and from `__init__`, before the loop serves anything), so the warning would be a false alarm
    that hides a real one."""
    futures = [ref.future() for ref in refs]
    return [future.result() for future in futures]


class RayRelay:
    """Relay over Ray: bulk payloads in the object store, keys in a named directory actor.

    Every process that creates a `RayRelay` with the same `name` (and namespace) shares it: a
    receiver on another node needs nothing but the name. `ray.init` must have run. The first
    creates the directory, on its own node (the driver's, in a run): left to Ray, an actor that
    asks for no CPU may land on any node, and dies with it when that node leaves.
    """

    def __init__(self, name: str = "rose-relay", namespace: str = "rose") -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(num_cpus=0, max_concurrency=1000)(_Directory)
        self._dir = actor.options(name=name, namespace=namespace, get_if_exists=True,
                                  scheduling_strategy=here).remote()
        # Ray runs one caller's calls in order only on a synchronous actor, and the directory is
        # async (readers wait in it): registrations this process sent and has not seen land.
        self._unacked: dict[str, Any] = {}
        self._lock = threading.Lock()

    def put(self, key: str, value: Any) -> None:
        """Store `value` (the payload is in the object store when this returns) and register it
        without waiting; an earlier registration of the same key lands first."""
        # A reference goes wrapped in a list so that Ray hands the directory the reference itself.
        bulk = _nbytes(value) >= _INLINE_LIMIT
        item = ("ref", [self._ray.put(value)]) if bulk else ("inline", value)
        self._settle(key)
        ref = self._dir.put.remote(key, item)
        with self._lock:
            self._unacked[key] = ref

    def get(self, key: str, timeout: float | None = None) -> Any:
        self._settle()
        start = time.monotonic()
        found, item = get_objects([self._dir.get.remote(key, timeout)])[0]
        if not found:
            raise TimeoutError(f"relay: no {key!r} after {time.monotonic() - start:.1f} s")
        return self._resolve(item)

    def scan(self, prefix: str) -> dict[str, Any]:
        self._settle()
        return {k: self._resolve(v) for k, v in get_objects([self._dir.scan.remote(prefix)])[0].items()}

    def delete(self, prefix: str) -> None:
        self._settle()
        get_objects([self._dir.delete.remote(prefix)])

    def flush(self) -> None:
        """Wait until this process's registrations are in the directory: a `put` returns before
        other processes can see it, and nothing orders it before their later reads."""
        self._settle()

    def __getstate__(self) -> dict[str, Any]:
        return {"_ray": self._ray, "_dir": self._dir}   # another process: its own registrations

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _unacked={}, _lock=threading.Lock())

    def _settle(self, key: str | None = None) -> None:
        """Wait until this process's registrations (all, or those of `key`) are in the
        directory, so that what follows sees them: read your writes, delete after put."""
        with self._lock:
            if key is None:
                refs, self._unacked = list(self._unacked.values()), {}
            else:
                refs = [self._unacked.pop(key)] if key in self._unacked else []
        get_objects(refs)

    def close(self) -> None:
        """Remove the directory (and with it every payload it still references)."""
        self._ray.kill(self._dir)

    def _resolve(self, item: tuple[str, Any]) -> Any:
        kind, value = item
        return get_objects(value)[0] if kind == "ref" else value
