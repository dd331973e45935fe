"""The step's rollout is one function named in the config (rose.runtime.rollouts): the cluster
calls the configured one with the step's context, and a name that cannot be a rollout function
is refused before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rose.rollout.manager import RolloutReport
from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config
from rose.runtime.rollouts import RolloutContext

CALLS: list[tuple[int, int, str]] = []
NOT_A_FUNCTION = 42


async def recording_rollout(ctx: RolloutContext) -> RolloutReport:
    CALLS.append((ctx.step, ctx.version, ctx.config.rollout.function))
    return RolloutReport([], [], 0.0)


def test_the_configured_rollout_function_runs_the_step(tmp_path: Path) -> None:
    name = f"{__name__}:recording_rollout"
    cluster = Cluster(load_config(None, [f"rollout.function={name}", f"train.out_dir={tmp_path}"]),
                      Mode.FIXED, tmp_path)
    cluster.tokenizer = None  # start() loads it; this rollout does not use it
    try:
        report = cluster.rollout(3)
    finally:
        cluster.loop.close()
    assert [(3, 0, name)] == CALLS and report.trajectories == []


@pytest.mark.parametrize(("function", "error"), [
    ("rose.runtime.rollouts", "must be 'package.module:function'"),
    ("no_such_module:rollout", "cannot be imported: No module named 'no_such_module'"),
    ("rose.runtime.rollouts:no_such_function", "cannot be imported"),
    (f"{__name__}:NOT_A_FUNCTION", "is not a function"),
])
def test_a_bad_rollout_function_is_refused_with_its_name(function: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)) as info:
        load_config(None, [f"rollout.function={function}"])
    assert str(info.value).startswith("config: rollout.function") and repr(function) in str(info.value)
