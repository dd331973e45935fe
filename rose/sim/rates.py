"""Each worker's rates for one tick (`rollout.TickRates`): dedicated and elastic replicas from the
roofline cost model, and the rollout manager's CPU where it shares their cores. Co-serving
executors' rates come from admission (`coserving.CoServing.plan`)."""

from __future__ import annotations

import numpy as np

from rose.contracts import TURN_CHUNK_S
from rose.sim.costs import ForwardCost
from rose.sim.rollout import ActiveView, Round, TickRates

# Per worker: the sequences its iterations decode (those decoding: `view_load`; every one it runs
# in the tick: `BatchedRound.tick_load`), their context tokens, prompt tokens and prompts pending.
WorkerLoad = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def view_load(rnd: Round, view: ActiveView, workers: int) -> WorkerLoad:
    """Per worker, of the sequences of `view` that fit: decoding ones, their context tokens,
    prompt tokens pending and prompts pending."""
    fit = view.fits
    wk = view.worker[fit]
    rows = view.idx[fit]
    is_dec = view.decode_rank[fit] >= 0
    dec = np.bincount(wk[is_dec], minlength=workers).astype(float)
    ctx = np.bincount(wk[is_dec], weights=rnd.ctx[rows[is_dec]], minlength=workers)
    pending = np.bincount(wk[~is_dec], weights=rnd.prefill_left[rows[~is_dec]], minlength=workers)
    return dec, ctx, pending, np.bincount(wk[~is_dec], minlength=workers)


def plan_rates(dec: np.ndarray, ctx: np.ndarray, pending: np.ndarray, prompts: np.ndarray, cost: ForwardCost,
               dt: float, batched_tokens: float) -> tuple[TickRates, np.ndarray]:
    """Rates of every worker as a replica of `cost` that runs only rollouts, at most
    `batched_tokens` of prefill per iteration, given its decoding sequences, their context, its
    pending prompt tokens and prompts. Returns them with each worker's mean iteration time."""
    n = len(dec)
    pf = np.minimum(batched_tokens, pending)
    chunk_seqs = np.maximum(1, prompts)
    # The prompts pending at the tick's start take their chunked iterations, and the rest of
    # the tick runs decode-only ones (as on serving GPUs): decodes do not crawl at a prefill
    # iteration's pace for a whole tick because a few chunks were pending at its start.
    iter_p = cost.time(pf, dec, ctx, chunk_seqs)
    iter_d = cost.time(0.0, np.maximum(dec, 1), ctx)
    n_pre = np.minimum(pending / np.maximum(pf, 1.0), dt / np.maximum(iter_p, 1e-12))
    iters = n_pre + np.maximum(0.0, dt - n_pre * iter_p) / iter_d
    iter_s = dt / iters                            # the tick's mean iteration time
    plan = TickRates(prefill_rate=pf / np.maximum(iter_p, 1e-12), rate0=np.zeros(n),
                     cap1=np.full(n, np.inf), rate1=1.0 / iter_s, cap2=np.zeros(n), rate2=np.zeros(n))
    return plan, iter_s


def charge_manager(plan: TickRates, iter_s: np.ndarray, dec: np.ndarray, dedicated: np.ndarray,
                   manager_s: float) -> None:
    """The rollout manager runs on the dedicated devices' cores (`cluster.manager_on_dedicated`,
    as `rose train` pins its driver to the trainer's): each chunk any worker streams costs them
    `manager_s`, a chunk being a sequence's tokens of `TURN_CHUNK_S` (or one, if slower). A
    dedicated worker's own chunks lengthen its iterations; the other workers' chunks, at this
    tick's planned rates, take a share of the tick from the dedicated workers alike (none left
    when the manager would need more than all of it)."""
    n1, n2 = np.minimum(dec, plan.cap1), np.minimum(dec, plan.cap2)   # sequences at each tier
    both, one, rest = np.minimum(n1, n2), np.abs(n1 - n2), dec - np.maximum(n1, n2)
    one_rate = np.where(n1 > n2, plan.rate1, plan.rate2)
    most = 1.0 / TURN_CHUNK_S
    chunks = (both * np.minimum(plan.rate0 + plan.rate1 + plan.rate2, most)
              + one * np.minimum(plan.rate0 + one_rate, most) + rest * np.minimum(plan.rate0, most))
    others = manager_s * float(chunks[~dedicated].sum()) / max(1, int(dedicated.sum()))
    own_s = iter_s[dedicated] + manager_s * dec[dedicated] * np.minimum(1.0, iter_s[dedicated] / TURN_CHUNK_S)
    scale = max(0.0, 1.0 - others) * iter_s[dedicated] / np.maximum(own_s, 1e-12)
    plan.prefill_rate[dedicated] *= scale
    plan.rate1[dedicated] *= scale
