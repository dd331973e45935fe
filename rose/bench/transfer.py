"""`rose bench transfer`: weight sync after real optimizer steps, three ways side by side.

A trainer of 2 FSDP ranks (fp32 master weights, AdamW at lr 1e-6 on a next-token loss, bf16
policy weights cast from the master after every step) syncs three rollout replicas -- two with
TP=2 and one with TP=1, five receiving processes -- over a cross-cluster link emulated at 20
Gbps, through the Ray object store relay. After every step, in rotating order:

- `naive`: rank 0 gathers the full weights and sends a full copy to every receiving process,
  which keeps its own slice (what frameworks that broadcast to every inference worker do);
- `shard_full`: shard-aware routing, full weights (each slice crosses the link once);
- `rose`: shard-aware routing and bit-exact sparse deltas.

The `small` preset with `--quick`; a synthetic ~0.5 B-parameter model (Qwen2.5-0.5B's shape)
otherwise. Sync time runs from "the new weights are ready" until every receiver has applied
and verified them. Codec throughput is measured single-threaded on the same real deltas.
With `--device cuda` the trainer, the senders' weights and baselines and the receivers' mirrors
live on the GPU, so the codec runs there (torch ops) and payloads cross to the relay through
pinned host memory.

With `--lora`, a LoRA adapter of the same model (rank `--lora-rank`, on every attention and MLP
projection) is synced alone through the same senders' layout, receivers, link and relay, in a
group of its own: its first (full) sync beside the model's, and its sync after an update that
changes every element beside the model's delta sync after a step. The summary's `lora_8b`
gives the same comparison computed for Llama-3.1-8B's shape from its layout (no weights made).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from rose.contracts.adapter import LoRAConfig
from rose.model import ModelConfig, preset_config, random_model
from rose.reporting import write_report
from rose.runtime.devices import init_ray
from rose.transfer import codec
from rose.transfer.layouts import (
    ModelSpec,
    ReceiverSpec,
    TrainerSpec,
    adapter_spec,
    config_spec,
    full_box,
    local_slices,
    model_spec,
    receiver_layout,
    shard,
    trainer_layout,
)
from rose.transfer.link import Link
from rose.transfer.receiver import Receiver
from rose.transfer.relay import LocalRelay, RayRelay, Relay
from rose.transfer.sender import Sender
from rose.transfer.versions import SyncPolicy

# Qwen2.5-0.5B's shape (494 M parameters, tied embeddings) on the qwen3 architecture.
HALF_B = dict(model_type="qwen3", vocab_size=151936, hidden_size=896, intermediate_size=4864,
              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
              tie_word_embeddings=True)
# Llama-3.1-8B's shape (8.03 B parameters, untied embeddings), for the computed `lora_8b` figures.
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
REPLICAS = (("tp2a", 2), ("tp2b", 2), ("tp1", 1))
MODES = ("naive", "shard_full", "rose")
T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the `small` preset (34 M) instead of ~0.5 B")
    p.add_argument("--preset", choices=["tiny", "small", "0.5b"], help="model (default 0.5b, quick small)")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--steps", type=int, help="optimizer steps, each followed by the three syncs "
                                             "(default 4, quick 3)")
    p.add_argument("--gbps", type=float, default=20.0, help="emulated cross-cluster link (default 20)")
    p.add_argument("--bucket-mb", type=int, help="bucket size in MiB (default 64, quick 8: "
                                                 "several buckets per rank so the pipeline fills)")
    p.add_argument("--relay", choices=["ray", "local"], default="ray")
    p.add_argument("--zstd-level", type=int, help="compress delta bodies with zstd at this level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights live and the codec runs (default cuda when available, else cpu)")
    p.add_argument("--lora", action="store_true",
                   help="also sync a LoRA adapter alone, beside the full model (first sync and an update)")
    p.add_argument("--lora-rank", type=int, default=16,
                   help="the adapter's rank (default 16: LoRAConfig's, the adapter `rose train` makes)")


class SyntheticTrainer:
    """Real optimizer steps on random tokens (fp32 master weights, AdamW), so that the bf16
    policy weights the senders publish change as training changes them."""

    def __init__(self, config: ModelConfig, seed: int, batch: int, seq: int, lr: float = 1e-6,
                 device: torch.device | str = "cpu") -> None:
        self.model = random_model(config, seed).to(device).train()
        # AdamW per parameter, stepped from the parameter's gradient hook: each fp32 gradient is
        # freed once used, so they never all exist at once (2 GB less at 0.5 B). The update is the
        # same as one AdamW over all parameters: AdamW treats every parameter on its own.
        self.opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in self.model.parameters()}
        for p in self.opts:
            p.register_post_accumulate_grad_hook(self._update)
        self.policy = {n: p.detach().to(torch.bfloat16) for n, p in self.model.named_parameters()}
        self.gen = torch.Generator().manual_seed(seed)  # on the CPU: the same batches on any device
        self.batch, self.seq, self.vocab, self.device = batch, seq, config.vocab_size, device

    def _update(self, p: torch.Tensor) -> None:
        self.opts[p].step()
        p.grad = None

    def step(self) -> float:
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen).to(self.device)
        logits = self.model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                self.policy[n].copy_(p)
        return loss.item()


class SyntheticAdapter:
    """A LoRA adapter mid-training (fp32 master, bf16 policy, no factor zero) whose `step`
    changes every element, as an optimizer step on every A and B does: the adapter's worst case
    for a delta."""

    def __init__(self, config: ModelConfig, lora: LoRAConfig, seed: int, device: torch.device) -> None:
        self.lora, self.spec = lora, adapter_spec(config, lora)
        self.gen = torch.Generator().manual_seed(seed)
        self.master = {n: (torch.randn(shape, generator=self.gen) * 0.02).to(device)
                       for n, shape in lora.shapes(config).items()}
        self.policy = {n: t.to(torch.bfloat16) for n, t in self.master.items()}

    def step(self) -> None:
        # Adam's first step moves every element by the same size in the gradient's sign; here
        # 2^-6 of it, past bf16's spacing (2^-8 to 2^-7 of a value), so every element's bits change.
        for n, m in self.master.items():
            signs = 2.0 * torch.randint(0, 2, m.shape, generator=self.gen) - 1
            m.mul_(1 + 2.0**-6 * signs.to(m.device))
            self.policy[n].copy_(m)


def run(args: argparse.Namespace) -> int:
    load_start = os.getloadavg()
    torch.set_num_threads(2)
    steps = args.steps or (3 if args.quick else 4)
    bucket_bytes = (args.bucket_mb or (8 if args.quick else 64)) << 20
    preset = args.preset or ("small" if args.quick else "0.5b")
    config = ModelConfig(**HALF_B) if preset == "0.5b" else preset_config("qwen3", preset)
    device = torch.device(args.device)
    trainer = SyntheticTrainer(config, args.seed, *((1, 64) if preset == "0.5b" else (4, 128)), device=device)
    spec = model_spec(trainer.model)
    adapter = None
    if args.lora:
        adapter = SyntheticAdapter(config, LoRAConfig(rank=args.lora_rank), args.seed, device)
    relay, ray = _relay(args.relay, args.quick)
    link = Link(args.gbps)
    parties = functools.partial(_parties, relay=relay, link=link, bucket_bytes=bucket_bytes,
                                zstd_level=args.zstd_level, device=device)
    lora: dict | None = None
    try:
        senders, receivers = parties(spec, trainer.policy, "bench")
        pool = ThreadPoolExecutor(max_workers=len(senders) + len(receivers))
        version = 0
        torch.set_num_threads(1)  # the syncs run numpy in many threads; torch's pool would only spin
        # Receivers start with the weights: the first (full) sync.
        (first_s, _, _), first_bytes = _on_link(link, _sync, pool, senders, receivers, version, full=True)
        rows = []
        for step in range(1, steps + 1):
            torch.set_num_threads(2)
            loss = trainer.step()
            torch.set_num_threads(1)
            version += 1
            codec_rates = _codec_rates(senders) if step == steps else None
            row: dict = {"step": step, "loss": loss}
            # The delta goes first (it needs the previous version's baseline); the two full modes
            # then resend the same version, in alternating order.
            for mode in ("rose", *(MODES[:2] if step % 2 else MODES[1::-1])):
                before, cpu = link.bytes_sent, time.process_time()
                if mode == "naive":
                    seconds = _naive(pool, relay, link, senders, receivers, trainer.policy, version,
                                     bucket_bytes)
                else:
                    seconds, reports, party_cpu = _sync(pool, senders, receivers, version,
                                                        full=mode == "shard_full")
                    if mode == "rose":
                        row["changed"] = sum(r.changed for r in reports)
                        row["compared"] = sum(r.compared for r in reports)
                        row["party_cpu_s_rose"] = party_cpu
                # CPU seconds of this process (senders, receivers, Ray client): the work each mode needs
                # apart from the link, whatever else shares the machine.
                row[mode] = {"seconds": seconds, "bytes": link.bytes_sent - before,
                             "cpu_s": time.process_time() - cpu}
            rows.append(row)
            print(f"step {step}: changed {row['changed'] / row['compared']:.4f}, " + ", ".join(
                f"{m} {row[m]['seconds']:.3f} s / {row[m]['bytes'] / 1e6:.1f} MB" for m in MODES), flush=True)
        bit_exact = _bit_exact(trainer.policy, receivers)
        if adapter is not None:
            a_senders, a_receivers = parties(adapter.spec, adapter.policy, "bench-lora")
            lora = _adapter_syncs(pool, link, adapter, a_senders, a_receivers)
            senders += a_senders
        pool.shutdown()
        for s in senders:
            s.close()
    finally:
        if ray is not None:
            ray.shutdown()
    summary = _summary(rows, link, codec_rates, bit_exact)
    if adapter is not None and lora is not None:
        # The model's step is its delta sync ("rose", the median over the steps).
        summary["lora"] = {"rank": adapter.lora.rank, "model_bytes_bf16": spec.nbytes,
                           "sync_s_first_model": first_s, "bytes_first_model": first_bytes,
                           "sync_s_step_model": summary["sync_s_rose"],
                           "bytes_step_model": summary["bytes_rose"], **lora}
        summary["lora_8b"] = _eight_b(adapter.lora, link, summary["delta_bytes_ratio"],
                                      codec_rates["encode_gb_per_s"], lora["encode_gb_per_s_adapter"])
    write_report(args.json, summary, steps=rows, config={
        "model_params": sum(p.numel for p in spec.params), "model_bytes_bf16": spec.nbytes,
        "trainer": "fsdp=2", "receivers": [f"{n} tp={tp}" for n, tp in REPLICAS], "gbps": args.gbps,
        "bucket_bytes": bucket_bytes, "relay": args.relay, "zstd_level": args.zstd_level,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "optimizer": "AdamW lr=1e-6, fp32 master, bf16 policy", "torch": torch.__version__,
        "lora": None if adapter is None else {
            "rank": adapter.lora.rank, "targets": list(adapter.lora.targets),
            "update": "every element times 1 +- 2^-6 (random sign)"},
        "cpus": os.cpu_count(), "machine": platform.machine(),
        # The machine may be shared: its load says how much of it this run had.
        "load_average_start": load_start, "load_average_end": os.getloadavg()})
    return 0


def _parties(spec: ModelSpec, policy: dict[str, torch.Tensor], group: str, *, relay: Relay, link: Link,
             bucket_bytes: int, zstd_level: int | None, device: torch.device
             ) -> tuple[list[Sender], list[Receiver]]:
    """The 2 FSDP trainer ranks' senders of `policy` and the replicas' receivers (joined), in `group`."""
    tspec = TrainerSpec(fsdp=2)
    tlayout = trainer_layout(spec, tspec)
    senders = [Sender(relay, spec, shard(policy, tlayout.rank_boxes(r)), trainer=tspec, rank=r, group=group,
                      policy=SyncPolicy(full_every=0), link=link, keep_syncs=1, bucket_bytes=bucket_bytes,
                      zstd_level=zstd_level) for r in range(tspec.world)]
    receivers = [Receiver(relay, spec, ReceiverSpec(name, tp, 1, r), group=group, device=device)
                 for name, tp in REPLICAS for r in range(tp)]
    for r in receivers:
        r.join()
    return senders, receivers


def _on_link(link: Link, fn: Callable[..., T], *args: object, **kwargs: object) -> tuple[T, int]:
    """`fn`'s result and the bytes it put on the link."""
    before = link.bytes_sent
    out = fn(*args, **kwargs)
    return out, link.bytes_sent - before


def _adapter_syncs(pool: ThreadPoolExecutor, link: Link, adapter: SyntheticAdapter, senders: list[Sender],
                   receivers: list[Receiver]) -> dict:
    """The adapter alone: its first (full) sync, then its sync after an update of every element."""
    (first_s, _, _), first_bytes = _on_link(link, _sync, pool, senders, receivers, 0, full=True)
    exact = _bit_exact(adapter.policy, receivers)
    adapter.step()
    rates = _codec_rates(senders)
    (step_s, reports, _), step_bytes = _on_link(link, _sync, pool, senders, receivers, 1, full=False)
    print(f"adapter rank {adapter.lora.rank}: first sync {first_s:.3f} s / {first_bytes / 1e6:.2f} MB, "
          f"update {step_s:.3f} s / {step_bytes / 1e6:.2f} MB", flush=True)
    return {
        "adapter_params": sum(p.numel for p in adapter.spec.params),
        "adapter_bytes_bf16": adapter.spec.nbytes,
        "sync_s_first_adapter": first_s, "bytes_first_adapter": first_bytes,
        "sync_s_step_adapter": step_s, "bytes_step_adapter": step_bytes,
        "step_changed_fraction_adapter": sum(r.changed for r in reports) / sum(r.compared for r in reports),
        # A delta sync, but where every element changed the codec sends each tensor as a full copy
        # (smaller than a bitmap and every value): then the update costs the first sync's bytes.
        "step_sent_adapter": "full" if step_bytes >= first_bytes else "delta",
        "encode_gb_per_s_adapter": rates["encode_gb_per_s"],
        "bit_exact": exact and _bit_exact(adapter.policy, receivers),
    }


def _eight_b(lora: LoRAConfig, link: Link, delta_bytes_ratio: float, model_gb_per_s: float,
             adapter_gb_per_s: float) -> dict:
    """The full model against the adapter on Llama-3.1-8B's shape, computed from its layout (bf16,
    each slice crossing the link once, headers left out) and this run's rates: the link's rate
    and the single-threaded encode rates measured on the model's delta and on the adapter's update."""
    config = ModelConfig(**LLAMA_8B)
    model, adapter = config_spec(config), adapter_spec(config, lora)
    step_model = delta_bytes_ratio * model.nbytes  # as this run's steps changed the model
    return {
        "shape": "Llama-3.1-8B", "rank": lora.rank,
        "model_params": sum(p.numel for p in model.params),
        "adapter_params": sum(p.numel for p in adapter.params),
        "model_bytes_bf16": model.nbytes, "adapter_bytes_bf16": adapter.nbytes,
        "bytes_ratio": adapter.nbytes / model.nbytes,
        "link_s_first_model": link.seconds(model.nbytes),
        "link_s_first_adapter": link.seconds(adapter.nbytes),
        "bytes_step_model": step_model, "bytes_step_adapter": adapter.nbytes,
        "link_s_step_model": link.seconds(step_model), "link_s_step_adapter": link.seconds(adapter.nbytes),
        # One thread encoding it all: what the trainer's ranks share between them.
        "encode_s_step_model": model.nbytes / model_gb_per_s / 1e9,
        "encode_s_step_adapter": adapter.nbytes / adapter_gb_per_s / 1e9,
    }


def _relay(kind: str, quick: bool) -> tuple[Relay, object | None]:
    if kind == "local":
        return LocalRelay(), None
    import ray

    init_ray(num_cpus=2, object_store_memory=(1 if quick else 2) << 30)
    return RayRelay(name="rose-bench-relay"), ray


def _sync(pool: ThreadPoolExecutor, senders: list[Sender], receivers: list[Receiver], version: int,
          full: bool) -> tuple[float, list, float]:
    """The sync's wall time, the senders' reports, and the most CPU time any one party's thread
    spent in it (encoding or applying; not the sender's pusher thread, which only hands the
    payloads to the relay): the sync's length if every party had a core of its own."""
    start = time.perf_counter()
    pulls = [pool.submit(_thread_cpu, r.sync, 120) for r in receivers]
    pushes = [pool.submit(_thread_cpu, s.publish, version, full=full) for s in senders]
    reports, send_cpu = zip(*[f.result() for f in pushes], strict=True)
    got, receive_cpu = zip(*[f.result() for f in pulls], strict=True)
    seconds = time.perf_counter() - start
    if list(got) != [version] * len(receivers):
        raise RuntimeError(f"sync of version {version} failed: {[r.last for r in receivers]}")
    return seconds, list(reports), max(send_cpu + receive_cpu)


def _thread_cpu(fn: Callable[..., T], *args: object, **kwargs: object) -> tuple[T, float]:
    start = time.thread_time()
    out = fn(*args, **kwargs)
    return out, time.thread_time() - start


def _naive(pool: ThreadPoolExecutor, relay: Relay, link: Link, senders: list[Sender],
           receivers: list[Receiver], policy: dict[str, torch.Tensor], version: int,
           bucket_bytes: int) -> float:
    """Gather on rank 0, then a full copy of every tensor to every receiving process, bucketed
    and pipelined like the others, each receiver keeping its own slice."""
    start = time.perf_counter()
    names = list(policy)
    buckets, size = [[]], 0
    for n in names:
        if size and size + policy[n].nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(n)
        size += policy[n].nbytes

    def push() -> None:
        for i, group in enumerate(buckets):
            # The all-gather: rank 0 concatenates every rank's dim-0 shard.
            parts = [codec.host_bits(torch.cat([s.tensors[n] for s in senders if n in s.tensors]))
                     for n in group]
            for r in receivers:
                key = f"naive/{version}/{r.id}/{i}"
                link.transmit(key, sum(p.nbytes for p in parts))
                relay.put(key, parts)

    def pull(r: Receiver) -> None:
        boxes = receiver_layout(r.spec, r.me.tp, r.me.pp).rank_boxes(r.me.rank)
        for i, group in enumerate(buckets):
            key = f"naive/{version}/{r.id}/{i}"
            parts = relay.get(key, 120)
            for n, raw in zip(group, parts, strict=True):
                if n in boxes:  # keep our slice of the full tensor (copied on the raw bits)
                    codec.load_bits(r.tensors[n], raw.view(np.int16).reshape(policy[n].shape)[local_slices(
                        boxes[n], full_box(policy[n].shape))])
            relay.delete(key)

    jobs = [pool.submit(push)] + [pool.submit(pull, r) for r in receivers]
    for j in jobs:
        j.result()
    return time.perf_counter() - start


def _codec_rates(senders: list[Sender]) -> dict[str, float]:
    """Single-threaded encode and apply of this step's real delta (baseline -> new), in GB/s of weights."""
    enc_s = app_s = nbytes = 0.0
    for s in senders:
        for name, new in s.tensors.items():
            base = s.baseline[name]
            t0 = time.perf_counter()
            enc = codec.encode_delta(base, new, advance=False)
            t1 = time.perf_counter()
            target = base.clone()
            t2 = time.perf_counter()
            codec.apply_into(target, enc.header, enc.body)
            t3 = time.perf_counter()
            enc_s, app_s, nbytes = enc_s + t1 - t0, app_s + t3 - t2, nbytes + new.nbytes
    return {"encode_gb_per_s": nbytes / enc_s / 1e9, "apply_gb_per_s": nbytes / app_s / 1e9}


def _bit_exact(policy: dict[str, torch.Tensor], receivers: list[Receiver]) -> bool:
    for r in receivers:
        want = shard(policy, receiver_layout(r.spec, r.me.tp, r.me.pp).rank_boxes(r.me.rank))
        if any(codec.tensor_hash(want[n]) != codec.tensor_hash(t) for n, t in r.tensors.items()):
            return False
    return True


def _summary(rows: list[dict], link: Link, rates: dict[str, float], bit_exact: bool) -> dict:
    sync = {m: statistics.median(r[m]["seconds"] for r in rows) for m in MODES}
    cpu = {m: statistics.median(r[m]["cpu_s"] for r in rows) for m in MODES}
    nbytes = {m: statistics.median(r[m]["bytes"] for r in rows) for m in MODES}
    eff = {m: link.seconds(nbytes[m]) / sync[m] for m in MODES}
    return {
        "changed_fraction": sum(r["changed"] for r in rows) / sum(r["compared"] for r in rows),
        "delta_bytes_ratio": (sum(r["rose"]["bytes"] for r in rows)
                              / sum(r["shard_full"]["bytes"] for r in rows)),
        "bytes_naive": nbytes["naive"],
        "bytes_shard_full": nbytes["shard_full"],
        "bytes_rose": nbytes["rose"],
        "sync_s_naive": sync["naive"],
        "sync_s_shard_full": sync["shard_full"],
        "sync_s_rose": sync["rose"],
        "speedup_vs_naive": sync["naive"] / sync["rose"],
        "cpu_s_naive": cpu["naive"],
        "cpu_s_shard_full": cpu["shard_full"],
        "cpu_s_rose": cpu["rose"],
        # The busiest party's own CPU time in a delta sync (median over the steps): how long the
        # sync would take if each party had a core of its own, as in a deployment.
        "party_cpu_s_rose": statistics.median(r["party_cpu_s_rose"] for r in rows),
        # The link-bound full sync (the path new receivers and periodic full syncs take): how
        # close the relay pipeline gets to the link. The delta sync is CPU-bound here, below.
        "efficiency_vs_link": eff["shard_full"],
        "efficiency_vs_link_rose": eff["rose"],
        "efficiency_vs_link_naive": eff["naive"],
        **rates,
        "bit_exact": bit_exact,
        "gbps": link.gbps,
    }

