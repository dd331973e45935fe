"""Every rollout replica a run may use, by kind, as arrays indexed by worker id: dedicated ones,
elastic ones (spot instances, serverless functions) and co-serving executors on serving GPUs."""

from __future__ import annotations

import dataclasses

import numpy as np

from rose.sim.rollout import ActiveView, Round

DEDICATED, ELASTIC, COSERVE = 0, 1, 2
KIND_NAMES = ("dedicated", "elastic", "serving")


@dataclasses.dataclass
class Workers:
    kind: np.ndarray
    kv_cap: np.ndarray          # KV tokens (co-serving: the rollout budget, updated per tick)
    max_seqs: np.ndarray
    ready_at: np.ndarray        # usable from (inf: not now)
    gone_at: np.ndarray         # preempted or released at
    registered: np.ndarray      # currently in the routing table

    @classmethod
    def build(cls, counts: tuple[int, int, int], kv: tuple[int, int, int], max_seqs: int) -> Workers:
        kind = np.repeat([DEDICATED, ELASTIC, COSERVE], counts)
        n = len(kind)
        return cls(kind, np.repeat(np.array(kv, float), counts), np.full(n, max_seqs),
                   np.where(kind == DEDICATED, 0.0, np.inf), np.full(n, np.inf), np.zeros(n, bool))

    def view(self, rnd: Round, only_fresh: bool = False) -> ActiveView:
        """The round's sequences on these workers now, and which of them fit (`Round.active_view`)."""
        return rnd.active_view(self.kv_cap, self.max_seqs, only_fresh)
