"""Dual-SLO admission and the burst state machine (`rose.coserve.admission`) on constructed cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rose.contracts import TokenLoad
from rose.coserve.admission import (
    BurstController,
    BurstState,
    RolloutDemand,
    RolloutWait,
    ServingRequest,
    ServingState,
    SlackGuard,
    SLOBudgets,
    admission_step,
    admit,
    iteration_limit,
    memory_room,
    priority_pages,
    priority_tokens,
    rollout_capacity,
    rollout_duty,
    serving_state,
)


@dataclasses.dataclass
class LinearLatency:
    """10 ms base, 1 ms per 100 prefill tokens, 0.1 ms per decode sequence, per model."""

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        def part(x: TokenLoad) -> float:
            return 0.0 if x == TokenLoad() else 0.005 + x.prefill_tokens * 1e-5 + x.decode_seqs * 1e-4
        return 0.005 + part(serving) + part(rollout)


SLO = SLOBudgets(ttft_s=1.0, tpot_s=0.05)
LAT = LinearLatency()


def test_no_serving_admits_everything_up_to_the_chunk():
    a = admit(0.0, ServingState(), RolloutDemand([100] * 300, 5000), LAT, SLO, chunk_tokens=512)
    assert (a.decode_seqs, a.prefill_tokens) == (300, 512)
    assert math.isinf(a.limit_s) and math.isinf(a.prefill_slack_s) and math.isinf(a.decode_slack_s)


def test_decode_slack_caps_rollout_decode_sequences():
    # Serving: 10 decoding requests, last token at t=0; now t=0; T_dec must stay < 50 ms.
    serving = ServingState(decoding_last_token_s=[0.0] * 10, decode_context_tokens=1000)
    a = admit(0.0, serving, RolloutDemand([50] * 1000, 0), LAT, SLO)
    # base 5 ms + serving 5 + 1 ms + rollout 5 ms + 0.1 ms * d < 50 ms  ->  d < 340
    assert a.decode_seqs == 339
    assert a.decode_slack_s > 0
    assert a.iteration_s < a.limit_s == pytest.approx(0.05)


def test_time_since_last_token_eats_decode_slack():
    serving = ServingState(decoding_last_token_s=[0.0], decode_context_tokens=10)
    a = admit(0.04, serving, RolloutDemand([50] * 1000, 512), LAT, SLO)
    # Only 10 ms of budget left and serving alone takes 10.1 ms: nothing joins.
    assert (a.decode_seqs, a.prefill_tokens) == (0, 0)
    assert a.decode_slack_s < 0


def test_prefill_slack_counts_the_queue_ahead():
    # Two waiting prompts of 1024 tokens; chunk 512 -> the second needs 4 iterations.
    serving = ServingState(waiting=[(0.0, 1024), (0.0, 1024)])
    limit = iteration_limit(0.9, serving, SLO, LAT, 512)
    assert limit == pytest.approx(0.1 / 4)
    a = admit(0.9, serving, RolloutDemand([10] * 100, 1000), LAT, SLO, chunk_tokens=512)
    assert a.iteration_s < 0.025
    assert a.prefill_slack_s > 0
    # serving alone: 5 + 5 + 5.12 = 15.12 ms; rollout adds 5 ms + 0.1 ms/seq: 48 seqs fit,
    # then 0.08 ms of the ceiling is left for 7 prefill tokens at 0.01 ms each.
    assert a.decode_seqs == 48 and a.prefill_tokens == 7


def test_prefill_tokens_fill_what_decode_leaves():
    serving = ServingState(decoding_last_token_s=[1.0], decode_context_tokens=10)
    a = admit(1.0, serving, RolloutDemand([10] * 5, 100_000), LAT, SLO, rollout_chunk_tokens=4096)
    # 5 + 5.1 + 5 + 0.5 + 0.01 ms * p < 50  ->  p < 3440 (within float rounding)
    assert a.decode_seqs == 5 and a.prefill_tokens == pytest.approx(3440, abs=1)
    assert a.decode_slack_s >= 0


def test_slacks_match_the_design_formulas():
    serving = ServingState(waiting=[(0.2, 600)], decoding_last_token_s=[0.25, 0.3])
    a = admit(0.3, serving, RolloutDemand(), LAT, SLO)  # no rollout work: serving's own iteration
    t = a.iteration_s
    assert a.prefill_slack_s == pytest.approx((0.2 + 1.0) - 0.3 - 2 * t)  # 600 tokens: two chunks
    assert a.decode_slack_s == pytest.approx((0.25 + 0.05) - 0.3 - t)


def test_bad_budgets_and_chunk_are_rejected():
    with pytest.raises(ValueError, match="SLO budgets must be positive"):
        SLOBudgets(0, 1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        admit(0.0, ServingState(), RolloutDemand(), LAT, SLO, chunk_tokens=0)


INF = math.inf


def test_banked_slack_lets_a_request_ahead_of_its_tpot_spend_it_beyond_a_reserve():
    # 10 tokens by t=0.3 against a budget of first + 10 x 50 ms = 0.5 s: 0.2 s banked.
    ahead = ServingState(decoding_last_token_s=[0.3], decode_context_tokens=10, decoding_first_token_s=[0.0],
                         decoding_output_tokens=[10], decoding_rollout_s=[0.0])
    reserve = LAT.iteration_time(TokenLoad(512, 1, 10), TokenLoad())  # one full serving iteration
    assert iteration_limit(0.3, ahead, SLO, LAT) == pytest.approx(0.2 - reserve)
    per_token = ServingState(decoding_last_token_s=[0.3], decode_context_tokens=10)
    assert iteration_limit(0.3, per_token, SLO, LAT) == pytest.approx(0.05)
    # Behind schedule: nothing banked, the per-token budget still holds.
    behind = dataclasses.replace(ahead, decoding_last_token_s=[0.59])
    assert iteration_limit(0.6, behind, SLO, LAT) == pytest.approx(0.04)


def test_tpot_inflation_budget_counts_what_rollouts_already_took():
    slo = SLOBudgets(ttft_s=INF, tpot_s=INF, tpot_inflation=0.1)
    serving_s = LAT.iteration_time(TokenLoad(0, 1, 10), TokenLoad())
    state = ServingState(decoding_last_token_s=[1.0], decode_context_tokens=10, decoding_first_token_s=[0.0],
                         decoding_output_tokens=[20], decoding_rollout_s=[0.05])
    own = 1.0 - 0.05 + serving_s           # its time not spent on rollouts, with the next iteration
    assert iteration_limit(1.0, state, slo, LAT) == pytest.approx(serving_s + 0.1 * own - 0.05)
    spent = dataclasses.replace(state, decoding_rollout_s=[0.2])  # over budget: rollouts wait
    a = admit(1.0, spent, RolloutDemand([10] * 4, 100), LAT, slo)
    assert a.rollout_tokens == 0
    # Without accounts (the simulator), each iteration may grow by the budget's share.
    plain = ServingState(decoding_last_token_s=[1.0], decode_context_tokens=10)
    assert iteration_limit(1.0, plain, slo, LAT) == pytest.approx(1.1 * serving_s)


def test_ttft_inflation_budget_of_a_waiting_request():
    slo = SLOBudgets(ttft_s=INF, tpot_s=INF, ttft_inflation=0.1)
    serving_s = LAT.iteration_time(TokenLoad(100), TokenLoad())
    fresh = ServingState(waiting=[(0.0, 100)])
    assert iteration_limit(0.1, fresh, slo, LAT) == pytest.approx(serving_s + 0.1 * (0.1 + serving_s))
    waited = ServingState(waiting=[(0.0, 100)], waiting_rollout_s=[0.05])  # it waited for rollouts
    assert iteration_limit(0.1, waited, slo, LAT) < serving_s


def test_share_and_cap_scale_the_rollout_part_only():
    serving = ServingState(decoding_last_token_s=[0.0], decode_context_tokens=10)
    serving_s = LAT.iteration_time(serving.load(512), TokenLoad())
    half = iteration_limit(0.0, serving, SLO, LAT, share=0.5)
    assert half == pytest.approx(serving_s + 0.5 * (0.05 - serving_s))
    assert iteration_limit(0.0, serving, SLO, LAT, max_rollout_s=0.001) == pytest.approx(serving_s + 0.001)
    a = admit(0.0, ServingState(), RolloutDemand([100] * 300, 5000), LAT, SLO, max_rollout_s=0.02)
    idle_s = LAT.iteration_time(TokenLoad(), TokenLoad())  # the model's constant
    assert a.limit_s == pytest.approx(idle_s + 0.02) and a.iteration_s < a.limit_s and a.rollout_tokens > 0


def test_the_step_caps_an_idle_iteration_for_a_request_that_may_arrive():
    # B_TTFT 1 s, TTFT inflation 3%: an arriving request may wait 30 ms for the rollout part.
    slo = SLOBudgets(ttft_s=1.0, tpot_s=0.05, ttft_inflation=0.03)
    a = admission_step(0.0, ServingState(), RolloutDemand([100] * 1000), LAT, slo)
    # base 5 ms + rollout 5 ms + 0.1 ms * d < 5 ms (serving's empty iteration) + 30 ms  ->  d < 250
    assert a.decode_seqs == 249 and a.prefill_tokens == 0
    assert math.isinf(a.limit_s)        # idle: no serving slack for the feedback guard to measure
    # Its ceiling leaves a prompt of `arrival_reserve_tokens` time to prefill within B_TTFT.
    reserve_s = LAT.iteration_time(TokenLoad(900), TokenLoad())
    tight = admission_step(0.0, ServingState(), RolloutDemand([100] * 1000), LAT, SLOBudgets(0.04, 0.05),
                           arrival_reserve_tokens=900)
    assert tight.iteration_s < LAT.iteration_time(TokenLoad(), TokenLoad()) + 0.04 - reserve_s


def test_the_step_admits_prefill_only_beside_every_ready_decode():
    serving = ServingState(decoding_last_token_s=[0.0] * 10, decode_context_tokens=1000)
    demand = RolloutDemand([50] * 1000, 512)
    alone = admit(0.0, serving, demand, LAT, SLO)
    assert alone.decode_seqs == 339 and alone.prefill_tokens > 0     # prefill fills what is left
    step = admission_step(0.0, serving, demand, LAT, SLO)
    assert (step.decode_seqs, step.prefill_tokens) == (339, 0)
    assert step.iteration_s < alone.iteration_s and step.limit_s == alone.limit_s
    # With every decode in, prefill joins as before.
    few = admission_step(0.0, serving, RolloutDemand([50] * 5, 512), LAT, SLO)
    assert few.decode_seqs == 5 and few.prefill_tokens == 512


class Overestimating:
    """A latency model that predicts 10 s for any work (a noisy start-up profile)."""

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        return 10.0 if serving != TokenLoad() or rollout != TokenLoad() else 0.0


def test_the_step_gives_rollouts_a_minimum_only_while_serving_is_idle():
    demand = RolloutDemand([100] * 5, 100)
    idle = admission_step(0.0, ServingState(), demand, Overestimating(), SLO)
    assert (idle.decode_seqs, idle.prefill_tokens) == (5, 27)        # 32 tokens, decodes first
    assert math.isinf(idle.limit_s)
    few = admission_step(0.0, ServingState(), RolloutDemand([], 10), Overestimating(), SLO)
    assert (few.decode_seqs, few.prefill_tokens) == (0, 10)          # no more than there is
    busy = ServingState(decoding_last_token_s=[0.0], decode_context_tokens=10)
    held = admission_step(0.0, busy, demand, Overestimating(), SLO)
    assert held.rollout_tokens == 0 and math.isfinite(held.limit_s)


def test_the_step_leaves_inflation_to_the_caller_without_accounts():
    slo = SLOBudgets(ttft_s=1.0, tpot_s=0.05, tpot_inflation=0.1, ttft_inflation=INF)
    serving = ServingState(decoding_last_token_s=[0.0], decode_context_tokens=10)
    serving_s = LAT.iteration_time(serving.load(512), TokenLoad())
    banked = admission_step(0.0, serving, RolloutDemand([100] * 1000), LAT, slo)
    assert banked.limit_s == pytest.approx(1.1 * serving_s)         # per iteration, no accounts
    fluid = admission_step(0.0, serving, RolloutDemand([100] * 1000), LAT, slo, banked=False)
    assert fluid.limit_s == pytest.approx(0.05)                     # the SLO alone
    assert fluid.decode_seqs > banked.decode_seqs


def test_rollout_waits_are_charged_up_to_each_request_s_age_and_split_at_its_first_token():
    wait = RolloutWait()
    wait.charge(0.2, age_s=0.05, first_token=False)     # arrived 50 ms into the rollout work
    wait.charge(0.1, age_s=1.0, first_token=False)
    assert (wait.total_s, wait.before_first_s) == (pytest.approx(0.15), pytest.approx(0.15))
    wait.charge(0.1, age_s=2.0, first_token=True)
    assert (wait.total_s, wait.before_first_s, wait.since_first_s) == pytest.approx((0.25, 0.15, 0.1))


def test_serving_state_splits_requests_into_waiting_and_decoding_with_their_accounts():
    decoding_wait, waiting_wait = RolloutWait(0.3, 0.1), RolloutWait(0.05, 0.05)
    # (arrival, prompt left, context, first token, last token, output tokens, wait), arrival order
    state = serving_state([ServingRequest(0.0, 0, 120, 0.4, 0.9, 6, decoding_wait),
                           ServingRequest(0.5, 300, 300, None, None, 0, waiting_wait),
                           ServingRequest(0.7, 0, 80, 0.8, 0.95, 2, RolloutWait())])
    assert state == ServingState(waiting=[(0.5, 300)], decoding_last_token_s=[0.9, 0.95],
                                 decode_context_tokens=200, waiting_rollout_s=[0.05],
                                 decoding_first_token_s=[0.4, 0.8], decoding_output_tokens=[6, 2],
                                 decoding_rollout_s=[pytest.approx(0.2), 0.0])


def test_free_slots_follow_one_memory_rule_and_the_slos_alone():
    assert memory_room(BurstState.NORMAL, 1000, 300) == 3
    assert memory_room(BurstState.FROZEN, 299, 300) == 0 and memory_room(BurstState.NORMAL, -5, 300) == 0
    assert memory_room(BurstState.BURST, 10_000, 300) == 0          # none while pages are taken back
    # A prompt past its TTFT deadline and a spent inflation budget would admit nothing this
    # iteration; neither is held against a turn that runs over many.
    late = ServingState(waiting=[(0.0, 512)], decoding_last_token_s=[1.0], decode_context_tokens=10,
                        decoding_first_token_s=[0.0], decoding_output_tokens=[20], decoding_rollout_s=[0.5])
    slo = SLOBudgets(ttft_s=0.5, tpot_s=0.05, ttft_inflation=0.0, tpot_inflation=0.0)
    assert admission_step(1.0, late, RolloutDemand([100] * 4), LAT, slo).rollout_tokens == 0
    slots = rollout_capacity(1.0, late, RolloutDemand([100] * 4), LAT, slo, typical_context=100, limit=64)
    assert 0 < slots <= 64
    assert rollout_capacity(1.0, late, RolloutDemand([100] * 4), LAT, slo, typical_context=100, limit=0) == 0


def test_rollout_duty_keeps_the_mean_inflation_within_the_budget():
    # Serving iterations of 10 ms, 30 ms with a rollout step: one in twenty may carry one.
    duty = rollout_duty(0.010, 0.030, 0.10)
    assert duty == pytest.approx(0.05)
    mean = duty * 0.030 + (1 - duty) * 0.010
    assert mean == pytest.approx(1.10 * 0.010)
    assert rollout_duty(0.010, 0.0105, 0.10) == 1.0      # a cheap step fits every iteration
    assert rollout_duty(0.0, 0.030, 0.10) == 1.0         # no serving work: nothing to inflate
    assert rollout_duty(0.010, 0.030, INF) == 1.0


def test_priority_lets_rollouts_fill_what_serving_leaves_of_tokens_and_pages_whatever_the_slos():
    # vLLM's priority scheduling across two models: serving's tokens go first, rollouts take the
    # rest of the iteration's budget; no SLO enters the decision.
    assert priority_tokens(0, 2048) == 2048                      # serving idle: the whole budget
    assert priority_tokens(512 + 10, 2048) == 2048 - 522         # beside a prefill chunk and 10 decodes
    assert priority_tokens(4096, 2048) == 0
    with pytest.raises(ValueError, match="max_batched_tokens >= 1"):
        priority_tokens(10, 0)
    # Memory: what serving holds and what its next iteration may take come first.
    assert priority_pages(1000, 300, 20) == 680
    assert priority_pages(1000, 990, 20) == 0
    assert priority_pages(1000, 0, 0) == 1000                    # serving's KV elsewhere (vLLM's own cache)


def test_slack_guard_halves_at_once_and_regrows_slowly():
    guard = SlackGuard(floor=0.1, regrow=0.05)
    assert guard.observe(0.06, INF) == 1.0 and guard.observed == 0   # no serving: nothing learnt
    assert guard.observe(0.06, 0.05) == 0.5 and guard.overruns == 1
    assert guard.observe(0.06, 0.05) == 0.25
    for _ in range(3):
        guard.observe(0.06, 0.05)
    assert guard.share == 0.1                                         # the floor
    assert guard.observe(0.01, 0.05) == pytest.approx(0.15)
    for _ in range(100):
        guard.observe(0.01, 0.05)
    assert guard.share == 1.0 and guard.observed == 106
    with pytest.raises(ValueError, match="floor"):
        SlackGuard(floor=0.0)


# Burst state machine: pool 1000 units, headroom 200, trigger when free <= 100.

def test_normal_budget_follows_serving_usage():
    bc = BurstController(1000, headroom=0.2, high_watermark=0.5)
    d = bc.observe(300, [("a", 100)])
    assert d.state is BurstState.NORMAL and d.rollout_budget == 500 and not d.cut
    assert bc.observe(100, []).rollout_budget == 700


def test_burst_trigger_halves_budget_and_aborts_newest_first():
    bc = BurstController(1000)
    bc.observe(100, [("a", 200), ("b", 200), ("c", 200)])
    d = bc.observe(310, [("a", 200), ("b", 200), ("c", 200)])    # free 90 <= 100
    assert d.cut and d.state is BurstState.BURST
    assert d.rollout_budget == 300                                 # min(budget 700, used 600) / 2
    assert d.abort == ("c", "b")                                   # 600 -> 200 <= 300
    assert bc.bursts == 1 and bc.aborted == 2


def test_burst_then_frozen_until_new_rl_step():
    bc = BurstController(1000)
    bc.observe(310, [("a", 600)])                                  # cut: budget 300, abort a
    assert bc.state is BurstState.BURST
    d = bc.observe(310, [])                                        # free 690: burst over
    assert d.state is BurstState.FROZEN and d.rollout_budget == 300
    d = bc.observe(0, [])                                          # serving drained: no regrowth
    assert d.state is BurstState.FROZEN and d.rollout_budget == 300
    bc.new_rl_step()
    d = bc.observe(0, [])
    assert d.state is BurstState.NORMAL and d.rollout_budget == 800


def test_a_step_inside_the_spike_keeps_the_freeze_until_serving_recedes():
    bc = BurstController(1000)                                     # headroom 200, trigger at free 100
    bc.observe(100, [("a", 600)])                                  # normal: budget 700
    d = bc.observe(350, [("a", 600)])                              # free 50: cut at serving 350
    assert d.cut and bc.thaw_below == 250                          # 350 less the watermark's 100
    bc.observe(350, [])                                            # -> FROZEN, budget 300
    bc.new_rl_step()                                               # the spike still runs
    assert bc.state is BurstState.FROZEN
    d = bc.observe(300, [("b", 100)])
    assert d.state is BurstState.FROZEN and d.rollout_budget == 300
    d = bc.observe(250, [("b", 100)])                              # receded: the step's thaw
    assert d.state is BurstState.NORMAL and d.rollout_budget == 550 and not bc.step_begun
    d = bc.observe(350, [("b", 100), ("c", 450)])                  # back to the level that fired it
    assert d.cut                                                   # ... fires it again, only there


def test_a_step_after_the_spike_ends_the_freeze_at_once_and_a_burst_waits_for_one():
    bc = BurstController(1000)
    bc.observe(350, [("a", 700)])                                  # cut at serving 350
    bc.new_rl_step()                                               # during BURST: held for the freeze
    assert bc.state is BurstState.BURST and bc.step_begun
    bc.observe(200, [])                                            # -> FROZEN
    d = bc.observe(200, [])                                        # receded and a step begun: thaw
    assert d.state is BurstState.NORMAL
    assert bc.observe(350, [("a", 600)]).cut                       # a second burst
    bc.observe(100, [])                                            # FROZEN, serving long receded,
    assert bc.observe(100, []).state is BurstState.FROZEN          # ... but no step since it began
    bc.new_rl_step()
    assert bc.state is BurstState.NORMAL                           # at once


def test_a_burst_fired_from_a_quiet_device_thaws_once_serving_is_quiet_again():
    bc = BurstController(1000)                                     # the watermark's share of H: 100
    bc.observe(0, [("a", 800)])                                    # rollouts at their budget
    assert bc.observe(120, [("a", 800)]).cut                       # one prompt fires it
    assert bc.thaw_below == 100                                    # not 120 - 100: idle is not needed
    bc.observe(120, [])
    bc.observe(90, [])
    bc.new_rl_step()
    assert bc.state is BurstState.NORMAL


def test_repeated_crossing_halves_again_and_frozen_can_burst():
    bc = BurstController(1000)
    bc.observe(500, [("a", 150), ("b", 150)])                      # free 200: normal, budget 300
    d = bc.observe(750, [("a", 150), ("b", 150)])                  # free -50: cut to 150
    assert d.abort == ("b",) and d.rollout_budget == 150
    d = bc.observe(860, [("a", 150)])                              # still crossed: cut to 75
    assert d.abort == ("a",) and d.rollout_budget == 75 and bc.bursts == 2
    bc.observe(100, [])                                            # -> FROZEN
    d = bc.observe(950, [("x", 10)])                               # crossing again while frozen
    assert d.cut and d.state is BurstState.BURST and d.rollout_budget == 5


def test_crossing_with_no_rollout_cuts_nothing():
    bc = BurstController(1000)
    d = bc.observe(950, [])
    assert not d.cut and d.abort == () and d.rollout_budget == 0


def test_bad_controller_arguments():
    for kwargs in (dict(pool=0), dict(pool=10, headroom=1.0), dict(pool=10, high_watermark=0)):
        with pytest.raises(ValueError):
            BurstController(**kwargs)


def _columns(entries: list[list[tuple[float, float]]], width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-device lists of (time, tokens) as `ServingState`'s arrays: columns, padded with inf."""
    return [(np.array([e[k][0] if k < len(e) else np.inf for e in entries]),
             np.array([e[k][1] if k < len(e) else 0.0 for e in entries])) for k in range(width)]


class ArrayLatency:
    """`LinearLatency` on numbers and on arrays of them alike."""

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        def part(x: TokenLoad) -> float:
            busy = np.asarray(x.prefill_tokens + x.decode_seqs + x.context_tokens) > 0
            return np.where(busy, 0.005 + x.prefill_tokens * 1e-5 + x.decode_seqs * 1e-4, 0.0)
        return 0.005 + part(serving) + part(rollout)


def test_arrays_decide_for_each_device_as_the_device_alone():
    """The simulator's call for thousands of devices at once is the executor's call for each."""
    latency = ArrayLatency()
    rng = np.random.default_rng(0)
    slo = SLOBudgets(0.5, 0.15, 0.3, 0.2)
    for _ in range(50):
        n, now = 6, 100.0
        waiting = [[(now - float(rng.uniform(0, 0.6)), int(rng.integers(1, 3000)))
                    for _ in range(int(rng.integers(0, 4)))] for _ in range(n)]
        decoding = rng.integers(0, 4, n)
        ctx = rng.integers(0, 50000, n) * (decoding > 0)
        running = [rng.integers(100, 20000, int(rng.integers(0, 9))).tolist() for _ in range(n)]
        prefill = rng.integers(0, 3000, n) * rng.integers(0, 2, n)
        limit = rng.integers(-1, 20, n)
        states = [ServingState(sorted(w), (now,) * int(d), int(c))
                  for w, d, c in zip(waiting, decoding, ctx, strict=True)]
        one = [admission_step(now, s, RolloutDemand(r, int(p)), latency, slo, 512, banked=False)
               for s, r, p in zip(states, running, prefill, strict=True)]
        free = [rollout_capacity(now, s, RolloutDemand(r), latency, slo, 3000, 512, limit=int(k))
                for s, r, k in zip(states, running, limit, strict=True)]
        matrix = np.zeros((n, 8), np.int64)
        for i, r in enumerate(running):
            matrix[i, :len(r)] = r
        # The decoding requests, all with a token just emitted, as one entry with their count.
        state = ServingState(_columns([sorted(w) for w in waiting], 3),
                             [np.where(decoding > 0, now, np.inf)], ctx, [decoding])
        many = admission_step(now, state, RolloutDemand(matrix, prefill), latency, slo, 512, banked=False)
        assert many.decode_seqs.tolist() == [a.decode_seqs for a in one]
        assert many.prefill_tokens.tolist() == [a.prefill_tokens for a in one]
        assert many.iteration_s.tolist() == pytest.approx([a.iteration_s for a in one])
        assert many.limit_s.tolist() == pytest.approx([a.limit_s for a in one])
        decodes_only = ServingState((), state.decoding_last_token_s, ctx, state.decoding_counts)
        capacity = rollout_capacity(now, decodes_only, RolloutDemand(matrix), latency, slo, 3000, 512,
                                    limit=limit)
        assert np.broadcast_to(capacity, n).tolist() == free


def test_one_controller_of_arrays_is_a_controller_per_device():
    rng = np.random.default_rng(1)
    n, width = 5, 4
    each = [BurstController(1000, 0.2, 0.5) for _ in range(n)]
    many = BurstController(1000, 0.2, 0.5, devices=n)
    for _ in range(60):
        serving = rng.integers(0, 1000, n)
        held = rng.integers(1, 120, (n, width))
        count = rng.integers(0, width + 1, n)
        ids = np.arange(n * width).reshape(n, width)
        present = np.arange(width)[None, :] < count[:, None]
        held, ids = np.where(present, held, 0), np.where(present, ids, -1)
        one = [c.observe(int(serving[i]), [(int(ids[i, k]), int(held[i, k])) for k in range(count[i])])
               for i, c in enumerate(each)]
        all_ = many.observe(serving, list(zip(ids.T, held.T, strict=True)))
        aborted = set(np.concatenate(all_.abort).tolist()) if all_.abort else set()
        for i, d in enumerate(one):
            assert (d.state, d.rollout_budget, d.cut) == (all_.state[i], all_.rollout_budget[i], all_.cut[i])
            assert set(d.abort) == {a for a in aborted if a // width == i}
        if rng.random() < 0.2:
            step = rng.random(n) < 0.5
            for c, s in zip(each, step, strict=True):
                if s:
                    c.new_rl_step()
            many.new_rl_step(step)
    assert [c.bursts for c in each] == many.bursts.tolist()
