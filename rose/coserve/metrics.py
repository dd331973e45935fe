"""Prometheus metrics of one co-serving executor (its own registry, so several can coexist).

The serving model's are named and labelled as vLLM's (`vllm:*`, `model_name`), so dashboards
and alerts written for a vLLM server read a ROSE executor unchanged; what only co-serving has
(rollouts, leases, burst control, admission) is `rose:*`. docs/coserve.md lists them all.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from rose.coserve.admission import BurstState
from rose.engine import RequestOutput

# vLLM's buckets (seconds), so that percentiles over a ROSE and a vLLM server compare.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
# Token counts: 1, 2, 5, 10, ... as vLLM builds them.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
# An emergency cut's pages come back while the aborts run: sub-millisecond unless a cut ever
# waits for an iteration.
_RECLAIM_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
_RECLAIM_ITERATION_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

# -- the pool timeline: what a sampler of /metrics (or of the registry in process) records ------

STATES = tuple(state.name.lower() for state in BurstState)
TRANSITIONS = {f"{a}_to_{b}": (a, b) for a in STATES for b in STATES if a != b}  # column -> (from, to)
POOL_COLUMNS = {  # column -> (sample name, labels)
    "serving_pages": ("rose:kv_pool_pages", {"owner": "serving"}),
    "rollout_pages": ("rose:kv_pool_pages", {"owner": "rollout"}),
    "free_pages": ("rose:kv_pool_pages", {"owner": "free"}),
    "cached_serving_pages": ("rose:kv_cached_pages", {"owner": "serving"}),
    "cached_rollout_pages": ("rose:kv_cached_pages", {"owner": "rollout"}),
    "rollout_budget": ("rose:rollout_budget_pages", {}),
    "state": ("rose:burst_state", {}),
    "rollout_tokens": ("rose:rollout_tokens_total", {}),
    "rollout_turns_cut": ("rose:rollout_aborted_turns_total", {}),
    "serving_running": ("vllm:num_requests_running", {}),
    "serving_waiting": ("vllm:num_requests_waiting", {}),
    "serving_preemptions": ("vllm:num_preemptions_total", {}),
    # The server's Unix time of the last transition of each kind.
    **{column: ("rose:burst_transition_timestamp_seconds", {"from_state": a, "to_state": b})
       for column, (a, b) in TRANSITIONS.items()},
}
_POOL_NAMES = tuple({name for name, _ in POOL_COLUMNS.values()})


def pool_columns(families: Iterable[Metric]) -> dict[str, float]:
    """The pool timeline's columns from metric families (a registry's, or a scrape's)."""
    out = dict.fromkeys(POOL_COLUMNS, 0.0)
    for family in families:
        for s in family.samples:
            for column, (name, labels) in POOL_COLUMNS.items():
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    out[column] = s.value
    return out


def read_pool_sample(text: str) -> dict[str, float]:
    """The pool timeline's columns from one scrape of /metrics (only their lines are parsed)."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_POOL_NAMES))
    return pool_columns(text_string_to_metric_families(lines + "\n"))


def transitions(samples: Iterable[dict[str, float]], wall0: float) -> list[tuple[float, str, str]]:
    """The burst state transitions a pool timeline saw, as (seconds after `wall0`, from, to), at
    the server's own time of each (one of a kind per sample at most)."""
    seen: set[tuple[float, str]] = set()
    for s in samples:
        for column in TRANSITIONS:
            if s.get(column):
                seen.add((s[column], column))
    return sorted((round(at - wall0, 3), *TRANSITIONS[column]) for at, column in seen)


class ExecutorMetrics:
    def __init__(self, engines: tuple[str, ...]) -> None:
        """`engines`: the executor's engines' names, the `engine` label's values."""
        self.registry = CollectorRegistry()
        self.model_name = ""
        r, model = self.registry, ["model_name"]
        # -- vLLM's, for the serving model -------------------------------------------------------
        self.running = Gauge("vllm:num_requests_running", "Serving requests in the running batch", model,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Serving requests waiting to be scheduled", model,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of the KV cache serving may use that "
                              "its requests hold (1 = full)", model, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of serving requests, counted at "
                                     "their first token", model, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for serving requests",
                                         model, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished serving requests, by finish reason",
                                       [*model, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Serving time to first token", model,
                              buckets=_TTFT_BUCKETS, registry=r)
        # Once per request, its mean after the first token: the quantity the TPOT SLO bounds.
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Serving time per output token after the first, per request", model,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Serving request latency, arrival to last "
                             "token", model, buckets=_E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per serving "
                                               "request", model, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per "
                                                   "serving request", model, buckets=_TOKEN_BUCKETS,
                                                   registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Serving requests preempted for want of KV pages "
                                   "(their KV is computed again later)", model, registry=r)
        # -- ROSE's own ------------------------------------------------------------------------------
        self.serving_requests = Counter("rose:serving_requests", "Finished serving requests that had a "
                                        "first token (the SLO attainment's denominator)", registry=r)
        self.slo_met = Counter("rose:serving_slo_met", "Finished serving requests within both SLOs",
                               registry=r)
        self.slo_attainment = Gauge("rose:serving_slo_attainment",
                                    "Share of finished serving requests within both SLOs", registry=r)
        self.rollout_tokens = Counter("rose:rollout_tokens", "Tokens generated for rollout turns", registry=r)
        self.rollout_beside_serving = Counter(
            "rose:rollout_tokens_beside_serving", "Rollout tokens computed (prompt and decode) in iterations "
            "in which serving computed too", registry=r)
        self.turns_running = Gauge("rose:rollout_turns_running", "Leased rollout turns running", registry=r)
        self.turns_finished = Counter("rose:rollout_turns_finished", "Finished rollout turns, by finish "
                                      "reason", ["finished_reason"], registry=r)
        self.rollout_aborts = Counter("rose:rollout_aborted_turns",
                                      "Rollout turns aborted by an emergency cut", registry=r)
        self.rollout_interrupted = Counter(
            "rose:rollout_interrupted", "Rollout iterations given up part way for a serving request "
            "that arrived while they ran", registry=r)
        self.iterations = Counter("rose:iterations", "Executor iterations", ["engine"], registry=r)
        self.busy = Counter("rose:busy_seconds", "Time spent computing iterations", ["engine"], registry=r)
        self.rollout_kv_usage = Gauge("rose:rollout_kv_cache_usage_perc", "Share of the KV pool rollouts "
                                      "draw from that their turns hold (1 = full)", registry=r)
        self.pool_pages = Gauge("rose:kv_pool_pages", "KV pool pages by owner (and free)", ["owner"],
                                registry=r)
        self.cached_pages = Gauge("rose:kv_cached_pages",
                                  "KV pages only an owner's prefix cache holds (evictable)", ["owner"],
                                  registry=r)
        self.state = Gauge("rose:burst_state", "Burst state: 0 normal, 1 burst, 2 frozen", registry=r)
        self.transitions = Counter("rose:burst_transitions", "Burst state transitions",
                                   ["from_state", "to_state"], registry=r)
        self.rollout_budget = Gauge("rose:rollout_budget_pages", "Pages rollouts may hold", registry=r)
        self.transition_time = Gauge("rose:burst_transition_timestamp_seconds", "Unix time of the last "
                                     "burst state transition of each kind (0: none yet)",
                                     ["from_state", "to_state"], registry=r)
        self.cuts = Counter("rose:burst_cuts", "Emergency cuts: each time serving crossed the high "
                            "watermark while rollouts held pages (a burst's trigger and each crossing in it)",
                            registry=r)
        self.cut_pages = Counter("rose:burst_cut_pages", "KV pages the rollout turns that emergency cuts "
                                 "aborted held", registry=r)
        self.reclaim_seconds = Histogram(
            "rose:burst_reclaim_seconds", "Per emergency cut, from its trigger until rollouts hold no more "
            "than the cut's budget (the pages it took back are serving's)", buckets=_RECLAIM_BUCKETS,
            registry=r)
        self.reclaim_iterations = Histogram(
            "rose:burst_reclaim_iterations", "Per emergency cut, serving iterations run from its trigger "
            "until rollouts hold no more than the cut's budget (0: before the trigger's own)",
            buckets=_RECLAIM_ITERATION_BUCKETS, registry=r)
        self.admissions = Counter("rose:admission_decisions", "Iterations with rollout work, by whether "
                                  "any of it was admitted", ["outcome"], registry=r)
        self.slack = Gauge("rose:admission_slack_seconds", "Least serving slack left with the admitted "
                           "rollout work (+Inf: no serving request in flight)", registry=r)
        self.latency_error = Gauge("rose:latency_model_error",
                                   "Time-weighted relative error of iteration-time predictions", registry=r)
        self.admission_overruns = Counter(
            "rose:admission_overruns", "Co-served iterations that ran past the ceiling they were admitted "
            "under", registry=r)
        self.rollout_share = Gauge(
            "rose:rollout_share", "Feedback guard: share of the admission ceiling rollouts may use",
            registry=r)
        self.rollout_share.set(1.0)
        # Every series from the first scrape on, so rates and dashboards need no first event.
        for reason in FINISH_REASONS:
            self.turns_finished.labels(reason)
        for engine in engines:
            self.iterations.labels(engine)
            self.busy.labels(engine)
        for before in BurstState:
            for after in BurstState:
                if before is not after:
                    self.transitions.labels(before.name.lower(), after.name.lower())
                    self.transition_time.labels(before.name.lower(), after.name.lower())
        for outcome in ("admitted", "held"):
            self.admissions.labels(outcome)

    def set_model_name(self, name: str) -> None:
        """The name clients call the serving model (the server's): the `model_name` label."""
        self.model_name = name
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.ttft, self.tpot, self.e2e, self.request_prompt_tokens,
                       self.request_generation_tokens, self.preemptions):
            metric.labels(name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)

    def set_kv_usage(self, serving: tuple[int, int], rollout: tuple[int, int] | None) -> None:
        """Each model's KV usage, as (pages its requests hold, pages it may hold). Pages only a
        prefix cache holds count as free, as vLLM counts them. Serving may hold its own cache
        (vLLM's, with --engine vllm) or the whole shared pool (the native engine: the burst
        cut takes the rollouts' pages back for it; under `static`, its fixed share); rollouts
        draw from the shared pool, or from their own beside vLLM's cache."""
        held, total = serving
        self.kv_usage.labels(self.model_name).set(held / total)
        if rollout is not None:
            self.rollout_kv_usage.set(rollout[0] / rollout[1])

    def serving_output(self, out: RequestOutput) -> None:
        """One iteration's output of a serving request: its new tokens, and its prompt's with its
        first token."""
        self.generation_tokens.labels(self.model_name).inc(len(out.token_ids))
        if out.token_ids and out.num_output_tokens == len(out.token_ids):
            self.prompt_tokens.labels(self.model_name).inc(out.num_prompt_tokens)

    def serving_finished(self, out: RequestOutput) -> tuple[float, float] | None:
        """A finished (or aborted) serving request: its (TTFT, TPOT), None before its first token."""
        name = self.model_name
        self.request_success.labels(name, out.finish_reason or "abort").inc()
        if out.first_token_time is None or out.last_token_time is None:
            return None
        n = out.num_output_tokens
        ttft = out.first_token_time - out.arrival_time
        tpot = (out.last_token_time - out.first_token_time) / (n - 1) if n > 1 else 0.0
        self.ttft.labels(name).observe(ttft)
        self.tpot.labels(name).observe(tpot)
        self.e2e.labels(name).observe(out.last_token_time - out.arrival_time)
        self.request_prompt_tokens.labels(name).observe(out.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(n)
        return ttft, tpot

    def expose(self) -> bytes:
        return generate_latest(self.registry)

    def pool_sample(self) -> dict[str, float]:
        """The pool timeline's columns now, read in process."""
        return pool_columns(self.registry.collect())
