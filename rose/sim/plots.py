"""Figures of a scenario (six panels) and of a sweep (its headline figures against the swept
value), written as PNG with matplotlib's Agg backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from rose.sim.runner import ScenarioResult, SweepResult
from rose.sim.workers import KIND_NAMES

COLORS = {"fixed-sync": "#7f7f7f", "fixed-async": "#bcbd22", "elastic-spot": "#ff7f0e",
          "elastic-serverless": "#d62728", "rose": "#1f77b4", "rose-no-affinity": "#9ecae1",
          "rose-full-weights": "#6baed6", "naive-share": "#9467bd", "serving-alone": "#2ca02c"}
KIND_COLORS = {"dedicated": "#7f7f7f", "elastic": "#ff7f0e", "serving": "#1f77b4"}


def _bars(ax, names, values, fmt, title, ylabel) -> None:
    bars = ax.bar(range(len(names)), values, color=[COLORS.get(n, "#333") for n in names])
    for b, v in zip(bars, values, strict=True):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [n.replace("-", "-\n", 1) for n in names], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.margins(y=0.15)


def plot_scenario(res: ScenarioResult, out: Path) -> None:
    runs, sv, sc = res.runs, res.serving, res.scenario
    names = list(runs)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    base = runs.get("fixed-sync") or next(iter(runs.values()))
    _bars(axes[0, 0], names, [r.throughput / base.throughput for r in runs.values()], "{:.2f}x",
          f"end-to-end throughput (vs {base.system})", "trajectories/s, relative")
    ax = axes[0, 1]
    for name, r in runs.items():
        ax.plot([s.step for s in r.steps], [s.rollout_s for s in r.steps], "o-", label=name,
                color=COLORS.get(name), lw=2 if name == "rose" else 1)
    ax.set_title("rollout time per step", fontsize=10)
    ax.set_xlabel("RL step", fontsize=9)
    ax.set_ylabel("s", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="best", framealpha=0.6)
    _bars(axes[0, 2], names, [100 * r.allocation_overhead for r in runs.values()], "{:.1f}%",
          "allocation overhead", "% of training time")
    e = sc.serving.executor
    for ax, attr, slo, label in ((axes[1, 0], "minute_ttft_ms", e.slo_ttft_ms, "P99 TTFT"),
                                 (axes[1, 1], "minute_tpot_ms", e.slo_tpot_ms, "P99 TPOT")):
        for name, st in sv.items():
            ax.plot(st.minute_t / 60, getattr(st, attr), label=name, color=COLORS.get(name),
                    lw=2 if name in ("rose", "serving-alone") else 1)
        ax.axhline(slo, color="k", ls="--", lw=1, label=f"SLO {slo:g} ms")
        ax.set_yscale("log")
        ax.set_title(f"serving {label} per minute", fontsize=10)
        ax.set_xlabel("minutes", fontsize=9)
        ax.set_ylabel("ms", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[1, 2]
    shown = "rose" if "rose" in runs else names[0]
    r = runs[shown]
    if len(r.tick_t):
        minute = (r.tick_t // 60).astype(int)
        span = np.bincount(minute, minlength=minute.max() + 1) * sc.sim.tick_s
        per = [np.bincount(minute, weights=r.tick_tokens[:, k], minlength=len(span)) for k in range(3)]
        rates = [p / np.maximum(span, 1e-9) / 1e3 for p in per]
        keep = [k for k in range(3) if per[k].sum() > 0]
        ax.stackplot(np.arange(len(span)), *[rates[k] for k in keep],
                     labels=[KIND_NAMES[k] for k in keep], colors=[KIND_COLORS[KIND_NAMES[k]] for k in keep])
        ax.legend(fontsize=7, loc="upper right")
    ax.set_title(f"where rollout tokens were generated ({shown})", fontsize=10)
    ax.set_xlabel("minutes (gaps: training)", fontsize=9)
    ax.set_ylabel("k tokens/s", fontsize=9)
    fig.suptitle(f"{sc.name}: {sc.description}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_sweep(res: SweepResult, out: Path) -> None:
    s = res.summary()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    x = [str(v) for v in s["values"]]
    others = [n for n in res.sweep.systems if n != "fixed-sync"]
    for name in others:
        ys = [(p[1]["throughput_vs_fixed_sync_by_system"] or {}).get(name) for p in res.points]
        axes[0].plot(x, ys, "o-", label=name, color=COLORS.get(name), lw=2 if name == "rose" else 1)
    axes[0].axhline(1.0, color="k", lw=1, ls="--", label="fixed-sync")
    axes[0].set_title("end-to-end throughput vs fixed-sync", fontsize=10)
    axes[0].set_ylabel("x", fontsize=9)
    for name in others:
        ys = [p[1]["allocation_overhead"].get(name, 0) * 100 for p in res.points]
        axes[1].plot(x, ys, "o-", label=name, color=COLORS.get(name))
    axes[1].set_title("allocation overhead", fontsize=10)
    axes[1].set_ylabel("% of training time", fontsize=9)
    axes[1].set_ylim(bottom=0)
    for key, label, style in (("serving_alone_slo_violations", "serving-alone", "s-"),
                              ("slo_violations", "rose", "o--")):
        ys = [p[1].get(key) for p in res.points]
        axes[2].plot(x, [y if y is not None else np.nan for y in ys], style, label=label, color=COLORS[label])
    axes[2].set_ylim(bottom=0)
    axes[2].set_title("minutes violating the serving SLO", fontsize=10)
    for ax in axes:
        ax.set_xlabel(res.sweep.key, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res.sweep.name}: {res.sweep.description}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
