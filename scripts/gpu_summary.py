"""The summary of scripts/gpu_checks.sh: `python scripts/gpu_summary.py OUT STEPS`.

Reads what the run left in OUT (the tests' JUnit XML, tests_*.xml; the benchmarks' reports,
bench_*.json) and STEPS (one line per step: name, status, rc, seconds, note, tab-separated), and
writes OUT/gpu_summary.json and OUT/gpu_summary.txt (also printed): the GPU, each step, the test
counts with every failure and why tests were skipped, each benchmark's summary figures. Exits 1
when a step did not end well, so that the run's status says so."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# A module's skip in the XML: "('path', line, 'Skipped: why')".
MODULE_SKIP = re.compile(r"Skipped: (.*)['\"]\)$")


def gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():  # the run stops before this; a summary all the same
        return {"name": "no CUDA device", "memory_gib": 0, "multiprocessors": 0, "driver": None,
                "torch": torch.__version__, "cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout.strip()
    return {"name": props.name, "memory_gib": round(props.total_memory / 1024**3, 1),
            "multiprocessors": props.multi_processor_count, "driver": smi or None,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def steps(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        name, status, rc, seconds, note = (line.split("\t") + [""] * 5)[:5]
        rows.append({"name": name, "status": status, "rc": int(rc) if rc else None,
                     "seconds": int(seconds or 0), "note": note or None})
    return rows


def tests(path: Path) -> dict[str, Any]:
    """Counts, each failure with the first line of its message, and the reasons for skips."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in keys}
    failed, skipped = [], collections.Counter()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for bad in (*case.findall("failure"), *case.findall("error")):
            failed.append({"test": name, "message": (bad.get("message") or "").splitlines()[0][:300]})
        for skip in case.findall("skipped"):
            why = skip.get("message") or ""
            if why == "collection skipped":  # a whole module: its reason is in the text
                reason = MODULE_SKIP.search(skip.text or "")
                why = f"{case.get('name')}: {reason.group(1) if reason else skip.text}"
            skipped[why.splitlines()[0][:200] if why else ""] += 1
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "skipped_because": dict(skipped)}


def text(summary: dict[str, Any]) -> str:
    g = summary["gpu"]
    lines = [f"GPU: {g['name']}, {g['memory_gib']} GiB, driver {g['driver']}; torch {g['torch']} "
             f"(CUDA {g['cuda']})"]
    for s in summary["steps"]:
        rc = f" (rc {s['rc']})" if s["rc"] else ""
        note = f", {s['note']}" if s["note"] else ""
        lines.append(f"step {s['name']}: {s['status']}{rc}, {s['seconds']} s{note}")
    for name, t in summary["tests"].items():
        lines.append(f"{name}: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
                     f"{t['skipped']} skipped")
        lines += [f"  FAILED {f['test']}: {f['message']}" for f in t["failed"]]
        lines += [f"  skipped {n}: {why}" for why, n in t["skipped_because"].items()]
    lines += [f"{name}: {json.dumps(figures)}" for name, figures in summary["benchmarks"].items()]
    return "\n".join(lines) + "\n"


def main(out: Path, steps_path: Path) -> int:
    summary: dict[str, Any] = {"gpu": gpu(), "steps": steps(steps_path)}
    summary["tests"] = {p.stem: tests(p) for p in sorted(out.glob("tests_*.xml"))}
    summary["benchmarks"] = {p.stem: json.loads(p.read_text())["summary"]
                             for p in sorted(out.glob("bench_*.json"))}
    (out / "gpu_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = text(summary)
    (out / "gpu_summary.txt").write_text(report)
    print(report, end="")
    return 0 if all(s["status"] == "ok" for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
