"""vLLM's engine as the co-serving executor's serving engine (`ServingEngine`): production
requests on vLLM, the rollout model on ROSE's native engine beside it
(`CoServingExecutor.from_pretrained(..., engine="vllm")`).

vLLM runs in this process (`VllmEngine`), so its scheduler is the very object its engine core
steps: what admission and the burst state machine need is read from it between two iterations,
as `rose.coserve.vllm_admission` does. Each request's timing comes from `VllmEngine`'s own
accounts (the monotonic clock, like the native engine's); how far each has computed, and the
KV blocks in use, from vLLM's scheduler and block pool; the load of an iteration from how far
each request advanced in it.

vLLM's KV cache is its own allocation, fixed when the engine starts: it cannot be one pool with
the rollout engine's. The executor bounds each (`ExecutorConfig.serving_pool_share`: of the pool
on the CPU, of `gpu_memory_utilization` on a GPU, `rose.coserve.device_memory`) and counts both as
the device's KV, so that the burst state machine follows vLLM's usage as it follows the native
engine's in a shared pool.

Requests sample as on vLLM's own OpenAI server: every sampling field is handed to vLLM as its
server hands it (`vllm_sampling`), and logprobs are vLLM's default, the model's raw log-softmax,
where the rollout backend records the processed ones and refuses what would make them differ
from ROSE's recorded policy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from rose.contracts import RequestOutput, SamplingParams, TokenLoad
from rose.coserve.admission import RolloutWait, ServingRequest
from rose.coserve.serving_engine import KVPages
from rose.engine.kv_pool import KVSpec
from rose.engine.llm_engine import EngineStep
from rose.engine.vllm_engine import BLOCK_SIZE, VllmEngine, vllm_sampling
from rose.model import ModelConfig

if TYPE_CHECKING:
    import vllm


class VllmServing(VllmEngine):
    """A `VllmEngine` as a `ServingEngine` (rose.coserve.serving_engine)."""

    # vLLM's default, what its server returns: logprobs before any bias, penalty, temperature or
    # filter (the native serving engine's too, without `logprobs_at_temperature`).
    logprobs_mode: ClassVar[str] = "raw_logprobs"
    chat_top_logprobs_sampled_first = True
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def __init__(self, llm: Any, config: ModelConfig) -> None:
        super().__init__(llm, config)
        self.scheduler = llm.engine_core.engine_core.scheduler  # in process: the same object
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        model_config = llm.vllm_config.model_config
        self.max_model_len: int = model_config.max_model_len
        self.page_bytes = KVSpec.of(config, model_config.dtype, BLOCK_SIZE).block_bytes
        self.last_step = EngineStep()
        self.num_preemptions = 0  # requests vLLM preempted (their KV freed, recomputed later)

    def sampling_params(self, params: SamplingParams) -> vllm.SamplingParams:
        """Every field, as vLLM's server takes it (a temperature under ROSE's MIN_TEMPERATURE
        too: vLLM samples it at 0.01). ValueError for tempered logprobs, which raw logprobs are
        not (the OpenAI API never asks for them)."""
        if params.logprobs_at_temperature and not params.greedy and params.temperature != 1:
            raise ValueError("the vLLM serving engine returns raw logprobs (vLLM's default), not "
                             f"logprobs at the temperature ({params.temperature})")
        return vllm_sampling(params, self.vocab_size)

    @property
    def max_request_tokens(self) -> int:
        """The model's context or what the KV cache holds (vLLM starts with no more)."""
        return self.max_model_len

    def step(self) -> list[RequestOutput]:
        """One vLLM iteration; `last_step` its serving load: a request that advanced by one token
        it had sampled decoded, any other advance was prefill (a request that finished computed
        everything it had)."""
        before = {rid: (r.num_computed_tokens, r.num_tokens, r.num_preemptions)
                  for rid, r in self.scheduler.requests.items()}
        start = time.perf_counter()
        outputs = super().step()
        seconds = time.perf_counter() - start
        prefill = decodes = context = 0
        for rid, (computed, tokens, preemptions) in before.items():
            after = self.scheduler.requests.get(rid)
            if after is not None:
                self.num_preemptions += after.num_preemptions - preemptions
            advanced = (after.num_computed_tokens if after is not None else tokens) - computed
            if advanced == 1 and computed + 1 == tokens:
                decodes += 1
                context += tokens
            elif advanced > 0:  # a preempted request goes back to 0
                prefill += advanced
        load = TokenLoad(prefill, decodes, context)
        self.last_step = EngineStep(load, seconds) if load != TokenLoad() else EngineStep()
        return outputs

    def in_flight(self, waited: Mapping[str, RolloutWait]) -> dict[str, ServingRequest]:
        no_wait, requests = RolloutWait(), self.scheduler.requests
        in_flight = {}
        for rid, acct in self._requests.items():  # in the order they were added
            request = requests.get(acct.engine_id)
            if request is None:  # finished in vLLM; its output comes with the next step
                continue
            in_flight[rid] = ServingRequest(
                acct.arrival_time, request.num_tokens - request.num_computed_tokens, request.num_tokens,
                acct.first_token_time, acct.last_token_time, acct.num_output_tokens, waited.get(rid, no_wait))
        return in_flight

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def kv_pages(self) -> KVPages:
        total = self.block_pool.num_gpu_blocks - 1  # vLLM keeps one back (its null block)
        return KVPages(total - self.block_pool.get_num_free_blocks(), total, self.page_bytes)

    def cached_pages(self) -> int:
        """Free blocks that still hold a prefix: vLLM's cache (reused, or evicted when needed).
        vLLM keeps no count of them: a pass over its blocks."""
        return sum(1 for b in self.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
