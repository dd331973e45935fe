"""Checkpoints through the object store: an actor on a node that does not share the driver's
filesystem opens a copy of its own, written whole, once per node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rose.model import load_model
from rose.runtime.checkpoints import (
    check_checkpoint_dir,
    for_actors,
    open_checkpoint,
    probe_dir,
    ship,
    written_at,
)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False,
                 log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_a_shipped_checkpoint_opens_as_a_copy_on_another_node(local_ray: None, tiny_qwen3: Path,
                                                               tmp_path: Path) -> None:
    shipped = for_actors(str(tiny_qwen3), local=False)
    assert written_at(shipped) == str(tiny_qwen3)
    assert for_actors(str(tiny_qwen3), local=True) == str(tiny_qwen3)  # locally: the path itself
    node = tmp_path / "other-node"  # what that node's temporary directory holds
    copy = Path(open_checkpoint(shipped, node))
    assert copy.parent == node and copy != tiny_qwen3
    assert sorted(f.name for f in copy.iterdir()) == sorted(f.name for f in tiny_qwen3.iterdir())
    assert all((copy / f.name).read_bytes() == f.read_bytes() for f in tiny_qwen3.iterdir())
    load_model(copy)  # a checkpoint, whole
    written = (copy / "config.json").stat().st_mtime_ns
    assert open_checkpoint(shipped, node) == str(copy)  # once per node
    assert (copy / "config.json").stat().st_mtime_ns == written
    assert not [p for p in node.iterdir() if p.name.endswith(".partial")]


def test_other_files_are_another_copy(local_ray: None, tiny_qwen3: Path, tiny_qwen2: Path,
                                      tmp_path: Path) -> None:
    a, b = ship(tiny_qwen3), ship(tiny_qwen2)
    assert a.digest != b.digest and ship(tiny_qwen3).digest == a.digest
    assert open_checkpoint(a, tmp_path) != open_checkpoint(b, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files to ship"):
        ship(tmp_path / "empty")


def test_the_checkpoint_dir_is_checked_from_the_trainers_node(tmp_path: Path) -> None:
    """Written on the trainer's node and seen from the driver's: fine, the probe removed; written
    but unseen (no shared filesystem): a warning; not writable: refused, naming the key."""
    out = tmp_path / "run"
    probe = probe_dir(out)
    assert check_checkpoint_dir(out, str(probe)) is None and not probe.exists() and out.is_dir()
    unseen = check_checkpoint_dir(out, str(out / ".rose-probe-on-another-node"))
    assert unseen is not None and "is not the driver's" in unseen and "share" in unseen
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        probe_dir(tmp_path / "file" / "run")
    with pytest.raises(ValueError, match=r"train.out_dir .* is not writable on the trainer's node \(denied"):
        check_checkpoint_dir(out, PermissionError("denied"))
