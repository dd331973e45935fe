"""Diagnostic logging for every process of a run: the driver and each Ray actor.

`rose --log-level LEVEL` sets the level of the `rose` loggers in the driver and exports it as
`ROSE_LOG_LEVEL`, which a run's Ray workers get (`rose.runtime.devices.init_ray`); an actor calls
`configure(role=...)` so that each of its lines names its role (`[trainer]`, `[dedicated-0]`,
`[serving-0]`) once Ray has forwarded it to the driver's terminal.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "ROSE_LOG_LEVEL"
DEFAULT_LEVEL = "info"


def configure(level: str | None = None, role: str = "driver") -> None:
    """Lines of the `rose` loggers at `level` (None: $ROSE_LOG_LEVEL, else info) to stderr,
    each tagged with `role`. Called again (a test, a restarted actor), it replaces its handler."""
    level = (level or os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL).lower()
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    os.environ[LEVEL_ENV] = level  # what this process's Ray workers start with
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
                                           "%H:%M:%S"))
    logger = logging.getLogger("rose")
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # Ray's and the root logger's handlers would print each line twice


class _Stderr(logging.StreamHandler):
    """To whatever sys.stderr is at each line: pytest and others swap it after `configure`."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass
