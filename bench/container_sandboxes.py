"""Container sandboxes (the CPU manager's containers option) against what a user runs without tangram.

    python bench/container_sandboxes.py [--engine podman] [--option OPT ...] [--cold 20] [--warm 200] [--json PATH]

A busybox image (a static busybox root built here from the Debian package busybox-static,
imported into the engine's store) and, in the same process, interleaved:

  start       a trajectory's first action, `true`, until its result: tangram with
              containers=ENGINE (a container started, one exec of the worker), tangram's
              own image sandbox on the same root (namespaces, no warm worker), and a user's
              `ENGINE run --rm IMAGE true`
  per action  one more `true` (and one function call, tangram only) in a live trajectory:
              tangram's container sandbox, tangram's image sandbox, and a user's
              `ENGINE exec CONTAINER true` in a container started once

Reports p50 and p99 in milliseconds and tangram's ratio to the user's way. Needs root and
an engine that runs containers here (--option passes more `run` options to both: a runtime,
for one). The image is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

from tangram.runtime.call import Call
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.managers.base import LiveAction

from sandbox_isolation import busybox_root, placement  # bench/ is on sys.path

_ids = itertools.count(1)


async def timed_call(mgr: CpuManager, call: Call) -> float:
    t0 = time.perf_counter()
    await mgr.execute(LiveAction(next(_ids), call), placement())
    return (time.perf_counter() - t0) * 1e3


async def timed_argv(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:3])} failed: {err.decode().strip()}")
    return (time.perf_counter() - t0) * 1e3


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(engine: str, options: list[str], image: str, root: str, cold: int, warm: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {k: [] for k in (
        "start_container", "start_image_sandbox", "start_engine_run",
        "true_container", "fn_container", "true_image_sandbox", "true_engine_exec")}
    containers = CpuManager(containers=engine, container_options=options, warm_sandboxes=0)
    own = CpuManager(isolation="namespaces", warm_sandboxes=0)
    live = f"tangram-bench-live-{os.getpid()}"
    await containers.start()
    await own.start()
    try:
        for i in range(cold):
            t = 1000 + i
            samples["start_container"].append(await timed_call(containers, Call(command="true", trajectory=t, image=image)))
            samples["start_image_sandbox"].append(await timed_call(own, Call(command="true", trajectory=t, image=root)))
            samples["start_engine_run"].append(await timed_argv([engine, "run", "--rm", "--network", "none", *options,
                                                                 image, "true"]))
            await containers.end_trajectory(t)
            await own.end_trajectory(t)
        await timed_argv([engine, "run", "-d", "--name", live, "--network", "none", *options, image, "sleep", "3600"])
        await timed_call(containers, Call(command="true", trajectory=1, image=image))
        await timed_call(own, Call(command="true", trajectory=1, image=root))
        for _ in range(warm):
            samples["true_container"].append(await timed_call(containers, Call(command="true", trajectory=1)))
            samples["fn_container"].append(await timed_call(containers, Call(fn=int, trajectory=1)))
            samples["true_image_sandbox"].append(await timed_call(own, Call(command="true", trajectory=1)))
            samples["true_engine_exec"].append(await timed_argv([engine, "exec", live, "true"]))
    finally:
        subprocess.run([engine, "rm", "-f", "-t", "0", live], capture_output=True)
        await containers.close()
        await own.close()
    out: dict[str, Any] = {k: {"p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99), "n": len(v)} for k, v in samples.items()}
    out["ratios_p50"] = {
        "start_container_over_engine_run": out["start_container"]["p50_ms"] / out["start_engine_run"]["p50_ms"],
        "true_container_over_engine_exec": out["true_container"]["p50_ms"] / out["true_engine_exec"]["p50_ms"],
        "true_container_over_image_sandbox": out["true_container"]["p50_ms"] / out["true_image_sandbox"]["p50_ms"],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="podman")
    parser.add_argument("--option", action="append", help="an option for the engine's run (repeatable)")
    parser.add_argument("--cold", type=int, default=20)
    parser.add_argument("--warm", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (tangram's image sandboxes mount an overlay; rootful containers)")
    engine = shutil.which(args.engine) or sys.exit(f"{args.engine} is not installed")
    image = f"localhost/tangram-bench-busybox:{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="tangram-bench-containers-") as tmp:
        root = busybox_root(os.path.join(tmp, "rootfs"))
        archive = os.path.join(tmp, "busybox.tar")
        with tarfile.open(archive, "w") as tar:
            for entry in sorted(os.listdir(root)):
                tar.add(os.path.join(root, entry), arcname=entry)
        subprocess.run([engine, "import", "-q", archive, image], check=True, capture_output=True)
        try:
            result = asyncio.run(measure(engine, args.option or [], image, root, args.cold, args.warm))
        finally:
            subprocess.run([engine, "rmi", "-f", image], capture_output=True)
    result["engine"] = os.path.basename(engine)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    print(f"{'':22} {'p50':>9} {'p99':>9}")
    for k, v in result.items():
        if isinstance(v, dict) and "p50_ms" in v:
            print(f"{k:22} {v['p50_ms']:7.2f}ms {v['p99_ms']:7.2f}ms")
    for k, v in result["ratios_p50"].items():
        print(f"{k}: {v:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
