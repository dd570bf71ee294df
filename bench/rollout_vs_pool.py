"""A coding rollout of real programs: tangram against the process pool a user would write.

    python bench/rollout_vs_pool.py [--trajectories 8 32] [--repeat 3] [--aging A]
        [--runtimes declared|learned] [--sandboxes trajectory|pooled] [--pace] [--json PATH]

Each trajectory alternates "generation" (a seeded 20-120 ms sleep, the policy model) with a
tool call, over `--turns` turns:
  run    one program, run once (a fresh interpreter namespace in a long-lived process)
  suite  a bundle of 8 programs, an elastic test suite: run by as many processes as its
         grant allows
The programs are CPU-bound Python of our own making (primes, merge sort, matrix product,
Collatz, N-queens, edit distance; 5-300 ms each here; bench/rollout_programs.py, a light
module every worker process imports, as a user's tool module would be); each checks its
own result against an independent computation, and this script checks every result
against the value from a calibration run. A wrong or missing result fails the run.

Three ways to run the same rollout, interleaved in every repetition, in this one process:
  pool        asyncio + concurrent.futures.ProcessPoolExecutor with one worker per core
              (started before the step, like a rollout server's); a suite is its 8 programs
              submitted to the pool at once. No scheduling, no sandboxes, no limits.
  tangram     the orchestrator (policy `tangram`, CPU manager with its defaults: grants are
              guarantees, running elastic actions are resized; a warm worker per
              trajectory, started before the step; with `--sandboxes pooled` every
              call is pooled instead, Call.pooled: the programs keep no state between
              calls, so a call runs in any idle sandbox, taken as it starts, and the
              sandboxes are as many as actions run at once). A run is an elastic action
              from the minimum demand up to one core (a single-threaded program); a suite an
              elastic action from the same minimum up to every core, run by
              `tangram.worker.shared_executor()` in the trajectory's sandbox.
  tangram-process  tangram with its sandboxes as bare processes (isolation="process"):
              against `tangram` (namespaced sandboxes, the default) it prices the
              isolation boundary (`--ways tangram tangram-process`).
  trajectory  the fixed-sandbox-per-trajectory baseline: policy `trajectory`, each
              trajectory a slot of cores/trajectories, enforced as a hard ceiling
              (cpu_limit="ceiling"), the way a container per trajectory is limited.
The minimum demand of every action is the trajectory baseline's slot (cores/trajectories, down
to a whole milli-core so that every trajectory has one),
so every policy runs the same calls. Run times are declared from the calibration (what a
user measures: one program's time on one core), as Amdahl models: a run's is perfectly
parallel up to its one core, a suite's 95% parallel. With `--runtimes learned` the calls
declare none, as a user who measured nothing writes them: each run starts cold and plans
with what it learns from its own finished actions (tangram.estimates: one estimate
for every run, one for every suite). With `--pace`, tangram's calls carry a priority that
keeps the trajectories at one pace (Call.priority: minus the calls the trajectory has made,
so the calls of the trajectories furthest behind go first), as the pool's arrival order does.

Reports per way and trajectory count: average, p50 and p99 ACT (action completion time:
from the call to its result), step duration (the rollout's wall time, from the first call
to the last result), throughput (actions per second of step) and how busy the cores were
with programs: "cores busy", the time integral of min(programs running, cores) over step
x cores (what a way leaves idle, in hand-overs and in the step's tail), and "program CPU",
the programs' CPU seconds over the same (which also counts what other processes took from
them); as medians over the repetitions, and the ratios the targets are stated in. The
machine's speed moves these two less than it moves the times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollout_programs import PROGRAMS, TIMELINE, run_program, run_suite
from tangram import Amdahl, Call, Orchestrator
from tangram.runtime.config import RuntimeConfig
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.sandbox.isolation import descendants

SUITE_SIZE = 8


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
    busy: float = 0.0  # core-seconds with a program running on them / (step x cores)
    program_cpu: float = 0.0  # programs' CPU seconds / (step x cores)

    def summary(self) -> dict[str, float]:
        acts = sorted(self.acts)
        return {"mean_act": statistics.fmean(acts), "p50_act": acts[len(acts) // 2],
                "p99_act": acts[min(len(acts) - 1, int(0.99 * len(acts)))], "step": self.step,
                "throughput": len(acts) / self.step, "busy": self.busy, "program_cpu": self.program_cpu}

    def read_timeline(self, path: str, cores: int) -> None:
        with open(path) as f:
            rows = [tuple(map(float, line.split())) for line in f if line.strip()]
        os.unlink(path)
        events = sorted([(start, 1) for start, _, _ in rows] + [(end, -1) for _, end, _ in rows])
        running, last, covered = 0, 0.0, 0.0
        for t, step in events:  # the time integral of min(programs running, cores)
            if running:
                covered += (t - last) * min(running, cores)
            running, last = running + step, t
        self.busy = covered / (self.step * cores)
        self.program_cpu = sum(cpu for _, _, cpu in rows) / (self.step * cores)


SANDBOX_TIMELINE = ".rollout-timeline"  # in each sandbox's directory


def new_timeline() -> str:
    """An empty file for one run's programs to append to."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="rollout-timeline-")
    os.close(fd)
    return path


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
    timeline = new_timeline()
    os.environ[TIMELINE] = timeline  # the pool's workers inherit it as they start
    try:
        with ProcessPoolExecutor(cores) as pool:
            await asyncio.gather(*(loop.run_in_executor(pool, int) for _ in range(4 * cores)))  # started

            async def act(t: int, turn: Turn) -> list[Any]:
                return list(await asyncio.gather(*(loop.run_in_executor(pool, run_program, p.source)
                                                   for p in turn.programs)))
            await rollout(plans, act, run)
    finally:
        del os.environ[TIMELINE]
    run.read_timeline(timeline, cores)
    return run


async def warm_workers_idle(mgr: CpuManager) -> None:
    """Until every warm worker has started and waits (its CPU time stands still)."""
    def cpu_times() -> list[int]:
        out = []
        for pid in (p for w in mgr.warm_processes() for p in (w, *descendants(w))):  # namespaced: bwrap's grandchild
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.append(int(fields[11]) + int(fields[12]))
        return out
    last: list[int] = []
    while len(mgr.warm_processes()) < mgr.warm_sandboxes or cpu_times() != last:
        last = cpu_times()
        await asyncio.sleep(0.1)


async def with_tangram(plans: list[list[Turn]], cores: int, policy: str, cpu_limit: str, label: str,
                       aging: float | None = None, learned: bool = False, pooled: bool = False,
                       pace: bool = False, isolation: str = "auto") -> Run:
    run = Run(label, len(plans))
    slot = math.floor(cores * 1000 / len(plans)) / 1000  # in whole milli-cores: n slots fit the node
    options: dict[str, float] = {"trajectory_slot_cpu": slot} if policy == "trajectory" else {}
    if aging is not None and policy == "tangram":
        options["aging"] = aging
    # A warm worker per trajectory, started before the step as the pool's workers are.
    timeline = new_timeline()
    config = RuntimeConfig(policy=policy, policy_options=options,
                           managers={"cpu": {"cpu_limit": cpu_limit, "warm_sandboxes": len(plans),
                                             "env": {TIMELINE: SANDBOX_TIMELINE}, "isolation": isolation}})
    async with Orchestrator(config) as orch:
        await warm_workers_idle(orch.managers["cpu"])  # type: ignore[arg-type]
        calls_made = [0] * len(plans)

        async def act(t: int, turn: Turn) -> list[Any]:
            seconds = sum(p.seconds for p in turn.programs)
            calls_made[t] += 1
            priority = -calls_made[t] if pace else 0
            if len(turn.programs) == 1:
                call = Call(fn=run_program, args=(turn.programs[0].source,), resources={"cpu": slot},
                            elastic="cpu", max_units=max(slot, 1.0),
                            runtime=None if learned else Amdahl.from_one_unit(seconds, 1.0, slot), trajectory=t, kind="run",
                            pooled=pooled, priority=priority)
                return [await orch.run(call)]
            call = Call(fn=run_suite, args=([p.source for p in turn.programs],), resources={"cpu": slot},
                        elastic="cpu", max_units=float(cores),
                        runtime=None if learned else Amdahl.from_one_unit(seconds, 0.95, slot), trajectory=t, kind="suite",
                        pooled=pooled, priority=priority)
            return await orch.run(call)
        await rollout(plans, act, run)
        cpu = orch.managers["cpu"]
        with open(timeline, "ab") as out:  # each sandbox's lines (a sandbox sees only its own directory)
            for key in list(cpu._sandboxes):  # type: ignore[attr-defined]
                try:
                    with open(os.path.join(cpu.sandbox_dir(key), SANDBOX_TIMELINE), "rb") as f:  # type: ignore[attr-defined]
                        out.write(f.read())
                except OSError:
                    pass
        for t in range(len(plans)):
            await orch.end_trajectory(t)
    run.read_timeline(timeline, cores)
    return run


WAYS = ("pool", "tangram", "trajectory", "tangram-process")
DEFAULT_WAYS = ("pool", "tangram", "trajectory")


async def repetition(plans: list[list[Turn]], cores: int, ways: tuple[str, ...], aging: float | None,
                     learned: bool = False, pooled: bool = False, pace: bool = False) -> list[Run]:
    runs = []
    for way in ways:
        if way == "pool":
            runs.append(await with_pool(plans, cores))
        elif way == "tangram":
            runs.append(await with_tangram(plans, cores, "tangram", "guarantee", way, aging, learned, pooled, pace))
        elif way == "trajectory":
            runs.append(await with_tangram(plans, cores, "trajectory", "ceiling", way, learned=learned))
        elif way == "tangram-process":
            runs.append(await with_tangram(plans, cores, "tangram", "guarantee", way, aging, learned, pooled, pace,
                                           isolation="process"))
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
        "turns": args.turns, "repeat": args.repeat, "tangram_aging": args.aging, "runtimes": args.runtimes,
        "sandboxes": args.sandboxes, "pace": args.pace,
        "results": {}}
    for n in args.trajectories:
        plans = workload(catalog, n, args.turns, args.seed)
        runs: dict[str, list[Run]] = {w: [] for w in args.ways}
        for rep in range(args.repeat):
            order = list(args.ways[rep % len(args.ways):] + args.ways[:rep % len(args.ways)])  # rotate who goes first
            for r in await repetition(plans, cores, tuple(order), args.aging, args.runtimes == "learned",
                                      args.sandboxes == "pooled", args.pace):
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
        if "tangram-process" in cell and "tangram" in cell:
            cell["namespaces_vs_process"] = {"mean_act": cell["tangram"]["mean_act"] / cell["tangram-process"]["mean_act"],
                                             "step": cell["tangram"]["step"] / cell["tangram-process"]["step"]}
        if "trajectory" in cell and "tangram" in cell:
            cell["trajectory_over_tangram_mean_act"] = cell["trajectory"]["mean_act"] / cell["tangram"]["mean_act"]
        out["results"][str(n)] = cell
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"coding rollout on {r['machine']['cpus']} CPUs: {r['turns']} turns per trajectory, "
             f"{r['programs']['count']} programs of {1e3 * r['programs']['seconds_min']:.0f}-"
             f"{1e3 * r['programs']['seconds_max']:.0f} ms, medians of {r['repeat']} repetitions" +
             (f"; tangram's aging {r['tangram_aging']}" if r.get("tangram_aging") is not None else "") +
             ("; run times learned, not declared" if r.get("runtimes") == "learned" else "") +
             ("; tangram's calls paced by trajectory" if r.get("pace") else ""), "",
             "| trajectories | way | mean ACT | p50 ACT | p99 ACT | step | actions/s | cores busy | program CPU |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, cell in r["results"].items():
        for way in WAYS:
            if way in cell:
                s = cell[way]
                lines.append(f"| {n} | {way} | {s['mean_act']:.3f} s | {s['p50_act']:.3f} s | {s['p99_act']:.3f} s | "
                             f"{s['step']:.2f} s | {s['throughput']:.1f} | {100 * s['busy']:.1f}% | "
                             f"{100 * s['program_cpu']:.1f}% |")
    lines.append("")
    for n, cell in r["results"].items():
        if "tangram_vs_pool" in cell:
            v = cell["tangram_vs_pool"]
            lines.append(f"{n} trajectories: tangram/pool mean ACT {v['mean_act']:.2f}x, step {v['step']:.2f}x" +
                         (f"; trajectory/tangram mean ACT {cell['trajectory_over_tangram_mean_act']:.2f}x"
                          if "trajectory_over_tangram_mean_act" in cell else ""))
        if "namespaces_vs_process" in cell:
            v = cell["namespaces_vs_process"]
            lines.append(f"{n} trajectories: tangram with namespaced sandboxes / with bare processes: mean ACT "
                         f"{v['mean_act']:.3f}x, step {v['step']:.3f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(DEFAULT_WAYS))
    parser.add_argument("--aging", type=float, help="the tangram policy's aging (default: the policy's own)")
    parser.add_argument("--runtimes", choices=("declared", "learned"), default="declared",
                        help="declared: calls carry the calibrated run times (default); learned: they carry none")
    parser.add_argument("--sandboxes", choices=("trajectory", "pooled"), default="trajectory",
                        help="tangram's calls run in their trajectory's sandbox (default) or in pooled ones "
                             "(Call.pooled: the programs keep no state between calls)")
    parser.add_argument("--pace", action="store_true",
                        help="tangram's calls go first for the trajectories that have made the fewest "
                             "(Call.priority), keeping the trajectories at one pace")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.ways = tuple(args.ways)
    results = asyncio.run(main(args))
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
