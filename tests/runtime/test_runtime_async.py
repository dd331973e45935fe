"""Asynchronous RL end to end (`train.max_staleness=1`): a short `rose train` whose rollouts go on
while the trainer trains, trained off-policy by at most one version, with nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from rose.runtime.config import Mode, load_config, objective_options
from rose.runtime.driver import train

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)


def test_rollouts_overlap_training_within_the_staleness_bound(tmp_path: Path) -> None:
    config = load_config(None, ["train.steps=4", "rollout.groups=2", "rollout.group_size=4",
                                "rollout.max_tokens=8", "train.max_staleness=1", f"train.out_dir={tmp_path}"])
    # Off-policy tokens are weighed against the trainer's own old policy and masked past the bound.
    assert {k: objective_options(config)[k] for k in ("recompute_old_logprobs", "max_version_lag")} == {
        "recompute_old_logprobs": True, "max_version_lag": 1}
    result = train(config, Mode.FIXED)
    assert [r.version for r in result.steps] == [1, 2, 3, 4]
    assert result.summary["lost_trajectories"] == 0 and result.summary["failed_trajectories"] == 0
    groups = result.summary["stream_groups"]
    assert groups["taken"] == 4 * 2 and groups["started"] == sum(groups[k] for k in (
        "taken", "dropped", "expired", "in_play"))
    lags = {int(lag) for r in result.steps for lag in r.staleness}
    assert 1 in lags  # some tokens sampled before the weights of the step before were trained
    # Older tokens (of a group carried over) do not train: the trainer masks them.
    for r in result.steps:
        stale = sum(n for lag, n in r.staleness.items() if int(lag) > 1)
        assert r.trainer["stale_tokens"] == stale and sum(r.staleness.values()) - stale == r.trainer["tokens"]
