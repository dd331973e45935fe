"""The benchmarks behind `rose bench NAME [--quick] --json OUT`."""

from __future__ import annotations

import argparse
from pathlib import Path

from rose.model import CheckpointError, ModelConfig
from rose.model.device import resolve


def checkpoint_arg(flag: str, path: str, min_vocab: int = 1) -> Path:
    """The checkpoint that `flag` names, checked before anything loads or starts: its config.json
    one this project runs, its vocabulary holding the token ids the benchmark draws (below
    `min_vocab`)."""
    try:
        vocab = ModelConfig.from_dir(path).vocab_size
    except CheckpointError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if vocab < min_vocab:
        raise ValueError(f"{flag} {path}: a vocabulary of {vocab} tokens; this benchmark draws token ids "
                         f"up to {min_vocab - 1}")
    return Path(path)


def serve_device_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The `rose serve` flags for the device asked (none: the server's defaults), checked first."""
    resolve(args.device, args.dtype, "--device/--dtype: ")
    return tuple(arg for flag, value in (("--device", args.device), ("--dtype", args.dtype)) if value
                 for arg in (flag, value))
