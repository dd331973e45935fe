"""The Ray actors of a training run: the trainer, dedicated rollout workers, serving devices.

In local mode each pins itself to its device's cores first (`devices.pin`) and binds the loopback;
on a joined Ray cluster (rose/runtime/placement.py) Ray's CPU count bounds it instead and it
binds its node's address, which it advertises. Weights travel from the trainer's
`Sender` through the relay (Ray's object store) to a `Receiver` in every rollout replica, which
hands them to its engine between two iterations. Every rollout replica serves the lease API's
turn stream (a serving device's `rose serve` app, a dedicated worker's `build_lease_app`): the
rollout manager's turns reach each over one WebSocket (`rose.coserve.lease_stream.LeaseStream`),
not through Ray, whose per-chunk cost in the driver was an HTTP stream's. Each names its role
(`trainer`, `dedicated-0`, `serving-0`) in its log lines and in the prefix Ray gives the lines
it forwards to the driver.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import uvicorn

from rose import logs
from rose.contracts import WeightUpdate
from rose.contracts.adapter import LoRAConfig
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_client import LeaseClient
from rose.coserve.loadgen import RequestResult, build_trace, replay, spike
from rose.coserve.server import build_app, build_lease_app
from rose.coserve.settings import Engine, ExecutorConfig, ServerLimits
from rose.coserve.turn_stream import MAX_MESSAGE_BYTES, EngineHost
from rose.engine import LLMEngine, RequestOutput
from rose.engine.async_engine import AsyncLLMEngine
from rose.engine.vllm_engine import VllmEngine
from rose.model import CausalLM, ModelConfig, load_tokenizer
from rose.model.lora import adapter_base, is_adapter
from rose.rl import Objective, Trainer, TrainerConfig, Trajectory
from rose.rl.trainer import process_group_backend
from rose.runtime.checkpoints import Checkpoint, open_checkpoint, probe_dir
from rose.runtime.config import POLICY_ADAPTER, ServingDeviceConfig, ServingRollout
from rose.runtime.devices import pin
from rose.steploop import StepLoop
from rose.traces import load_trace
from rose.transfer import (
    ModelSpec,
    RayRelay,
    Receiver,
    ReceiverSpec,
    Sender,
    adapter_spec,
    codec,
    model_spec,
)

# What a checkpoint directory needs beside the weights for a run to start from it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
POOL_SAMPLE_S = 0.25  # a serving device's pool timeline: a sample of its executor's pool this often,
POOL_SAMPLES_KEPT = 28_800  # the last two hours of them (report.png draws what is kept)


def meta_model(path: str | Path) -> CausalLM:
    """The checkpoint's model with its parameters' names and shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(ModelConfig.from_dir(path))


def on_loop(loop: StepLoop[Any], load: WeightUpdate,
            whole: dict[str, torch.Tensor] | None = None) -> WeightUpdate:
    """A receiver's apply hook: `load` on the engine's loop, between two iterations, with the
    tensors that changed, or with all of `whole` (the receiver's copy, already updated) for an
    engine that takes every weight at once."""
    def apply(named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        given = loop.progressing(named if whole is None else whole.items())  # progress for /health
        loop.submit(lambda: load(given, version)).result()

    return apply


def policy_spec(model: torch.nn.Module, lora: LoRAConfig | None) -> ModelSpec:
    """What a rollout replica of `model` receives at each sync: the policy's weights, or under
    LoRA its adapter alone."""
    return model_spec(model) if lora is None else adapter_spec(model.config, lora)


def policy_load(target: Any, lora: LoRAConfig | None) -> WeightUpdate:
    """What applies a sync: `target.load_weights`, or under LoRA `target.load_adapter` of the
    adapter the turns name. `target`: an engine, an executor or a lease client (each takes both)."""
    if lora is None:
        return target.load_weights
    return functools.partial(target.load_adapter, POLICY_ADAPTER, lora)


class Role:
    """An actor whose log lines carry its role (Ray prefixes the lines it forwards with the
    actor's repr, so that names the role too), on its device: its cores (local mode) or the
    share of its node Ray gave it."""

    role = "actor"
    host = LOOPBACK

    def _start_as(self, role: str, cores: list[int] | None = None, local: bool = True) -> None:
        """Log as `role`; pin to `cores` in local mode (None: an actor with no device)."""
        self.role = role
        logs.configure(role=role)  # at the driver's level, which the worker got as ROSE_LOG_LEVEL
        if local:
            if cores is not None:
                pin(cores)
        else:
            import ray

            self.host = ray.util.get_node_ip_address()  # where other nodes reach this one

    def __repr__(self) -> str:
        return self.role

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


class TrainerActor(Role):
    """One data-parallel rank of the trainer (NCCL between ranks on CUDA, gloo on the CPU); rank 0
    publishes the weights and writes the checkpoints."""

    def __init__(self, cores: list[int], rank: int = 0, world: int = 1, local: bool = True) -> None:
        self._start_as("trainer" if world == 1 else f"trainer-{rank}", cores, local)

    def address(self) -> str:
        """Where rank 0 takes the other ranks' connections."""
        with socket.socket() as sock:
            sock.bind((self.host, 0))
            return f"tcp://{self.host}:{sock.getsockname()[1]}"

    def start(self, checkpoint: Checkpoint, objective: str, objective_options: dict[str, Any],
              config: dict[str, Any], relay: str, group: str, resume: bool = False, rank: int = 0,
              world: int = 1, master: str | None = None) -> tuple[int, int]:
        """Join the ranks' process group (every rank's `start` runs at once), load the policy; the
        version and the steps it starts from. A LoRA checkpoint (an adapter) starts from its base."""
        model_path = open_checkpoint(checkpoint)
        if world > 1:
            device = torch.device(config["device"])
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL works on the current device: this rank's own
            torch.distributed.init_process_group(process_group_backend(device), init_method=master, rank=rank,
                                                 world_size=world)
        self.model_path = Path(model_path)
        base = adapter_base(model_path) if is_adapter(model_path) else model_path
        self.trainer = Trainer(base, Objective.named(objective, **objective_options), TrainerConfig(**config))
        if resume:
            self.trainer.load_state(model_path)
        log.info("policy %s on %s at version %d", model_path, config["device"], self.trainer.version)
        # The bf16 weights the rollout replicas get: the sender keeps views of these tensors.
        self.weights = dict(self.trainer.export_weights())
        spec = policy_spec(self.trainer.model, self.trainer.config.lora)
        self.sender = Sender(RayRelay(relay), spec, self.weights, group=group) if rank == 0 else None
        return self.trainer.version, self.trainer.steps

    def probe_dir(self, path: str) -> str | BaseException:
        """Whether this node can write checkpoints under `path` (`checkpoints.probe_dir`)."""
        try:
            return str(probe_dir(path))
        except OSError as exc:
            return exc

    def digests(self) -> list[int]:
        """xxh3 of every weight: the same on every rank while data parallelism holds."""
        return [codec.tensor_hash(t) for t in self.weights.values()]

    def step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        metrics = self.trainer.step(trajectories)
        log.debug("step: %s", metrics)
        for name, tensor in self.trainer.export_weights():
            self.weights[name].copy_(tensor)
        return metrics

    def publish(self) -> dict[str, Any]:
        """Send the current version to every replica (again, for one that just joined)."""
        return dataclasses.asdict(self.sender.publish(self.trainer.version))

    def renumber(self, version: int, steps: int) -> None:
        """After a restart: the checkpoint's weights are `version` (a number no other weights had,
        where they are older than the run's: each version names one set of weights, and tokens
        sampled since lag behind them), and the learning-rate schedule goes on from `steps`."""
        self.trainer.version, self.trainer.steps = version, steps

    def save(self, path: str) -> str:
        """A complete checkpoint, with the tokenizer's files: `--resume` starts from it alone."""
        assets = [self.model_path / name for name in TOKENIZER_FILES if (self.model_path / name).is_file()]
        return str(self.trainer.save(path, assets))


class _Replica(Role):
    """A rollout replica's receiving end: joins the relay group; each sync's weights go to `load`,
    which the replica's engine loop runs between two iterations.

    Ray runs every method of an actor that has an async one on a single event loop, a plain
    method included: what blocks (waiting for a sync, the relay's calls) runs in a thread, so
    `ready` (the run's liveness probe) and a dedicated worker's turn streams answer meanwhile."""

    def _join(self, relay: str, group: str, worker_id: str, spec: ModelSpec,
              loop: StepLoop[RequestOutput], load: WeightUpdate, whole: bool = False) -> None:
        """`whole`: `load` takes every weight at each sync (the vLLM backend's)."""
        self.receiver = Receiver(RayRelay(relay), spec, ReceiverSpec(worker_id), group=group)
        self.receiver.on_apply = on_loop(loop, load, self.receiver.tensors if whole else None)
        self.receiver.join()

    def _synced(self, timeout: float) -> dict[str, Any]:
        self.receiver.sync(timeout)
        log.debug("weights: %s", self.receiver.last)
        return dataclasses.asdict(self.receiver.last)

    async def ready(self) -> bool:
        return True

    async def sync_weights(self, timeout: float) -> dict[str, Any]:
        return await asyncio.to_thread(self._synced, timeout)

    async def leave(self) -> None:
        await asyncio.to_thread(self.receiver.leave)


class _HttpReplica(_Replica):
    """A replica the rollout manager reaches over HTTP at `self.url`: its lease API, whose turn
    stream carries every turn the driver leases it."""

    url = ""

    def address(self) -> str:
        return self.url

    def _serve(self, app: Any, limits: ServerLimits) -> uvicorn.Server:
        """Serve `app` from a thread on a free port of this actor's host (its URL: `self.url`);
        off the loopback (a cluster's node address) only with a lease key (the run's)."""
        limits.check_bind(self.host)
        sock = socket.socket()
        sock.bind((self.host, 0))
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=MAX_MESSAGE_BYTES,
                                               limit_concurrency=limits.max_connections))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        return server


class DedicatedWorkerActor(_HttpReplica):
    """The rollout model alone on its device: its engine behind the lease API's turn endpoints
    (`build_lease_app`, the run's lease key), plus the replica's weight syncs and the pause the
    trainer asks of a worker on its cores."""

    def __init__(self, worker_id: str, cores: list[int], local: bool, policy: Checkpoint,
                 engine: dict[str, Any], relay: str, group: str, limits: ServerLimits, max_turns: int,
                 backend: str = "native", lora: LoRAConfig | None = None) -> None:
        self._start_as(worker_id, cores, local)
        path = open_checkpoint(policy)
        if backend == "vllm":  # the relay's names and shapes are the HF checkpoint's, not vLLM's fused ones
            self.engine = AsyncLLMEngine(VllmEngine.from_pretrained(
                path, **engine, max_lora_rank=None if lora is None else lora.rank))
            spec_model = meta_model(path)
        else:
            self.engine = AsyncLLMEngine(LLMEngine.from_pretrained(path, **engine))
            spec_model = self.engine.engine.model
        app = build_lease_app(self.engine, EngineHost(self.engine.engine, max_turns), limits)
        self.server = self._serve(app, limits)
        self._join(relay, group, worker_id, policy_spec(spec_model, lora), self.engine,
                   policy_load(self.engine.engine, lora), whole=backend == "vllm")
        log.info("rollout engine (%s) on %s, cores %s, at %s", backend, engine.get("device"), cores, self.url)

    async def pause(self) -> None:
        """Stop generating (turns in flight wait, keeping their KV) until `resume`."""
        self.engine.pause()

    async def resume(self) -> None:
        self.engine.resume()


class ServingDeviceActor(_HttpReplica):
    """A co-serving executor (serving model + rollout model) behind its HTTP server, with a trace
    replay driving its serving side from this process. Synced weights reach the executor in
    process, through the engine loop the server runs on; they are the rollout model's, which
    runs on ROSE's engine whatever `engine` serves the serving model (`serving.engine`: vLLM's
    in this process, its KV cache `config.serving_pool_share` of the pool, as `rose serve
    --engine vllm`). With `serving.rollout=adapter` there is no rollout model: turns run on the
    serving model with the policy's adapter, and each sync loads the adapter there."""

    def __init__(self, worker_id: str, cores: list[int], local: bool, serving: Checkpoint, policy: Checkpoint,
                 config: ExecutorConfig, device: str, replay_spec: ServingDeviceConfig, relay: str,
                 group: str, limits: ServerLimits, engine: Engine = Engine.NATIVE,
                 lora: LoRAConfig | None = None) -> None:
        self._start_as(worker_id, cores, local)
        serving_path = open_checkpoint(serving)
        adapter_mode = replay_spec.rollout is ServingRollout.ADAPTER
        # In adapter mode the policy's base is the serving model (the config's checks): its
        # checkpoint is not loaded a second time.
        rollout_path = None if adapter_mode else open_checkpoint(policy)
        executor = CoServingExecutor.from_pretrained(serving_path, rollout_path, config, device,
                                                     engine=engine, adapter_mode=adapter_mode)
        executor.profile()
        self.limits = limits
        loop = StepLoop(executor, name="rose-executor")
        app = build_app(loop, executor, load_tokenizer(serving_path), Path(serving_path).name, limits)
        self.server = self._serve(app, limits)
        log.info("serving %s (%s engine; rollout turns on %s) at %s", Path(serving_path).name, engine.value,
                 "it, with the policy's adapter" if adapter_mode else "a rollout model", self.url)
        self.spec, self.executor = replay_spec, executor
        self.results: list[tuple[float, RequestResult]] = []  # (arrival, wall clock), result
        self.pool: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=POOL_SAMPLES_KEPT)  # (wall clock, `ExecutorMetrics.pool_sample`)
        self._stop = threading.Event()
        self._replay: threading.Thread | None = None
        assert executor.turns is not None  # a rollout model, or the serving engine in adapter mode
        self._join(relay, group, worker_id, policy_spec(executor.turns.model, lora), loop,
                   policy_load(executor, lora))

    def start_replay(self) -> None:
        self._replay = threading.Thread(target=lambda: asyncio.run(self._replay_windows()), daemon=True)
        self._replay.start()
        threading.Thread(target=self._sample_pool, daemon=True).start()

    def _sample_pool(self) -> None:
        while not self._stop.wait(POOL_SAMPLE_S):
            self.pool.append((time.time(), self.executor.metrics.pool_sample()))

    async def _replay_windows(self) -> None:
        s, offset = self.spec, replay_start(self.spec)
        while not self._stop.is_set():
            try:
                trace = build_trace(s.trace, s.window_s, s.load, offset, s.prompt_scale, s.output_scale)
            except ValueError:  # under two arrivals in this window (a short one, a low load): none sent
                await asyncio.sleep(s.window_s)
                offset += s.window_s
                continue
            start = time.time()
            for result in await replay(self.url, trace, s.max_context, s.max_output,
                                       api_key=self.limits.api_key):
                self.results.append((start + result.scheduled_s, result))
            offset += s.window_s

    async def serving_results(self, since: float = 0.0,
                              stop: bool = False) -> list[tuple[float, RequestResult]]:
        """Finished serving requests that arrived at or after `since` (wall clock); `stop` ends
        the replay first (its current window runs out)."""
        if stop and self._replay is not None:
            self._stop.set()
            await asyncio.to_thread(self._replay.join)
        return [(t, r) for t, r in self.results if t >= since]

    def pool_timeline(self, since: float = 0.0) -> list[tuple[float, dict[str, float]]]:
        """The executor's pool sampled every `POOL_SAMPLE_S` from `since` (wall clock): pages by
        owner, the rollout budget, the burst state and its transitions, turns cut."""
        return [(t, sample) for t, sample in self.pool if t >= since]


def replay_start(s: ServingDeviceConfig) -> float:
    """Where in the scaled trace a serving device's replay starts: at its start, or where its
    spike comes `spike_at_s` seconds later (sooner if the trace has less before it)."""
    if s.spike_at_s is None:
        return 0.0
    trace = load_trace(s.trace).scaled(rate=s.load, prompt_tokens=s.prompt_scale,
                                       output_tokens=s.output_scale)
    at, _ = spike(trace, s.max_context, s.max_output, s.spike_s)
    return max(0.0, at - s.spike_at_s)


class EndpointActor(_HttpReplica):
    """A `rose serve` process started on its own (a serving team's replica), attached to the run
    by URL and lease key (`serving.endpoints`): the run neither starts nor stops it. This actor is
    its receiving end: it mirrors the policy's weights from the relay and pushes each sync's
    changed tensors to the server's lease API (`POST /v1/lease/weights`); turns go to the server
    directly (`LeaseClient`). Killing the actor leaves the server as it was."""

    def __init__(self, worker_id: str, url: str, key: str | None, policy: Checkpoint, relay: str,
                 group: str, lora: LoRAConfig | None = None) -> None:
        self._start_as(worker_id)
        self.url, self.key, self.lora = url, key, lora
        self.receiver = Receiver(RayRelay(relay), policy_spec(meta_model(open_checkpoint(policy)), lora),
                                 ReceiverSpec(worker_id), self._push, group=group)
        self.receiver.join()
        log.info("attached to %s", url)

    def _push(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        async def post() -> None:
            client = LeaseClient(self.url, key=self.key)
            try:
                await policy_load(client, self.lora)(named, version)
            finally:
                await client.close()

        asyncio.run(post())
