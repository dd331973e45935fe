"""An emulated cross-cluster link: a token bucket at a given rate, with optional drops.

Senders call `transmit(key, nbytes)` before a bucket crosses the hop between the training and
the serving cluster; it returns when the link would have delivered the bytes, so timings at
10-200 Gbps are honest on one machine. All senders that share a `Link` share its bandwidth
(virtual-time scheduling: each transmission starts when the previous one has drained, less a
small burst allowance). `drop(key)` returning True loses that transmission after its bytes
were spent, as a real loss would, and the sender sees `LinkError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LinkError(ConnectionError):
    """A transmission was lost; retrying the same bucket is safe (payloads are idempotent)."""


class Link:
    def __init__(self, gbps: float, *, burst_bytes: int = 1 << 20,
                 drop: Callable[[str], bool] | None = None) -> None:
        if gbps <= 0:
            raise ValueError(f"link rate must be positive, got {gbps} Gbps")
        self.gbps = gbps
        self.bytes_per_s = gbps * 1e9 / 8
        self._burst_s = burst_bytes / self.bytes_per_s
        self._drop = drop
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.drops = 0

    def seconds(self, nbytes: int) -> float:
        """The link-limited time of `nbytes`."""
        return nbytes / self.bytes_per_s

    def transmit(self, key: str, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + self.seconds(nbytes)
            wait = self._free_at - self._burst_s - now
            self.bytes_sent += nbytes
        if wait > 0:
            time.sleep(wait)
        if self._drop is not None and self._drop(key):
            with self._lock:
                self.drops += 1
            raise LinkError(f"link: bucket {key} ({nbytes} bytes) was lost in transit")
