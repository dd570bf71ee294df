"""`tangram demo`: a small agentic rollout on this machine, under `trajectory` and `tangram`.

Trajectories start together (a rollout step's burst) and alternate "generation" (the
policy model thinking: a sleep, not an external resource) with real tool calls:

  write    the model's code lands in the trajectory's sandbox (a function run there)
  search   a query to a rate-limited search API: a local HTTP server this demo starts,
           with its own token bucket; tangram's quota keeps every call within it
  build    `python build.py`: py_compile plus a parallel "optimise" step (elastic)
  run      `python solution.py 50000` (one core at most, not elastic)
  test     `python run_tests.py`: the test suite on TANGRAM_CORES worker processes
           (elastic); a buggy solution fails, is fixed, and is tested again
  reward   the test report scored by a reward service batched through the GPU manager
           (a CPU-only scorer here; on a machine without GPUs the demo declares one fake
           device so the service's residency and batching take the real path)

Under `trajectory` each trajectory owns an equal share of the cores for the whole step,
as a hard ceiling (today's frameworks: a container per trajectory); under `tangram` the
cores are one pool, a grant is a guarantee rather than a ceiling, and elastic actions grow
into what the others leave idle, also while they run. The table compares action completion times (ACT: from
the tool call to its result, wait plus run) and the step's duration (until the last
trajectory is scored). The workload is sized to finish both runs in about 20 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .._model import Amdahl, Gpu, Inventory, Node, Quota, Service
from ..runtime import Call, CommandResult, Orchestrator, RuntimeConfig
from ..runtime.errors import ActionError
from . import programs

# The search API's limit: requests per second and burst. The quota in the core has one
# request less of burst: headroom for the jitter between admission and arrival.
SEARCH_RATE, SEARCH_BURST = 8.0, 3
TEST_CASES = [50_000, 75_000, 100_000, 60_000, 90_000, 70_000, 80_000, 55_000]
BUILD_ROUNDS = 30_000  # sha256 rounds per build unit


@dataclass
class PolicyRun:
    policy: str
    acts: dict[str, list[float]] = field(default_factory=dict)  # kind -> ACTs
    step_seconds: float = 0.0
    rewards: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)


def start_search_server() -> tuple[subprocess.Popen[str], int]:
    # -P: the server imports the installed tangram, never a source folder that happens to
    # be the caller's working directory.
    proc = subprocess.Popen([sys.executable, "-P", "-m", "tangram.demo.search_server", "--rate", str(SEARCH_RATE),
                             "--burst", str(SEARCH_BURST)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"the search server did not start: {line!r}")
    return proc, int(line.split()[1])


def stop_search_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def search(port: int, query: str) -> list[str]:
    """The search tool: one HTTP request (run by the API manager's threads)."""
    url = f"http://127.0.0.1:{port}/search?q={urllib.request.quote(query)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return [hit["title"] for hit in json.load(response)["results"]]


def server_stats(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as response:
        return json.load(response)


def score(report: str) -> float:
    """The reward model: the share of tests passed (none without a test report)."""
    if not report:
        return 0.0
    result = json.loads(report)
    return result["passed"] / result["total"]


def demo_inventory(cores: int, memory: float) -> tuple[Inventory, bool]:
    """This machine, a search quota and the reward service; (inventory, gpu_is_fake)."""
    local = Inventory.local()
    gpus = list(local.nodes[0].gpus)
    fake = not gpus
    if fake:
        gpus = [Gpu(16384.0)]  # declared for the demo: the scorer runs on the CPU
    node = Node(local.nodes[0].name, {"cpu": cores, "memory": memory}, gpus)
    return Inventory(nodes=[node], quotas=[Quota("search", rate=SEARCH_RATE, burst=SEARCH_BURST - 1, max_concurrency=4)],
                     services=[Service("reward", memory=2048, restore_seconds=0.2, max_batch=8)]), fake


async def rollout(policy: str, trajectories: int, port: int, seed: int, progress: Any) -> PolicyRun:
    from ..runtime.managers.gpu import FunctionService, GpuManager

    cores = len(os.sched_getaffinity(0))
    memory = min(Inventory.local().nodes[0].resources["memory"], 1024.0 * trajectories)
    inventory, fake_gpu = demo_inventory(cores, memory)
    slot = cores / trajectories  # the trajectory baseline's share; also every minimum demand
    options = {"trajectory_slot_cpu": slot} if policy == "trajectory" else {}
    # Without a GPU here, the one declared for the demo is a fake device copied from the
    # inventory (chosen explicitly, never by accident).
    gpu = GpuManager(services={"reward": FunctionService(score)}, devices="inventory" if fake_gpu else None)
    # The trajectory baseline is a fixed sandbox per trajectory: its share is a ceiling.
    limit = "ceiling" if policy == "trajectory" else "guarantee"
    config = RuntimeConfig(policy=policy, policy_options=options, managers={"cpu": {"cpu_limit": limit}})
    run = PolicyRun(policy)
    python = sys.executable

    async def act(call: Call) -> Any:
        # A tool call that fails is an observation for the agent, not the end of its
        # rollout: the error comes back as the result, the records keep its outcome (the
        # summary lists every action that did not end ok) and the trajectory goes on.
        try:
            return await orch.run(call)
        except ActionError as error:
            return error
        finally:
            progress.update(1)

    def think(t: int, turn: int) -> asyncio.Future[None]:
        # The policy model generating the next turn: 0.15-0.75 s, deterministic per (seed, t, turn).
        return asyncio.sleep(0.15 + ((seed * 7919 + t * 104729 + turn * 1299709) % 600) / 1000.0)

    async def trajectory(t: int) -> None:
        # Trajectories differ: half of the solutions are buggy (fixed after a failing test
        # run, except every fourth trajectory's), and they iterate once or twice.
        buggy, fixable = t % 2 == 1, t % 4 != 3
        iterations = 1 + t % 2
        common = dict(trajectory=t, kind="env", timeout=120.0)
        code = dict(resources={"cpu": slot, "memory": 256}, elastic="cpu", max_units=float(cores), **common)
        turn = iter(range(100))
        await think(t, next(turn))
        await act(Call(fn=programs.write_project, args=(TEST_CASES, buggy, BUILD_ROUNDS),
                       resources={"cpu": slot / 4, "memory": 64},
                       runtime=0.02, **common))
        await think(t, next(turn))
        await act(Call(fn=search, args=(port, "count primes up to n quickly"), quota="search",
                       resources={"cpu": slot / 4}, runtime=0.03, kind="search", trajectory=t))
        report = ""
        for _ in range(iterations):
            await think(t, next(turn))
            await act(Call(command=[python, "build.py"], runtime=Amdahl.from_one_unit(0.5, 0.85, slot), **code))
            await think(t, next(turn))
            await act(Call(command=[python, "solution.py", "30000"], resources={"cpu": slot, "memory": 128},
                           runtime=0.07 / slot, **common))
            await think(t, next(turn))
            result = await act(Call(command=[python, "run_tests.py"], runtime=Amdahl.from_one_unit(0.7, 0.9, slot), **code))
            if not isinstance(result, CommandResult) or not result.stdout.strip():
                continue  # no test report this time: the next iteration builds and tests again
            report = result.stdout.decode().strip().splitlines()[-1]
            if result.returncode != 0 and fixable:
                await act(Call(fn=programs.fix_solution, resources={"cpu": slot / 4, "memory": 64}, runtime=0.02,
                               **common))
        # The environment part is over: release the sandbox (and, under `trajectory`, the
        # trajectory's cores). The reward request holds GPU memory and a batch slot of its
        # service, no sandbox cores.
        await orch.end_trajectory(t)
        reward = await act(Call(args=(report,), service="reward", resources={}, gpu_memory=256, runtime=0.05,
                                kind="reward", trajectory=t))
        run.rewards.append(reward if isinstance(reward, float) else 0.0)

    async with Orchestrator(config, inventory=inventory, managers={"gpu": gpu}) as orch:
        started = time.perf_counter()
        await asyncio.gather(*(trajectory(t) for t in range(trajectories)))
        run.step_seconds = time.perf_counter() - started
        for record in orch.records:
            run.outcomes[record.outcome or "?"] = run.outcomes.get(record.outcome or "?", 0) + 1
            if record.act is not None:
                run.acts.setdefault(record.kind, []).append(record.act)
    return run


def _all_acts(run: PolicyRun) -> list[float]:
    return [a for acts in run.acts.values() for a in acts]


def _table(runs: list[PolicyRun]) -> str:
    kinds = ["env", "search", "reward"]
    lines = [f"{'policy':<12}{'mean ACT':>10}{'p99 ACT':>10}" + "".join(f"{k:>10}" for k in kinds)
             + f"{'step':>9}{'reward':>8}"]
    for r in runs:
        every = _all_acts(r)
        p99 = sorted(every)[max(0, int(round(0.99 * len(every))) - 1)] if every else 0.0
        cells = "".join(f"{statistics.fmean(r.acts[k]) if r.acts.get(k) else 0.0:>10.2f}" for k in kinds)
        lines.append(f"{r.policy:<12}{statistics.fmean(every):>10.2f}{p99:>10.2f}{cells}{r.step_seconds:>9.1f}"
                     f"{statistics.fmean(r.rewards):>8.2f}")
    return "\n".join(lines)


def main(trajectories: int | None = None, policies: tuple[str, ...] = ("trajectory", "tangram"), seed: int = 0,
         verbose: bool = False) -> int:
    """Runs the rollout under each policy and prints the comparison; 1 if any action failed."""
    from tqdm import tqdm

    from ..runtime.sandbox.isolation import detect
    from ..runtime.sandbox.namespaces import detect as detect_boundary

    cores = len(os.sched_getaffinity(0))
    trajectories = trajectories or max(4, min(32, 2 * cores))
    isolation = detect()
    boundary = detect_boundary()
    print(f"tangram demo: one RL rollout step of {trajectories} agentic coding trajectories on this machine "
          f"({cores} cores), run once per policy: {', '.join(policies)}")
    print("  each trajectory alternates LLM generation (a sleep) with tool calls in its own sandbox: write code, "
          f"query a search API limited to {SEARCH_RATE:g}/s, build, run, test (elastic), fix; a reward service "
          "scores it")
    print(f"  sandboxes: {boundary.description if verbose else boundary.summary}")
    print(f"  resources: {isolation.description if verbose else isolation.summary}")
    server, port = start_search_server()
    runs = []
    try:
        per_run = sum(4 + 4 * (1 + t % 2) for t in range(trajectories))  # at most
        for policy in policies:
            with tqdm(total=per_run, desc=f"{policy:<10}", unit="action", leave=False) as bar:
                runs.append(asyncio.run(rollout(policy, trajectories, port, seed, bar)))
        stats = server_stats(port)
    finally:
        stop_search_server(server)
    print()
    print("ACT (action completion time): seconds from a tool call to its result, waiting plus running.")
    print("Columns: mean and p99 ACT of all actions; mean ACT of env (sandbox), search and reward actions; "
          "step: seconds until the last trajectory was scored; reward: mean reward.")
    print(_table(runs))
    base, ours = runs[0], runs[-1]
    if base is not ours:
        act_ratio = statistics.fmean(_all_acts(base)) / statistics.fmean(_all_acts(ours))
        print(f"{ours.policy} against {base.policy}: mean ACT {act_ratio:.2f}x lower, step "
              f"{base.step_seconds / ours.step_seconds:.2f}x shorter")
    print(f"search API: {stats['requests']} requests, {stats['rejected']} rejected, at most {stats['max_in_window']} "
          f"admitted in any {stats['window']:g} s (limit {SEARCH_RATE:g}/s, burst {SEARCH_BURST})")
    failed = {r.policy: {k: v for k, v in r.outcomes.items() if k != "ok"} for r in runs}
    if any(failed.values()):
        print(f"actions that did not end ok: {failed}")
        return 1
    return 0
