"""Senders and receivers over the in-process relay: 20+ versions of real AdamW steps with a
dropped and retried bucket, a corrupted payload, a late joiner, a crashed and restarted
receiver and a leaver; at the end every receiver hash-equals the trainer."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard

from rose.bench.transfer import SyntheticTrainer
from rose.model import CausalLM, preset_config
from rose.transfer import (
    Link,
    LinkError,
    LocalRelay,
    Receiver,
    ReceiverSpec,
    Sender,
    SyncPolicy,
    TrainerSpec,
    codec,
    load_into,
    model_spec,
    receiver_layout,
    trainer_layout,
)
from rose.transfer.codec import tensor_hash
from rose.transfer.layouts import shard


class DropOnce:
    """A link fault: the first transmission of the first bucket whose key contains `needle` is lost."""

    def __init__(self, needle: str) -> None:
        self.needle, self.dropped = needle, []

    def __call__(self, key: str) -> bool:
        if not self.dropped and self.needle in key:
            self.dropped.append(key)
            return True
        return False


class Faulty:
    """The relay as one receiver sees it: can corrupt the next payload or kill the reader."""

    def __init__(self, relay: LocalRelay) -> None:
        self.relay, self.corrupt_next, self.crash_after = relay, False, None
        self.forge_next: Callable[[list], Any] | None = None

    def get(self, key: str, timeout: float | None = None) -> Any:
        value = self.relay.get(key, timeout)
        if isinstance(value, list):  # a bucket
            if self.forge_next is not None:
                value, self.forge_next = self.forge_next(value), None
            if self.crash_after is not None:
                self.crash_after -= 1
                if self.crash_after < 0:
                    raise RuntimeError("receiver process killed")
            if self.corrupt_next:
                self.corrupt_next = False
                body = value[1].copy()
                body[body.size // 2] ^= 0x40
                value = [value[0], body, *value[2:]]
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.relay, name)


def _round(pool: ThreadPoolExecutor, senders: list[Sender], receivers: list[Receiver],
           version: int) -> tuple[list, dict[str, Any]]:
    pulls = {r.id: pool.submit(r.sync, 10) for r in receivers}
    reports = [f.result() for f in [pool.submit(s.publish, version) for s in senders]]
    got = {}
    for rid, f in pulls.items():
        try:
            got[rid] = f.result()
        except RuntimeError as exc:
            got[rid] = exc
    return reports, got


def _assert_in_sync(policy: dict[str, torch.Tensor], r: Receiver) -> None:
    want = shard(policy, receiver_layout(r.spec, r.me.tp, r.me.pp).rank_boxes(r.me.rank))
    assert set(want) == set(r.tensors)
    for name, t in r.tensors.items():
        assert tensor_hash(t) == tensor_hash(want[name]), f"{r.id}: {name} differs from the trainer"


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one intra-op thread (two spin against the sync threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_twenty_versions_with_faults_end_bit_exact(one_thread: None) -> None:
    config = preset_config("qwen3", "tiny")
    trainer = SyntheticTrainer(config, seed=0, batch=2, seq=16, lr=1e-5)
    spec = model_spec(trainer.model)
    tspec = TrainerSpec(fsdp=2)
    tlayout = trainer_layout(spec, tspec)
    relay = LocalRelay()
    drop = DropOnce("/delta/s1/")
    link = Link(50.0, drop=drop)
    senders = [Sender(relay, spec, shard(trainer.policy, tlayout.rank_boxes(rank)), trainer=tspec, rank=rank,
                      policy=SyncPolicy(full_every=8), link=link, bucket_bytes=16 << 10) for rank in range(2)]
    engine_b = CausalLM(config)  # stands in for an engine with load_weights
    views = {"a/0": Faulty(relay), "a/1": Faulty(relay), "b/0": Faulty(relay)}
    receivers = {
        "a/0": Receiver(views["a/0"], spec, ReceiverSpec("a", tp=2, rank=0)),
        "a/1": Receiver(views["a/1"], spec, ReceiverSpec("a", tp=2, rank=1)),
        "b/0": Receiver(views["b/0"], spec, ReceiverSpec("b"), on_apply=load_into(engine_b)),
    }
    for r in receivers.values():
        r.join()
    kinds: dict[str, list[str]] = {}
    retries = 0
    pool = ThreadPoolExecutor(max_workers=8)
    for version in range(1, 23):
        if version > 1:
            trainer.step()
        if version == 6:
            views["b/0"].corrupt_next = True
        if version == 9:
            receivers["late/0"] = Receiver(relay, spec, ReceiverSpec("late"))
            receivers["late/0"].join()
        if version == 13:
            views["a/1"].crash_after = 1  # dies after its first bucket
        if version == 14:  # restarted: a fresh process with empty tensors, same identity
            receivers["a/1"] = Receiver(relay, spec, ReceiverSpec("a", tp=2, rank=1))
            receivers["a/1"].join()
        if version == 18:
            receivers.pop("late/0").leave()
        reports, got = _round(pool, senders, list(receivers.values()), version)
        retries += sum(r.retries for r in reports)
        for rid, r in receivers.items():
            kinds.setdefault(rid, []).append(r.last.kind if not isinstance(got[rid], Exception) else "crash")
        if version == 6:
            assert got["b/0"] is None and "payload checksum mismatch" in receivers["b/0"].last.error
            assert engine_b.policy_version == 5  # the engine never saw the bad version
    assert drop.dropped and link.drops == 1 and retries == 1
    assert kinds["a/0"] == ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 5
    assert kinds["b/0"][4:8] == ["delta", "failed", "full", "delta"]
    assert kinds["late/0"][:2] == ["full", "delta"]
    assert kinds["a/1"][11:15] == ["delta", "crash", "full", "delta"]
    for r in receivers.values():
        assert r.version == 22
        _assert_in_sync(trainer.policy, r)
    assert engine_b.policy_version == 22
    for name, p in engine_b.named_parameters():
        assert torch.equal(p, trainer.policy[name].float()), name
    # Publishing the current version again only serves members that are behind: none are.
    assert all(s.publish(22).buckets == 0 for s in senders)
    pool.shutdown()


def test_sync_policy_decisions() -> None:
    policy = SyncPolicy(full_every=4)
    members = {"a/0": 3, "b/0": None, "c/0": 2}
    d = policy.decide(4, baseline=3, last_full=1, members=members)
    assert (d.base, d.delta_for, d.full_for, d.periodic) == (3, ("a/0",), ("b/0", "c/0"), False)
    d = policy.decide(5, baseline=4, last_full=1, members={"a/0": 4})
    assert d.full_for == ("a/0",) and d.periodic  # every 4 versions everyone gets a full copy
    assert policy.decide(2, baseline=None, last_full=None, members=members).full_for == ("a/0", "b/0", "c/0")
    assert policy.decide(4, baseline=3, last_full=3, members={"a/0": 3}, force_full=True).full_for == ("a/0",)
    again = policy.decide(4, baseline=4, last_full=3, members={"a/0": 4, "b/0": 3})
    assert again.delta_for == () and again.full_for == ("b/0",)
    with pytest.raises(ValueError, match="full_every must be >= 0"):
        SyncPolicy(full_every=-1)


def test_sender_refuses_shards_that_do_not_match_its_layout() -> None:
    config = preset_config("qwen3", "tiny")
    model = CausalLM(config)
    spec = model_spec(model)
    tensors = shard({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
                    trainer_layout(spec, TrainerSpec(fsdp=2)).rank_boxes(0))
    with pytest.raises(ValueError, match=r"rank 0: model\.embed_tokens\.weight has shape \(256, 64\), "
                                         r"its shard is \(512, 64\)"):
        Sender(LocalRelay(), spec, tensors)  # a whole-model layout (fsdp=1) expects full tensors
    tensors = {n: t.float() for n, t in tensors.items()}
    with pytest.raises(ValueError, match=r"is torch\.float32, the transfer dtype is torch\.bfloat16"):
        Sender(LocalRelay(), spec, tensors, trainer=TrainerSpec(fsdp=2))


def test_link_paces_bytes_and_reports_losses() -> None:
    link = Link(0.08, burst_bytes=0)  # 10 MB/s
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # two senders share the link
        list(pool.map(lambda k: link.transmit(k, 500_000), ["x", "y"]))
    assert 0.09 < time.monotonic() - start < 0.5
    assert link.bytes_sent == 1_000_000 and link.seconds(1_000_000) == pytest.approx(0.1)
    lossy = Link(100, drop=lambda key: key == "lost")
    with pytest.raises(LinkError, match="bucket lost"):
        lossy.transmit("lost", 10)
    assert lossy.drops == 1


def test_local_relay_waits_and_times_out() -> None:
    relay = LocalRelay()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(relay.get, "k", 5)
        time.sleep(0.05)
        relay.put("k", 1)
        assert waiting.result() == 1
    with pytest.raises(TimeoutError, match=r"no 'missing' after 0\.01 s"):
        relay.get("missing", 0.01)
    relay.put("p/a", 1)
    relay.put("p/b", 2)
    assert relay.scan("p/") == {"p/a": 1, "p/b": 2}
    relay.delete("p/")
    assert relay.scan("p/") == {}


def _zstd_bomb(parts: list) -> list:
    """The bucket with its first payload forged: a valid-looking delta whose zstd body declares
    1 GiB (a 32 KiB frame); its check recomputed, as anyone who can write to the relay could."""
    fields = list(codec._FIXED.unpack_from(parts[0]))
    co = zstandard.ZstdCompressor().compressobj(size=1 << 30)
    frame = np.frombuffer(b"".join(co.compress(bytes(1 << 24)) for _ in range(64)) + co.flush(), np.uint8)
    fields[1], fields[3], fields[7], fields[8] = codec.DELTA, codec.ZSTD, 1 << 30, frame.size
    head = codec._FIXED.pack(*fields) + parts[0][codec._FIXED.size:-8]
    return [head + codec._CHECK.pack(xxhash.xxh3_64(head + frame.tobytes()).intdigest()), frame, *parts[2:]]


@pytest.mark.parametrize(("forge", "message"), [
    (_zstd_bomb, r"model\.\S+ \(\(.*\)\) in bucket \S+: delta body declares 1073741824 bytes, "
                 r"a delta must be smaller than the tensor's \d+"),
    (lambda parts: [parts[0], parts[1].tobytes(), *parts[2:]],
     "holds a bytes header and a bytes body, expected bytes and a flat uint8 array"),
    (lambda parts: {"parts": parts}, "holds a dict, the plan expects"),
])
def test_a_forged_bucket_fails_one_sync_and_the_next_repairs_it(forge: Callable[[list], Any], message: str,
                                                                 one_thread: None) -> None:
    trainer = SyntheticTrainer(preset_config("qwen3", "tiny"), seed=0, batch=2, seq=8, lr=1e-5)
    spec = model_spec(trainer.model)
    relay = LocalRelay()
    sender = Sender(relay, spec, trainer.policy, bucket_bytes=16 << 10)
    view = Faulty(relay)
    receiver = Receiver(view, spec, ReceiverSpec("a"))
    receiver.join()
    kinds = []
    with ThreadPoolExecutor(1) as pool:
        for version in (1, 2, 3):
            if version > 1:
                trainer.step()
            view.forge_next = forge if version == 2 else None
            pull = pool.submit(receiver.sync, 10)
            sender.publish(version)
            assert pull.result() == (None if version == 2 else version)
            kinds.append(receiver.last.kind)
            if version == 2:
                assert re.search(message, receiver.last.error), receiver.last.error
    assert kinds == ["full", "failed", "full"]
    _assert_in_sync(trainer.policy, receiver)
    sender.close()


def test_a_receiver_of_another_model_refuses_the_sync_by_its_fingerprint() -> None:
    trainer = SyntheticTrainer(preset_config("qwen3", "tiny"), seed=0, batch=2, seq=8, lr=1e-5)
    spec, other = model_spec(trainer.model), model_spec(trainer.model, dtype=torch.float16)
    relay = LocalRelay()
    sender = Sender(relay, spec, trainer.policy)
    receiver = Receiver(relay, other, ReceiverSpec("a"))
    receiver.join()
    with ThreadPoolExecutor(1) as pool:
        pull = pool.submit(receiver.sync, 10)
        sender.publish(1)
        assert pull.result() is None
    assert receiver.last.error == (f"sync 1 is for model {spec.fingerprint()}, "
                                   f"this receiver holds {other.fingerprint()}")
    sender.close()
