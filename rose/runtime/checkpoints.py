"""Checkpoint directories that every actor of a run can open, on any node.

Locally a checkpoint is its path. On a Ray cluster the run joined, nodes need not share the
driver's filesystem: the driver puts the files of the checkpoints it hands out (the initial
policy, the serving model, a resumed run's checkpoint) into Ray's object store once (`ship`),
and an actor writes them to a directory of its own node, named by their digest, before it loads
(`open_checkpoint`). A path on another node could hold other files under the same name (a
relative `train.out_dir`, an earlier run's), so on a cluster actors always open the shipped copy.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from rose.transfer.relay import get_objects

COPY_PREFIX = "rose-checkpoint-"


@dataclasses.dataclass(frozen=True)
class ShippedCheckpoint:
    """A checkpoint directory as the driver wrote it, its files in Ray's object store."""

    path: str  # where the driver wrote it (for messages)
    digest: str  # of the files' names and bytes: names the copy on each node
    files: Any  # ObjectRef of {path relative to the directory: bytes}


Checkpoint = str | ShippedCheckpoint


def written_at(checkpoint: Checkpoint) -> str:
    """Where the driver wrote `checkpoint` (its path on the driver's node)."""
    return checkpoint.path if isinstance(checkpoint, ShippedCheckpoint) else checkpoint


def ship(path: str | Path) -> ShippedCheckpoint:
    """Every file under `path` into the object store (the driver holds the reference)."""
    import ray

    root = Path(path)
    files = {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}
    if not files:
        raise ValueError(f"checkpoint {path}: no files to ship")
    digest = xxhash.xxh3_128()
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        digest.update(data)
    return ShippedCheckpoint(str(root), digest.hexdigest(), ray.put(files))


def open_checkpoint(checkpoint: Checkpoint, root: str | Path | None = None) -> str:
    """A directory of this node holding `checkpoint`: its path, or the shipped files written
    under `root` (default: the temporary directory) once per node, whole or not at all."""
    if isinstance(checkpoint, str):
        return checkpoint
    target = Path(root or tempfile.gettempdir()) / f"{COPY_PREFIX}{checkpoint.digest}"
    if target.is_dir():
        return str(target)  # written by an earlier actor on this node: renamed into place whole
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    for name, data in get_objects([checkpoint.files])[0].items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(data)
    try:
        partial.rename(target)
    except OSError:  # another actor of this node renamed its copy first: the same files
        shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def for_actors(path: str, local: bool) -> Checkpoint:
    """What the run hands its actors for the checkpoint at `path`: the path itself in local mode."""
    return path if local else ship(path)


def probe_dir(path: str | Path) -> Path:
    """Make `path` on this node and leave a probe file in it (its path returned): the trainer's
    node must be able to write its checkpoints there. OSError when it cannot."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".rose-probe-{os.getpid()}-{os.urandom(4).hex()}"
    probe.write_bytes(b"")
    return probe


def check_checkpoint_dir(out_dir: Path, probe: str | BaseException) -> str | None:
    """What the trainer's node made of `out_dir` (`probe`: its probe file's path, or why it failed),
    judged from the driver's node: ValueError when the trainer cannot write there; a warning
    (returned) when the driver cannot see what it wrote, i.e. the two share no filesystem."""
    if isinstance(probe, BaseException):
        raise ValueError(f"config: train.out_dir {out_dir} is not writable on the trainer's node "
                         f"({probe}); give a directory the trainer's nodes can write") from None
    file = Path(probe)
    if not file.exists():  # (the probe stays on the trainer's node: an empty hidden file)
        return (f"train.out_dir {out_dir} on the trainer's node is not the driver's: its checkpoints stay "
                "on that node, and a trainer restarted on another node cannot resume from them; give a "
                "directory on a filesystem the trainer's nodes share")
    file.unlink()
    return None
