"""`tangram demo --virtual`: the core deciding a burst of agentic-RL actions on this machine's
inventory, in virtual time, under each policy. `tangram sim` is the full evaluation; the numbers here
are modelled seconds, not measurements of real work."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from .._model import Inventory
from ..scheduler import Policy, Scheduler


@dataclass
class DemoResult:
    policy: str
    actions: int
    avg_act: float
    p99_act: float
    makespan: float
    decide_us: float  # wall time in the core per start decision


def burst(sched: Scheduler, count: int, trajectories: int, seed: int) -> np.ndarray:
    """A rollout step's burst: every trajectory runs a tool call at once. Test suites are
    elastic (Amdahl, 1..8 cores), compiles partly elastic, small commands are not."""
    rng = np.random.default_rng(seed)
    rec = sched.new_actions(count)
    cpu = sched.kinds.index("cpu")
    mem = sched.kinds.index("memory")
    kind = rng.choice(3, size=count, p=[0.5, 0.3, 0.2])  # command, test suite, compile
    seconds = np.where(kind == 0, rng.lognormal(-0.5, 0.8, count), rng.lognormal(1.5, 0.7, count))
    rec["id"] = np.arange(count)
    rec["trajectory"] = np.arange(count) % trajectories
    rec["demand"][:, cpu] = 1.0
    rec["demand"][:, mem] = rng.choice([256.0, 512.0, 1024.0], size=count)
    rec["seconds"] = seconds
    elastic = kind > 0
    rec["elastic_kind"][elastic] = cpu
    rec["elastic_max"][elastic] = 8.0
    rec["model"][elastic] = 1  # Amdahl
    rec["parallel_fraction"] = np.where(kind == 1, 0.9, np.where(kind == 2, 0.6, 0.0))
    return rec


def run(inventory: Inventory, policy: Policy, count: int, seed: int = 0) -> DemoResult:
    sched = Scheduler(inventory, policy)
    # One tool call per trajectory, all at once: the burst at the start of a rollout step.
    records = burst(sched, count, trajectories=count, seed=seed)
    finish: list[tuple[float, int]] = []
    started_at: dict[int, float] = {}
    acts: list[float] = []
    core_seconds = 0.0
    starts = 0

    def apply(decisions, now: float) -> None:  # type: ignore[no-untyped-def]
        nonlocal starts
        for row in decisions.of_kind("start"):
            aid = int(row["action"])
            starts += 1
            started_at[aid] = now
            heapq.heappush(finish, (now + sched.runtime(aid, float(row["grant"])), aid))

    t0 = time.perf_counter()
    decisions = sched.submit(records, 0.0)
    core_seconds += time.perf_counter() - t0
    apply(decisions, 0.0)
    while finish:
        now, aid = heapq.heappop(finish)
        done = [aid]
        while finish and finish[0][0] == now:
            done.append(heapq.heappop(finish)[1])
        acts.extend([now] * len(done))  # every action arrived at t=0: ACT = finish time
        t0 = time.perf_counter()
        decisions = sched.complete(done, now)
        core_seconds += time.perf_counter() - t0
        apply(decisions, now)
        # Each trajectory's tool call is over: its sandbox slot (trajectory policy) frees.
        t0 = time.perf_counter()
        decisions = sched.end_trajectories([int(records["trajectory"][a]) for a in done], now)
        core_seconds += time.perf_counter() - t0
        apply(decisions, now)
    sched.check_invariants()
    assert sched.waiting == 0 and sched.running == 0 and len(acts) == count
    arr = np.asarray(acts)
    return DemoResult(policy.name, count, float(arr.mean()), float(np.percentile(arr, 99)),
                      float(arr.max()), core_seconds / max(starts, 1) * 1e6)


def main(count: int = 2000, policies: tuple[str, ...] = ("tangram", "fifo", "trajectory")) -> int:
    inventory = Inventory.local()
    node = inventory.nodes[0]
    cores = node.resources["cpu"]
    print(f"tangram demo: a burst of {count} tool calls on this machine's inventory "
          f"({node.name}: {cores:g} cores, {node.resources['memory']:.0f} MiB, {len(node.gpus)} GPUs), "
          "in virtual time")
    print(f"{'policy':<12}{'avg ACT s':>11}{'p99 ACT s':>11}{'makespan s':>12}{'us/decision':>13}")
    results = []
    for name in policies:
        # The trajectory baseline: cores divided evenly among the trajectories that run at
        # once (here the burst's first wave holds one slot per core).
        policy = Policy(name=name, trajectory_slot_cpu=1.0)
        r = run(inventory, policy, count)
        results.append(r)
        print(f"{r.policy:<12}{r.avg_act:>11.2f}{r.p99_act:>11.2f}{r.makespan:>12.2f}{r.decide_us:>13.2f}")
    best = min(results, key=lambda r: r.avg_act)
    print(f"lowest average ACT: {best.policy}")
    return 0
