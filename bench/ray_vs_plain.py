"""tangram on Ray against plain Ray, same machine, same workload.

    python bench/ray_vs_plain.py [--trajectories 8] [--steps 6] [--json out.json]

A small coding-like agentic workload: each trajectory is a loop of steps, each step
waiting for the previous one (the agent reads the output before acting again). Most steps
are short commands (one core, ~50 ms); every third is a test suite whose run time follows
Amdahl's law (T seconds on one core, parallel fraction p): it can use more cores.

  plain Ray   what a user writes without tangram: one Ray task per action, with a resource
              request: @ray.remote(num_cpus=1) for commands, num_cpus=--plain-suite-cpus for
              test suites (a fixed guess; Ray cannot grow a task's grant)
  tangram     RayOrchestrator: the core places each action on a node and grants a test
              suite 1..--max-cores cores (elastic, by the Amdahl model); node agents run
              them in per-trajectory sandboxes, dispatched in batches

Work is simulated by sleeping the model's time for the cores actually granted (what a
parallel test runner would take), following the live grant as it changes, so the 2-core
machine is not what limits either side.
Reported per side: average ACT (submit to result), throughput (actions per second of
makespan), and the per-action scheduling overhead: the median round trip of a no-op action
on the idle cluster (one at a time), plus the mean of ACT minus modelled run time in the
workload (queueing + dispatch).

The Ray cluster is started here (ray.cluster_utils): --nodes worker nodes of --cpus logical
CPUs each, small object stores; a head node without CPUs for the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import cloudpickle


@dataclass(frozen=True)
class Step:
    kind: str  # "cmd" or "suite"
    seconds: float  # run time on one core
    p: float  # Amdahl parallel fraction (0 for commands)


def workload(trajectories: int, steps: int, seed: int) -> list[list[Step]]:
    rng = random.Random(seed)
    out = []
    for _ in range(trajectories):
        plan = []
        for i in range(steps):
            if i % 3 == 2:
                plan.append(Step("suite", round(rng.uniform(1.0, 3.0), 2), 0.9))
            else:
                plan.append(Step("cmd", round(rng.uniform(0.03, 0.08), 3), 0.0))
        out.append(plan)
    return out


def modelled(step: Step, cores: float) -> float:
    return step.seconds * ((1 - step.p) + step.p / max(1.0, cores))


def simulate(seconds: float, p: float) -> float:
    """Runs inside the action: sleeps the model's time for the cores it is granted. Under
    tangram the grant may change while it runs: the work left then goes at the new grant's
    pace, as a parallel test runner's would."""
    grant_file = os.environ.get("TANGRAM_GRANT_FILE")
    if grant_file is None or p == 0:  # plain Ray's fixed num_cpus, or a command: one core
        t = seconds * ((1 - p) + p / max(1.0, float(os.environ.get("BENCH_CORES") or 1)))
        time.sleep(t)
        return t
    left, spent = 1.0, 0.0  # the fraction of the work still to do; seconds slept
    while left > 1e-9:
        t = seconds * ((1 - p) + p / max(1.0, live_grant(grant_file)))
        slept = min(0.01, left * t)
        time.sleep(slept)
        left -= slept / t
        spent += slept
    return spent


def live_grant(path: str) -> float:
    """The grant file's cores, as tangram.worker.grant() reads it (read here directly: that
    import would load the tangram package into every sandbox, which costs more than a
    command of this workload)."""
    with open(path, "rb") as f:
        return float(f.read(64))


def noop() -> int:
    return 0


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def summarize(acts: list[float], overheads: list[float], makespan: float, rtts: list[float]) -> dict[str, float]:
    return {
        "actions": len(acts),
        "avg_act_s": statistics.fmean(acts),
        "p50_act_s": statistics.median(acts),
        "p95_act_s": sorted(acts)[int(0.95 * (len(acts) - 1))],
        "makespan_s": makespan,
        "throughput_per_s": len(acts) / makespan,
        "noop_rtt_ms_p50": 1000 * statistics.median(rtts),
        "noop_rtt_ms_mean": 1000 * statistics.fmean(rtts),
        "mean_wait_and_dispatch_ms": 1000 * statistics.fmean(overheads),
    }


def run_plain(plan: list[list[Step]], suite_cpus: float, noops: int) -> dict[str, float]:
    import ray

    @ray.remote(num_cpus=1)
    def cmd(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @ray.remote
    def suite(seconds: float, p: float, cores: float) -> float:
        os.environ["BENCH_CORES"] = str(cores)
        return simulate(seconds, p)

    @ray.remote(num_cpus=1)
    def nothing() -> int:
        return 0

    ray.get([nothing.remote() for _ in range(8)])  # warm the worker pool
    rtts = []
    for _ in range(noops):
        t = time.perf_counter()
        ray.get(nothing.remote())
        rtts.append(time.perf_counter() - t)

    async def trajectory(steps: list[Step], acts: list[float], overheads: list[float]) -> None:
        for s in steps:
            t = time.perf_counter()
            if s.kind == "cmd":
                await cmd.remote(s.seconds)
                ran = s.seconds
            else:
                ran = await suite.options(num_cpus=suite_cpus).remote(s.seconds, s.p, suite_cpus)
            act = time.perf_counter() - t
            acts.append(act)
            overheads.append(act - ran)

    async def main() -> dict[str, float]:
        acts: list[float] = []
        overheads: list[float] = []
        t0 = time.perf_counter()
        await asyncio.gather(*(trajectory(steps, acts, overheads) for steps in plan))
        return summarize(acts, overheads, time.perf_counter() - t0, rtts)

    return asyncio.run(main())


def run_tangram(plan: list[list[Step]], max_cores: float, noops: int) -> dict[str, float]:
    from tangram import Amdahl, Call
    from tangram.ray import RayOrchestrator

    async def main() -> dict[str, float]:
        async with RayOrchestrator(monitor_interval=0, metrics=False) as orch:
            # Warm, as plain Ray's worker pool is warmed: the agents, and the sandbox of every
            # trajectory of the workload (a sandbox is a process started at a trajectory's
            # first action; plain Ray's stateless tasks have none to start).
            await orch.map([Call(fn=noop, trajectory=t, resources={"cpu": 0.1}, runtime=0.001)
                            for t in [10_000, *range(1, len(plan) + 1)]])
            rtts = []
            for _ in range(noops):
                t = time.perf_counter()
                await orch.run(Call(fn=noop, trajectory=10_000, resources={"cpu": 0.1}, runtime=0.001))
                rtts.append(time.perf_counter() - t)

            acts: list[float] = []
            overheads: list[float] = []

            async def trajectory(t_id: int, steps: list[Step]) -> None:
                for s in steps:
                    if s.kind == "cmd":
                        call = Call(fn=simulate, args=(s.seconds, 0.0), trajectory=t_id, runtime=s.seconds)
                    else:
                        call = Call(fn=simulate, args=(s.seconds, s.p), trajectory=t_id, resources={"cpu": 1},
                                    elastic="cpu", max_units=max_cores, runtime=Amdahl(s.seconds, s.p), kind="suite")
                    t = time.perf_counter()
                    ran = await orch.run(call)
                    act = time.perf_counter() - t
                    acts.append(act)
                    overheads.append(act - ran)

            t0 = time.perf_counter()
            await asyncio.gather(*(trajectory(i + 1, steps) for i, steps in enumerate(plan)))
            out = summarize(acts, overheads, time.perf_counter() - t0, rtts)
            stats = orch.ray.describe()["nodes"]
            out["actor_calls"] = sum(s["batches"] for s in stats.values())
            out["largest_batch"] = max(s["largest_batch"] for s in stats.values())
            return out

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="Ray worker nodes (default 2)")
    ap.add_argument("--cpus", type=int, default=4, help="logical CPUs per worker node (default 4)")
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="actions per trajectory (every third a test suite)")
    ap.add_argument("--plain-suite-cpus", type=float, default=2.0, help="num_cpus plain Ray requests per test suite")
    ap.add_argument("--max-cores", type=float, default=None, help="tangram's elastic bound (default: --cpus)")
    ap.add_argument("--noops", type=int, default=50, help="no-op round trips timed per side")
    ap.add_argument("--seeds", type=int, default=3, help="workload seeds 1..N, run on one cluster (default 3)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    import ray
    from ray.cluster_utils import Cluster

    store = 100 * 1024**2
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": store,
                                                            "include_dashboard": False})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        per_seed = []
        for seed in range(1, args.seeds + 1):
            plan = workload(args.trajectories, args.steps, seed)
            per_seed.append({"seed": seed, "tangram": run_tangram(plan, args.max_cores or float(args.cpus), args.noops),
                             "plain_ray": run_plain(plan, args.plain_suite_cpus, args.noops)})
    finally:
        ray.shutdown()
        cluster.shutdown()
    keys = ["avg_act_s", "p50_act_s", "p95_act_s", "throughput_per_s", "makespan_s", "noop_rtt_ms_p50",
            "noop_rtt_ms_mean", "mean_wait_and_dispatch_ms"]
    mean = {side: {k: statistics.fmean(r[side][k] for r in per_seed) for k in keys} for side in ("tangram", "plain_ray")}
    result: dict[str, object] = {"config": vars(args), "seeds": per_seed, "mean": mean}
    print(f"{args.nodes} nodes x {args.cpus} CPUs, {args.trajectories} trajectories x {args.steps} steps "
          f"({args.trajectories * args.steps} actions) per seed, seeds 1..{args.seeds}; plain Ray suites request "
          f"{args.plain_suite_cpus:g} CPUs")
    print(f"{'metric (mean over seeds)':28s} {'tangram':>12s} {'plain Ray':>12s}")
    for k in keys:
        print(f"{k:28s} {mean['tangram'][k]:12.4f} {mean['plain_ray'][k]:12.4f}")
    print("average ACT per seed (tangram / plain Ray): " + ", ".join(
        f"{r['seed']}: {r['tangram']['avg_act_s']:.3f} / {r['plain_ray']['avg_act_s']:.3f}" for r in per_seed))
    last = per_seed[-1]["tangram"]
    print(f"tangram: {last['actor_calls']} batched actor calls for {last['actions']} actions in the last seed "
          f"(+ warm-up and no-ops), largest batch {last['largest_batch']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
