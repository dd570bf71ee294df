"""What tangram loses when nobody declares run times: the simulator's built-in workloads
planned with the true models (oracle), with run times learned within the step from
finished runs (learned: what the orchestrator does for a call without a runtime, starting
cold), with run times learned so but each elastic kind's true parallel fraction
(learned-runtimes: what learning the elasticity costs, apart from the run times), and with
declared run times that are off by a lognormal error (noisy:SIGMA).

    python bench/sim_estimates.py [--workloads coding,deepsearch,multireward] [--seeds 10]
        [--estimates learned,learned-runtimes,noisy:0.3,noisy:1.0] [--policies tangram,optimus]
        [--json out.json]

Per workload at its default load, per policy and way of estimating: mean ACT, p99 ACT
and step duration (means over seeds 0..N-1, each seed a paired comparison on the same
sampled step), and the mean over seeds of each one's ratio to the oracle's. About 1 s
per coding simulation here; the default takes about 4 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from tangram.sim.bounds import step_bounds
from tangram.sim.engine import StepSimulation
from tangram.sim.workloads import builtin

METRICS = ("avg_act", "p99_act", "step_duration")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="coding,deepsearch,multireward")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--estimates", default="learned,learned-runtimes,noisy:0.3,noisy:1.0")
    parser.add_argument("--policies", default="tangram,optimus")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    ways = ["oracle", *args.estimates.split(",")]
    policies = args.policies.split(",")
    rows = []
    t0 = time.perf_counter()
    for name in args.workloads.split(","):
        w = builtin(name)
        for seed in range(args.seeds):
            step = w.sample(seed)
            bounds = step_bounds(w, step)  # the same for every policy and estimate
            for policy in policies:
                for way in ways:
                    r = StepSimulation(w, policy, step, seed, way, bounds).run().row()
                    rows.append({k: r[k] for k in ("workload", "policy", "seed", "load", "estimates", *METRICS)})
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    summary = summarise(rows, ways, policies)
    print(report(summary, args.seeds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": args.seeds, "summary": summary, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


def summarise(rows: list[dict], ways: list[str], policies: list[str]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        for policy in policies:
            oracle = {r["seed"]: r for r in rows
                      if (r["workload"], r["policy"], r["estimates"]) == (name, policy, "oracle")}
            for way in ways:
                mine = [r for r in rows if (r["workload"], r["policy"], r["estimates"]) == (name, policy, way)]
                entry = {"workload": name, "policy": policy, "estimates": way, "load": mine[0]["load"]}
                for m in METRICS:
                    entry[m] = float(np.mean([r[m] for r in mine]))
                    entry[f"{m}_vs_oracle"] = float(np.mean([r[m] / oracle[r["seed"]][m] for r in mine]))
                out.append(entry)
    return out


def report(summary: list[dict], seeds: int) -> str:
    lines = [f"run-time estimates in the simulator: means over seeds 0-{seeds - 1} at each workload's default load; "
             "x: the mean over seeds of the ratio to the oracle's", "",
             "| workload | policy | estimates | mean ACT | x | p99 ACT | x | step | x |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in summary:
        lines.append(f"| {e['workload']} | {e['policy']} | {e['estimates']} | {e['avg_act']:.3f} s | "
                     f"{e['avg_act_vs_oracle']:.3f} | {e['p99_act']:.2f} s | {e['p99_act_vs_oracle']:.3f} | "
                     f"{e['step_duration']:.1f} s | {e['step_duration_vs_oracle']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
