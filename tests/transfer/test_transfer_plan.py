"""Layouts and the routing plan: property tests over random shapes, world sizes and layouts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.model import preset_config
from rose.transfer.layouts import (
    ModelSpec,
    ParamSpec,
    ReceiverSpec,
    Split,
    TrainerSpec,
    box_numel,
    config_spec,
    full_box,
    infer_split,
    local_slices,
    receiver_layout,
    stages_of,
    tp_box,
    trainer_layout,
)
from rose.transfer.plan import build_plan, member_plan


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    num_layers = draw(st.integers(1, 4))
    params = []
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
        splits = [Split.REPLICATED] + [s for s in Split if s.dim is not None and s.dim < len(shape)]
        params.append(ParamSpec(f"p{i}", shape, draw(st.sampled_from([torch.bfloat16, torch.float32])),
                                draw(st.sampled_from(splits)), draw(st.integers(-1, num_layers)),
                                tied=draw(st.booleans())))
    return ModelSpec(tuple(params), num_layers)


def _count(shape: tuple[int, ...], boxes) -> torch.Tensor:
    """How many of `boxes` cover each element."""
    count = torch.zeros(shape, dtype=torch.int32)
    for box in boxes:
        count[local_slices(box, full_box(shape))] += 1
    return count


@settings(max_examples=150, deadline=None)
@given(spec=model_specs(), fsdp=st.integers(1, 4), tp=st.integers(1, 3), pp=st.integers(1, 3),
       replicas=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=3),
       bucket_bytes=st.integers(1, 256))
def test_plan_routes_every_receiver_exactly_its_shard(spec: ModelSpec, fsdp: int, tp: int, pp: int,
                                                      replicas: list[tuple[int, int]],
                                                      bucket_bytes: int) -> None:
    trainer = trainer_layout(spec, TrainerSpec(fsdp, tp, pp))
    receivers = {}
    for i, (rtp, rpp) in enumerate(replicas):
        layout = receiver_layout(spec, rtp, rpp)
        for rank in range(rtp * rpp):
            receivers[ReceiverSpec(f"r{i}", rtp, rpp, rank).id] = layout.rank_boxes(rank)
    plan = build_plan(spec, trainer, receivers, bucket_bytes)
    itemsize = {p.name: p.dtype.itemsize for p in spec.params}
    for p in spec.params:
        owned = trainer.boxes[p.name]
        # The trainer owns every element exactly once.
        assert (_count(p.shape, [b for b in owned if b is not None]) == 1).all()
        frags = [f for b in plan.buckets for f in b.fragments if f.param == p.name]
        # Each element crosses the link at most once, and only from the rank that owns it.
        assert (_count(p.shape, [f.box for f in frags]) <= 1).all()
        for f in frags:
            assert _count(p.shape, [f.box]).le(_count(p.shape, [owned[f.sender]])).all()
        # Every receiver reassembles exactly its shard, from the senders' local shards only.
        full = torch.arange(math.prod(p.shape), dtype=torch.float64).reshape(p.shape)
        local = {r: full[local_slices(b, full_box(p.shape))] for r, b in enumerate(owned) if b is not None}
        for rid, boxes in receivers.items():
            mine = [f for f in frags if rid in f.receivers]
            if p.name not in boxes:
                assert not mine
                continue
            box = boxes[p.name]
            assert (_count(p.shape, [f.box for f in mine]) == _count(p.shape, [box])).all()
            out = torch.full(tuple(hi - lo for lo, hi in box), -1.0, dtype=torch.float64)
            for f in mine:
                out[local_slices(f.box, box)] = local[f.sender][local_slices(f.box, owned[f.sender])]
            assert torch.equal(out, full[local_slices(box, full_box(p.shape))])
    for b in plan.buckets:
        assert all(f.sender == b.sender and f.receivers == b.receivers for f in b.fragments)
        # A bucket stays within its size unless it is one fragment of a row larger than a bucket.
        assert b.nbytes <= bucket_bytes or len(b.fragments) == 1
        assert b.nbytes == sum(box_numel(f.box) * itemsize[f.param] for f in b.fragments)


def test_qwen_splits_follow_module_type_and_name() -> None:
    spec = config_spec(preset_config("qwen2", "tiny", tie_word_embeddings=False))
    split = {p.name: p.split for p in spec.params}
    layer = "model.layers.0."
    assert split["model.embed_tokens.weight"] == split["lm_head.weight"] == Split.VOCAB
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.weight"):
        assert split[layer + "self_attn." + name] == Split.COLUMN
    assert split[layer + "self_attn.o_proj.weight"] == split[layer + "mlp.down_proj.weight"] == Split.ROW
    assert split[layer + "mlp.gate_proj.weight"] == split[layer + "mlp.up_proj.weight"] == Split.COLUMN
    assert split[layer + "input_layernorm.weight"] == split["model.norm.weight"] == Split.REPLICATED
    assert infer_split("foo.o_proj.bias") == Split.REPLICATED  # added after the all-reduce
    assert infer_split("foo.bar.weight", torch.nn.Linear(2, 2)) == Split.COLUMN
    assert infer_split("foo.bar.weight", torch.nn.Embedding(2, 2)) == Split.VOCAB
    assert infer_split("foo.x_proj.weight", torch.nn.LayerNorm(2)) == Split.REPLICATED  # type wins


def test_overrides_and_bad_splits() -> None:
    config = preset_config("qwen3", "tiny")
    spec = config_spec(config, overrides={"*.mlp.up_proj.weight": Split.ROW,
                                          "model.norm.weight": "replicated"})
    assert {p.name: p.split for p in spec.params}["model.layers.1.mlp.up_proj.weight"] == Split.ROW
    with pytest.raises(ValueError, match=r"model\.norm\.weight: a row split needs dim 1"):
        config_spec(config, overrides={"model.norm.weight": Split.ROW})


def test_tensor_parallel_heads() -> None:
    spec = config_spec(preset_config("qwen3", "tiny"))  # 4 query heads, 2 KV heads of 16
    p = {q.name: q for q in spec.params}
    k = p["model.layers.0.self_attn.k_proj.weight"]
    # TP=4 over 2 KV heads: each head is replicated on two ranks, never cut.
    assert [tp_box(k, 4, r)[0] for r in range(4)] == [(0, 16), (0, 16), (16, 32), (16, 32)]
    o = p["model.layers.0.self_attn.o_proj.weight"]
    assert [tp_box(o, 2, r) for r in range(2)] == [((0, 64), (0, 32)), ((0, 64), (32, 64))]
    with pytest.raises(ValueError, match="4 heads cannot be split over tensor-parallel size 3"):
        tp_box(p["model.layers.0.self_attn.q_proj.weight"], 3, 0)
    # A trainer with TP=4 owns each replicated head once.
    owned = trainer_layout(spec, TrainerSpec(tp=4)).boxes[k.name]
    assert owned == (((0, 16), (0, 64)), None, ((16, 32), (0, 64)), None)


def test_pipeline_stages() -> None:
    spec = config_spec(preset_config("qwen3", "tiny", num_hidden_layers=5))  # tied embeddings
    p = {q.name: q for q in spec.params}
    stages = [stages_of(p[f"model.layers.{i}.mlp.up_proj.weight"], 2, 5) for i in range(5)]
    assert stages == [{0}, {0}, {0}, {1}, {1}]
    assert stages_of(p["model.embed_tokens.weight"], 2, 5) == {0, 1}  # tied: the last stage's lm_head
    assert stages_of(p["model.norm.weight"], 2, 5) == {1}
    layout = receiver_layout(spec, tp=2, pp=2)
    assert set(layout.rank_boxes(3)) == {n for n, q in p.items() if 1 in stages_of(q, 2, 5)}


def test_member_plan_shares_slices_between_replicas() -> None:
    spec = config_spec(preset_config("qwen3", "small"))
    members = tuple(ReceiverSpec(n, tp, 1, r) for n, tp in (("a", 2), ("b", 2), ("c", 1)) for r in range(tp))
    plan = member_plan(spec, TrainerSpec(fsdp=2), members, 8 << 20)
    # Each byte crosses once although three replicas need it.
    assert plan.nbytes == spec.nbytes
    assert sum(b.nbytes for b in plan.for_receiver("c/0")) == spec.nbytes
    assert sum(b.nbytes for b in plan.for_receiver("a/0")) + sum(b.nbytes for b in plan.for_receiver("a/1")) \
        > spec.nbytes  # replicated norms count on both ranks
    assert max(b.nbytes for b in plan.buckets) <= 8 << 20


def test_llama_heads_split_without_qk_norms() -> None:
    """SmolLM2-135M's attention (9 query heads, 3 KV heads of 64), with biases: TP 3 gives each
    rank whole heads, TP 2 cannot; o_proj's bias is added after the all-reduce."""
    config = preset_config("llama", "tiny", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, attention_bias=True)
    p = {q.name: q for q in config_spec(config).params}
    layer = "model.layers.0.self_attn."
    assert not any("norm" in name for name in p if name.startswith(layer))
    assert p[layer + "o_proj.bias"].split == Split.REPLICATED
    q, k = p[layer + "q_proj.weight"], p[layer + "k_proj.bias"]
    assert [tp_box(q, 3, r)[0] for r in range(3)] == [(0, 192), (192, 384), (384, 576)]
    assert [tp_box(k, 3, r) for r in range(3)] == [((0, 64),), ((64, 128),), ((128, 192),)]
    with pytest.raises(ValueError, match="9 heads cannot be split over tensor-parallel size 2"):
        tp_box(q, 2, 0)
