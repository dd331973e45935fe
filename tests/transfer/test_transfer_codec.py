"""The delta codec: bit-exact round trips on raw bits, idempotence, and refusing bad payloads."""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.transfer import codec, kernels
from rose.transfer.codec import CorruptDelta, apply, encode

DTYPES = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
SPECIAL = {  # NaN with payloads, infinities, signed zeros, as raw bits
    torch.bfloat16: [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001],
    torch.float16: [0x7E01, 0xFC01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001],
    torch.float32: [0x7FC00001, 0xFF800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000, 0x00000001],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(DTYPES[t.dtype])


def from_bits(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(raw.astype(np.int64).astype(np.int16 if dtype != torch.float32 else np.int32)
                            ).view(dtype)


@st.composite
def pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = draw(st.sampled_from(list(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
    n = int(np.prod(shape))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    width = 16 if dtype != torch.float32 else 32
    special = np.array([s - (1 << width) if s >= 1 << (width - 1) else s for s in SPECIAL[dtype]])
    old = rng.integers(-(1 << (width - 1)), 1 << (width - 1), n)
    odd = rng.random(n) < 0.1
    old[odd] = rng.choice(special, int(odd.sum()))
    density = draw(st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]))
    new = old.copy()
    changed = rng.random(n) < density
    pool = np.concatenate([special, rng.integers(-(1 << (width - 1)), 1 << (width - 1), 8)])
    new[changed] = rng.choice(pool, int(changed.sum()))
    return from_bits(old, dtype).reshape(shape), from_bits(new, dtype).reshape(shape)


@settings(max_examples=200, deadline=None)
@given(pair=pairs(), zstd=st.sampled_from([None, 1]))
def test_round_trip_is_bit_exact_and_idempotent(pair: tuple[torch.Tensor, torch.Tensor],
                                                zstd: int | None) -> None:
    old, new = pair
    payload = encode(old, new, zstd_level=zstd)
    out = apply(old, payload)
    assert out.dtype == new.dtype and out.shape == new.shape
    assert torch.equal(bits(out), bits(new))
    assert torch.equal(bits(apply(out, payload)), bits(new))  # applying twice is harmless
    assert len(payload) <= new.numel() * new.element_size() + 200  # never much worse than raw


@settings(max_examples=100, deadline=None)
@given(pair=pairs(), where=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_any_corrupted_byte_is_refused(pair: tuple[torch.Tensor, torch.Tensor], where: float,
                                       flip: int) -> None:
    old, new = pair
    payload = bytearray(encode(old, new))
    payload[int(where * len(payload))] ^= flip
    with pytest.raises(CorruptDelta):
        apply(old, bytes(payload))


def test_truncated_or_extended_payloads_are_refused() -> None:
    old = torch.randn(64, 33).to(torch.bfloat16)
    new = old.clone()
    new[::7, ::5] += 1
    payload = encode(old, new)
    for n in range(len(payload)):
        with pytest.raises(CorruptDelta):
            apply(old, payload[:n])
    with pytest.raises(CorruptDelta, match="truncated or extended"):
        apply(old, payload + b"\0")


def test_mismatches_name_what_is_wrong() -> None:
    old = torch.randn(8, 16).to(torch.bfloat16)
    new = old.clone()
    new[0, :3] = 7
    payload = encode(old, new)
    with pytest.raises(CorruptDelta, match=r"shape mismatch: payload holds \(8, 16\), tensor is \(16, 8\)"):
        apply(old.reshape(16, 8), payload)
    dtype_error = "dtype mismatch: payload holds torch.bfloat16, tensor is torch.float16"
    with pytest.raises(CorruptDelta, match=re.escape(dtype_error)):
        apply(old.to(torch.float16), payload)
    other_base = old.clone()
    other_base[5, 5] = 3  # a position the delta does not touch
    with pytest.raises(CorruptDelta, match="result checksum mismatch"):
        apply(other_base, payload)
    with pytest.raises(CorruptDelta, match="not a ROSE weight payload"):
        apply(old, b"XXXX" + payload[4:])
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.int64"):
        encode(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"shape mismatch: old is \(3,\), new is \(4,\)"):
        encode(torch.zeros(3), torch.zeros(4))


def test_sparse_payload_mixes_gaps_bitmaps_and_escapes() -> None:
    n = 5 * codec.CHUNK + 123
    old = (torch.randn(n) * 0.02).to(torch.bfloat16)
    new = old.clone()
    rng = np.random.default_rng(0)
    sparse = rng.choice(codec.CHUNK, codec.CHUNK // 100, replace=False)  # chunk 0: 1%, byte gaps
    dense = codec.CHUNK + rng.choice(codec.CHUNK, codec.CHUNK // 2, replace=False)  # chunk 1: bitmap
    lonely = [3 * codec.CHUNK + 7, n - 1]  # gaps past 255: escapes; chunk 2 stays empty
    for idx in (sparse, dense, lonely):
        new[torch.as_tensor(idx)] = -new[torch.as_tensor(idx)] - 1
    payload = encode(old, new)
    assert torch.equal(bits(apply(old, payload)), bits(new))
    changed = len(sparse) + len(dense) + len(lonely)
    # values 2 bytes each, sparse indices a byte (some 5: an escape), the dense chunk an 8 KiB bitmap
    assert len(payload) < 2 * changed + 1.5 * len(sparse) + codec.CHUNK // 8 + 200


def test_delta_of_a_real_sparsity_is_small_and_applies_through_strides() -> None:
    old = (torch.randn(1024, 1024) * 0.02).to(torch.bfloat16)
    new = old.clone()
    mask = torch.rand(old.shape) < 0.01
    new[mask] = (new[mask].float() * 1.01).to(torch.bfloat16)
    payload = encode(old, new)
    assert len(payload) < 0.02 * old.numel() * 2  # 1% changed: ~3 bytes per change
    # The receiver applies into views of its shard: rows, columns, transposes.
    big = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    big[:, 1024:] = old
    header, body = codec.split_payload(payload)
    codec.apply_into(big[:, 1024:], header, body)
    assert torch.equal(bits(big[:, 1024:]), bits(new)) and not big[:, :1024].any()
    t = old.t().clone().t()  # same values, column-major strides
    codec.apply_into(t, header, body)
    assert torch.equal(bits(t), bits(new))


def test_encode_delta_advances_the_baseline_sparsely() -> None:
    base = torch.randn(300, 7).to(torch.float16)
    new = base.clone()
    new[17] = torch.inf
    enc = codec.encode_delta(base, new)
    assert torch.equal(bits(base), bits(new)) and enc.changed == 7 and not enc.full
    flipped = (bits(new) ^ 1).view(torch.float16)
    dense = codec.encode_delta(base, flipped)  # everything changed: a full copy is smaller
    assert dense.full and dense.changed == new.numel()
    assert torch.equal(bits(codec.apply(new, dense.to_bytes())), bits(flipped))


def test_encode_delta_advances_a_strided_baseline() -> None:
    base = torch.randn(64, 48).to(torch.bfloat16).t()  # column-major view
    new = base.clone()
    new[5, 7] = -new[5, 7] - 1
    enc = codec.encode_delta(base, new)
    assert enc.changed == 1 and torch.equal(bits(base), bits(new))


def _reseal(header: bytes, body: np.ndarray) -> bytes:
    """The header with its check recomputed over a tampered body: a forged payload."""
    import xxhash

    head = header[:-8]
    return head + xxhash.xxh3_64(head + body.tobytes()).intdigest().to_bytes(8, "little")


def test_forged_gaps_are_refused_before_any_write() -> None:
    """Past the checksum a forged body must still never write out of range: the compiled
    scatter trusts the checks before it."""
    n = 4096
    old = torch.zeros(n, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 900, n - 1]] = 1.0  # gaps 4, then two escapes (897, 3195)
    header, body = codec.split_payload(encode(old, new))
    gaps_at = body.size - 3
    assert body[gaps_at:].tolist() == [4, 0, 0]
    for where, value, message in ((gaps_at, 0, "escapes do not match"),
                                  (gaps_at, 200, "index out of range")):
        forged = body.copy()
        forged[where] = value
        target = old.clone()
        with pytest.raises(CorruptDelta, match=message):
            codec.apply_into(target, _reseal(header, forged), forged)
        assert not target.any()


def _zstd_frame(content_bytes: int, declare: bool = True) -> bytes:
    """A zstd frame of `content_bytes` zeros (a few KiB per 64 MiB), declaring its size or not."""
    compressor = zstandard.ZstdCompressor(write_content_size=declare)
    co = compressor.compressobj(size=content_bytes if declare else -1)
    zeros = bytes(1 << 20)
    return b"".join(co.compress(zeros) for _ in range(content_bytes >> 20)) + co.flush()


BOMB = 64 << 20


@pytest.mark.parametrize(("frame", "raw_len", "message"), [
    # the header agrees with the frame: both far beyond the tensor
    (lambda: _zstd_frame(BOMB), BOMB,
     f"delta body declares {BOMB} bytes, a delta must be smaller than the tensor's 8192"),
    # a plausible header, a frame that declares far more (zstandard would allocate it all)
    (lambda: _zstd_frame(BOMB), 100, f"zstd frame declares {BOMB} bytes, header says 100 bytes"),
    (lambda: _zstd_frame(BOMB, declare=False), BOMB, "a delta must be smaller than the tensor's 8192"),
    (lambda: _zstd_frame(BOMB, declare=False), 100, "zstd frame declares no size, header says 100 bytes"),
    (lambda: b"\x28\xb5\x2f\xfd", 100, "zstd body has no valid frame header"),
])
def test_forged_zstd_sizes_are_refused_before_allocating(frame: Callable[[], bytes], raw_len: int,
                                                         message: str) -> None:
    """The checksum is no MAC: a forged header and frame may declare any size. Nothing near it
    may be allocated, and the error names the numbers."""
    target = torch.zeros(64, 64, dtype=torch.bfloat16)
    body = np.frombuffer(frame(), np.uint8)
    header = codec._header(codec.DELTA, target, 1, 0, raw_len, body, 0, codec.ZSTD)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDelta, match=re.escape(message)):
            codec.apply_into(target, header, body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and not target.any()


def test_forged_counts_are_refused() -> None:
    target = torch.zeros(100, dtype=torch.float32)
    body = np.zeros(10, np.uint8)
    for kind, n_changed, n_escapes, raw_len, message in (
            (codec.DELTA, 101, 0, 10, "declares 101 changed elements and 0 escapes for a tensor of 100"),
            (codec.DELTA, 5, 6, 10, "declares 5 changed elements and 6 escapes"),
            (codec.FULL, 100, 0, 10, "full payload is 10 bytes, tensor needs 400")):
        header = codec._header(kind, target, n_changed, n_escapes, raw_len, body, 0, 0)
        with pytest.raises(CorruptDelta, match=re.escape(message)):
            codec.apply_into(target, header, body)


# -------------------------------------------------------------------- the torch (device) path
# The torch kernels run on any device, so on CPU tensors they are checked here against numba's:
# the same bytes out, and each path applies what the other wrote.

PATHS = {"numba": kernels.NUMBA, "torch": kernels.TorchKernels(torch.device("cpu"))}


def _encode_both(old: torch.Tensor, new: torch.Tensor, zstd: int | None = None) -> codec.Encoded:
    """The payload both paths write (asserted equal), each advancing its own copy of `old` to `new`."""
    out = {}
    for name, k in PATHS.items():
        base = old.clone()
        out[name] = codec.encode_delta(base, new, zstd_level=zstd, kernels=k)
        assert torch.equal(bits(base), bits(new)), f"{name} did not advance the baseline"
    assert out["numba"].to_bytes() == out["torch"].to_bytes()
    assert out["numba"].changed == out["torch"].changed
    return out["numba"]


def _apply_both(old: torch.Tensor, enc: codec.Encoded, new: torch.Tensor) -> None:
    for name, k in PATHS.items():
        target = old.clone()
        codec.apply_into(target, enc.header, enc.body, kernels=k)
        assert torch.equal(bits(target), bits(new)), f"{name} applied it wrong"


@settings(max_examples=150, deadline=None)
@given(pair=pairs(), zstd=st.sampled_from([None, 1]))
def test_torch_and_numba_paths_write_and_apply_the_same_payloads(pair: tuple[torch.Tensor, torch.Tensor],
                                                                 zstd: int | None) -> None:
    old, new = pair
    _apply_both(old, _encode_both(old, new, zstd), new)
    full = {name: codec.encode_full(new, kernels=k).to_bytes() for name, k in PATHS.items()}
    assert full["numba"] == full["torch"]


def test_torch_path_mixes_gaps_bitmaps_and_escapes_like_numba() -> None:
    n = 5 * codec.CHUNK + 123
    old = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    new = old.clone()
    rng = np.random.default_rng(1)
    sparse = rng.choice(codec.CHUNK, codec.CHUNK // 100, replace=False)
    dense = codec.CHUNK + rng.choice(codec.CHUNK, codec.CHUNK // 2, replace=False)
    tail = 5 * codec.CHUNK + rng.choice(123, 100, replace=False)  # the partial last chunk as a bitmap
    lonely = [3 * codec.CHUNK + 7]
    for idx in (sparse, dense, tail, lonely):
        new[torch.as_tensor(idx)] = -new[torch.as_tensor(idx)] - 1
    new[17] = torch.nan
    new[18] = -0.0
    enc = _encode_both(old, new)
    assert not enc.full and enc.changed == len(sparse) + len(dense) + len(tail) + len(lonely) + 2
    _apply_both(old, enc, new)


def test_torch_path_applies_and_advances_through_strides() -> None:
    old = (torch.randn(256, 96) * 0.02).to(torch.float16)
    new = old.clone()
    new[torch.rand(old.shape) < 0.05] = torch.inf
    k = PATHS["torch"]
    base = old.t().clone().t()  # same values, column-major strides
    enc = codec.encode_delta(base, new, kernels=k)
    assert torch.equal(bits(base), bits(new))
    big = torch.zeros(256, 192, dtype=torch.float16)
    big[:, 96:] = old
    codec.apply_into(big[:, 96:], enc.header, enc.body, kernels=k)
    assert torch.equal(bits(big[:, 96:]), bits(new)) and not big[:, :96].any()


@pytest.mark.parametrize("path", PATHS)
def test_forged_gaps_are_refused_on_every_path(path: str) -> None:
    """The checks run on the host before either path writes: a forged delta never reaches the device."""
    n = 4096
    old = torch.zeros(n, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 900, n - 1]] = 1.0
    header, body = codec.split_payload(encode(old, new))
    forged = body.copy()
    forged[-3] = 200  # the first gap now points past the end
    with pytest.raises(CorruptDelta, match="index out of range"):
        codec.apply_into(old, _reseal(header, forged), forged, kernels=PATHS[path])
    assert not old.any()


# ----------------------------------------------------------- on a CUDA device (`pytest -m gpu`)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@settings(max_examples=60, deadline=None)
@given(pair=pairs(), zstd=st.sampled_from([None, 1]))
def test_cuda_payloads_are_the_cpu_payloads_and_apply_across_devices(pair: tuple[torch.Tensor, torch.Tensor],
                                                                     zstd: int | None) -> None:
    old, new = pair
    on_cpu = codec.encode_delta(old.clone(), new, zstd_level=zstd)
    base = old.cuda()
    on_gpu = codec.encode_delta(base, new.cuda(), zstd_level=zstd)
    assert on_gpu.to_bytes() == on_cpu.to_bytes() and torch.equal(bits(base.cpu()), bits(new))
    for enc in (on_cpu, on_gpu):
        target = old.cuda()
        codec.apply_into(target, enc.header, enc.body)  # encoded on either device, applied on CUDA
        assert torch.equal(bits(target.cpu()), bits(new))
        assert torch.equal(bits(apply(old, enc.to_bytes())), bits(new))  # ... and on the CPU
    assert codec.tensor_hash(new.cuda()) == codec.tensor_hash(new)
    assert codec.encode_full(new.cuda()).to_bytes() == codec.encode_full(new).to_bytes()


@pytest.mark.gpu
@cuda
def test_cuda_path_mixes_gaps_bitmaps_and_escapes_and_strides() -> None:
    n = 3 * codec.CHUNK + 4
    old = (torch.randn(n) * 0.02).to(torch.bfloat16)
    new = old.clone()
    new[: codec.CHUNK // 2] += 1  # a bitmap chunk
    new[codec.CHUNK + 3 :: 97] = torch.nan  # gaps, the first an escape
    new[n - 1] = -0.0
    enc = codec.encode_delta(old.cuda(), new.cuda(), advance=False)
    assert enc.to_bytes() == encode(old, new)
    t = old.reshape(-1, 4).cuda().t().contiguous().t()  # column-major on the device
    codec.apply_into(t, enc.header, enc.body)
    assert torch.equal(bits(t.cpu().reshape(-1)), bits(new))


@pytest.mark.gpu
@cuda
def test_sync_from_cuda_senders_to_cpu_and_cuda_receivers() -> None:
    from rose.bench.transfer import Trainer
    from rose.model import preset_config
    from rose.transfer import (
        LocalRelay,
        Receiver,
        ReceiverSpec,
        Sender,
        TrainerSpec,
        model_spec,
        trainer_layout,
    )
    from rose.transfer.layouts import receiver_layout, shard

    trainer = Trainer(preset_config("qwen3", "tiny"), seed=0, batch=2, seq=16, lr=1e-5, device="cuda")
    spec, tspec, relay = model_spec(trainer.model), TrainerSpec(fsdp=2), LocalRelay()
    senders = [Sender(relay, spec, shard(trainer.policy, trainer_layout(spec, tspec).rank_boxes(r)),
                      trainer=tspec, rank=r, bucket_bytes=16 << 10) for r in range(2)]
    receivers = [Receiver(relay, spec, ReceiverSpec("gpu", tp=2, rank=r), device="cuda") for r in range(2)]
    receivers.append(Receiver(relay, spec, ReceiverSpec("cpu")))
    for r in receivers:
        r.join()
    with ThreadPoolExecutor(max_workers=5) as pool:
        for version in range(1, 5):
            if version > 1:
                trainer.step()
            pulls = [pool.submit(r.sync, 30) for r in receivers]
            for s in senders:
                s.publish(version)
            assert [f.result() for f in pulls] == [version] * 3
    assert [r.last.kind for r in receivers] == ["delta"] * 3
    for r in receivers:
        want = shard(trainer.policy, receiver_layout(spec, r.me.tp, r.me.pp).rank_boxes(r.me.rank))
        assert r.digests() == {n: codec.tensor_hash(want[n]) for n in r.tensors}
