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
    parser.add_argument("--workload", default="coding", help="built-in name (coding) or a JSON file")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES),
                        help=f"comma-separated, of {', '.join(POLICY_NAMES)}")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (default 1)")
    parser.add_argument("--batch", type=int, default=None, help="trajectories per step (the load)")
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
    t0 = time.perf_counter()
    rows = run_many(w, policies, range(args.seeds))
    elapsed = time.perf_counter() - t0
    print(f"tangram sim: workload {w.name}, {w.batch} trajectories per step, {args.seeds} seed(s); "
          f"seconds of virtual time (mean±sd over seeds)")
    print(table(rows, policies))
    print(f"simulated {len(rows)} step(s) in {elapsed:.1f} s of wall time")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
