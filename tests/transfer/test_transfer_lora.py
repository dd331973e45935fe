"""A LoRA adapter alone through the transfer engine: `adapter_spec` makes its tensors a model of
their own, so Sender and Receiver sync it (full, then deltas) exactly as they sync weights."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from rose.contracts import WeightUpdate
from rose.contracts.adapter import LoRAConfig
from rose.model import preset_config
from rose.model.lora import check_tensors
from rose.transfer import (
    LocalRelay,
    Receiver,
    ReceiverSpec,
    Sender,
    Split,
    SyncPolicy,
    TrainerSpec,
    adapter_spec,
    receiver_layout,
    trainer_layout,
)
from rose.transfer.codec import tensor_hash
from rose.transfer.layouts import shard

CONFIG = preset_config("qwen3", "tiny")
LORA = LoRAConfig(rank=8)
LAYER0 = "model.layers.0."


def test_adapter_spec_is_the_adapters_tensors_split_as_vllm_splits_them() -> None:
    spec = adapter_spec(CONFIG, LORA)
    assert {p.name: p.shape for p in spec.params} == LORA.shapes(CONFIG)
    assert all(p.dtype == torch.bfloat16 for p in spec.params)
    splits = {p.name.removeprefix(LAYER0): (p.split, p.units) for p in spec.params if p.layer == 0}
    # Column-parallel linears: A whole on every rank, B cut on its output rows by heads.
    assert splits["self_attn.q_proj.lora_A.weight"] == (Split.REPLICATED, None)
    assert splits["self_attn.k_proj.lora_B.weight"] == (Split.COLUMN, CONFIG.num_key_value_heads)
    assert splits["mlp.up_proj.lora_B.weight"] == (Split.COLUMN, None)
    # Row-parallel linears: A cut on its input columns, B whole.
    assert splits["self_attn.o_proj.lora_A.weight"] == (Split.ROW, CONFIG.num_attention_heads)
    assert splits["mlp.down_proj.lora_B.weight"] == (Split.REPLICATED, None)
    assert {p.layer for p in spec.params} == set(range(CONFIG.num_hidden_layers))
    # Two LoRAs of other ranks are other models: a receiver refuses the other's announcement.
    assert spec.fingerprint() != adapter_spec(CONFIG, LoRAConfig(rank=4)).fingerprint()


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
            for name, shape in LORA.shapes(CONFIG).items()}


def _collect(into: dict[str, torch.Tensor]) -> WeightUpdate:
    def on_apply(named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        into.update((n, t.clone()) for n, t in named)
    return on_apply


def test_adapter_syncs_bit_exact_full_then_sparse_then_dense_deltas() -> None:
    spec = adapter_spec(CONFIG, LORA)
    policy = _adapter(0)
    tspec = TrainerSpec(fsdp=2)
    tlayout = trainer_layout(spec, tspec)
    relay = LocalRelay()
    senders = [Sender(relay, spec, shard(policy, tlayout.rank_boxes(r)), trainer=tspec, rank=r,
                      group="adapter", policy=SyncPolicy(full_every=0), bucket_bytes=4 << 10)
               for r in range(tspec.world)]
    engine: dict[str, torch.Tensor] = {}  # what an engine's load_adapter would be handed
    receivers = [Receiver(relay, spec, ReceiverSpec("a", tp=2, rank=r), group="adapter") for r in range(2)]
    receivers.append(Receiver(relay, spec, ReceiverSpec("b"), on_apply=_collect(engine), group="adapter"))
    for r in receivers:
        r.join()
    pool = ThreadPoolExecutor(max_workers=len(senders) + len(receivers))
    raw = spec.nbytes

    def sync(version: int) -> tuple[list[str], int, float]:
        """The receivers' kinds of sync, the bytes put on the link, the fraction of elements changed."""
        pulls = [pool.submit(r.sync, 10) for r in receivers]
        reports = [f.result() for f in [pool.submit(s.publish, version) for s in senders]]
        assert [f.result() for f in pulls] == [version] * len(receivers)
        for r in receivers:
            want = shard(policy, receiver_layout(spec, r.me.tp).rank_boxes(r.me.rank))
            assert {n: tensor_hash(t) for n, t in r.tensors.items()} == {n: tensor_hash(t) for n, t in
                                                                        want.items()}, r.id
        check_tensors(LORA, CONFIG, engine, "receiver b/0")
        assert all(torch.equal(engine[n].view(torch.int16), policy[n].view(torch.int16)) for n in policy)
        assert sum(r.raw_bytes for r in reports) == raw  # every element crosses the link once
        changed = sum(r.changed for r in reports) / sum(r.compared for r in reports) if version > 1 else 1.0
        return [r.last.kind for r in receivers], sum(r.payload_bytes for r in reports), changed

    try:
        kinds, first_bytes, _ = sync(1)
        assert kinds == ["full"] * 3 and raw < first_bytes < 1.2 * raw  # a 72-byte header per fragment
        # A TP=2 rank holds A of q_proj whole but half of its B; o_proj the other way round.
        held = {n.removeprefix(LAYER0): tuple(t.shape) for n, t in receivers[0].tensors.items()}
        assert held["self_attn.q_proj.lora_A.weight"] == (LORA.rank, CONFIG.hidden_size)
        assert held["self_attn.q_proj.lora_B.weight"] == (CONFIG.num_attention_heads * CONFIG.head_dim // 2,
                                                          LORA.rank)
        assert held["self_attn.o_proj.lora_A.weight"] == (LORA.rank, CONFIG.num_attention_heads
                                                          * CONFIG.head_dim // 2)

        for t in policy.values():  # one bf16 ulp at every 37th element: a sparse delta
            t.view(torch.int16).view(-1)[::37] += 1
        kinds, sparse_bytes, changed = sync(2)
        assert kinds == ["delta"] * 3 and 0.02 < changed < 0.04 and sparse_bytes < 0.2 * raw

        gen = torch.Generator().manual_seed(1)
        for t in policy.values():  # an optimizer-like update: every element moves by two ulps or more
            signs = 2.0 * torch.randint(0, 2, t.shape, generator=gen) - 1
            t.copy_(t.float() * (1 + 2.0**-6 * signs))
        kinds, dense_bytes, changed = sync(3)
        # Still a delta sync, but a tensor whose every element changed travels as a full copy.
        assert kinds == ["delta"] * 3 and changed == 1.0 and dense_bytes == first_bytes
    finally:
        pool.shutdown()
        for s in senders:
            s.close()
