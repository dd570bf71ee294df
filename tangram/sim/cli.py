"""`tangram sim`: simulate workloads under policies over seeds; a table and JSON rows."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Sequence

import numpy as np

from .engine import POLICY_NAMES, simulate
from .workloads import Workload


def run_many(workload: Workload, policies: Sequence[str], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (policy, seed); every policy sees the same sampled step for a seed."""
    rows = []
    for seed in seeds:
        step = workload.sample(seed)
        for p in policies:
            rows.append(simulate(workload, p, seed, step=step).row())
    return rows


SWEEP_KEYS = ("batch",)


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`batch=256,512,1024` -> ("batch", [256, 512, 1024])."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in SWEEP_KEYS:
        raise ValueError(f"expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}, got {text!r}")
    try:
        out = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"sweep values must be integers, got {values!r}") from None
    if not out or any(v < 1 for v in out):
        raise ValueError(f"sweep values must be positive integers, got {values!r}")
    return key, out


def _fmt(values: list[float]) -> str:
    a = np.asarray(values, dtype=float)
    if len(a) > 1:
        return f"{a.mean():.2f}±{a.std(ddof=1):.2f}"
    return f"{a.mean():.2f}"


def table(rows: list[dict[str, Any]], policies: Sequence[str]) -> str:
    cols = [("avg ACT", "avg_act"), ("p99 ACT", "p99_act"), ("env ACT", "act_env"),
            ("reward ACT", "act_reward"), ("step s", "step_duration"), ("ACT/bound", "act_ratio_to_bound")]
    width = 14
    out = [f"{'policy':<12}" + "".join(f"{c:>{width}}" for c, _ in cols) + f"{'cpu util':>10}"]
    for p in policies:
        rs = [r for r in rows if r["policy"] == p]
        line = f"{p:<12}" + "".join(f"{_fmt([r[k] for r in rs]):>{width}}" for _, k in cols)
        line += f"{np.mean([r['utilisation'].get('cpu', math.nan) for r in rs]):>10.1%}"
        out.append(line)
    lb = [r["lower_bound_act"] for r in rows if r["policy"] == policies[0]]
    out.append(f"lower bound on avg ACT (best grant, no wait): {_fmt(lb)} s")
    return "\n".join(out)


def cli_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tangram sim", description=__doc__)
    parser.add_argument("--workload", default="coding", help="built-in name (coding, deepsearch, multireward) or a JSON file")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES),
                        help=f"comma-separated, of {', '.join(POLICY_NAMES)}")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (default 1)")
    parser.add_argument("--batch", type=int, default=None, help="trajectories per step (the load)")
    parser.add_argument("--sweep", default=None,
                        help="load sweep, e.g. batch=256,512,1024: one table and one set of rows per value")
    parser.add_argument("--json", default=None, help="write one JSON row per (workload, policy, seed, load)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICY_NAMES:
            parser.error(f"unknown policy {p!r} (one of {', '.join(POLICY_NAMES)})")
    if args.seeds < 1:
        parser.error("--seeds must be positive")
    w = Workload.load(args.workload)
    if args.batch is not None:
        if args.batch < 1:
            parser.error("--batch must be positive")
        w = w.with_batch(args.batch)
    loads = [w.batch]
    if args.sweep is not None:
        try:
            _, loads = parse_sweep(args.sweep)
        except ValueError as e:
            parser.error(f"--sweep: {e}")
    rows: list[dict[str, Any]] = []
    for load in loads:
        wl = w.with_batch(load)
        t0 = time.perf_counter()
        part = run_many(wl, policies, range(args.seeds))
        elapsed = time.perf_counter() - t0
        print(f"tangram sim: workload {wl.name}, {wl.batch} trajectories per step (load), {args.seeds} seed(s); "
              f"seconds of virtual time (mean±sd over seeds)")
        print(table(part, policies))
        print(f"simulated {len(part)} step(s) in {elapsed:.1f} s of wall time")
        rows += part
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
