"""Experiments on top of `simulate`: runs over policies and seeds, inventory sweeps, the
resource-savings search, ACT over time, and a progress bar for long runs.

Every run of one seed uses the same sampled step (`Workload.sample(seed)` depends on the
batch and the seed only, not on the inventory), so policies and inventories are compared on
common random numbers.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .bounds import step_bounds
from .engine import StepSimulation
from .result import SimResult
from .workloads import Step, Workload

RESOURCES = ("gpus", "cores")
RESOURCE_WORDS = {"gpus": "GPUs", "cores": "cores"}

# ------------------------------------------------------------------ progress


class Progress:
    """Counts finished simulations on stderr: a tqdm bar when tqdm is installed, else a
    plain counter (redrawn in place on a terminal; a line every ~10% otherwise). Disabled,
    it does nothing. `total` may be None (unknown, e.g. a search)."""

    def __init__(self, total: int | None, desc: str, enabled: bool = True) -> None:
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._bar: Any = None
        self._last_line = -1
        if not enabled:
            return
        try:
            from tqdm import tqdm  # optional: never required
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="sim", file=sys.stderr, leave=False)

    def update(self, k: int = 1, note: str = "") -> None:
        self.n += k
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(k)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            return
        of = f"/{self.total}" if self.total else ""
        text = f"{self.desc}: {self.n}{of} simulations {note}".rstrip()
        if sys.stderr.isatty():
            sys.stderr.write("\r" + text)
            sys.stderr.flush()
        else:
            step = max(1, (self.total or 100) // 10)
            if self.n // step != self._last_line:
                self._last_line = self.n // step
                sys.stderr.write(text + "\n")

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif sys.stderr.isatty():
            sys.stderr.write("\n")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ runs


def run_many(workload: Workload, policies: Sequence[str], seeds: Iterable[int],
             progress: Progress | None = None,
             on_result: Callable[[SimResult], None] | None = None,
             steps: dict[int, Step] | None = None, estimates: str = "oracle") -> list[dict[str, Any]]:
    """One row per (policy, seed); every policy sees the same sampled step for a seed, and
    the step's bounds, computed once. `on_result` sees each full SimResult (e.g. for ACT
    over time); `steps` caches samples; `estimates`: what the core is told of run times
    (tangram.sim.engine)."""
    rows = []
    for seed in seeds:
        if steps is not None and seed in steps:
            step = steps[seed]
        else:
            step = workload.sample(seed)
            if steps is not None:
                steps[seed] = step
        bounds = step_bounds(workload, step)
        for p in policies:
            r = StepSimulation(workload, p, step, seed, estimates, bounds).run()
            if on_result is not None:
                on_result(r)
            rows.append(r.row())
            if progress is not None:
                progress.update(1, f"{workload.name} {p} seed {seed}")
    return rows


def act_timeline(r: SimResult, bin_seconds: float = 5.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ACT over time: actions binned by finish time into `bin_seconds` windows; returns
    (window starts, mean ACT of the actions finishing in each window (NaN when none),
    count per window)."""
    ok = ~r.rejected
    fin, act = r.finish[ok], r.act[ok]
    if not len(fin):
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
    nb = int(math.floor(float(fin.max()) / bin_seconds)) + 1
    idx = np.minimum((fin // bin_seconds).astype(np.int64), nb - 1)
    count = np.bincount(idx, minlength=nb)
    total = np.bincount(idx, weights=act, minlength=nb)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return np.arange(nb) * bin_seconds, mean, count


def mean_act_by_kind(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> dict[str, dict[str, float]]:
    """{policy: {kind: mean over rows of act_by_kind[kind]}} (kinds in first-seen order)."""
    out: dict[str, dict[str, float]] = {}
    for p in policies:
        acc: dict[str, list[float]] = {}
        for r in rows:
            if r["policy"] == p:
                for k, v in r["act_by_kind"].items():
                    acc.setdefault(k, []).append(v)
        out[p] = {k: float(np.mean(v)) for k, v in acc.items()}
    return out


# ------------------------------------------------------------------ savings search


@dataclass
class _Evaluator:
    """Mean ACT over seeds of one policy at one inventory value; cached, with the samples
    shared across values and policies."""

    workload: Workload
    resource: str
    seeds: Sequence[int]
    progress: Progress | None = None
    cache: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    steps: dict[int, Step] = field(default_factory=dict)

    def __call__(self, policy: str, value: int) -> dict[str, Any]:
        key = (policy, value)
        if key not in self.cache:
            w = self.workload.with_value(self.resource, value)
            rows = run_many(w, [policy], self.seeds, progress=self.progress, steps=self.steps)
            acts = [r["avg_act"] for r in rows]
            self.cache[key] = {
                "value": value,
                "total": w.total(self.resource),
                "avg_act": float(np.mean(acts)),
                "sd": float(np.std(acts, ddof=1)) if len(acts) > 1 else 0.0,
                "avg_act_per_seed": acts,
                "step_duration": float(np.mean([r["step_duration"] for r in rows])),
                "rejected": int(sum(r["rejected"] for r in rows)),  # actions that could never run
            }
        return self.cache[key]

    def act_if_all_ran(self, policy: str, value: int) -> float:
        """The mean ACT, or infinity when the inventory rejected actions (a rejected action
        ends at once: its ACT of 0 would make an inventory too small to run it look fast)."""
        probe = self(policy, value)
        return probe["avg_act"] if probe["rejected"] == 0 else math.inf


def smallest_meeting(f: Callable[[int], float], target: float, lo: int, hi: int,
                     scan_limit: int = 16) -> tuple[int | None, str]:
    """The smallest v in [lo, hi] with f(v) <= target, and the method used. When the range
    holds at most `scan_limit` values, a scan upward from `lo` (exact, whatever the shape of
    f); otherwise a bisection that assumes f non-increasing in v (more resources, no worse
    ACT), after checking that hi meets the target. None when hi does not."""
    if hi - lo + 1 <= scan_limit:
        for v in range(lo, hi + 1):
            if f(v) <= target:
                return v, "scan"
        return None, "scan"
    if f(hi) > target:
        return None, "bisection"
    if f(lo) <= target:
        return lo, "bisection"
    bad, good = lo, hi  # f(bad) > target >= f(good)
    while good - bad > 1:
        mid = (bad + good) // 2
        if f(mid) <= target:
            good = mid
        else:
            bad = mid
    return good, "bisection"


def savings_search(workload: Workload, policies: Sequence[str], baseline: str, resource: str,
                   seeds: Sequence[int], baseline_value: int | None = None, cap: int | None = None,
                   progress: Progress | None = None) -> list[dict[str, Any]]:
    """For each policy, the smallest inventory of `resource` (`gpus` per GPU node or `cores`
    per CPU node, everything else as in the workload) whose average ACT (mean over `seeds`)
    is at most the `baseline` policy's at `baseline_value` (default: the workload's own).
    Searched over 1..cap (default: 4x the larger of the default and baseline values).
    One row per policy, with every probe made (value, total, mean ACT, spread)."""
    if resource not in RESOURCES:
        raise ValueError(f"resource must be one of {', '.join(RESOURCES)}, got {resource!r}")
    default = workload.value(resource)
    if default < 1:
        raise ValueError(f"workload {workload.name!r} has no {resource} to scale")
    bval = int(baseline_value) if baseline_value is not None else default
    hi = int(cap) if cap is not None else 4 * max(default, bval)
    if hi < bval:
        raise ValueError(f"cap {hi} is below the baseline's inventory {bval}")
    ev = _Evaluator(workload, resource, list(seeds), progress)
    base = ev(baseline, bval)
    if base["rejected"]:
        raise ValueError(f"the {baseline} baseline rejects {base['rejected']} action(s) it can never run at "
                         f"{bval} {RESOURCE_WORDS[resource]} per node: its average ACT is no target")
    target = base["avg_act"]
    per_node = workload.total(resource) // default  # nodes the value is multiplied by
    word = RESOURCE_WORDS[resource]
    out = []
    for p in policies:
        needed, method = smallest_meeting(lambda v, p=p: ev.act_if_all_ran(p, v), target, 1, hi)
        probes = sorted((v for (q, _), v in ev.cache.items() if q == p), key=lambda d: d["value"])
        row: dict[str, Any] = {
            "workload": workload.name,
            "load": workload.batch,
            "resource": resource,
            "policy": p,
            "baseline": baseline,
            "baseline_value": bval,
            "baseline_total": bval * per_node,
            "baseline_avg_act": target,
            "baseline_avg_act_sd": base["sd"],
            "default_value": default,
            "seeds": list(seeds),
            "cap": hi,
            "method": method,
            "reached": needed is not None,
            "needed": needed,
            "needed_total": needed * per_node if needed is not None else None,
            "fraction_of_baseline": (needed / bval) if needed is not None else None,
            "avg_act_at_needed": ev(p, needed)["avg_act"] if needed is not None else None,
            "probes": probes,
        }
        if needed is None:
            rejecting = [d["value"] * per_node for d in probes if d["rejected"]]
            row["statement"] = (f"{p} does not reach the {baseline} baseline's average ACT "
                                f"({target:.3f} s at {bval * per_node} {word}) with up to "
                                f"{hi * per_node} {word}" +
                                (f"; it rejects actions it can never run with {', '.join(map(str, rejecting))} {word}"
                                 if rejecting else ""))
        else:
            pct = 100.0 * needed / bval
            more = " (more than the baseline)" if needed > bval else ""
            row["statement"] = (f"{p} needs {pct:.0f}% of the {word} of the {baseline} baseline "
                                f"for the same average ACT: {needed * per_node} against "
                                f"{bval * per_node} {word} ({row['avg_act_at_needed']:.3f} s <= "
                                f"{target:.3f} s){more}")
        out.append(row)
    return out
