"""Hostile calls through the core's face and the in-process orchestrator: every bad call
ends alone, with a typed error naming its field (at submit where it can be seen there,
else as its own result), and nothing else notices: not the calls submitted in the same
event-loop iteration, not `close()`, and no process is left behind."""

from __future__ import annotations

import asyncio
import math
import operator
import os
import sys
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings

import tangram
from tangram import Action, Call, Inventory, MockManager, Orchestrator, Quota, Scheduler
from tangram.runtime.managers.api import ApiManager
from tangram.runtime.managers.base import LiveAction, ResourceManager

from hostile import HOSTILE, Mix, plans

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandboxes need Linux")
NAN, INF = math.nan, math.inf
BEYOND = {"id": 2**64, "trajectory": 2**64, "task": 2**32, "tokens": 2**63, "priority": 2**31}


# ------------------------------------------------------------------ the core's face

def refused(s: Scheduler, submit: Callable[[], Any], field: str) -> tangram.ValidationError:
    """`submit()` raises a ValidationError naming exactly `field` and changes nothing."""
    before = (s.waiting, s.running)
    with pytest.raises(tangram.ValidationError) as info:
        submit()
    assert info.value.field == field, str(info.value)
    assert (s.waiting, s.running) == before
    s.check_invariants()
    return info.value


# Integers beyond the core's record fields (ids, trajectories, tasks, tokens, priorities)
# are ValidationErrors naming the action and the field, never a bare OverflowError, and
# nothing of the batch is applied.
@pytest.mark.parametrize("field", sorted(BEYOND))
@pytest.mark.parametrize("sign", [1, -1])
def test_integers_beyond_the_record_are_refused_naming_the_field(field: str, sign: int) -> None:
    s = Scheduler(Inventory.uniform(1, {"cpu": 4}))
    value = sign * BEYOND[field] - (sign < 0)  # 2**64 and -2**64 - 1, ...
    batch = [Action(i, {"cpu": 1}) for i in range(1, 4)] + [Action(**{"id": 4, "demand": {"cpu": 1}, field: value})]
    refused(s, lambda: s.submit(batch, 0), f"actions[3].{field}")
    assert s.state(1) == "unknown"


# Values no record field can hold (a number beyond float64, a node index beyond int32, a
# mapping that is not one, a model whose callable raises) are typed errors too.
@pytest.mark.parametrize("action, field", [
    (Action(1, None), "actions[0].demand"),  # type: ignore[arg-type]
    (Action(1, {"cpu": 2**2000}), "actions[0].demand.cpu"),
    (Action(1, {"cpu": True}), "actions[0].demand.cpu"),
    (Action(1, {"cpu": 1}, gpu_memory=2**2000), "actions[0].gpu_memory"),
    (Action(1, {"cpu": 1}, affinity=2**40), "actions[0].affinity"),
    (Action(1, {"cpu": 1}, affinity=-1), "actions[0].affinity"),
    (Action(1, {"cpu": 1}, affinity=0.5), "actions[0].affinity"),  # type: ignore[arg-type]
    (Action(1, {"cpu": 1}, 2**2000), "actions[0].runtime.seconds"),
    (Action(1, {"cpu": 1}, tangram.Amdahl("slow", 0.5)), "actions[0].runtime.seconds"),  # type: ignore[arg-type]
    (Action(1, {"cpu": 1}, lambda u: 1 / 0), "actions[0].runtime"),
    (Action(1, {"cpu": 1}, lambda u: 2**2000), "actions[0].runtime"),
    (Action(1, {"cpu": 1}, tangram.Native(-1)), "actions[0].runtime.address"),
    (Action(1, {"cpu": 1}, elastic=["cpu"], max_units=2), "actions[0].elastic"),  # type: ignore[arg-type]
    (Action(1, {"cpu": 1}, elastic="cpu", max_units="8"), "actions[0].max_units"),  # type: ignore[arg-type]
    (Action(1, {"cpu": 1}, quota=["q"]), "actions[0].quota"),  # type: ignore[arg-type]
])
def test_values_no_record_holds_are_refused_naming_the_field(action: Action, field: str) -> None:
    s = Scheduler(Inventory.uniform(2, {"cpu": 4}))
    refused(s, lambda: s.submit([Action(7, {"cpu": 1}), action], 0), field.replace("actions[0]", "actions[1]"))


# ------------------------------------------------------------------ the orchestrator

def inventory() -> Inventory:
    return Inventory.uniform(1, {"cpu": 2, "memory": 4096}, quotas=[Quota("q")])


def mock_orchestrator() -> Orchestrator:
    mock = MockManager()
    return Orchestrator(inventory=inventory(), default_managers=False, managers={"cpu": mock, "api": mock})


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))  # a hang fails the test instead of stalling it


def assert_idle(orch: Orchestrator) -> None:
    """Every action ended and the core holds nothing."""
    assert not orch._live and orch._dispatch is not None and not orch._dispatch.pending_submit
    assert orch.scheduler is not None and orch.scheduler.waiting == 0 and orch.scheduler.running == 0
    orch.scheduler.check_invariants()


def sandbox_processes() -> list[int]:
    from tangram.runtime.sandbox.kills import marked_processes

    return marked_processes(f"{os.getpid()}.")


# The reported case: a trajectory beyond the core's 64 bits raises at submit, and the calls
# submitted in the same event-loop iteration, before and after it, all get their results;
# close() then ends cleanly.
def test_a_trajectory_beyond_the_core_raises_at_submit_and_the_iteration_runs() -> None:
    async def main() -> None:
        orch = await mock_orchestrator().start()
        before = [orch.submit(Call(fn=operator.add, args=(i, 1))) for i in range(10)]
        with pytest.raises(tangram.ValidationError) as info:
            orch.submit(Call(fn=operator.add, args=(0, 1), trajectory=2**64))
        assert info.value.field == "call.trajectory"
        after = [orch.submit(Call(fn=operator.add, args=(i, 1))) for i in range(10)]
        assert await asyncio.gather(*before, *after) == [i + 1 for i in range(10)] * 2
        assert_idle(orch)
        await orch.close()

    run(main())


# Robust anyway: a call whose trajectory is changed after submit (past every check) fails
# only its own record at the flush; the rest of the batch proceeds, close() is clean.
def test_a_call_that_fails_to_encode_at_the_flush_ends_alone() -> None:
    async def main() -> None:
        orch = await mock_orchestrator().start()
        good = [orch.submit(Call(fn=operator.add, args=(i, 1))) for i in range(5)]
        bad_call = Call(fn=operator.add, args=(0, 1))
        bad = orch.submit(bad_call)
        bad_call.trajectory = 2**64
        more = [orch.submit(Call(fn=operator.add, args=(i, 1))) for i in range(5)]
        assert await asyncio.gather(*good, *more) == [i + 1 for i in range(5)] * 2
        with pytest.raises(tangram.ValidationError) as info:
            await bad
        assert info.value.field == "call"
        assert [r.outcome for r in orch.records].count("failed") == 1
        assert_idle(orch)
        # Alone in its batch, too; then a cancel while waiting and close() still end
        # every action once.
        lone_call = Call(fn=operator.add, args=(0, 1))
        lone = orch.submit(lone_call)
        lone_call.trajectory = -1
        with pytest.raises(tangram.ValidationError):
            await lone
        running = orch.submit(Call(runtime=60.0, resources={"cpu": 2}))
        queued = orch.submit(Call(runtime=60.0, resources={"cpu": 2}))
        await asyncio.sleep(0)
        assert queued.cancel()
        await orch.close()
        for handle in (running, queued):
            with pytest.raises(tangram.ActionCancelled):
                await handle

    run(main())


# Each field of a Call of the wrong type or out of its range raises at submit, naming it;
# nothing is queued, and a good call right after runs.
@pytest.mark.parametrize("kwargs, field", [
    (dict(resources=None), "call.resources"),
    (dict(resources={"cpu": NAN}), "call.resources.cpu"),
    (dict(resources={"cpu": -1}), "call.resources.cpu"),
    (dict(resources={"cpu": 2**2000}), "call.resources.cpu"),
    (dict(env={"A": 1}), "call.env.A"),
    (dict(env={1: "a"}), "call.env"),
    (dict(env={"A=B": "a"}), "call.env"),
    (dict(env={"A": "a\0b"}), "call.env.A"),
    (dict(env=None), "call.env"),
    (dict(kwargs={1: 2}), "call.kwargs"),
    (dict(kwargs=None), "call.kwargs"),
    (dict(args=None), "call.args"),
    (dict(args="ab"), "call.args"),
    (dict(fn=5), "call.fn"),
    (dict(fn=None, command=[]), "call.command"),
    (dict(fn=None, command=["echo", 1]), "call.command[1]"),
    (dict(fn=None, command="echo \0"), "call.command"),
    (dict(trajectory=-1), "call.trajectory"),
    (dict(trajectory=True), "call.trajectory"),
    (dict(trajectory=2**20000), "call.trajectory"),  # too long even to show
    (dict(timeout=True), "call.timeout"),
    (dict(timeout=NAN), "call.timeout"),
    (dict(kind=None), "call.kind"),
    (dict(manager=["cpu"]), "call.manager"),
    (dict(idempotent=0), "call.idempotent"),
    (dict(idempotent=None), "call.idempotent"),
    (dict(elastic=["cpu"], max_units=2), "call.elastic"),
    (dict(priority=2**31), "call.priority"),
    (dict(tokens=2**64, quota="q"), "call.tokens"),
    (dict(gpu_memory=INF), "call.gpu_memory"),
    (dict(runtime=NAN), "call.runtime.seconds"),
    (dict(runtime=lambda u: 1 / 0), "call.runtime"),
    (dict(affinity=2**40), "call.affinity"),
    (dict(quota=5), "call.quota"),
])
def test_bad_fields_raise_at_submit_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    async def main() -> None:
        async with mock_orchestrator() as orch:
            with pytest.raises(tangram.ValidationError) as info:
                orch.submit(Call(**{"fn": operator.add, "args": (1, 2), **kwargs}))
            assert info.value.field == field, str(info.value)
            assert not orch._live and orch._dispatch is not None and not orch._dispatch.pending_submit
            assert await orch.run(Call(fn=operator.add, args=(1, 2))) == 3

    run(main())


# An action id given by the caller (the server's) and a trajectory to end are checked
# against the same record ranges.
def test_action_ids_and_ended_trajectories_beyond_the_core_are_refused() -> None:
    async def main() -> None:
        async with mock_orchestrator() as orch:
            for aid in (2**64, -1, "7", True):
                with pytest.raises(tangram.ValidationError) as info:
                    orch.submit(Call(runtime=0.0), aid)
                assert info.value.field == "action_id"
            for t in (2**64, -1, 1.5):
                with pytest.raises(tangram.ValidationError) as info:
                    await orch.end_trajectory(t)
                assert info.value.field == "trajectory"
            assert await orch.run(Call(runtime=0.0)) is None
            assert_idle(orch)

    run(main())


class Echo(ResourceManager):
    """A plugin manager that runs nothing: it returns its call's args."""

    name = "echo"

    async def execute(self, action: LiveAction, placement: tangram.runtime.Placement) -> Any:
        return action.call.args


# What "nothing to run" means is the manager's: the cpu manager needs fn or command and
# the api manager fn (both refused at submit, naming call.fn), the mock manager sleeps the
# runtime and a plugin runs what it likes; a GPU service call gives its input as its one
# argument, without fn.
@linux
def test_a_call_needs_what_its_manager_runs() -> None:
    from tangram.runtime.managers.cpu import CpuManager

    async def main() -> None:
        managers = {"cpu": CpuManager(resource_control="affinity"), "api": ApiManager(), "mock": MockManager(),
                    "echo": Echo()}
        async with Orchestrator(inventory=inventory(), default_managers=False, managers=managers) as orch:
            for call in (Call(), Call(args=(1,)), Call(quota="q", resources={}),
                         Call(command="true", quota="q", resources={})):
                with pytest.raises(tangram.ValidationError) as info:
                    orch.submit(call)
                assert info.value.field == "call.fn", str(info.value)
            assert await orch.run(Call(manager="mock", runtime=0.0)) is None
            assert await orch.run(Call(manager="echo", args=(1, 2), resources={})) == (1, 2)
            assert await orch.run(Call(fn=operator.add, args=(1, 2), quota="q", resources={})) == 3
            result = await orch.run(Call(command="true", resources={"cpu": 0.1}))
            assert result.returncode == 0
        assert sandbox_processes() == []

    run(main())
    # The managers of GPU services (the gpu manager, a Ray cluster's) take the service's
    # input as the call's one positional argument; a Ray node runs other calls in a sandbox.
    from tangram.ray.manager import RayManager
    from tangram.runtime.managers.gpu import GpuManager

    service = Call(service="judge", args=("input",), resources={})
    for manager in (GpuManager.__new__(GpuManager), RayManager.__new__(RayManager)):
        manager.check_call(service)
        for bad, field in ((dict(fn=len), "call.fn"), (dict(command="x"), "call.command"),
                           (dict(args=(1, 2)), "call.args"), (dict(kwargs={"a": 1}), "call.args")):
            with pytest.raises(tangram.ValidationError) as info:
                manager.check_call(Call(**{"service": "judge", "args": ("input",), **bad}))
            assert info.value.field == field
    with pytest.raises(tangram.ValidationError, match="call.service"):
        GpuManager.__new__(GpuManager).check_call(Call(fn=len))
    with pytest.raises(tangram.ValidationError, match="call.fn"):
        RayManager.__new__(RayManager).check_call(Call())
    RayManager.__new__(RayManager).check_call(Call(fn=len))


# The reported case: an environment value that is not a string is refused at submit,
# before any sandbox sees it (it used to end as a worker killed by signal 9); a string one
# reaches the command.
@linux
def test_a_bad_environment_never_reaches_a_sandbox() -> None:
    from tangram.runtime.managers.cpu import CpuManager

    async def main() -> None:
        managers = {"cpu": CpuManager(resource_control="affinity")}
        async with Orchestrator(inventory=inventory(), default_managers=False, managers=managers) as orch:
            with pytest.raises(tangram.ValidationError) as info:
                orch.submit(Call(command="echo $A", env={"A": 1}, resources={"cpu": 0.1}))
            assert info.value.field == "call.env.A"
            result = await orch.run(Call(command="echo $A", env={"A": "1"}, resources={"cpu": 0.1}))
            assert result.stdout == b"1\n"
        assert sandbox_processes() == []

    run(main())


# ------------------------------------------------------------------ random hostile mixes

# Random mixes of good and hostile calls within one event-loop iteration (the real cpu
# manager, the api manager, the mock manager): every good call gets its result, every bad
# one a typed error naming its field, nothing hangs, close() is clean and no sandbox
# process is left.
@linux
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(HOSTILE, max_size=30))
def test_random_hostile_calls_end_alone_in_process(plan: list[int]) -> None:
    from tangram.runtime.managers.cpu import CpuManager

    async def main() -> None:
        managers = {"cpu": CpuManager(resource_control="affinity"), "api": ApiManager(max_threads=2), "mock": MockManager()}
        orch = await Orchestrator(inventory=inventory(), default_managers=False, managers=managers).start()
        try:
            mix = Mix()
            mix.submit_plan(orch.submit, plan, HOSTILE)
            await mix.check_outcomes()
            await asyncio.sleep(0)
            assert_idle(orch)
        finally:
            await orch.close()
        assert orch._state == "closed"

    run(main())
    assert sandbox_processes() == []
