"""tangram's two objectives side by side: "step" (the default) and "act" (Policy.objective).

    python bench/objectives.py [--workloads coding,...] [--loads 128,512,2048] [--seeds 10] [--jobs 2]
        [--json rows.json] [--markdown docs/results/objectives.md]

Each (workload, load, seed) samples one step and runs it under `tangram` with each
objective, and under the other policies for the best of them by mean ACT (common random
numbers, as bench/sim_grid.py). Per cell: the mean over seeds of mean ACT, step duration and
p99 ACT for each objective, the paired change from "step" to "act" in percent (negative:
"act" lower), and the lowest mean ACT of another policy with its step and p99. About five
minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool

import numpy as np

from tangram.sim.bounds import step_bounds
from tangram.sim.engine import POLICY_NAMES, StepSimulation, make_policy
from tangram.sim.workloads import builtin, builtin_names

METRICS = ("avg_act", "step_duration", "p99_act")
OBJECTIVES = ("step", "act")


def run_cell_seed(task: tuple[str, int, int]) -> dict:
    name, load, seed = task
    w = builtin(name).with_batch(load)
    step = w.sample(seed)
    bounds = step_bounds(w, step)  # the same for every policy
    out: dict = {"workload": name, "load": load, "seed": seed}
    for objective in OBJECTIVES:
        row = StepSimulation(w, make_policy(w, "tangram", objective), step, seed, bounds=bounds).run(check=False).row()
        out[objective] = {m: row[m] for m in METRICS}
    for policy in POLICY_NAMES:
        if policy != "tangram":
            row = StepSimulation(w, policy, step, seed, bounds=bounds).run(check=False).row()
            out[policy] = {m: row[m] for m in METRICS}
    return out


def summarise(rows: list[dict]) -> list[dict]:
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["load"]), []).append(r)
    out = []
    for (name, load), rs in sorted(cells.items()):
        cell: dict = {"workload": name, "load": load, "seeds": len(rs)}
        for objective in OBJECTIVES:
            cell[objective] = {m: float(np.mean([r[objective][m] for r in rs])) for m in METRICS}
        cell["change_percent"] = {m: float(np.mean([(r["act"][m] - r["step"][m]) / r["step"][m] * 100 for r in rs]))
                                  for m in METRICS}
        others = [p for p in POLICY_NAMES if p != "tangram"]
        best = min(others, key=lambda p: np.mean([r[p]["avg_act"] for r in rs]))
        cell["best_other"] = {"policy": best, **{m: float(np.mean([r[best][m] for r in rs])) for m in METRICS}}
        out.append(cell)
    return out


def markdown(cells: list[dict], command: str) -> str:
    out = ["# tangram's objectives", "",
           f"Produced by `{command}`. Each workload at each load, `tangram` with objective \"step\" (the "
           "default) and \"act\" on the same sampled steps, and the other policy with the lowest mean ACT there. "
           "Mean over seeds; the change is the paired mean of (act - step) / step in percent. "
           "[docs/scheduling.md](../scheduling.md#objectives) says what each objective does and when to pick it.", "",
           "| workload | load | mean ACT step / act (change) | step duration step / act (change) "
           "| p99 ACT step / act (change) | lowest other mean ACT: policy, mean ACT, step, p99 |",
           "|---|---:|---|---|---|---|"]
    for c in cells:
        parts = [f"{c['step'][m]:.2f} / {c['act'][m]:.2f} ({c['change_percent'][m]:+.1f}%)" for m in METRICS]
        b = c["best_other"]
        out.append(f"| {c['workload']} | {c['load']} | " + " | ".join(parts)
                   + f" | `{b['policy']}` {b['avg_act']:.2f}, {b['step_duration']:.1f}, {b['p99_act']:.1f} |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(builtin_names()))
    ap.add_argument("--loads", default="128,512,2048")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    tasks = [(name, int(load), seed) for name in args.workloads.split(",") for load in args.loads.split(",")
             for seed in range(args.seeds)]
    t0 = time.time()
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            rows = pool.map(run_cell_seed, tasks)
    else:
        rows = [run_cell_seed(t) for t in tasks]
    print(f"{len(tasks)} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    cells = summarise(rows)
    command = "python bench/objectives.py " + " ".join(argv if argv is not None else sys.argv[1:])
    page = markdown(cells, command.strip())
    print(page)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(page)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": cells, "rows": rows}, f, indent=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
