"""`rose bench soak` end to end: a 20 s soak of a real `rose serve` process (about a minute with
start-up, drain and shutdown, hence `slow`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rose.cli import main

KEYS = {"requests", "status_5xx", "rss_growth_after_warmup", "kv_pages_leaked", "lost_turns", "p99_ttft_ms",
        "serving_requests", "status_2xx", "status_4xx", "status_429", "transport_errors", "timeouts",
        "turns_submitted", "turns_finished", "turns_refused", "server_alive_after"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    assert main(["bench", "soak", "--duration", "20", "--drain", "20", "--json", str(out)]) == 0
    return json.loads(Path(out).read_text())


def test_soak_reports_its_summary(report: dict[str, Any]) -> None:
    s = report["summary"]
    assert s.keys() >= KEYS
    # Every kind of client ran: the trace, the lease turns, and each kind of misbehaving client.
    kinds = {k.split("/")[0] for k in report["outcomes"]}
    assert kinds >= {"serving", "lease", "disconnect", "stall", "garbage", "probe"}
    assert s["serving_requests"] >= 10 and s["turns_submitted"] >= 4
    counted = sum(sum(c.values()) for c in report["outcomes"].values())
    assert s["requests"] == counted
    assert s["status_2xx"] + s["status_4xx"] + s["status_5xx"] + s["transport_errors"] + s["timeouts"] \
        + s["client_left"] + s["unanswered_at_drain_deadline"] <= s["requests"]
    assert 0 <= s["status_429"] <= s["status_4xx"]
    assert s["turns_finished"] + s["turns_refused"] + s["lost_turns"] == s["turns_submitted"]
    assert s["rss_growth_after_warmup"] > -1 and s["rss_mb_end"] > 0
    assert isinstance(s["kv_pages_leaked"], int) and s["kv_pages_leaked"] >= 0
    assert s["p99_ttft_ms"] is None or s["p99_ttft_ms"] >= s["p50_ttft_ms"] > 0
    assert s["client_exceptions"] == 0, report["client_exceptions"]


def test_soak_meets_the_goals_in_short(report: dict[str, Any]) -> None:
    # Issue 16's goals, but for RSS growth (20 s is too short to tell growth from warm-up).
    s = report["summary"]
    assert s["status_5xx"] == 0, s["status_5xx_by_kind"]
    assert s["lost_turns"] == 0, report["lost_turn_reasons"]
    assert s["kv_pages_leaked"] == 0
    assert s["server_alive_after"] and s["idle_probe_ok"] and not s["sigterm_ignored"]
    assert s["p99_ttft_ms"] is not None
