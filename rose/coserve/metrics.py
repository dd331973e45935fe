"""Prometheus metrics of one co-serving executor (its own registry, so several can coexist)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds: TTFT spans milliseconds to many seconds under load; TPOT is per token.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class ExecutorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("rose_serving_ttft_seconds", "Serving time to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("rose_serving_tpot_seconds", "Serving time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.serving_requests = Counter("rose_serving_requests", "Finished serving requests", registry=r)
        self.slo_met = Counter("rose_serving_slo_met", "Finished serving requests within both SLOs",
                               registry=r)
        self.rollout_tokens = Counter("rose_rollout_tokens", "Tokens generated for rollout turns", registry=r)
        self.rollout_aborts = Counter("rose_rollout_aborted_turns",
                                      "Rollout turns aborted by an emergency cut", registry=r)
        self.iterations = Counter("rose_iterations", "Executor iterations", ["model"], registry=r)
        self.busy = Counter("rose_busy_seconds", "Time spent computing iterations", ["model"], registry=r)
        self.pool_pages = Gauge("rose_kv_pool_pages", "KV pool pages by owner (and free)", ["owner"],
                                registry=r)
        self.cached_pages = Gauge("rose_kv_cached_pages",
                                  "KV pages only an owner's prefix cache holds (evictable)", ["owner"],
                                  registry=r)
        self.state = Gauge("rose_executor_state", "Burst state: 0 normal, 1 burst, 2 frozen", registry=r)
        self.transitions = Counter("rose_executor_transitions", "Burst state transitions",
                                   ["from_state", "to_state"], registry=r)
        self.rollout_budget = Gauge("rose_rollout_budget_pages", "Pages rollouts may hold", registry=r)
        self.latency_error = Gauge("rose_latency_model_error",
                                   "Time-weighted relative error of iteration-time predictions", registry=r)
        self.admission_overruns = Counter(
            "rose_admission_overruns", "Co-served iterations that ran past the ceiling they were admitted "
            "under", registry=r)
        self.rollout_interrupted = Counter(
            "rose_rollout_interrupted", "Rollout iterations given up part way for a serving request "
            "that arrived while they ran", registry=r)
        self.rollout_share = Gauge(
            "rose_rollout_share", "Feedback guard: share of the admission ceiling rollouts may use",
            registry=r)
        self.rollout_share.set(1.0)
        self.slo_attainment = Gauge("rose_serving_slo_attainment",
                                    "Share of finished serving requests within both SLOs", registry=r)

    def expose(self) -> bytes:
        return generate_latest(self.registry)
