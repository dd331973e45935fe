"""Each worker's rates for one tick (`rollout.TickRates`): dedicated and elastic replicas from the
roofline cost model. Co-serving executors' rates come from admission (`coserving.CoServing.plan`),
and what the rollout manager's CPU leaves of them all from `control.ControlPlane`."""

from __future__ import annotations

import numpy as np

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
