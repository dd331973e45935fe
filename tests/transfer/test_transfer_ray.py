"""The default relay: Ray's object store, with a receiver in another process (a Ray actor)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from rose.bench.transfer import SyntheticTrainer
from rose.model import preset_config
from rose.transfer import RayRelay, Receiver, ReceiverSpec, Sender, model_spec, receiver_layout
from rose.transfer.codec import tensor_hash
from rose.transfer.layouts import shard
from rose.transfer.relay import _Directory

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def relay():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             log_to_driver=False, object_store_memory=200 << 20)
    relay = RayRelay(name="rose-test-relay")
    yield relay
    relay.close()
    ray.shutdown()


def test_relay_round_trip_and_timeout(relay: RayRelay) -> None:
    bulk = [b"header", np.arange(1 << 17, dtype=np.uint8)]  # past the inline limit: object store
    relay.put("t/bulk", bulk)
    relay.put("t/small", {"version": 3})
    got = relay.get("t/bulk", 5)
    assert got[0] == b"header" and np.array_equal(got[1], bulk[1]) and not got[1].flags.writeable
    assert relay.scan("t/").keys() == {"t/bulk", "t/small"} and relay.get("t/small") == {"version": 3}
    relay.delete("t/")
    with pytest.raises(TimeoutError, match="no 't/small'"):
        relay.get("t/small", 0.05)


def test_receivers_in_and_out_of_process_end_bit_exact(relay: RayRelay) -> None:
    trainer = SyntheticTrainer(preset_config("qwen3", "tiny"), seed=1, batch=2, seq=8, lr=1e-5)
    spec = model_spec(trainer.model)
    sender = Sender(relay, spec, trainer.policy, group="ray", bucket_bytes=32 << 10)
    local = [Receiver(relay, spec, ReceiverSpec("local", tp=2, rank=r), group="ray") for r in range(2)]
    remote = ray.remote(Receiver).options(num_cpus=0).remote(relay, spec, ReceiverSpec("remote"), group="ray")
    ray.get(remote.join.remote())
    for r in local:
        r.join()
    with ThreadPoolExecutor(2) as pool:
        for version in (1, 2, 3):
            if version > 1:
                trainer.step()
            pulls = [pool.submit(r.sync, 30) for r in local]
            pulled = remote.sync.remote(30)
            sender.publish(version)
            assert [f.result() for f in pulls] == [version, version] and ray.get(pulled) == version
    assert ray.get(remote.digests.remote()) == {n: tensor_hash(t) for n, t in trainer.policy.items()}
    for r in local:
        want = shard(trainer.policy, receiver_layout(spec, 2).rank_boxes(r.me.rank))
        assert r.digests() == {n: tensor_hash(t) for n, t in want.items()}
        assert r.last.kind == "delta"
    sender.close()


def test_a_receiver_in_another_process_is_in_the_first_sync_after_its_join(relay: RayRelay) -> None:
    """A loaded node delivers a receiver's registration late: `join` and `sync` must not return
    before it lands, or the sender's next announcement leaves the receiver out (its first sync
    then returns None) or sends it a full copy instead of a delta."""

    class LateMembers(_Directory):
        async def put(self, key: str, item: Any) -> None:
            if "/members/" in key:
                await asyncio.sleep(2.0)
            await super().put(key, item)

    class Remote(Receiver):
        def last_kind(self) -> str:
            return self.last.kind

    name = "rose-test-late-members"
    actor = ray.remote(num_cpus=0, max_concurrency=1000)(LateMembers)
    directory = actor.options(name=name, namespace="rose").remote()  # held: an actor without a handle is gone
    late = RayRelay(name=name)  # finds the directory above by its name
    trainer = SyntheticTrainer(preset_config("qwen3", "tiny"), seed=2, batch=2, seq=8, lr=1e-5)
    spec = model_spec(trainer.model)
    sender = Sender(late, spec, trainer.policy, group="late")
    remote = ray.remote(Remote).options(num_cpus=0).remote(late, spec, ReceiverSpec("remote"), group="late")
    ray.get(remote.join.remote())
    kinds = []
    for version in (1, 2):
        if version > 1:
            trainer.step()
        pulled = remote.sync.remote(30)
        sender.publish(version)
        assert ray.get(pulled) == version
        kinds.append(ray.get(remote.last_kind.remote()))
    assert kinds == ["full", "delta"]
    sender.close()
    ray.kill(directory)
