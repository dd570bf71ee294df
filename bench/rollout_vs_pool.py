"""A coding rollout of real programs: tangram against the process pool a user would write.

    python bench/rollout_vs_pool.py [--trajectories 8 32] [--repeat 3] [--json PATH]

Each trajectory alternates "generation" (a seeded 20-120 ms sleep, the policy model) with a
tool call, over `--turns` turns:
  run    one program, run once (a fresh interpreter namespace in a long-lived process)
  suite  a bundle of 8 programs, an elastic test suite: run by as many processes as its
         grant allows
The programs are CPU-bound Python of our own making (primes, merge sort, matrix product,
Collatz, N-queens, edit distance; 10-150 ms each here); each checks its own result against
an independent computation, and this script checks every result against the value from a
calibration run. A wrong or missing result fails the run.

Three ways to run the same rollout, interleaved in every repetition, in this one process:
  pool        asyncio + concurrent.futures.ProcessPoolExecutor with one worker per core
              (started before the step, like a rollout server's); a suite is its 8 programs
              submitted to the pool at once. No scheduling, no sandboxes, no limits.
  tangram     the orchestrator (policy `tangram`, CPU manager with its defaults: grants are
              guarantees, running elastic actions are resized). A run is an elastic action
              from the minimum demand up to one core (a single-threaded program); a suite an
              elastic action from the same minimum up to every core, run by
              `tangram.worker.shared_executor()` in the trajectory's sandbox.
  trajectory  the fixed-sandbox-per-trajectory baseline: policy `trajectory`, each
              trajectory a slot of cores/trajectories, enforced as a hard ceiling
              (cpu_limit="ceiling"), the way a container per trajectory is limited.
The minimum demand of every action is the trajectory baseline's slot (cores/trajectories),
so every policy runs the same calls. Run times are declared from the calibration (what a
user measures: one program's time on one core), as Amdahl models: a run's is perfectly
parallel up to its one core, a suite's 95% parallel.

Reports per way and trajectory count: average, p50 and p99 ACT (action completion time:
from the call to its result), step duration (the rollout's wall time, from the first call
to the last result) and throughput (actions per second of step), as medians over the
repetitions, and the ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tangram import Amdahl, Call, Orchestrator
from tangram.runtime.config import RuntimeConfig

SUITE_SIZE = 8

# Each program sets `result` after asserting it against an independent computation.
PROGRAMS = {
    "primes": (
        "def is_prime(k):\n    if k < 2:\n        return False\n    d = 2\n    while d * d <= k:\n"
        "        if k % d == 0:\n            return False\n        d += 1\n    return True\n"
        "n = {n}\ncount = sum(1 for k in range(n) if is_prime(k))\n"
        "marks = bytearray([1]) * n\nmarks[0:2] = b'\\x00\\x00'\n"
        "for p in range(2, int(n ** 0.5) + 1):\n    if marks[p]:\n        marks[p*p::p] = bytes(len(range(p*p, n, p)))\n"
        "assert count == sum(marks), (count, sum(marks))\nresult = count\n", (8_000, 16_000, 30_000, 50_000)),
    "mergesort": (
        "def msort(a):\n    if len(a) < 2:\n        return a\n    m = len(a) // 2\n    l, r = msort(a[:m]), msort(a[m:])\n"
        "    out, i, j = [], 0, 0\n    while i < len(l) and j < len(r):\n        if l[i] <= r[j]:\n"
        "            out.append(l[i]); i += 1\n        else:\n            out.append(r[j]); j += 1\n"
        "    return out + l[i:] + r[j:]\n"
        "x, data = {n}, []\nfor _ in range({n}):\n    x = (x * 1103515245 + 12345) % 2147483648\n    data.append(x)\n"
        "got = msort(data)\nassert got == sorted(data)\nresult = got[len(got) // 2]\n", (5_000, 10_000, 18_000, 28_000)),
    "matmul": (
        "n = {n}\nA = [[(i * 7 + j * 3) % 11 for j in range(n)] for i in range(n)]\n"
        "B = [[(i * 5 + j) % 13 for j in range(n)] for i in range(n)]\n"
        "C = [[sum(A[i][k] * B[k][j] for k in range(n)) for j in range(n)] for i in range(n)]\n"
        "Bv = [sum(row) for row in B]\n"
        "assert [sum(row) for row in C] == [sum(A[i][k] * Bv[k] for k in range(n)) for i in range(n)]\n"
        "result = sum(C[i][i] for i in range(n))\n", (30, 40, 50, 60)),
    "collatz": (
        "def steps(k):\n    s = 0\n    while k != 1:\n        k = k // 2 if k % 2 == 0 else 3 * k + 1\n        s += 1\n"
        "    return s\nn = {n}\nbest = max(range(1, n), key=steps)\nmemo = {{1: 0}}\n"
        "def steps2(k):\n    path = []\n    while k not in memo:\n        path.append(k)\n"
        "        k = k // 2 if k % 2 == 0 else 3 * k + 1\n    s = memo[k]\n    for v in reversed(path):\n"
        "        s += 1\n        memo[v] = s\n    return s\n"
        "assert steps(best) == max(steps2(k) for k in range(1, n))\nresult = best\n", (2_000, 4_000, 7_000, 10_000)),
    "queens": (
        "def solve(n, row=0, cols=0, d1=0, d2=0):\n    if row == n:\n        return 1\n    total = 0\n"
        "    for c in range(n):\n        if not (cols >> c) & 1 and not (d1 >> (row + c)) & 1 and not (d2 >> (row - c + n)) & 1:\n"
        "            total += solve(n, row + 1, cols | 1 << c, d1 | 1 << (row + c), d2 | 1 << (row - c + n))\n"
        "    return total\nn = {n}\nresult = solve(n)\n"
        "assert result == [1, 1, 0, 0, 2, 10, 4, 40, 92, 352, 724, 2680][n]\n", (10, 11)),
    "editdist": (
        "def dist(a, b):\n    prev = list(range(len(b) + 1))\n    for i, ca in enumerate(a, 1):\n        cur = [i]\n"
        "        for j, cb in enumerate(b, 1):\n            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))\n"
        "        prev = cur\n    return prev[-1]\n"
        "n = {n}\na = ''.join('acgt'[(i * i + 3) % 4] for i in range(n))\n"
        "b = ''.join('acgt'[(i * 7 + 1) % 4] for i in range(n))\nd = dist(a, b)\n"
        "assert d == dist(b, a) and abs(len(a) - len(b)) <= d <= max(len(a), len(b))\nresult = d\n", (120, 200, 280, 350)),
}


def run_program(source: str) -> Any:
    """Runs one program in a fresh namespace and returns its checked `result`."""
    namespace: dict[str, Any] = {"__name__": "__program__"}
    exec(compile(source, "<program>", "exec"), namespace)
    return namespace["result"]


def run_suite(sources: list[str]) -> list[Any]:
    """A test suite inside a tangram sandbox: its programs on the sandbox's process pool,
    which runs as many at once as the action's live grant."""
    from tangram.worker import shared_executor
    return list(shared_executor().map(run_program, sources))


# ---------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Program:
    source: str
    seconds: float  # calibrated: its time on one core
    result: Any


@dataclass(frozen=True)
class Turn:
    think: float
    programs: tuple[Program, ...]  # one: a run; SUITE_SIZE: a suite


def calibrate() -> list[Program]:
    catalog = []
    for template, sizes in PROGRAMS.values():
        for n in sizes:
            source = template.format(n=n)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                result = run_program(source)
                times.append(time.perf_counter() - start)
            catalog.append(Program(source, min(times), result))
    return catalog


def workload(catalog: list[Program], trajectories: int, turns: int, seed: int) -> list[list[Turn]]:
    rng = random.Random(seed)
    out = []
    for _ in range(trajectories):
        plan = []
        for _ in range(turns):
            think = rng.uniform(0.02, 0.12)
            if rng.random() < 0.4:
                plan.append(Turn(think, tuple(rng.choice(catalog) for _ in range(SUITE_SIZE))))
            else:
                plan.append(Turn(think, (rng.choice(catalog),)))
        out.append(plan)
    return out


# ---------------------------------------------------------------- the ways to run it
@dataclass
class Run:
    way: str
    trajectories: int
    acts: list[float] = field(default_factory=list)
    step: float = 0.0
    wrong: int = 0

    def summary(self) -> dict[str, float]:
        acts = sorted(self.acts)
        return {"mean_act": statistics.fmean(acts), "p50_act": acts[len(acts) // 2],
                "p99_act": acts[min(len(acts) - 1, int(0.99 * len(acts)))], "step": self.step,
                "throughput": len(acts) / self.step}


async def rollout(plans: list[list[Turn]], act: Any, run: Run) -> None:
    async def trajectory(t: int) -> None:
        for turn in plans[t]:
            await asyncio.sleep(turn.think)
            start = time.perf_counter()
            got = await act(t, turn)
            run.acts.append(time.perf_counter() - start)
            expected = [p.result for p in turn.programs]
            if got != expected:
                run.wrong += 1
    start = time.perf_counter()
    await asyncio.gather(*(trajectory(t) for t in range(len(plans))))
    run.step = time.perf_counter() - start


async def with_pool(plans: list[list[Turn]], cores: int) -> Run:
    run = Run("pool", len(plans))
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(cores) as pool:
        await asyncio.gather(*(loop.run_in_executor(pool, int) for _ in range(4 * cores)))  # started

        async def act(t: int, turn: Turn) -> list[Any]:
            return list(await asyncio.gather(*(loop.run_in_executor(pool, run_program, p.source)
                                               for p in turn.programs)))
        await rollout(plans, act, run)
    return run


async def with_tangram(plans: list[list[Turn]], cores: int, policy: str, cpu_limit: str, label: str) -> Run:
    run = Run(label, len(plans))
    slot = cores / len(plans)
    options = {"trajectory_slot_cpu": slot} if policy == "trajectory" else {}
    config = RuntimeConfig(policy=policy, policy_options=options, managers={"cpu": {"cpu_limit": cpu_limit}})
    async with Orchestrator(config) as orch:
        await asyncio.sleep(0.5)  # the warm workers are up, as they are between steps

        async def act(t: int, turn: Turn) -> list[Any]:
            seconds = sum(p.seconds for p in turn.programs)
            if len(turn.programs) == 1:
                call = Call(fn=run_program, args=(turn.programs[0].source,), resources={"cpu": slot},
                            elastic="cpu", max_units=max(slot, 1.0), runtime=Amdahl(seconds / slot, 1.0),
                            trajectory=t, kind="run")
                return [await orch.run(call)]
            call = Call(fn=run_suite, args=([p.source for p in turn.programs],), resources={"cpu": slot},
                        elastic="cpu", max_units=float(cores), runtime=Amdahl(seconds / slot, 0.95),
                        trajectory=t, kind="suite")
            return await orch.run(call)
        await rollout(plans, act, run)
        for t in range(len(plans)):
            await orch.end_trajectory(t)
    return run


WAYS = ("pool", "tangram", "trajectory")


async def repetition(plans: list[list[Turn]], cores: int, ways: tuple[str, ...]) -> list[Run]:
    runs = []
    for way in ways:
        if way == "pool":
            runs.append(await with_pool(plans, cores))
        elif way == "tangram":
            runs.append(await with_tangram(plans, cores, "tangram", "guarantee", way))
        elif way == "trajectory":
            runs.append(await with_tangram(plans, cores, "trajectory", "ceiling", way))
    return runs


def median_summary(runs: list[Run]) -> dict[str, float]:
    summaries = [r.summary() for r in runs]
    return {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    catalog = calibrate()
    out: dict[str, Any] = {
        "machine": {"cpus": cores, "python": platform.python_version()},
        "programs": {"count": len(catalog), "seconds_min": min(p.seconds for p in catalog),
                     "seconds_max": max(p.seconds for p in catalog)},
        "turns": args.turns, "repeat": args.repeat, "results": {}}
    for n in args.trajectories:
        plans = workload(catalog, n, args.turns, args.seed)
        runs: dict[str, list[Run]] = {w: [] for w in args.ways}
        for rep in range(args.repeat):
            order = list(args.ways[rep % len(args.ways):] + args.ways[:rep % len(args.ways)])  # rotate who goes first
            for r in await repetition(plans, cores, tuple(order)):
                if r.wrong:
                    raise SystemExit(f"{r.way}: {r.wrong} wrong results with {n} trajectories")
                runs[r.way].append(r)
                print(f"  {n} trajectories, repetition {rep + 1}, {r.way}: " +
                      ", ".join(f"{k} {v:.3f}" for k, v in r.summary().items()), file=sys.stderr)
        cell = {w: median_summary(rs) for w, rs in runs.items()}
        cell["repetitions"] = {w: [r.summary() for r in rs] for w, rs in runs.items()}
        if "pool" in cell and "tangram" in cell:
            cell["tangram_vs_pool"] = {"mean_act": cell["tangram"]["mean_act"] / cell["pool"]["mean_act"],
                                       "step": cell["tangram"]["step"] / cell["pool"]["step"]}
        if "trajectory" in cell and "tangram" in cell:
            cell["trajectory_over_tangram_mean_act"] = cell["trajectory"]["mean_act"] / cell["tangram"]["mean_act"]
        out["results"][str(n)] = cell
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"coding rollout on {r['machine']['cpus']} CPUs: {r['turns']} turns per trajectory, "
             f"{r['programs']['count']} programs of {1e3 * r['programs']['seconds_min']:.0f}-"
             f"{1e3 * r['programs']['seconds_max']:.0f} ms, medians of {r['repeat']} repetitions", "",
             "| trajectories | way | mean ACT | p50 ACT | p99 ACT | step | actions/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for n, cell in r["results"].items():
        for way in WAYS:
            if way in cell:
                s = cell[way]
                lines.append(f"| {n} | {way} | {s['mean_act']:.3f} s | {s['p50_act']:.3f} s | {s['p99_act']:.3f} s | "
                             f"{s['step']:.2f} s | {s['throughput']:.1f} |")
    lines.append("")
    for n, cell in r["results"].items():
        if "tangram_vs_pool" in cell:
            v = cell["tangram_vs_pool"]
            lines.append(f"{n} trajectories: tangram/pool mean ACT {v['mean_act']:.2f}x, step {v['step']:.2f}x" +
                         (f"; trajectory/tangram mean ACT {cell['trajectory_over_tangram_mean_act']:.2f}x"
                          if "trajectory_over_tangram_mean_act" in cell else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.ways = tuple(args.ways)
    results = asyncio.run(main(args))
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
