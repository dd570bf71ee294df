"""Liveness end to end: the live orchestrator never leaves an action waiting for good.

A rollout step as a user writes the `trajectory` baseline (a slot of cores / n per
trajectory) and the `isolated` one: n = 1 to 64 trajectories on this machine's cores, one
action each asking for cores / n (a third of that under `isolated`, whose task pool holds a
third of the node), trajectories ended only after the whole step. Every action must be done
within BOUND_SECONDS: a wait for good shows as a timeout naming what still waits. The sweep
runs through the mock manager (the orchestrator, its event loop and wall clock are real;
the action is a short sleep); a sample of n runs real sandbox processes.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tangram import Call, Inventory, MockManager, Orchestrator, RuntimeConfig
from tangram.runtime import ActionInfeasible

# Every action of a step is done within this many seconds, or the test fails: the actions
# take milliseconds, so only an action that waits for good comes near it.
BOUND_SECONDS = 60.0


def machine_cores() -> float:
    return float(Inventory.local().nodes[0].resources["cpu"])


def step_config(policy: str, n: int, cores: float) -> tuple[RuntimeConfig, float]:
    """The policy's configuration for n trajectories on `cores`, and each action's cores."""
    if policy == "trajectory":
        return RuntimeConfig(policy="trajectory", policy_options={"trajectory_slot_cpu": cores / n}), cores / n
    # Task pool 0 (every Call's) holds a third of each node beside pool 1; the weights do not
    # divide the node evenly in milli-cores.
    return RuntimeConfig(policy="isolated", policy_options={"pools": {0: 1.0, 1: 2.0}}), cores / (3 * n)


async def one_step(orch: Orchestrator, n: int, demand: float, call) -> None:  # type: ignore[no-untyped-def]
    """n trajectories, one action each; trajectories end once every action is done."""
    handles = [orch.submit(call(t, demand)) for t in range(1, n + 1)]
    done, pending = await asyncio.wait([asyncio.ensure_future(h.future) for h in handles], timeout=BOUND_SECONDS)
    if pending:
        waiting = [h.id for h in handles if not h.future.done()]
        pytest.fail(f"{len(pending)} of {n} actions not done within {BOUND_SECONDS:g} s: " +
                    "; ".join(orch.explain_now(i) for i in waiting[:3]))
    for f in done:
        assert not isinstance(f.exception(), ActionInfeasible), f.exception()
        assert f.exception() is None, f.exception()
    for t in range(1, n + 1):
        await orch.end_trajectory(t)


def sleep_call(trajectory: int, demand: float) -> Call:
    return Call(runtime=0.005, resources={"cpu": demand}, trajectory=trajectory)


def command_call(trajectory: int, demand: float) -> Call:
    return Call(command=[sys.executable, "-c", "print(1)"], resources={"cpu": demand}, trajectory=trajectory,
                timeout=BOUND_SECONDS)


@pytest.mark.parametrize("policy", ["trajectory", "isolated"])
def test_every_n_from_1_to_64_finishes(policy: str) -> None:
    cores = machine_cores()

    async def main() -> None:
        for n in range(1, 65):
            config, demand = step_config(policy, n, cores)
            async with Orchestrator(config, default_managers=False, managers={"cpu": MockManager()}) as orch:
                await one_step(orch, n, demand, sleep_call)
                assert orch.scheduler is not None and orch.scheduler.waiting == 0 and orch.scheduler.running == 0

    asyncio.run(main())


# Real sandbox processes: a command action per trajectory, at the counts that hung (17 and
# 32: one slot short when the slot was rounded) and around them.
@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 31, 32, 33, 63, 64])
@pytest.mark.parametrize("policy", ["trajectory", "isolated"])
def test_sandbox_processes_finish(policy: str, n: int) -> None:
    cores = machine_cores()
    config, demand = step_config(policy, n, cores)

    async def main() -> None:
        async with Orchestrator(config) as orch:
            await one_step(orch, n, demand, command_call)

    asyncio.run(main())


# More trajectories than slots, none ended before the step's end: the trajectories without
# a slot run in slots lent by holders with nothing live, instead of waiting for an end that
# only comes after the step.
def test_more_trajectories_than_slots_finish() -> None:
    async def main() -> None:
        config = RuntimeConfig(policy="trajectory", policy_options={"trajectory_slot_cpu": 1.0})
        inventory = Inventory.uniform(1, {"cpu": 2, "memory": 4096})
        async with Orchestrator(config, inventory=inventory, default_managers=False,
                                managers={"cpu": MockManager()}) as orch:
            await one_step(orch, 40, 1.0, sleep_call)

    asyncio.run(main())
