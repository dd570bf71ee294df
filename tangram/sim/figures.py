"""Figures like the paper's, with matplotlib (imported here only, on the Agg backend, so the
simulator never needs it unless figures are asked for): ACT over time in small windows,
ACT by action kind, resources needed against ACT."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


_STYLES = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P")]


def _style(i: int) -> dict[str, str]:
    ls, m = _STYLES[i % len(_STYLES)]
    return {"ls": ls, "marker": m}


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib.pyplot on the Agg backend; RuntimeError saying what to install when
    matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("figures need matplotlib: pip install matplotlib "
                           "(from a checkout: pip install '.[sim]')") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def act_over_time(timelines: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str | Path,
                  title: str, bin_seconds: float) -> Path:
    """One line per policy: mean ACT of the actions finishing in each window."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (policy, (t, act)) in enumerate(timelines.items()):
        ax.plot(t + bin_seconds / 2, act, label=policy, lw=1.3, ms=2.5, **_style(i))
    ax.set_xlabel(f"time in the step (s), {bin_seconds:g} s windows by action finish time")
    ax.set_ylabel("mean ACT (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def act_by_kind(by_kind: Mapping[str, Mapping[str, float]], path: str | Path, title: str) -> Path:
    """Grouped bars: per action kind (and reward), one bar per policy."""
    plt = pyplot()
    policies = list(by_kind)
    kinds: list[str] = []
    for p in policies:
        kinds += [k for k in by_kind[p] if k not in kinds]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(kinds) + 2), 3.6))
    width = 0.8 / max(1, len(policies))
    x = np.arange(len(kinds))
    for i, p in enumerate(policies):
        vals = [by_kind[p].get(k, np.nan) for k in kinds]
        ax.bar(x + (i - (len(policies) - 1) / 2) * width, vals, width, label=p)
    ax.set_xticks(x, kinds)
    ax.set_ylabel("mean ACT (s)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def resources_vs_act(curves: Mapping[str, Sequence[tuple[float, float, float]]], path: str | Path,
                     title: str, xlabel: str, target: float | None = None,
                     target_label: str = "", needed: Mapping[str, Any] | None = None) -> Path:
    """One line per policy through (resource total, mean ACT) with error bars (sd over
    seeds); the baseline's ACT as a horizontal line and each policy's needed inventory
    circled, when given."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (p, pts) in enumerate(curves.items()):
        pts = sorted(pts)
        xs, ys, sd = (np.array([q[i] for q in pts], dtype=float) for i in range(3))
        line = ax.errorbar(xs, ys, yerr=sd, label=p, ms=3.5, lw=1.2, capsize=2, **_style(i))
        if needed is not None and needed.get(p) is not None:
            nx = needed[p]
            ny = ys[np.flatnonzero(xs == nx)[0]] if (xs == nx).any() else None
            if ny is not None:
                ax.plot([nx], [ny], "o", ms=11, mfc="none", color=line.lines[0].get_color())
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=1, label=target_label or "baseline ACT")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean ACT (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def savings_figure(savings: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """resources_vs_act from the rows of one savings search."""
    from .experiments import RESOURCE_WORDS

    first = savings[0]
    word = RESOURCE_WORDS[first["resource"]]
    curves = {s["policy"]: [(pr["total"], pr["avg_act"], pr["sd"]) for pr in s["probes"]] for s in savings}
    needed = {s["policy"]: s["needed_total"] for s in savings}
    return resources_vs_act(
        curves, path,
        title=f"{first['workload']}: {word} needed for the {first['baseline']} baseline's ACT",
        xlabel=f"{word} (total)", target=first["baseline_avg_act"],
        target_label=f"{first['baseline']} at {first['baseline_total']} {word}", needed=needed)


def load_sweep(curves: Mapping[str, Sequence[tuple[float, float, float]]], path: str | Path,
               workloads: Sequence[str], policies: Sequence[str]) -> Path:
    """One panel per workload: average ACT against trajectories per step, one line per
    policy, error bars one sd over seeds. `curves` is keyed "workload policy"."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for i, p in enumerate(policies):
            pts = sorted(curves.get(f"{w} {p}", []))
            if not pts:
                continue
            xs, ys, sd = (np.array([q[j] for q in pts], dtype=float) for j in range(3))
            ax.errorbar(xs, ys, yerr=sd, label=p, ms=3.5, lw=1.2, capsize=2, **_style(i))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("trajectories per step")
        ax.set_ylabel("average ACT (s)")
        ax.set_title(w)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
