"""Where a model runs and in which dtype: every `device` and `dtype` setting is resolved here.

`device` is "cpu", "cuda" or "cuda:N"; None picks CUDA when torch sees a CUDA device, else the
CPU. `dtype` is "float32" or "bfloat16"; None picks the device's default: bfloat16 on CUDA
(tensor cores, half the memory for weights and KV), float32 on the CPU, where most processors
have no fast bf16 arithmetic.
"""

from __future__ import annotations

import argparse

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda if this machine has one, else cpu)"
DTYPE_HELP = "float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device named (None: the default); ValueError saying what is wrong when it cannot be used."""
    name = default_device() if device is None else str(device)
    try:
        resolved = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a device; expected {DEVICE_HELP}") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device {name!r}: ROSE runs on cpu or cuda, not {resolved.type}")
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device {name!r}: no CUDA device is available here (torch {torch.__version__} is "
                         f"{build}, torch.cuda.is_available() is False); name cpu instead")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype named (None: `device`'s default); ValueError naming the choices otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve(device: str | torch.device | None, dtype: str | torch.dtype | None = None,
            label: str = "") -> tuple[torch.device, torch.dtype]:
    """`resolve_device` then `resolve_dtype` on it; an error's message starts with `label`."""
    try:
        resolved = resolve_device(device)
        return resolved, resolve_dtype(dtype, resolved)
    except ValueError as exc:
        raise ValueError(f"{label}{exc}") from None


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype`, for a command that runs a model (not given: the defaults)."""
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=list(DTYPES), help=DTYPE_HELP)
