"""How the CPU manager enforces a grant: guarantees (weights) against ceilings (quotas).

    python bench/cpu_grants.py [--repeat 5] [--json bench/results/cpu_grants-2core.json]

Runs the CPU manager directly (no scheduler), with real processes, and measures:

  idle node    one CPU-bound program (a fixed amount of Python work), alone on the machine:
               as a bare subprocess, and as an action granted 0.25 cores under each
               `cpu_limit`. Median wall time, and its ratio to the bare subprocess.
  contention   two actions granted 1.5 and 0.5 cores, each running as many busy processes
               as there are CPUs, all spinning over one shared window of wall time, so every
               CPU is wanted: the CPU seconds each one got in it, and their ratio (the
               grants' ratio is 3).
  cold start   a new trajectory's first action (a no-op function) at grants of 0.0625,
               0.25 and 1 core, with warm workers and without (warm_sandboxes=0): median
               time from execute to its result.
  resize       manager time of one `resize` of a running action (cgroup writes, the grant
               file, jobserver tokens), alternating 1 and 2 cores: median and p99.

Every measurement of one kind is interleaved across the variants it compares, `--repeat`
times, in this one process. Needs a writable cgroup for the weights and quotas (under the
affinity fallback both limits run the same way and the table says so).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from tangram.runtime.call import Call, Placement
from tangram.runtime.managers.cpu import CPU_LIMITS, CpuManager
from tangram.runtime.managers.base import LiveAction

_ids = itertools.count(1)
# A fixed amount of work (about 0.4 s of one core here), checked: a wrong sum fails the run.
WORK = ("s = 0\nfor i in range({n}):\n    s += i * i % 7\n"
        "assert s == {expected}, s\n")
WORK_N = 3_000_000
# Busy over one window of wall time shared by every process of a round (from `start`, an
# absolute time.time(), for `seconds`), then print the CPU seconds this process got in it.
BUSY = ("import time\nstart, end = {start}, {start} + {seconds}\nwhile time.time() < start: pass\n"
        "cpu = time.process_time()\nwhile time.time() < end: pass\nprint(time.process_time() - cpu)\n")


def work_program() -> str:
    return WORK.format(n=WORK_N, expected=sum(i * i % 7 for i in range(WORK_N)))


def placement(cores: float) -> Placement:
    return Placement(0, 0, "local", None, cores, cores, 0.0, 0.0, {})


async def run(mgr: CpuManager, call: Call, cores: float) -> Any:
    return await mgr.execute(LiveAction(next(_ids), call), placement(cores))


async def bare(program: str) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", program)
    assert await proc.wait() == 0
    return time.perf_counter() - start


async def timed(mgr: CpuManager, program: str, cores: float, trajectory: int) -> float:
    start = time.perf_counter()
    r = await run(mgr, Call(command=[sys.executable, "-c", program], trajectory=trajectory), cores)
    assert r.returncode == 0, r.stderr
    return time.perf_counter() - start


async def idle_node(managers: dict[str, CpuManager], repeat: int) -> dict[str, Any]:
    program = work_program()
    times: dict[str, list[float]] = {"bare subprocess": []} | {f"{k}, 0.25 core": [] for k in managers}
    for _ in range(repeat):
        times["bare subprocess"].append(await bare(program))
        for limit, mgr in managers.items():
            times[f"{limit}, 0.25 core"].append(await timed(mgr, program, 0.25, 1))
    base = statistics.median(times["bare subprocess"])
    return {k: {"median_s": statistics.median(v), "vs_bare": statistics.median(v) / base} for k, v in times.items()}


async def contention(managers: dict[str, CpuManager], repeat: int, seconds: float) -> dict[str, Any]:
    n = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {}
    for limit, mgr in managers.items():
        ratios, big, small = [], [], []
        for _ in range(repeat):
            # both actions' processes start, then all spin over the same window (1 s ahead)
            busy = BUSY.format(start=time.time() + 1.0, seconds=seconds)
            program = "; ".join([
                "import subprocess, sys",
                f"ps = [subprocess.Popen([sys.executable, '-c', {busy!r}], stdout=subprocess.PIPE) for _ in range({n})]",
                "print(sum(float(p.communicate()[0]) for p in ps))"])
            a, b = await asyncio.gather(run(mgr, Call(command=[sys.executable, "-c", program], trajectory=1), 1.5),
                                        run(mgr, Call(command=[sys.executable, "-c", program], trajectory=2), 0.5))
            ca, cb = float(a.stdout), float(b.stdout)
            big.append(ca)
            small.append(cb)
            ratios.append(ca / cb)
        out[limit] = {"cpu_s_1.5_core": statistics.median(big), "cpu_s_0.5_core": statistics.median(small),
                      "ratio": statistics.median(ratios), "cores_used": (statistics.median(big) + statistics.median(small)) / seconds}
    return out


async def cold_start(repeat: int) -> dict[str, Any]:
    variants = {f"{limit}, warm": dict(cpu_limit=limit) for limit in CPU_LIMITS}
    variants |= {f"{limit}, no warm workers": dict(cpu_limit=limit, warm_sandboxes=0) for limit in CPU_LIMITS}
    grants = (0.0625, 0.25, 1.0)
    times: dict[str, list[float]] = {f"{v}, {g:g} core": [] for v in variants for g in grants}
    trajectory = itertools.count(100)
    managers = {v: CpuManager(**o) for v, o in variants.items()}
    for mgr in managers.values():
        await mgr.start()
    try:
        await asyncio.sleep(1.0)  # the warm workers are up
        for _ in range(repeat):
            for v, mgr in managers.items():
                for g in grants:
                    t = next(trajectory)
                    start = time.perf_counter()
                    await run(mgr, Call(fn=int, trajectory=t), g)
                    times[f"{v}, {g:g} core"].append(time.perf_counter() - start)
                    await mgr.end_trajectory(t)
                    await asyncio.sleep(0.2)  # the warm worker is replaced
    finally:
        for mgr in managers.values():
            await mgr.close()
    return {k: {"median_ms": 1e3 * statistics.median(v), "max_ms": 1e3 * max(v)} for k, v in times.items()}


async def resize_cost(managers: dict[str, CpuManager], count: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for limit, mgr in managers.items():
        action = LiveAction(next(_ids), Call(fn=time.sleep, args=(3600,), trajectory=3))
        task = asyncio.ensure_future(mgr.execute(action, placement(1.0)))
        while action.id not in mgr._running or mgr._running[action.id].sandbox.proc is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        costs = []
        for i in range(count):
            p = placement(2.0 if i % 2 == 0 else 1.0)
            start = time.perf_counter_ns()
            mgr.resize(action, p)
            costs.append(time.perf_counter_ns() - start)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        costs.sort()
        out[limit] = {"median_us": costs[len(costs) // 2] / 1e3, "p99_us": costs[int(len(costs) * 0.99)] / 1e3}
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    managers = {limit: CpuManager(cpu_limit=limit) for limit in CPU_LIMITS}
    for mgr in managers.values():
        await mgr.start()
    try:
        isolation = managers["guarantee"].isolation.mechanism  # type: ignore[union-attr]
        results: dict[str, Any] = {
            "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(), "isolation": isolation},
            "idle_node": await idle_node(managers, args.repeat),
            "contention": await contention(managers, args.repeat, args.seconds),
            "resize": await resize_cost(managers, args.resizes),
        }
    finally:
        for mgr in managers.values():
            await mgr.close()
    results["cold_start"] = await cold_start(args.repeat)
    return results


def report(r: dict[str, Any]) -> str:
    lines = [f"CPU grants on {r['machine']['cpus']} CPUs, isolation {r['machine']['isolation']}", "",
             "| idle node: one CPU-bound program | median | vs bare |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['median_s']:.3f} s | {v['vs_bare']:.2f}x |" for k, v in r["idle_node"].items()]
    lines += ["", "| contention: 1.5 and 0.5 cores, every CPU wanted | CPU s (1.5) | CPU s (0.5) | ratio | cores used |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['cpu_s_1.5_core']:.2f} | {v['cpu_s_0.5_core']:.2f} | {v['ratio']:.2f} | {v['cores_used']:.2f} |"
              for k, v in r["contention"].items()]
    lines += ["", "| cold start: a new trajectory's first no-op action | median | max |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['median_ms']:.1f} ms | {v['max_ms']:.1f} ms |" for k, v in r["cold_start"].items()]
    lines += ["", "| resize of a running action (manager time) | median | p99 |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['median_us']:.1f} us | {v['p99_us']:.1f} us |" for k, v in r["resize"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="busy time of each contention round")
    parser.add_argument("--resizes", type=int, default=2000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = asyncio.run(main(args))
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
