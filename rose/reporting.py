"""The JSON report every command with `--json OUT` writes (benchmarks, `rose train`, load
generation), and the one summary line it prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: str | Path | None, summary: dict[str, Any], **details: Any) -> None:
    """Write `{"summary": ..., **details}` as JSON and print the summary as the last line."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"summary": summary, **details}, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
