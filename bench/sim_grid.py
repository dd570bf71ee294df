"""The policy grid: every built-in workload at loads 128 to 2,048 trajectories, 30 seeds,
every policy, paired per seed against `tangram`.

    python bench/sim_grid.py [--workloads coding,deepsearch,multireward,...]  (default: every built-in)
        [--loads 128,256,512,1024,2048] [--seeds 30] [--jobs 2] [--tie 0.5]
        [--json rows.json] [--markdown docs/results/grid.md]

Each (workload, load, seed) samples one step and runs it under every policy (common random
numbers: all policies see the same trajectories, run times and noise). Per cell (workload,
load) and other policy P, for mean ACT, step duration and p99 ACT: the mean over seeds of
the paired margin (P - tangram) / P in percent (positive: tangram lower) and how many seeds
tangram wins, ties (within --tie percent) and loses. A cell "holds" for a metric when the
mean paired margin against every other policy is at least -tie: tangram is best there or
tied with the best. The summary counts the cells that hold. Last, per cell, tangram's mean
ACT over the zero-wait bound and over the capacity bound (tangram.sim.bounds), and its step
over the step bound (tangram.sim.bounds: bound_schedule), mean over seeds, and every
policy's mean ACT over the capacity bound. Last, every policy's ratio to the exact optima
of small instances (bench/exact_optima.py).

About 60 s per seed for the five workloads at the five loads on one core here (coding and
deepsearch at 2,048 trajectories are most of it); --jobs spreads seeds over processes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool

import numpy as np

from tangram.sim.bounds import step_bounds
from tangram.sim.engine import POLICY_NAMES, StepSimulation
from tangram.sim.workloads import builtin, builtin_names

try:
    from bench import exact_optima
except ImportError:  # run as a script: bench/ is its own directory
    import exact_optima  # type: ignore[no-redef]

OPTIMA_INSTANCES = 60

METRICS = (("avg_act", "mean ACT"), ("step_duration", "step duration"), ("p99_act", "p99 ACT"))


def run_cell_seed(task: tuple[str, int, int]) -> list[dict]:
    """Every policy on one sampled step: one row per policy."""
    name, load, seed = task
    w = builtin(name).with_batch(load)
    step = w.sample(seed)
    bounds = step_bounds(w, step)  # the same for every policy
    rows = []
    for policy in POLICY_NAMES:
        row = StepSimulation(w, policy, step, seed, bounds=bounds).run(check=False).row()
        rows.append({key: row[key] for key in ("workload", "load", "seed", "policy", "avg_act", "p99_act",
                                               "step_duration", "lower_bound_act", "capacity_bound_act", "step_bound",
                                               "rejected")})
    return rows


def summarise(rows: list[dict], tie: float) -> dict:
    """Per (workload, load) cell: per metric and other policy, the mean paired margin, its
    worst seed and the win/tie/loss counts; whether the cell holds per metric."""
    cells: dict[tuple[str, int], dict] = {}
    by_cell: dict[tuple[str, int], dict[str, dict[int, dict]]] = {}
    for r in rows:
        by_cell.setdefault((r["workload"], r["load"]), {}).setdefault(r["policy"], {})[r["seed"]] = r
    for key, policies in sorted(by_cell.items()):
        ours = policies["tangram"]
        cell: dict = {"seeds": len(ours)}
        for metric, _ in METRICS:
            per_policy = {}
            for other in POLICY_NAMES:
                if other == "tangram":
                    continue
                theirs = policies[other]
                m = np.array([(theirs[s][metric] - ours[s][metric]) / theirs[s][metric] * 100 for s in sorted(ours)])
                per_policy[other] = {
                    "mean": float(m.mean()), "worst": float(m.min()),
                    "win": int((m > tie).sum()), "tie": int((np.abs(m) <= tie).sum()), "loss": int((m < -tie).sum()),
                }
            cell[metric] = {"policies": per_policy, "holds": all(v["mean"] >= -tie for v in per_policy.values())}
        cell["act_to_bound"] = float(np.mean([r["avg_act"] / r["lower_bound_act"] for r in ours.values()]))
        cell["act_to_capacity_bound"] = float(np.mean([r["avg_act"] / r["capacity_bound_act"] for r in ours.values()]))
        cell["step_to_bound"] = float(np.mean([r["step_duration"] / r["step_bound"] for r in ours.values()]))
        cell["capacity_bound_ratio"] = {
            p: float(np.mean([r["avg_act"] / r["capacity_bound_act"] for r in policies[p].values()]))
            for p in POLICY_NAMES}
        cells[key] = cell
    return cells


TRADE_OFF = 5.0  # percent: a lower mean ACT bought with a step or p99 worse by more than this is a trade-off


def better_elsewhere(cells: dict, tie: float) -> list[dict]:
    """Each (cell, other policy) where the other policy's step is lower by more than `tie`
    percent, or its mean ACT is, with a trade-off or without: the mean paired margins (the
    other policy buys a lower mean ACT with a trade-off when its step or p99 margin is at
    least TRADE_OFF percent, i.e. they are that much longer)."""
    found = []
    for (name, load), c in cells.items():
        for other, act in c["avg_act"]["policies"].items():
            step = c["step_duration"]["policies"][other]["mean"]
            p99 = c["p99_act"]["policies"][other]["mean"]
            if step < -tie or act["mean"] < -tie:
                found.append({"workload": name, "load": load, "policy": other, "avg_act": act["mean"], "step": step,
                              "p99": p99, "trade_off": step >= -tie and max(step, p99) >= TRADE_OFF})
    return found


def markdown(cells: dict, tie: float, seeds: int, command: str, optima: list[dict]) -> str:
    others = [p for p in POLICY_NAMES if p != "tangram"]
    out = ["# The policy grid", "",
           f"Produced by `{command}`. Every built-in workload at each load (trajectories per step), "
           f"seeds 0 to {seeds - 1}, every policy on the same sampled steps. Each entry: the mean over "
           f"seeds of the paired margin (policy - `tangram`) / policy in percent (positive: `tangram` "
           f"lower), then how many seeds `tangram` wins / ties (within {tie}%) / loses. A cell holds "
           f"when the mean margin against every policy is at least -{tie}% (marked yes).", ""]
    for metric, label in METRICS:
        held = sum(c[metric]["holds"] for c in cells.values())
        out += [f"## {label}", "", f"Cells that hold: {held} of {len(cells)}.", "",
                "| workload | load | " + " | ".join(f"vs `{p}`" for p in others) + " | holds |",
                "|---|---:|" + "---|" * len(others) + "---|"]
        for (name, load), c in cells.items():
            entries = []
            for p in others:
                v = c[metric]["policies"][p]
                entries.append(f"{v['mean']:+.2f} ({v['win']}/{v['tie']}/{v['loss']})")
            out.append(f"| {name} | {load} | " + " | ".join(entries) + f" | {'yes' if c[metric]['holds'] else 'no'} |")
        out.append("")
    found = better_elsewhere(cells, tie)
    losses = [f for f in found if not f["trade_off"]]
    out += ["## Where another policy is better", "",
            f"A cell and policy whose step is shorter than `tangram`'s by more than {tie}% (mean margin), "
            f"or whose mean ACT is lower by more than {tie}%. The second is a trade-off when that policy's "
            f"step or p99 ACT is longer than `tangram`'s by at least {TRADE_OFF:g}% (margin at least "
            f"+{TRADE_OFF:g}%); otherwise it is a loss. Losses: {len(losses)}; trade-offs: "
            f"{len(found) - len(losses)}.", ""]
    if found:
        out += ["| workload | load | policy | mean ACT | step | p99 ACT | |", "|---|---:|---|---:|---:|---:|---|"]
        for f in found:
            out.append(f"| {f['workload']} | {f['load']} | `{f['policy']}` | {f['avg_act']:+.2f} | {f['step']:+.2f} "
                       f"| {f['p99']:+.2f} | {'trade-off' if f['trade_off'] else 'loss'} |")
        out.append("")
    out += ["## `tangram` against the lower bounds", "",
            "Mean over seeds of `tangram`'s mean ACT over the zero-wait bound (every action at its best "
            "grant, no wait: it ignores capacity) and over the capacity bound (each sandbox node, reward "
            "service, the reward devices and each quota relaxed to one fluid machine, the trajectories' "
            "ends bounded through them: [findings.md](findings.md#the-lower-bounds)), and of its step over "
            "the step bound (the longest trajectory with no wait, and each resource's demand served at "
            "capacity).", "",
            "| workload | load | ACT / zero-wait bound | ACT / capacity bound | step / step bound |",
            "|---|---:|---:|---:|---:|"]
    for (name, load), c in cells.items():
        out.append(f"| {name} | {load} | {c['act_to_bound']:.3f} | {c['act_to_capacity_bound']:.3f} "
                   f"| {c['step_to_bound']:.3f} |")
    out += ["", "Every policy's mean ACT over the capacity bound (mean over seeds):", "",
            "| workload | load | " + " | ".join(f"`{p}`" for p in POLICY_NAMES) + " |",
            "|---|---:|" + "---:|" * len(POLICY_NAMES)]
    for (name, load), c in cells.items():
        out.append(f"| {name} | {load} | "
                   + " | ".join(f"{c['capacity_bound_ratio'][p]:.3f}" for p in POLICY_NAMES) + " |")
    out += ["", "## Against exact optima of small instances", "",
            f"`bench/exact_optima.py` (run here with {OPTIMA_INSTANCES} instances per family, seed 0): "
            "2 to 4 trajectories of 1 to 3 actions (at most 7 actions), drawn until the optimum waits "
            "somewhere, each solved exactly by enumeration; the optimum knows every arrival in advance, "
            "so an online policy cannot always reach it. Families: `rigid` (fixed cores on one node), "
            "`moldable` (some actions elastic; the optimum fixes each grant at its start, which "
            "`tangram`'s resizes can beat: a ratio under 1), `quota` (requests under a token bucket). "
            "Per family and policy: the ratio to the optimum's mean ACT and to the optimum's step (each "
            "minimised on its own), mean, 90th percentile and worst over the instances, and on how "
            "many the policy is optimal.", ""]
    out += exact_optima.markdown(optima)
    out.append("")
    return "\n".join(out)


def write_json(path: str, tie: float, rows: list[dict], cells: dict, optima: list[dict]) -> None:
    """One row per line (rows sorted), so a regenerated file diffs by row."""
    rows = sorted(rows, key=lambda r: (r["workload"], r["load"], r["seed"], r["policy"]))
    cell_rows = [{"workload": k[0], "load": k[1], **v} for k, v in cells.items()]
    with open(path, "w") as f:
        f.write(f'{{"tie_percent": {json.dumps(tie)},\n"exact_optima": {json.dumps(optima)},\n"cells": [\n')
        f.write(",\n".join(json.dumps(c) for c in cell_rows))
        f.write('\n],\n"rows": [\n')
        f.write(",\n".join(json.dumps(r) for r in rows))
        f.write("\n]}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(builtin_names()))
    ap.add_argument("--loads", default="128,256,512,1024,2048")
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--tie", type=float, default=0.5, help="percent within which two results tie")
    ap.add_argument("--json", default=None, help="write every (workload, load, seed, policy) row")
    ap.add_argument("--markdown", default=None, help="write the grid as a markdown page")
    args = ap.parse_args(argv)
    tasks = [(name, int(load), seed) for name in args.workloads.split(",") for load in args.loads.split(",")
             for seed in range(args.seeds)]
    t0 = time.time()
    rows: list[dict] = []

    def collect(parts) -> None:  # type: ignore[no-untyped-def]
        for i, part in enumerate(parts, 1):
            rows.extend(part)
            print(f"\r{i}/{len(tasks)} steps simulated", end="", file=sys.stderr, flush=True)

    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            collect(pool.imap_unordered(run_cell_seed, tasks))
    else:
        collect(map(run_cell_seed, tasks))
    print(f" ({time.time() - t0:.0f} s)", file=sys.stderr)
    cells = summarise(rows, args.tie)
    command = "python bench/sim_grid.py " + " ".join(argv if argv is not None else sys.argv[1:])
    optima = exact_optima.summary(exact_optima.run(OPTIMA_INSTANCES, seed=0))
    page = markdown(cells, args.tie, args.seeds, command.strip(), optima)
    print(page)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(page + "\n")
    if args.json:
        write_json(args.json, args.tie, rows, cells, optima)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
