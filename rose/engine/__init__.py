"""Native generation engine: paged KV pool, continuous batching, prefix cache, sampling."""

from rose.contracts import InFlight, RequestOutput, SamplingParams
from rose.engine.kv_pool import KVPool, KVSpec
from rose.engine.llm_engine import EngineConfig, LLMEngine

__all__ = ["EngineConfig", "InFlight", "KVPool", "KVSpec", "LLMEngine", "RequestOutput", "SamplingParams"]
