"""The co-serving executor's mechanisms: pool split, burst states, admission in the loop,
partial tokens handed back, the latency model."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rose.contracts import TokenLoad, Turn
from rose.coserve.executor import CoServingExecutor
from rose.coserve.latency import FittedLatencyModel, TailLatency, nonnegative_lstsq
from rose.coserve.metrics import read_pool_sample, transitions
from rose.coserve.settings import MB, ExecutorConfig, Policy
from rose.engine import KVSpec, SamplingParams
from rose.model import preset_config, random_model


def _executor(pages: int = 64, **config: object) -> CoServingExecutor:
    serving = random_model(preset_config("qwen2", "tiny"), seed=1)
    rollout = random_model(preset_config("qwen3", "tiny", num_hidden_layers=3, head_dim=8), seed=2)
    spec = max(KVSpec.of(serving.config).block_bytes, KVSpec.of(rollout.config).block_bytes)
    return CoServingExecutor(serving, rollout, ExecutorConfig(pool_mb=pages * spec / MB, **config))


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def test_two_kv_shapes_share_one_pool() -> None:
    ex = _executor(pages=64)
    assert ex.serving.blocks.spec != ex.rollout.blocks.spec
    assert ex.pool.budget("rollout") == 64 - int(64 * 0.2)  # NORMAL: pool - H - serving (0)
    ex.add_serving(_ids(40), SamplingParams(max_tokens=2))
    ex.submit_turn(Turn("t", "traj", _ids(70, 1), SamplingParams(max_tokens=2)))
    ex.step()
    assert (ex.pool.used("serving"), ex.pool.used("rollout")) == (3, 5)
    assert ex.pool.num_free == 64 - 8


def test_priority_fills_the_iteration_s_token_budget_and_preempts_rollouts_for_serving_pages() -> None:
    # SLOs so tight that rose would admit nothing beside serving: priority does not look at them.
    ex = _executor(pages=40, policy=Policy.PRIORITY, slo_ttft_ms=1, slo_tpot_ms=1)
    for i in range(4):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(60, i), LONG))
    for _ in range(4):
        ex.step()
    assert ex.pool.used("rollout") >= 16
    ex.add_serving(_ids(10, 9), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ex.step()
    # Serving's prefill ran first; every rollout decode ran beside it in the same iteration.
    assert ex.serving.last_step.load.prefill_tokens == 10
    assert ex.rollout.last_step.load.decode_seqs == 4
    # Serving prompts that need the pages rollouts hold: the newest rollouts are preempted (to be
    # recomputed, not handed back) and serving never waits for a page.
    preempted = ex.rollout.num_preemptions
    for i in range(3):
        ex.add_serving(_ids(150, 10 + i), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    outs = []
    for _ in range(4):
        outs += ex.step()
    assert ex.rollout.num_preemptions > preempted
    assert not [o for o in outs if o.finish_reason == "abort"]
    assert ex.pool.used("rollout") <= ex.pool.budget("rollout")
    firsts = {o.request_id for o in outs if o.token_ids and o.request_id.startswith("serving")}
    assert len(firsts) == 4  # the first serving request and the three prompts: each had its pages
    assert len(ex._turns) == 4 and len(ex.rollout.scheduler.waiting) >= 1  # preempted turns wait


def test_burst_cut_hands_back_partial_turns_then_freeze_until_new_rl_step() -> None:
    ex = _executor(pages=40, slo_ttft_ms=1e6, slo_tpot_ms=1e6)  # memory alone decides here
    for i in range(4):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(60, i), LONG))
    for _ in range(6):
        ex.step()
    assert ex.burst.state.name == "NORMAL" and ex.pool.used("rollout") >= 20
    before = {t: len(ex.rollout._seqs[t].output_token_ids) for t in ex._turns}
    # A serving burst: long prompts that eat the headroom.
    for i in range(3):
        ex.add_serving(_ids(150, 10 + i), SamplingParams(max_tokens=4))
    aborted = []
    for _ in range(8):
        aborted += [o for o in ex.step() if o.finish_reason == "abort"]
        if aborted:
            break
    assert aborted and ex.burst.state.name == "BURST"
    assert ex.capacity().free_slots == 0
    for out in aborted:  # nothing lost: the partial tokens were streamed; the abort counts them
        assert out.num_output_tokens >= before[out.request_id] > 0 and out.token_ids == []
        assert out.request_id not in ex._turns
    budget = ex.pool.budget("rollout")
    while ex.serving.has_unfinished():
        ex.step()
    ex.step()
    assert ex.burst.state.name == "FROZEN" and ex.pool.budget("rollout") <= budget
    ex.new_rl_step()
    ex.step()
    assert ex.burst.state.name == "NORMAL" and ex.pool.budget("rollout") > budget
    metrics = ex.metrics.expose().decode()
    assert 'rose:burst_transitions_total{from_state="normal",to_state="burst"} 1.0' in metrics
    assert 'rose:burst_transitions_total{from_state="burst",to_state="frozen"} 1.0' in metrics
    # new_rl_step's own transition
    assert 'rose:burst_transitions_total{from_state="frozen",to_state="normal"} 1.0' in metrics
    assert "rose:rollout_aborted_turns_total" in metrics
    # The pool timeline's sample, in process as a scrape reads it: the burst's course in it.
    sample = ex.metrics.pool_sample()
    assert sample == read_pool_sample(metrics)
    assert sample["state"] == 0 and sample["rollout_turns_cut"] >= len(aborted)
    assert [(a, b) for _, a, b in transitions([sample], 0.0)] == [
        ("normal", "burst"), ("burst", "frozen"), ("frozen", "normal")]


def test_a_prompt_waiting_for_pages_the_rollouts_hold_fires_the_burst() -> None:
    """Free pages above the trigger but short of a prompt: the prompt's pages count as serving's,
    so the cut comes in the iteration it arrives, not when the rollouts' turns end."""
    ex = _executor(pages=40, slo_ttft_ms=1e6, slo_tpot_ms=1e6)  # headroom 8 pages, trigger at 4 free
    for i in range(3):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(100, i), LONG))
    ex.step()
    ex.step()
    free = ex.pool.num_free
    assert free > ex.burst.trigger_free and ex.burst.state.name == "NORMAL"
    ex.add_serving(_ids(16 * free + 1, 9), SamplingParams(max_tokens=4))  # one page more than is free
    outs = ex.step()
    assert ex.burst.state.name == "BURST" and [o.finish_reason for o in outs].count("abort") >= 1
    assert ex.serving.last_step.load.prefill_tokens == 16 * free + 1  # prefilled in that iteration


def _samples(ex: CoServingExecutor) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(ex.metrics.expose().decode()) for s in f.samples}


def test_a_cuts_pages_are_servings_before_the_triggers_own_serving_step() -> None:
    """The burst's course in /metrics: each cut, the pages its aborted turns held, how many
    iterations and seconds after the trigger rollouts were within its budget, the time of each
    transition, serving's preemptions."""
    ex = _executor(pages=40, slo_ttft_ms=1e6, slo_tpot_ms=1e6)
    for i in range(4):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(60, i), LONG))
    for _ in range(6):
        ex.step()
    held = {s.request_id: len(s.block_table) for s in ex._rollout_seqs()}
    for i in range(3):
        ex.add_serving(_ids(150, 10 + i), SamplingParams(max_tokens=4))
    cut: list[str] = []
    while not cut:
        cut = [o.request_id for o in ex.step() if o.finish_reason == "abort"]
    m = _samples(ex)
    assert m[("rose:burst_cuts_total", ())] == 1.0
    assert m[("rose:burst_cut_pages_total", ())] == sum(held[t] for t in cut) > 0
    assert m[("rose:burst_reclaim_iterations_count", ())] == 1.0
    assert m[("rose:burst_reclaim_iterations_bucket", (("le", "0.0"),))] == 1.0  # before serving's step
    assert 0 < m[("rose:burst_reclaim_seconds_sum", ())] < 0.5
    assert ex.rollout.blocks.num_active_pages <= ex.pool.budget("rollout")
    transition = (("from_state", "normal"), ("to_state", "burst"))
    trigger = m[("rose:burst_transition_timestamp_seconds", transition)]
    assert abs(trigger - time.time()) < 60
    assert m[("vllm:num_preemptions_total", (("model_name", ""),))] == ex.serving.num_preemptions


def _rollout_tokens_per_iteration(ex: CoServingExecutor) -> list[int]:
    for i in range(6):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(30, i), LONG))
    ex.add_serving(_ids(20, 50), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    def computed() -> int:
        return sum(len(s.token_ids) - s.num_uncomputed for s in ex._rollout_seqs())

    counts = []
    for _ in range(12):
        before = computed()
        ex.step()
        counts.append(computed() - before)
    return counts


def test_admission_holds_rollouts_back_only_when_serving_slo_is_tight() -> None:
    inf = float("inf")
    loose = _executor(pages=256, slo_ttft_ms=1e5, slo_tpot_ms=1e5, tpot_inflation=inf, ttft_inflation=inf)
    loose.profile()
    assert sum(_rollout_tokens_per_iteration(loose)) >= 6 * 30  # all prefills and decodes ran
    tight = _executor(pages=256, slo_ttft_ms=1e5, slo_tpot_ms=0.01)  # 10 us per token: never
    tight.profile()
    # Once serving decodes, no rollout token fits its TPOT budget.
    assert sum(_rollout_tokens_per_iteration(tight)[2:]) == 0


def test_static_and_naive_policies() -> None:
    static = _executor(pages=100, policy=Policy.STATIC, static_rollout_pages=0.3, static_rollout_tokens=8)
    assert (static.pool.budget("rollout"), static.pool.budget("serving")) == (30, 70)
    static.submit_turn(Turn("t", "traj", _ids(40), LONG))
    static.step()
    assert static.rollout.last_step.load.prefill_tokens == 8
    naive = _executor(pages=100, policy=Policy.NAIVE)
    naive.submit_turn(Turn("t", "traj", _ids(40), LONG))
    naive.step()
    assert naive.rollout.last_step.load.prefill_tokens == 40 and naive.pool.budget("rollout") == 100


def test_lease_refuses_bad_turns() -> None:
    ex = _executor()
    ex.submit_turn(Turn("t", "traj", _ids(5), LONG))
    with pytest.raises(ValueError, match="already in use"):
        ex.submit_turn(Turn("t", "traj", _ids(5), LONG))
    with pytest.raises(ValueError, match="expects policy version 3"):
        ex.submit_turn(Turn("u", "traj", _ids(5), LONG, policy_version=3))
    with pytest.raises(ValueError, match="the prompt is empty"):
        ex.submit_turn(Turn("v", "traj", [], LONG))
    partial = ex.abort("t")
    assert partial is not None and partial.finish_reason == "abort"
    serving_only = CoServingExecutor(random_model(preset_config("qwen2", "tiny")), None)
    with pytest.raises(ValueError, match="no rollout model"):
        serving_only.submit_turn(Turn("t", "traj", _ids(5), LONG))


def test_latency_model_fits_and_reports_its_error() -> None:
    rng = np.random.default_rng(0)
    model = FittedLatencyModel(refit_every=8)
    truth = np.array([0.002, 1e-4, 1e-5, 3e-4, 2e-3])  # per feature, seconds
    for _ in range(200):
        load = TokenLoad(int(rng.integers(0, 512)), int(rng.integers(0, 32)), int(rng.integers(0, 8000)))
        p = load.prefill_tokens
        t = truth @ [1, p, p * p / 1024, load.decode_seqs, load.context_tokens / 1024]
        model.observe("serving", load, float(t * rng.uniform(0.95, 1.05)))
    assert model.error < 0.1
    load = TokenLoad(256, 8, 2048)
    both = model.iteration_time(load, TokenLoad())
    assert both == pytest.approx(truth @ [1, 256, 64, 8, 2], rel=0.1)
    assert model.iteration_time(TokenLoad(), TokenLoad()) == 0.0
    coef = nonnegative_lstsq(np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]), np.array([3.0, 2.0, 1.0]))
    assert (coef >= 0).all()


def test_latency_model_keeps_rare_prefill_iterations_beside_many_decodes() -> None:
    # Serving's prefills are rare beside its decodes: thousands of decodes later, what the
    # model predicts for a prompt still rests on measured prefills, not on the decodes alone.
    model = FittedLatencyModel(window=64, refit_every=8)
    for p in (16, 64, 256, 512) * 4:
        model.observe("serving", TokenLoad(p), 0.002 + 4e-4 * p)
    for k in range(2000):
        model.observe("serving", TokenLoad(0, 1 + k % 8, 100 * (1 + k % 8)), 0.004 + 1e-3 * (1 + k % 8))
    assert model.time("serving", TokenLoad(512)) == pytest.approx(0.002 + 4e-4 * 512, rel=0.05)
    assert model.time("serving", TokenLoad(0, 4, 400)) == pytest.approx(0.008, rel=0.05)


def test_rollouts_are_not_starved_by_an_overestimating_model_when_serving_is_idle() -> None:
    ex = _executor(pages=128, slo_ttft_ms=100, slo_tpot_ms=50)
    for load in (TokenLoad(16), TokenLoad(64), TokenLoad(0, 4, 100)):  # a noisy profile: 10 s each
        ex.latency.observe("rollout", load, 10.0)
        ex.latency.observe("serving", load, 10.0)
    ex.submit_turn(Turn("t", "traj", _ids(100), SamplingParams(max_tokens=3, ignore_eos=True)))
    ex.step()
    assert ex.rollout.last_step.load.prefill_tokens == ex.config.idle_min_rollout_tokens
    while ex.has_unfinished():
        ex.step()  # it finishes, a floor's worth of tokens per iteration


class _StubLatency:
    """Serving free, a rollout decode 2.6 s, a rollout prefill token 10 ms (long, so that the
    wall time the test itself takes, under load, stays far inside the TPOT margin)."""

    error = 0.0

    def time(self, model: str, load: TokenLoad) -> float:
        return 0.0 if model == "serving" else 2.6 * load.decode_seqs + 0.01 * load.prefill_tokens

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        return self.time("serving", serving) + self.time("rollout", rollout)

    def observe(self, model: str, load: TokenLoad, seconds: float) -> None:
        pass


def test_the_token_budget_runs_only_the_admitted_rollout_decodes() -> None:
    inf = float("inf")
    ex = _executor(pages=256, slo_ttft_ms=1e5, slo_tpot_ms=10_000, tpot_inflation=inf, ttft_inflation=inf)
    ex.tail = _StubLatency()
    for i in range(4):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(8, i), LONG))
    ex.step()  # serving idle: the four prefill and become ready to decode
    ex.add_serving(_ids(8, 50), LONG)
    ex.step()  # serving's first token
    ex.submit_turn(Turn("t4", "traj4", _ids(40, 4), LONG))
    ex.step()
    # Under 10 s: three decodes (7.8 s) plus prefill tokens fit, a fourth decode does not; a
    # budget of that many tokens would run four decodes (10.4 s), so only the three go.
    load = ex.rollout.last_step.load
    assert (load.decode_seqs, load.prefill_tokens) == (3, 0)


def test_inflation_budget_keeps_rollouts_off_a_decoding_request_and_charges_what_it_waited() -> None:
    # SLOs that would allow anything: only the TPOT inflation budget (0: none) holds rollouts back.
    ex = _executor(pages=256, slo_ttft_ms=1e5, slo_tpot_ms=1e5, tpot_inflation=0.0,
                   ttft_inflation=float("inf"))
    ex.profile()
    counts = _rollout_tokens_per_iteration(ex)
    assert counts[0] > 0                                 # beside serving's prefill: TTFT unbounded
    assert sum(counts[1:]) == 0                          # serving decodes: rollouts wait
    rid = next(iter(ex.serving._seqs))
    waited = ex._waited[rid]
    # Its first token came from serving's part of the first iteration; the rollout part ran after
    # it, so it was charged to its decode (and the budget of 0 held rollouts back from then on).
    assert waited.total_s > 0 and waited.before_first_s == 0
    assert ex.serving.abort(rid) is not None
    ex.step()
    ex.submit_turn(Turn("late", "traj-late", _ids(10, 99), SamplingParams(max_tokens=2)))
    ex.step()
    assert rid not in ex._waited                         # accounts end with their requests


def test_feedback_guard_halves_the_share_after_an_overrun() -> None:
    ex = _executor()
    ex._limit_s = 0.0                                    # admitted under a ceiling of 0 s...
    ex._observe_slack(1e-3)                              # ...it ran 1 ms: an overrun
    assert ex.guard.share == 0.5 and ex.guard.overruns == 1
    metrics = ex.metrics.expose().decode()
    assert "rose:rollout_share 0.5" in metrics and "rose:admission_overruns_total 1.0" in metrics


def test_bad_admission_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="admission_quantile"):
        ExecutorConfig(admission_quantile=0.0)
    with pytest.raises(ValueError, match="inflation"):
        ExecutorConfig(tpot_inflation=-0.1)


def test_both_models_run_on_one_device_in_the_dtype_named(tiny_qwen2: Path, tiny_qwen3: Path) -> None:
    ex = CoServingExecutor.from_pretrained(tiny_qwen2, tiny_qwen3, ExecutorConfig(pool_mb=4), device="cpu",
                                           dtype="bfloat16")
    assert ex.pool.device == torch.device("cpu")
    assert {next(e.model.parameters()).dtype for e in (ex.serving, ex.rollout)} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"the serving model is on cpu, the rollout model on meta"):
        CoServingExecutor(ex.serving.model, ex.rollout.model.to("meta"))


def test_tail_latency_covers_the_quantile_of_fresh_measurements() -> None:
    rng = np.random.default_rng(1)
    model = FittedLatencyModel(refit_every=16)

    def measured(load: TokenLoad) -> float:  # decodes jitter more than prefills
        noise = rng.lognormal(0, 0.3 if load.decode_seqs else 0.05)
        return (0.002 + 1e-4 * load.prefill_tokens + 3e-4 * load.decode_seqs) * noise

    def draw() -> TokenLoad:
        return (TokenLoad(int(rng.integers(16, 512))) if rng.random() < 0.5
                else TokenLoad(0, int(rng.integers(1, 32)), 1024))

    for _ in range(600):
        load = draw()
        model.observe("rollout", load, measured(load))
    tail, mean = TailLatency(model, 0.95), TailLatency(model, 0.5)
    assert model.factor("rollout", TokenLoad(0, 8), 0.95) > model.factor("rollout", TokenLoad(64), 0.95)
    fresh = [draw() for _ in range(2000)]
    times = [measured(x) for x in fresh]
    covered = np.mean([t <= tail.time("rollout", x) for x, t in zip(fresh, times, strict=True)])
    half = np.mean([t <= mean.time("rollout", x) for x, t in zip(fresh, times, strict=True)])
    assert covered >= 0.9 and 0.35 <= half <= 0.65
    with pytest.raises(ValueError, match="quantile"):
        TailLatency(model, 1.5)


def _turn_tokens(ex: CoServingExecutor, steps: int) -> list[int]:
    ex.submit_turn(Turn("t", "traj", _ids(30, 4), SamplingParams(max_tokens=6, temperature=0,
                                                                 ignore_eos=True)))
    tokens = []
    for _ in range(steps):
        tokens += [t for out in ex.step() if out.request_id == "t" for t in out.token_ids]
    return tokens


@pytest.mark.parametrize("policy", [Policy.ROSE, Policy.NAIVE])
def test_a_serving_arrival_interrupts_the_rollout_iteration_under_rose_only(policy: Policy) -> None:
    clean = _turn_tokens(_executor(policy=policy), steps=12)
    ex = _executor(policy=policy)
    arrivals = iter([False, True, False, True])  # before each rollout layer: cut at the 2nd and 4th
    ex.serving_arrived = lambda: next(arrivals, False)
    assert _turn_tokens(ex, steps=14) == clean
    interrupted = ex.metrics.rollout_interrupted._value.get()
    assert interrupted == (2 if policy is Policy.ROSE else 0)
    assert ex.rollout.num_interrupted == interrupted
