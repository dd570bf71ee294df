"""What the namespace boundary costs: sandbox starts, per-action overhead, idle memory.

    python bench/sandbox_isolation.py [--repeat 40] [--idle 200] [--json bench/results/sandbox_isolation.json]

Runs the CPU manager directly (no scheduler), with real processes, under
isolation="namespaces" (bubblewrap) and isolation="process" (a bare process), and measures:

  warm start   a new trajectory's first action (a no-op function) when a warm worker waits
               for it: execute to result, the pool refilled between samples.
  cold start   the same without warm workers (warm_sandboxes=0): the worker (and under
               namespaces bwrap with it) starts inside the action.
  action       one more action in a live sandbox: a no-op function and the command `true`.
  idle         --idle sandboxes each holding its worker between actions: the proportional
               set size (PSS, /proc/<pid>/smaps_rollup) of all their processes (bwrap's
               included), per sandbox.

Samples of the two isolations are interleaved, in this one process; medians and p99 are
reported, with each namespaced figure's difference from the bare process's.
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
from tangram.runtime.cpu import CpuManager
from tangram.runtime.manager import LiveAction
from tangram.runtime.namespaces import detect

ISOLATIONS = ("process", "namespaces")
_ids = itertools.count(1)


def placement() -> Placement:
    return Placement(action_id=0, node=0, node_name="local", device=None, grant=1.0, cores=1.0, memory=0.0,
                     gpu_memory=0.0, env={})


async def timed(mgr: CpuManager, call: Call) -> float:
    t0 = time.perf_counter()
    await mgr.execute(LiveAction(next(_ids), call), placement())
    return time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(values) * 1e3, "p99_ms": pct(values, 0.99) * 1e3, "n": len(values)}


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


async def settle_warm(mgr: CpuManager, size: int) -> None:
    deadline = time.monotonic() + 30
    while len(mgr.warm_processes()) < size and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # its imports done (the worker says nothing when it is ready)


async def measure(repeat: int, idle: int) -> dict[str, Any]:
    warm = {iso: CpuManager(isolation=iso, warm_sandboxes=1) for iso in ISOLATIONS}
    cold = {iso: CpuManager(isolation=iso, warm_sandboxes=0) for iso in ISOLATIONS}
    for mgr in (*warm.values(), *cold.values()):
        await mgr.start()
    out: dict[str, Any] = {}
    try:
        samples: dict[str, dict[str, list[float]]] = {k: {iso: [] for iso in ISOLATIONS}
                                                      for k in ("warm_start", "cold_start", "fn", "command")}
        trajectory = itertools.count(1)
        for _ in range(repeat):
            for iso in ISOLATIONS:
                await settle_warm(warm[iso], 1)
                samples["warm_start"][iso].append(await timed(warm[iso], Call(fn=int, trajectory=next(trajectory))))
                samples["cold_start"][iso].append(await timed(cold[iso], Call(fn=int, trajectory=next(trajectory))))
        for _ in range(repeat * 5):
            for iso in ISOLATIONS:
                samples["fn"][iso].append(await timed(cold[iso], Call(fn=int, trajectory=0)))
                samples["command"][iso].append(await timed(cold[iso], Call(command="true", trajectory=0)))
        for kind, by_iso in samples.items():
            out[kind] = {iso: summary(v) for iso, v in by_iso.items()}
            out[kind]["namespaces_minus_process_p50_ms"] = (out[kind]["namespaces"]["p50_ms"]
                                                            - out[kind]["process"]["p50_ms"])
    finally:
        for mgr in (*warm.values(), *cold.values()):
            await mgr.close()
    out["idle"] = {}
    for iso in ISOLATIONS:
        mgr = CpuManager(isolation=iso, warm_sandboxes=0)
        await mgr.start()
        try:
            await asyncio.gather(*(mgr.execute(LiveAction(next(_ids), Call(fn=int, trajectory=t)), placement())
                                   for t in range(idle)))
            pids = mgr.processes()
            total = sum(pss_kib(p) for p in pids)
            out["idle"][iso] = {"sandboxes": idle, "processes": len(pids), "pss_mib_per_sandbox": total / idle / 1024}
        finally:
            await mgr.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--idle", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    boundary = detect("auto")
    if not boundary.namespaces:
        sys.exit(f"no namespaces here: {boundary.reason}")
    result = asyncio.run(measure(args.repeat, args.idle))
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                         "uid": os.geteuid(), "isolation": boundary.description}
    print(f"{'':12} {'process p50':>12} {'namespaces p50':>15} {'difference':>11} {'namespaces p99':>15}")
    for kind in ("warm_start", "cold_start", "fn", "command"):
        r = result[kind]
        print(f"{kind:12} {r['process']['p50_ms']:10.2f}ms {r['namespaces']['p50_ms']:13.2f}ms "
              f"{r['namespaces_minus_process_p50_ms']:+9.2f}ms {r['namespaces']['p99_ms']:13.2f}ms")
    for iso, r in result["idle"].items():
        print(f"idle {iso:10} {r['sandboxes']} sandboxes, {r['processes']} processes, "
              f"{r['pss_mib_per_sandbox']:.1f} MiB PSS each")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
