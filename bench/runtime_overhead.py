"""Overhead of the live orchestrator, against asyncio with a plain ProcessPoolExecutor.

    python bench/runtime_overhead.py [--actions 20000] [--rounds 3] [--json PATH]

Four ways to run the same no-op Python function, all in this one process and run:

  pool         asyncio + concurrent.futures.ProcessPoolExecutor(cores): what a rollout
               server does without an orchestrator (no scheduling, no grants, no limits)
  tangram-cpu  the orchestrator with the CPU manager: each action runs in its
               trajectory's sandbox process (one per core here), pinned to its grant
  tangram      the orchestrator with the in-process mock manager: the scheduling path
               alone (submit, batch into the core, decisions, task, result, records and
               metrics), with nothing to carry out
  tangram-learned  the same, with calls that declare no run time: each is planned with an
               estimate learned from the ones before it, and each end updates it
               (tangram.estimates)

Two measurements each:
  submit-to-start  one action at a time: from the submit call to the first line of the
                   function (time.perf_counter is CLOCK_MONOTONIC, shared by processes).
                   Median over `--latency` actions.
  throughput       `--actions` no-op actions submitted at once, until every result is
                   back: actions per second. Best of `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Awaitable, Callable

from tangram import Call, Inventory, MockManager, Orchestrator


def noop() -> None:
    return None


def started_at() -> float:
    return time.perf_counter()


def cores() -> int:
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------- implementations
class Pool:
    name = "pool"

    async def __aenter__(self) -> "Pool":
        self.pool = ProcessPoolExecutor(cores())
        self.loop = asyncio.get_running_loop()
        await asyncio.gather(*(self.loop.run_in_executor(self.pool, noop) for _ in range(4 * cores())))  # warm
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.pool.shutdown()

    def one(self, fn: Callable[[], Any], trajectory: int) -> Awaitable[Any]:
        return self.loop.run_in_executor(self.pool, fn)

    async def many(self, fn: Callable[[], Any], n: int) -> None:
        await asyncio.gather(*(self.loop.run_in_executor(self.pool, fn) for _ in range(n)))


class Tangram:
    def __init__(self, manager: str, learned: bool = False) -> None:
        self.manager = manager
        self.name = ("tangram-learned" if learned else "tangram") if manager == "mock" else "tangram-cpu"
        self.runtime = None if learned else 0.0
        # A sandbox runs with exactly its grant (a fractional core is a CFS quota), so the
        # CPU manager's actions take one whole core each, as a pool worker has; the mock
        # carries nothing out, so slivers let every action start at once.
        self.cpu = 0.01 if manager == "mock" else 1.0

    async def __aenter__(self) -> "Tangram":
        n = cores()
        inventory = Inventory.uniform(1, {"cpu": n, "memory": 4096 * n})
        managers: dict[str, Any] = {"cpu": MockManager(sleep=False)} if self.manager == "mock" else {}
        self.orch = await Orchestrator(inventory=inventory, default_managers=False, managers=managers,
                                       config=None if managers else _cpu_only()).start()
        await self.many(noop, 4 * n)  # warm: sandboxes started
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.orch.close()

    def _call(self, fn: Callable[[], Any], trajectory: int) -> Call:
        # One trajectory (sandbox) per core, like one pool worker per core.
        return Call(fn=fn, resources={"cpu": self.cpu}, runtime=self.runtime, trajectory=trajectory % cores())

    def one(self, fn: Callable[[], Any], trajectory: int) -> Awaitable[Any]:
        return self.orch.submit(self._call(fn, trajectory)).future

    async def many(self, fn: Callable[[], Any], n: int) -> None:
        results = await self.orch.map([self._call(fn, i) for i in range(n)])
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]


def _cpu_only() -> Any:
    from tangram import RuntimeConfig

    return RuntimeConfig(managers={"cpu": {}})


# ---------------------------------------------------------------- measurements
async def submit_to_start(impl: Any, count: int) -> float:
    samples = []
    for i in range(count):
        t0 = time.perf_counter()
        t1 = await impl.one(started_at, i)
        samples.append(t1 - t0)
    return statistics.median(samples) * 1e6


async def throughput(impl: Any, actions: int, rounds: int) -> float:
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        await impl.many(noop, actions)
        best = max(best, actions / (time.perf_counter() - t0))
    return best


async def measure(impls: list[Any], actions: int, rounds: int, latency: int) -> list[dict[str, Any]]:
    rows = []
    for impl in impls:
        async with impl:
            rows.append({"impl": impl.name, "submit_to_start_us": await submit_to_start(impl, latency),
                         "actions_per_second": await throughput(impl, actions, rounds)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actions", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=int, default=2000)
    parser.add_argument("--impls", default="pool,tangram-cpu,tangram,tangram-learned")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    table = {"pool": Pool, "tangram-cpu": lambda: Tangram("cpu"), "tangram": lambda: Tangram("mock"),
             "tangram-learned": lambda: Tangram("mock", learned=True)}
    impls = [table[name]() for name in args.impls.split(",")]
    rows = asyncio.run(measure(impls, args.actions, args.rounds, args.latency))
    base = next((r for r in rows if r["impl"] == "pool"), None)
    print(f"{cores()} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'impl':<16} {'submit-to-start us (median)':>28} {'actions/s':>12} {'vs pool':>8}")
    for r in rows:
        ratio = f"{r['actions_per_second'] / base['actions_per_second']:.2f}x" if base else "-"
        print(f"{r['impl']:<16} {r['submit_to_start_us']:>28.1f} {r['actions_per_second']:>12,.0f} {ratio:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores(), "python": sys.version, "load_average": os.getloadavg()[0],
                       "actions": args.actions, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
