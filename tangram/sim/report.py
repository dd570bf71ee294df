"""`tangram sim --report DIR`: regenerate the results table (DIR/results.md), the figures
(DIR/*.png, when matplotlib is installed) and the JSON rows (DIR/rows.json,
DIR/savings.json) from scratch: every built-in workload under every policy over a few
seeds, and the resource-savings searches."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .engine import POLICY_NAMES
from .experiments import RESOURCE_WORDS, Progress, act_timeline, mean_act_by_kind, run_many, savings_search
from .result import SimResult
from .workloads import Workload, builtin

WORKLOADS = ("coding", "deepsearch", "multireward")
# (workload, resource, baseline policy, baseline inventory (None: the workload's), cap)
SAVINGS = (
    ("multireward", "gpus", "isolated", None, 16),
    ("multireward", "gpus", "isolated", 10, 16),  # the paper's over-provisioned baseline: a GPU per service
    ("coding", "cores", "trajectory", None, None),
)
# The paper's numbers (../shared/docs/paper.md) to set ours beside.
PAPER = {
    ("coding", "avg_act"): 4.3, ("coding", "act_env"): 9.0, ("coding", "act_reward"): 2.8,
    ("coding", "step_duration"): 1.4, ("deepsearch", "step_duration"): 1.5,
}
BIN_SECONDS = 5.0
# The load sweep: trajectories per step, as fractions of each workload's default batch (the
# default itself is the main run).
LOAD_FRACTIONS = (0.25, 0.5)
BOUND_KEYS = (("bound_peak_cpu", "peak cores / node cores"), ("bound_cpu_over", "env actions started over cores"),
              ("bound_peak_gpu", "peak GPU memory / GPUs"), ("bound_gpu_over", "rewards started over GPU memory"),
              ("bound_peak_quota", "peak in-flight / quota concurrency"),
              ("bound_quota_over", "quota calls started over concurrency"))


def _ms(values: Sequence[float], digits: int = 2) -> str:
    a = np.asarray(values, dtype=float)
    if len(a) > 1:
        return f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}"
    return f"{a.mean():.{digits}f}"


def _mean(rows: Sequence[dict[str, Any]], policy: str, key: str) -> float:
    return float(np.mean([r[key] for r in rows if r["policy"] == policy]))


def _gain_text(gain: float) -> str:
    return "inf" if math.isinf(gain) else f"{gain:g}"


def _compute_note(gains: Sequence[float]) -> str:
    """What the run assumed of GPU compute (docs/workloads.md, "GPU compute")."""
    if not gains:
        return ""
    if all(math.isinf(g) for g in gains):
        return ("GPU compute is not modelled in this run (`gpu_batch_gain` inf): each reward runs at its "
                "speed alone, whatever else runs on its device.")
    s = ", ".join(_gain_text(g) for g in gains)
    return (f"Reward actions on one GPU device share its compute (saturation batch gain S = {s}: with n "
            "running there, each at 1 / (1 + (n - 1) / S) of its speed alone); the core plans each reward "
            "with its run time alone.")


def workload_table(rows: list[dict[str, Any]], policies: Sequence[str]) -> list[str]:
    cols = [("avg ACT (s)", "avg_act"), ("p99 ACT (s)", "p99_act"), ("env ACT (s)", "act_env"),
            ("reward ACT (s)", "act_reward"), ("reward run / alone", "reward_slowdown"), ("step (s)", "step_duration"),
            ("ACT / bound", "act_ratio_to_bound"), ("ACT / capacity bound", "act_ratio_to_capacity_bound"),
            ("step / bound", "step_ratio_to_bound")]
    out = ["| policy | " + " | ".join(c for c, _ in cols) + " | services / GPU | CPU util |",
           "| --- | " + " | ".join("---:" for _ in cols) + " | ---: | ---: |"]
    for p in policies:
        rs = [r for r in rows if r["policy"] == p]
        cells = [_ms([r[k] for r in rs]) for _, k in cols]
        util = np.mean([r["utilisation"].get("cpu", math.nan) for r in rs])
        peak = "/".join(str(r["peak_services_per_device"]) for r in rs)
        out.append(f"| `{p}` | " + " | ".join(cells) + f" | {peak} | {util:.1%} |")
    lb = [r["lower_bound_act"] for r in rows if r["policy"] == policies[0]]
    out.append("")
    out.append("Reward run / alone: mean over rewards of the run time over the run time alone on an idle device "
               "(GPU compute sharing). Services / GPU: the most services resident on one device at once, per seed.")
    out.append("")
    out.append(f"Lower bound on average ACT (every action at its best grant, no wait): {_ms(lb)} s.")
    cb = [r["capacity_bound_act"] for r in rows if r["policy"] == policies[0]]
    out.append(f"Lower bound on average ACT counting capacity ([findings.md](findings.md#the-lower-bounds)): "
               f"{_ms(cb)} s.")
    sb = [r["step_bound"] for r in rows if r["policy"] == policies[0]]
    out.append(f"Lower bound on step duration (the longest trajectory with no wait, and each resource's "
               f"demand served at capacity): {_ms(sb)} s.")
    return out


def ratios(rows: list[dict[str, Any]], workload: str, policies: Sequence[str]) -> list[str]:
    if "tangram" not in policies:
        return []
    keys = [("average ACT", "avg_act"), ("env ACT", "act_env"), ("reward ACT", "act_reward"),
            ("step duration", "step_duration")]
    out = ["| ratio to `tangram` | " + " | ".join(k for k, _ in keys) + " |",
           "| --- | " + " | ".join("---:" for _ in keys) + " |"]
    for p in policies:
        if p == "tangram":
            continue
        cells = []
        for _, k in keys:
            r = _mean(rows, p, k) / _mean(rows, "tangram", k)
            paper = PAPER.get((workload, k)) if p == "trajectory" else None
            cells.append(f"{r:.2f}x" + (f" (paper {paper}x)" if paper else ""))
        out.append(f"| `{p}` / `tangram` | " + " | ".join(cells) + " |")
    return out


def who_wins(rows: list[dict[str, Any]], policies: Sequence[str]) -> str:
    losses = []
    for seed in sorted({r["seed"] for r in rows}):
        rs = {r["policy"]: r["avg_act"] for r in rows if r["seed"] == seed}
        best = min(rs, key=lambda p: (rs[p], p != "tangram"))
        if best != "tangram" and "tangram" in rs:
            losses.append(f"seed {seed}: `{best}` {rs[best]:.3f} s against `tangram` {rs['tangram']:.3f} s")
    if not losses:
        return "`tangram` has the lowest average ACT on every seed."
    return "`tangram` does **not** have the lowest average ACT on every seed: " + "; ".join(losses) + "."


def bound_section(all_rows: list[dict[str, Any]], names: Sequence[str]) -> list[str]:
    """What the lower bound asks of each workload's inventory (bounds.bound_schedule)."""
    keys = [(k, label) for k, label in BOUND_KEYS if any(k in r for r in all_rows)]
    out = ["| workload | ACT / bound (`tangram`) | ACT / capacity bound | " + " | ".join(label for _, label in keys)
           + " |", "| --- | ---: | ---: | " + " | ".join("---:" for _ in keys) + " |"]
    for name in names:
        rows = [r for r in all_rows if r["workload"] == name and r["policy"] == "tangram"]
        if not rows:
            continue
        cells = []
        for k, _ in keys:
            v = [r[k] for r in rows if k in r]
            pct = k.endswith("_over")
            cells.append("-" if not v else (f"{100 * np.mean(v):.0f}%" if pct else f"{np.mean(v):.2f}x"))
        out.append(f"| {name} | {_ms([r['act_ratio_to_bound'] for r in rows])} "
                   f"| {_ms([r['act_ratio_to_capacity_bound'] for r in rows])} | " + " | ".join(cells) + " |")
    return out


def sweep_section(rows: list[dict[str, Any]], policies: Sequence[str]) -> list[str]:
    """Average ACT per load (rows) and policy (columns): mean [min, max] over seeds."""
    loads = sorted({r["load"] for r in rows})
    out = ["| trajectories | " + " | ".join(f"`{p}`" for p in policies) + " | zero-wait bound | capacity bound |",
           "| ---: | " + " | ".join("---:" for _ in policies) + " | ---: | ---: |"]
    for load in loads:
        at = [r for r in rows if r["load"] == load]
        cells = []
        for p in policies:
            v = np.array([r["avg_act"] for r in at if r["policy"] == p])
            cells.append(f"{v.mean():.3f} [{v.min():.3f}, {v.max():.3f}]")
        lb = np.array([r["lower_bound_act"] for r in at if r["policy"] == policies[0]])
        cb = np.array([r["capacity_bound_act"] for r in at if r["policy"] == policies[0]])
        out.append(f"| {load} | " + " | ".join(cells) + f" | {lb.mean():.3f} | {cb.mean():.3f} |")
    losses = []
    for load in loads:
        for seed in sorted({r["seed"] for r in rows}):
            rs = {r["policy"]: r["avg_act"] for r in rows if r["load"] == load and r["seed"] == seed}
            if "tangram" in rs:
                best = min(rs, key=lambda p: (rs[p], p != "tangram"))
                if best != "tangram":
                    losses.append(f"{load} trajectories, seed {seed}: `{best}` {rs[best]:.4f} s against "
                                  f"`tangram` {rs['tangram']:.4f} s")
    out.append("")
    out.append("`tangram` has the lowest average ACT at every load and seed." if not losses else
               "`tangram` does **not** have the lowest average ACT everywhere: " + "; ".join(losses) + ".")
    return out


def savings_section(rows: list[dict[str, Any]]) -> list[str]:
    r0 = rows[0]
    word = RESOURCE_WORDS[r0["resource"]]
    base = (f"`{r0['baseline']}` at {r0['baseline_total']} {word}"
            + (" (the workload's inventory)" if r0["baseline_value"] == r0["default_value"] else
               f" (not the workload's {r0['default_value'] * r0['baseline_total'] // r0['baseline_value']})"))
    out = [f"### {r0['workload']}: {word} for the ACT of {base}", "",
           f"Target: average ACT {r0['baseline_avg_act']:.3f} ± {r0['baseline_avg_act_sd']:.3f} s "
           f"(mean ± sd over {len(r0['seeds'])} seeds). Searched 1..{r0['cap']} per node "
           f"({r0['method']}{'; bisection assumes ACT does not rise with more resources' if r0['method'] == 'bisection' else ''}).",
           "",
           f"| policy | {word} needed | % of baseline | avg ACT there (s) |",
           "| --- | ---: | ---: | ---: |"]
    for r in rows:
        if r["reached"]:
            out.append(f"| `{r['policy']}` | {r['needed_total']} | {100 * r['fraction_of_baseline']:.0f}% "
                       f"| {r['avg_act_at_needed']:.3f} |")
        else:
            out.append(f"| `{r['policy']}` | not reached | - | - |")
    out.append("")
    out += [f"- {r['statement']}." for r in rows if r["policy"] == "tangram"]
    return out


def write_json(path: str | Path, obj: Any) -> None:
    """`obj` as indented JSON, one trailing newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


@dataclass
class _ReportRuns:
    """What the report's simulations gave."""

    rows: list[dict[str, Any]]  # every workload, policy and seed at its default load
    firsts: dict[str, dict[str, SimResult]]  # per workload: the first seed's result per policy
    sweep_rows: list[dict[str, Any]]  # the load sweep, the default load included
    savings: list[list[dict[str, Any]]]  # one list of rows per savings search
    runs_seconds: float  # wall time of the runs
    seconds: float  # wall time of the runs and the savings searches


def write_report(directory: str | Path, seeds: int | Sequence[int] = 3, progress: bool = True,
                 workloads: Sequence[str] = WORKLOADS, policies: Sequence[str] = POLICY_NAMES,
                 batch: int | None = None, savings: Sequence[tuple[Any, ...]] = SAVINGS,
                 figures: bool = True, load_fractions: Sequence[float] = LOAD_FRACTIONS,
                 gpu_batch_gain: float | None = None) -> Path:
    """Writes DIR/results.md (returned), DIR/rows.json, DIR/savings.json and, with
    matplotlib, the PNG figures. `seeds`: a count N (seeds 0..N-1) or the seeds themselves.
    `batch` overrides every workload's load (tests); `gpu_batch_gain` every workload's GPU
    compute model (math.inf: no contention; None: each workload's own)."""
    seeds = range(seeds) if isinstance(seeds, int) else list(seeds)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def load(name: str) -> Workload:
        w = builtin(name)
        if batch is not None:
            w = w.with_batch(batch)
        return w.with_gpu_batch_gain(gpu_batch_gain) if gpu_batch_gain is not None else w

    loaded = {name: load(name) for name in workloads}
    runs = _report_runs(loaded, load, policies, seeds, savings, load_fractions, progress)
    pngs, fig_note = _report_figures(d, loaded, runs, policies, seeds) if figures else ([], "")
    write_json(d / "rows.json", runs.rows)
    write_json(d / "sweep.json", runs.sweep_rows)
    write_json(d / "savings.json", [r for sv in runs.savings for r in sv])
    md = _report_markdown(directory, loaded, runs, policies, seeds, batch, gpu_batch_gain, load_fractions)
    md += ["## Figures", ""]
    if fig_note:
        md += [fig_note, ""]
    for p in pngs:
        md += [f"![{p.stem}]({p.name})", ""]
    md += ["Raw rows: `rows.json` (one per workload, policy, seed, default load), `sweep.json` (the "
           "load sweep, default load included), `savings.json` (one per search and policy, with every "
           "probe).", ""]
    out = d / "results.md"
    out.write_text("\n".join(md), encoding="utf-8")
    return out


def _report_runs(loaded: dict[str, Workload], load: Callable[[str], Workload], policies: Sequence[str],
                 seeds: Sequence[int], savings: Sequence[tuple[Any, ...]], load_fractions: Sequence[float],
                 progress: bool) -> _ReportRuns:
    """Every loaded workload under every policy over the seeds, at its default load and at
    each fraction of it, then the savings searches (on workloads `load` gives)."""
    t0 = time.perf_counter()
    all_rows: list[dict[str, Any]] = []
    firsts: dict[str, dict[str, SimResult]] = {}
    with Progress(len(loaded) * len(policies) * len(seeds), "report runs", progress) as bar:
        for name, w in loaded.items():
            first: dict[str, SimResult] = {}

            def keep(r: SimResult, first: dict[str, SimResult] = first) -> None:
                if r.seed == seeds[0]:
                    first[r.policy] = r

            all_rows += run_many(w, policies, seeds, progress=bar, on_result=keep)
            firsts[name] = first
    sweep_rows: list[dict[str, Any]] = []
    with Progress(len(loaded) * len(policies) * len(seeds) * len(load_fractions), "load sweep", progress) as bar:
        for name, w in loaded.items():
            for f in load_fractions:
                wl = w.with_batch(max(1, int(round(w.batch * f))))
                sweep_rows += run_many(wl, policies, seeds, progress=bar)
    sweep_rows = sorted(sweep_rows + [dict(r) for r in all_rows], key=lambda r: (r["workload"], r["load"]))
    for r in sweep_rows:
        r["sweep"] = "batch"
    t_runs = time.perf_counter() - t0
    all_savings: list[list[dict[str, Any]]] = []
    for name, resource, baseline, bval, cap in savings:
        w = load(name)
        with Progress(None, f"savings {name}/{resource} vs {baseline}", progress) as bar:
            all_savings.append(savings_search(w, policies, baseline, resource, seeds,
                                              baseline_value=bval, cap=cap, progress=bar))
    return _ReportRuns(all_rows, firsts, sweep_rows, all_savings, t_runs, time.perf_counter() - t0)


def _report_figures(d: Path, loaded: dict[str, Workload], runs: _ReportRuns, policies: Sequence[str],
                    seeds: Sequence[int]) -> tuple[list[Path], str]:
    """The report's PNG figures in `d`, and a note for the report when matplotlib is missing."""
    pngs: list[Path] = []
    try:
        from . import figures as fg

        for name in loaded:
            rows = [r for r in runs.rows if r["workload"] == name]
            tl = {p: act_timeline(runs.firsts[name][p], BIN_SECONDS)[:2] for p in policies}
            pngs.append(fg.act_over_time(tl, d / f"act_over_time_{name}.png",
                                         f"{name}: ACT over time (seed {seeds[0]})", BIN_SECONDS))
            pngs.append(fg.act_by_kind(mean_act_by_kind(rows, policies), d / f"act_by_kind_{name}.png",
                                       f"{name}: ACT by action kind (mean over {len(seeds)} seeds)"))
        curves: dict[str, list[tuple[float, float, float]]] = {}
        for name in loaded:
            for p in policies:
                pts: dict[int, list[float]] = {}
                for r in runs.sweep_rows:
                    if r["workload"] == name and r["policy"] == p:
                        pts.setdefault(r["load"], []).append(r["avg_act"])
                curves[f"{name} {p}"] = [(x, float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0)
                                         for x, v in pts.items()]
        pngs.append(fg.load_sweep(curves, d / "load_sweep.png", list(loaded), list(policies)))
        for sv in runs.savings:
            s0 = sv[0]
            pngs.append(fg.savings_figure(sv, d / f"savings_{s0['workload']}_{s0['resource']}_"
                                                  f"{s0['baseline']}{s0['baseline_total']}.png"))
    except RuntimeError as e:  # matplotlib missing
        return pngs, f"Figures not written: {e}."
    return pngs, ""


def _report_markdown(directory: str | Path, loaded: dict[str, Workload], runs: _ReportRuns,
                     policies: Sequence[str], seeds: Sequence[int], batch: int | None,
                     gpu_batch_gain: float | None, load_fractions: Sequence[float]) -> list[str]:
    """results.md's lines up to its figures."""
    all_rows, sweep_rows, all_savings = runs.rows, runs.sweep_rows, runs.savings
    elapsed, t_runs = runs.seconds, runs.runs_seconds
    gains = sorted({w.reward.gpu_batch_gain for w in loaded.values() if w.reward is not None})
    flag = "" if gpu_batch_gain is None else f" --gpu-batch-gain {_gain_text(gpu_batch_gain)}"
    md = ["# Simulator results", "",
          f"Regenerate with `tangram sim --report {directory}{flag}` (this run: {len(seeds)} seed(s) per workload and "
          f"policy{', batch ' + str(batch) if batch is not None else ', each workload at its default load'}; "
          f"{elapsed:.0f} s of wall time, {t_runs:.0f} s of it for the runs, the rest for the savings searches). "
          "Seconds are virtual time, mean ± sd over seeds. Every workload parameter is a stated "
          "assumption documented in docs/workloads.md, not a measurement: these numbers say what the "
          "policies do on those assumptions, not what the paper's testbed measured. "
          + _compute_note(gains),
          ""]
    if len(seeds) < 3:
        md += [f"Only {len(seeds)} seed(s): the spread is not meaningful.", ""]
    md += ["## ACT per workload", ""]
    for name, w in loaded.items():
        rows = [r for r in all_rows if r["workload"] == name]
        md += [f"### {name} ({w.batch} trajectories, {w.total('cores')} sandbox cores, "
               f"{w.total('gpus')} GPUs)", ""]
        md += workload_table(rows, policies) + [""]
        md += ratios(rows, name, policies) + [""]
        md += [who_wins(rows, policies), ""]
    md += ["## Why the zero-wait bound is out of reach", "",
           "The capacity bound (its column below; [findings.md](findings.md#the-lower-bounds)) counts "
           "each resource's capacity and holds for every policy. The zero-wait bound runs every action at its best grant (elastic maximum) with zero wait. That "
           "schedule does not depend on the policy, so we can ask what it needs: replay each "
           "trajectory with no wait (think, actions back to back at their best grants, then its "
           "reward) and add up, at every instant, the best-grant cores of the actions running on each "
           "sandbox node, the GPU memory the reward services would need (ceil(running / max_batch) "
           "resident copies of each service with actions running), and the in-flight requests of "
           "each API quota. Peaks above 1x and the share of actions that start while their resource "
           "is over its inventory mean no policy can meet the bound on this inventory; restore time "
           "(never in the bound) comes on top for services that must be evicted. Mean over seeds, "
           "default load (columns: `bound_*` fields of rows.json).", ""]
    md += bound_section(all_rows, list(loaded)) + [""]
    md += ["## Load sweep", "",
           f"Average ACT (s) at {', '.join(str(int(round(100 * f))) + '%' for f in load_fractions)} and "
           f"100% of each workload's default batch, same inventory: mean [min, max] over {len(seeds)} "
           "seed(s). Rows in `sweep.json`.", ""]
    for name in loaded:
        md += [f"### {name}", ""]
        md += sweep_section([r for r in sweep_rows if r["workload"] == name], policies) + [""]
    md += ["## Resource savings at equal ACT", "",
           "For each policy, the smallest inventory of one resource (everything else as in the "
           "workload) whose average ACT, over the same seeds, is at most the baseline policy's. "
           "The paper reports tangram needing 29% of the GPUs of an over-provisioned baseline "
           "(a GPU per reward service) on multireward; the second multireward search uses that "
           "baseline (10 GPUs), the first the workload's own 4 GPUs. GPUs come in whole devices, "
           "so percentages move in steps of 1/baseline.", ""]
    for sv in all_savings:
        md += savings_section(sv) + [""]
    return md
