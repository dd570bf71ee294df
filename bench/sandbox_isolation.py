"""What the namespace boundary costs: sandbox starts, per-action overhead, idle memory.

    python bench/sandbox_isolation.py [--repeat 40] [--idle 200] [--json bench/results/sandbox_isolation.json]

Runs the CPU manager directly (no scheduler), with real processes, under
isolation="namespaces" (bubblewrap), isolation="process" (a bare process) and, as root with
busybox installed, namespaces on a task image ("image": a busybox root built here, unpacked
already, as a cached image is; Call.image), and measures:

  warm start   a new trajectory's first action (a no-op function) when a warm worker waits
               for it: execute to result, the pool refilled between samples.
  cold start   the same without warm workers (warm_sandboxes=0): the worker (and under
               namespaces bwrap with it) starts inside the action.
  action       one more action in a live sandbox: a no-op function and the command `true`.
  idle         --idle sandboxes each holding its worker between actions: the proportional
               set size (PSS, /proc/<pid>/smaps_rollup) of all their processes (bwrap's
               included), per sandbox.

Samples of the configurations are interleaved, in this one process; medians and p99 are
reported, with each namespaced figure's difference from the bare process's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from tangram.runtime.call import Call, Placement
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.managers.base import LiveAction
from tangram.runtime.sandbox.namespaces import detect

ISOLATIONS = ("process", "namespaces")
BUSYBOX = shutil.which("busybox") or "/bin/busybox"


def busybox_root(path: str) -> str:
    """A task image's root: a static busybox, its shell, `true`, `sleep` and `cat`."""
    os.makedirs(os.path.join(path, "bin"))
    os.makedirs(os.path.join(path, "tmp"), mode=0o1777)
    shutil.copy2(BUSYBOX, os.path.join(path, "bin", "busybox"))
    for applet in ("sh", "true", "sleep", "cat"):
        os.symlink("busybox", os.path.join(path, "bin", applet))
    return path
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


async def measure(repeat: int, idle: int, image: str | None) -> dict[str, Any]:
    configs = (*ISOLATIONS, "image") if image else ISOLATIONS
    isolation = {"process": "process", "namespaces": "namespaces", "image": "namespaces"}
    warm = {c: CpuManager(isolation=isolation[c], warm_sandboxes=1) for c in configs}
    cold = {c: CpuManager(isolation=isolation[c], warm_sandboxes=0) for c in configs}
    for mgr in (*warm.values(), *cold.values()):
        await mgr.start()
    out: dict[str, Any] = {}
    try:
        samples: dict[str, dict[str, list[float]]] = {k: {c: [] for c in configs}
                                                      for k in ("warm_start", "cold_start", "fn", "command")}
        trajectory = itertools.count(1)
        if image:  # the image's warm pool starts at its first call
            await timed(warm["image"], Call(fn=int, trajectory=next(trajectory), image=image))
        pool_size = {c: 2 if c == "image" else 1 for c in configs}  # the image's pool beside the host's
        for _ in range(repeat):
            for c in configs:
                on = image if c == "image" else None
                for kind, mgr in (("warm_start", warm[c]), ("cold_start", cold[c])):
                    for other in configs:  # no warm worker starting meanwhile (the refill after a warm sample)
                        await settle_warm(warm[other], pool_size[other])
                    samples[kind][c].append(await timed(mgr, Call(fn=int, trajectory=next(trajectory), image=on)))
        for _ in range(repeat * 5):
            for c in configs:
                on = image if c == "image" else None
                samples["fn"][c].append(await timed(cold[c], Call(fn=int, trajectory=0, image=on)))
                samples["command"][c].append(await timed(cold[c], Call(command="true", trajectory=0, image=on)))
        for kind, by_config in samples.items():
            out[kind] = {c: summary(v) for c, v in by_config.items()}
            out[kind]["namespaces_minus_process_p50_ms"] = (out[kind]["namespaces"]["p50_ms"]
                                                            - out[kind]["process"]["p50_ms"])
            if image:
                out[kind]["image_minus_process_p50_ms"] = out[kind]["image"]["p50_ms"] - out[kind]["process"]["p50_ms"]
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
    with tempfile.TemporaryDirectory(prefix="tangram-bench-image-") as tmp:
        image = busybox_root(os.path.join(tmp, "rootfs")) if os.geteuid() == 0 and os.path.exists(BUSYBOX) else None
        result = asyncio.run(measure(args.repeat, args.idle, image))
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                         "uid": os.geteuid(), "isolation": boundary.description}
    print(f"{'':12} {'process p50':>12} {'namespaces p50':>15} {'difference':>11} {'namespaces p99':>15}"
          + (f" {'image p50':>10} {'difference':>11} {'image p99':>10}" if image else ""))
    for kind in ("warm_start", "cold_start", "fn", "command"):
        r = result[kind]
        print(f"{kind:12} {r['process']['p50_ms']:10.2f}ms {r['namespaces']['p50_ms']:13.2f}ms "
              f"{r['namespaces_minus_process_p50_ms']:+9.2f}ms {r['namespaces']['p99_ms']:13.2f}ms"
              + (f" {r['image']['p50_ms']:8.2f}ms {r['image_minus_process_p50_ms']:+9.2f}ms "
                 f"{r['image']['p99_ms']:8.2f}ms" if image else ""))
    for iso, r in result["idle"].items():
        print(f"idle {iso:10} {r['sandboxes']} sandboxes, {r['processes']} processes, "
              f"{r['pss_mib_per_sandbox']:.1f} MiB PSS each")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
