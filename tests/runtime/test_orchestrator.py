"""The orchestrator's own contract, through the mock manager: one terminal state per
action, batching, timeouts and cancels, quotas and records, the sync facade, metrics."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

import tangram
from tangram import Call, Inventory, MockManager, Orchestrator, Quota, SyncOrchestrator
from tangram.runtime import ActionCancelled, ActionFailed, ActionInfeasible, ActionTimeout, OrchestratorClosed
from tangram.runtime.errors import ManagerError


def inventory(cpu: float = 4, quotas=()):  # type: ignore[no-untyped-def]
    return Inventory.uniform(1, {"cpu": cpu, "memory": 8192}, quotas=quotas)


def orchestrator(cpu: float = 4, quotas=(), policy: str = "tangram", **kw) -> Orchestrator:  # type: ignore[no-untyped-def]
    mock = MockManager()
    return Orchestrator(inventory=inventory(cpu, quotas), policy=policy, default_managers=False,
                        managers={"cpu": mock, "api": mock}, **kw)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def assert_idle(orch: Orchestrator) -> None:
    """Every action ended, the core is empty and its pools are exactly full."""
    assert not orch._live
    assert orch.scheduler is not None
    assert orch.scheduler.waiting == 0 and orch.scheduler.running == 0
    for n, node in enumerate(orch.inventory.nodes):
        for kind, cap in node.resources.items():
            assert orch.scheduler.free(n, kind) == pytest.approx(cap)
    orch.scheduler.check_invariants()
    assert all(w == 0 and r == 0 for w, r in orch.queue_lengths_now().values())


def test_run_returns_the_function_result_and_keeps_a_record() -> None:
    async def main() -> None:
        async with orchestrator() as orch:
            assert await orch.run(Call(fn=lambda a, b: a + b, args=(2, 3), kind="env")) == 5
            await asyncio.sleep(0)
            assert_idle(orch)
            (rec,) = list(orch.records)
            assert rec.outcome == "ok" and rec.kind == "env" and rec.node == "node0"
            assert rec.submit <= rec.start <= rec.end and rec.act is not None and rec.act >= 0

    run(main())


def test_a_burst_is_one_batch_and_queues_beyond_capacity() -> None:
    async def main() -> None:
        async with orchestrator(cpu=2) as orch:
            calls = [Call(runtime=0.05, resources={"cpu": 1}) for _ in range(6)]
            started = time.perf_counter()
            results = await orch.map(calls)
            elapsed = time.perf_counter() - started
            assert results == [None] * 6
            mock = orch.managers["cpu"]
            assert isinstance(mock, MockManager)
            assert mock.max_running == 2  # capacity 2 cores, 1 core each
            assert elapsed >= 0.15 - 0.01  # three waves of 0.05 s
            waited = [r for r in orch.records if r.wait_reason]
            assert len(waited) == 4 and all("resources" in r.wait_reason or "cpu" in r.wait_reason for r in waited)
            await asyncio.sleep(0)
            assert_idle(orch)

    run(main())


def test_elastic_grant_reaches_the_manager() -> None:
    async def main() -> None:
        async with orchestrator(cpu=4) as orch:
            await orch.run(Call(resources={"cpu": 1}, elastic="cpu", max_units=4, runtime=tangram.Amdahl(1.0, 0.9)))
            _, _, placement = orch.managers["cpu"].events[0]  # type: ignore[attr-defined]
            assert placement.cores == 4 and placement.grant == 4

    run(main())


def test_every_error_is_typed_and_terminal() -> None:
    def boom() -> None:
        raise KeyError("missing")

    async def main() -> None:
        async with orchestrator() as orch:
            with pytest.raises(ActionFailed, match="KeyError"):
                await orch.run(Call(fn=boom))
            with pytest.raises(ActionInfeasible, match="can never run"):
                await orch.run(Call(resources={"cpu": 64}))
            with pytest.raises(ActionTimeout):
                await orch.run(Call(runtime=10.0, timeout=0.05))
            await asyncio.sleep(0)
            assert_idle(orch)
            outcomes = sorted(r.outcome for r in orch.records)  # type: ignore[type-var]
            assert outcomes == ["failed", "infeasible", "timeout"]

    run(main())


def test_bad_calls_raise_at_submit_naming_the_field() -> None:
    async def main() -> None:
        async with orchestrator() as orch:
            with pytest.raises(tangram.UnknownNameError, match=r"call\.resources"):
                orch.submit(Call(resources={"gpu_hours": 1}))
            with pytest.raises(tangram.ValidationError, match=r"call\.max_units"):
                orch.submit(Call(resources={"cpu": 1}, elastic="cpu"))
            with pytest.raises(tangram.ValidationError, match=r"call\.timeout"):
                orch.submit(Call(timeout=-1))
            with pytest.raises(ManagerError, match=r"call\.manager"):
                orch.submit(Call(manager="nope"))
            with pytest.raises(tangram.UnknownNameError, match=r"call\.quota"):
                orch.submit(Call(quota="nope"))
            # Beyond the core's bounds, caught when the batch is flushed: only the bad action fails.
            good = orch.submit(Call(runtime=0.0))
            bad = orch.submit(Call(resources={"cpu": 1e13}))
            assert await good is None
            with pytest.raises(tangram.ValidationError, match=r"call\.resources\.cpu"):
                await bad
            # Alone in its batch, too.
            with pytest.raises(tangram.ValidationError, match=r"call\.runtime\.seconds"):
                await orch.run(Call(runtime=2e9))
            await asyncio.sleep(0)
            assert_idle(orch)

    run(main())


def test_cancel_waiting_and_running_actions() -> None:
    async def main() -> None:
        async with orchestrator(cpu=1) as orch:
            running = orch.submit(Call(runtime=10.0))
            waiting = orch.submit(Call(runtime=10.0))
            await asyncio.sleep(0.01)
            reason = await orch.explain(waiting.id)
            assert "cpu" in reason or "resources" in reason
            assert waiting.cancel() and running.cancel()
            for h in (running, waiting):
                with pytest.raises(ActionCancelled):
                    await h
            assert not running.cancel()  # already ended
            # Cancelling the task that awaits an action cancels the action too.
            task = asyncio.ensure_future(orch.run(Call(runtime=10.0)))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.01)
            assert_idle(orch)
            assert [r.outcome for r in orch.records] == ["cancelled"] * 3

    run(main())


def test_a_cancel_of_a_running_and_a_waiting_action_at_once_leaves_no_action_behind() -> None:
    """What a client that drops does: it cancels its running action and its waiting one in
    the same breath. The running one's end frees its cores; they must go to the waiting
    action of another caller, not to the one withdrawn (whose start, had the core made it,
    used to fail and lose the batch's other starts: that caller's action waited for good)."""
    async def main() -> None:
        async with orchestrator(cpu=2) as orch:
            running = orch.submit(Call(runtime=60.0, resources={"cpu": 2}))
            while not orch._live[running.id].running:
                await asyncio.sleep(0.005)
            withdrawn = orch.submit(Call(runtime=0.01, resources={"cpu": 1}))
            bystander = orch.submit(Call(runtime=0.01, resources={"cpu": 1}))
            await asyncio.sleep(0.01)  # both wait in the core
            assert running.cancel() and withdrawn.cancel()
            await asyncio.wait_for(bystander.future, 30)
            for h in (running, withdrawn):
                with pytest.raises(ActionCancelled):
                    await h
            assert_idle(orch)
            assert sorted(r.outcome for r in orch.records) == ["cancelled", "cancelled", "ok"]

    run(main())


class _FirstStepManager(tangram.runtime.ResourceManager):
    """Runs `hook(orch, action)` in the first step of execute, then sleeps `seconds`
    (0: returns at once, without suspending)."""

    name = "first-step"

    def __init__(self, hook=None, seconds: float = 0.0) -> None:  # type: ignore[no-untyped-def]
        self.hook = hook
        self.seconds = seconds
        self.orch: Orchestrator | None = None
        self.steps: list[str] = []

    async def execute(self, action, placement):  # type: ignore[no-untyped-def]
        self.steps.append("first")
        if self.hook is not None:
            self.hook(self.orch, action)
        if self.seconds:
            try:
                await asyncio.sleep(self.seconds)
            except asyncio.CancelledError:
                self.steps.append("cancelled")
                raise
        return "done"


def _first_step_orchestrator(manager: _FirstStepManager) -> Orchestrator:
    orch = Orchestrator(inventory=inventory(), default_managers=False, managers={"cpu": manager})
    manager.orch = orch
    return orch


def test_an_action_that_ends_without_suspending_ends_in_its_start() -> None:
    # Eager start: the manager's first step runs as the core's start decision is carried
    # out, so an action that needs no waiting has its result when the flush returns.
    async def main() -> None:
        manager = _FirstStepManager()
        async with _first_step_orchestrator(manager) as orch:
            handle = orch.submit(Call(runtime=0.0))
            orch.flush()
            assert handle.future.done() and handle.future.result() == "done"
            assert orch._live == {}
            await asyncio.sleep(0)
            assert_idle(orch)

    run(main())


def test_a_cancel_before_the_task_first_runs_reaches_the_action() -> None:
    # The action suspended in its first step; its task has not run yet when the cancel
    # comes: the manager still sees the CancelledError and the action ends cancelled.
    async def main() -> None:
        manager = _FirstStepManager(seconds=30.0)
        async with _first_step_orchestrator(manager) as orch:
            handle = orch.submit(Call(runtime=1.0))
            orch.flush()
            assert manager.steps == ["first"] and orch._live[handle.id].running
            assert handle.cancel()
            with pytest.raises(ActionCancelled, match="cancelled while running"):
                await asyncio.wait_for(handle.future, 5)
            assert manager.steps == ["first", "cancelled"]
            await asyncio.sleep(0)
            assert_idle(orch)

    run(main())


@pytest.mark.parametrize("seconds", [0.0, 30.0])
def test_a_cancel_from_inside_the_first_step_is_kept(seconds: float) -> None:
    # The manager cancels its own action before it has a task: when it then suspends, its
    # task is cancelled as soon as it exists; when it ends at once, its result stands.
    async def main() -> None:
        manager = _FirstStepManager(hook=lambda orch, action: orch.cancel(action.id), seconds=seconds)
        async with _first_step_orchestrator(manager) as orch:
            handle = orch.submit(Call(runtime=1.0))
            if seconds:
                with pytest.raises(ActionCancelled):
                    await asyncio.wait_for(handle.future, 5)
                assert manager.steps == ["first", "cancelled"]
            else:
                assert await handle == "done"
            await asyncio.sleep(0)
            assert_idle(orch)
            assert [r.outcome for r in orch.records] == ["cancelled" if seconds else "ok"]

    run(main())


def test_a_requeue_from_inside_the_first_step_runs_the_action_again() -> None:
    async def main() -> None:
        requeued: list[int] = []

        def hook(orch, action):  # type: ignore[no-untyped-def]
            if not requeued:
                requeued.append(action.id)
                assert orch.requeue(action.id)

        manager = _FirstStepManager(hook=hook, seconds=0.05)
        async with _first_step_orchestrator(manager) as orch:
            assert await asyncio.wait_for(orch.run(Call(runtime=1.0)), 5) == "done"
            assert manager.steps == ["first", "cancelled", "first"]
            await asyncio.sleep(0)
            assert_idle(orch)

    run(main())


def test_the_first_step_runs_in_the_action_task_context() -> None:
    # A context variable set by the manager's first step stays in the action's own
    # context, as it would in a task, and is still set when the action resumes.
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="caller")
    seen: list[str] = []

    class Setter(tangram.runtime.ResourceManager):
        name = "setter"

        async def execute(self, action, placement):  # type: ignore[no-untyped-def]
            var.set(f"action {action.id}")
            await asyncio.sleep(0.001)
            seen.append(var.get())

    async def main() -> None:
        async with Orchestrator(inventory=inventory(), default_managers=False, managers={"cpu": Setter()}) as orch:
            handle = orch.submit(Call(runtime=1.0))
            orch.flush()
            assert var.get() == "caller"
            await handle
            assert seen == [f"action {handle.id}"] and var.get() == "caller"

    run(main())


def test_the_first_step_may_use_wait_for_when_started_outside_any_task() -> None:
    # The second action starts when the first ends, from the orchestrator's callback (no
    # task is running then): its first step calls asyncio.wait_for, which on Python 3.12+
    # needs a current task (the CPU manager's does so when it replaces a worker).
    class Waiter(tangram.runtime.ResourceManager):
        name = "waiter"

        async def execute(self, action, placement):  # type: ignore[no-untyped-def]
            done = asyncio.get_running_loop().create_future()
            done.set_result(action.id)
            return await asyncio.wait_for(asyncio.shield(done), 5)

    async def main() -> None:
        async with Orchestrator(inventory=inventory(), default_managers=False, managers={"cpu": Waiter()}) as orch:
            whole = {"cpu": 4.0}  # the whole node: the second waits for the first
            first = orch.submit(Call(resources=whole, runtime=1.0))
            second = orch.submit(Call(resources=whole, runtime=1.0))
            assert await asyncio.wait_for(asyncio.gather(first, second), 5) == [first.id, second.id]

    run(main())


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.11 has no eager tasks: no task in the first step")
def test_the_first_step_runs_as_the_action_task_not_the_submitter() -> None:
    # asyncio.timeout in the first step belongs to the action's own task: submitted from
    # the caller's task, the first step must not see (or cancel) the caller's task.
    seen: list[object] = []

    class Timed(tangram.runtime.ResourceManager):
        name = "timed"

        async def execute(self, action, placement):  # type: ignore[no-untyped-def]
            seen.append(asyncio.current_task())
            async with asyncio.timeout(0.01):
                await asyncio.sleep(30)

    async def main() -> None:
        async with Orchestrator(inventory=inventory(), default_managers=False, managers={"cpu": Timed()}) as orch:
            handle = orch.submit(Call(runtime=1.0))
            orch.flush()
            with pytest.raises(ActionFailed, match="TimeoutError"):
                await asyncio.wait_for(handle.future, 5)
            assert seen and seen[0] is not None and seen[0] is not asyncio.current_task()

    run(main())


def test_quota_admission_is_part_of_act_and_visible_in_records() -> None:
    async def main() -> None:
        quota = Quota("search", rate=20, burst=2, max_concurrency=4)
        async with orchestrator(quotas=[quota]) as orch:
            calls = [Call(fn=lambda: "hit", quota="search", resources={"cpu": 0.01}, kind="search", runtime=0.0)
                     for _ in range(6)]
            started = time.perf_counter()
            assert await orch.map(calls) == ["hit"] * 6
            elapsed = time.perf_counter() - started
            # burst 2, then 20/s: the 6th is admitted 4 intervals of 50 ms later.
            assert elapsed >= 0.2 - 0.02
            starts = sorted(r.start for r in orch.records)  # type: ignore[type-var]
            assert starts[-1] - starts[0] == pytest.approx(0.2, abs=0.05)
            assert sum("quota" in r.wait_reason for r in orch.records) == 4
            await asyncio.sleep(0)
            assert_idle(orch)

    run(main())


def test_close_ends_everything_explicitly() -> None:
    async def main() -> None:
        orch = await orchestrator(cpu=1).start()
        handles = [orch.submit(Call(runtime=10.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        await orch.close()
        for h in handles:
            with pytest.raises(ActionCancelled):
                await h
        with pytest.raises(OrchestratorClosed):
            orch.submit(Call())
        assert sorted(r.outcome for r in orch.records) == ["cancelled"] * 3  # type: ignore[type-var]

    run(main())


def test_close_with_drain_lets_actions_finish() -> None:
    async def main() -> None:
        orch = await orchestrator(cpu=1).start()
        handles = [orch.submit(Call(runtime=0.02)) for _ in range(3)]
        await orch.close(drain=True)
        assert [await h for h in handles] == [None] * 3

    run(main())


def test_sync_facade_is_shared_by_threads() -> None:
    mock = MockManager()
    with SyncOrchestrator(inventory=inventory(cpu=4), default_managers=False, managers={"cpu": mock}) as orch:
        results: dict[int, object] = {}

        def worker(i: int) -> None:
            results[i] = orch.run(Call(fn=lambda x: x * x, args=(i,)))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {i: i * i for i in range(16)}
        assert orch.map([Call(fn=lambda: 1), Call(resources={"cpu": 99})])[0] == 1
        with pytest.raises(tangram.UnknownNameError):
            orch.submit(Call(resources={"bogus": 1}))
        h = orch.submit(Call(runtime=30.0))
        assert orch.cancel(h.id)
        with pytest.raises(ActionCancelled):
            h.result(5)
    assert len(orch.records) == 19


def test_metrics_export_act_histograms_queues_and_utilisation() -> None:
    async def main() -> None:
        async with orchestrator(cpu=2, quotas=[Quota("search", rate=100.0, burst=10)]) as orch:
            await orch.map([Call(runtime=0.0, kind="reward") for _ in range(3)])
            await orch.map([Call(runtime=0.0, quota="search") for _ in range(2)])
            blocker = orch.submit(Call(runtime=10.0, resources={"cpu": 2}, kind="env"))
            await asyncio.sleep(0.01)
            queued = orch.submit(Call(runtime=0.0, kind="env"))
            await asyncio.sleep(0.01)
            assert orch.metrics is not None
            text = orch.metrics.text().decode()
            assert 'tangram_action_completion_seconds_count{kind="reward",quota=""} 3.0' in text
            assert 'tangram_actions_total{kind="reward",outcome="ok",quota=""} 3.0' in text
            # labelled by its quota as well as its kind (a search call is kind "env")
            assert 'tangram_action_completion_seconds_count{kind="env",quota="search"} 2.0' in text
            assert 'tangram_actions_total{kind="env",outcome="ok",quota="search"} 2.0' in text
            assert all(r.quota == ("search" if r.kind == "env" else "") for r in orch.records)
            assert 'tangram_actions_waiting{kind="env"} 1.0' in text
            assert 'tangram_actions_running{kind="env"} 1.0' in text
            assert 'tangram_resource_utilisation{node="node0",resource="cpu"} 1.0' in text
            blocker.cancel()
            await queued
            with pytest.raises(ActionCancelled):
                await blocker

    run(main())


def test_status_snapshot_for_a_live_view() -> None:
    async def main() -> None:
        async with orchestrator(cpu=2, quotas=[Quota("search", rate=1.0, burst=1)]) as orch:
            await orch.map([Call(runtime=0.0) for _ in range(3)])
            long = [orch.submit(Call(runtime=30.0, resources={"cpu": 0.5}, trajectory=t)) for t in (1, 2, 3)]
            queued = orch.submit(Call(runtime=30.0, resources={"cpu": 1}, trajectory=4))
            searches = [orch.submit(Call(runtime=30.0, resources={"cpu": 0.25}, quota="search", trajectory=5 + i))
                        for i in range(2)]
            await asyncio.sleep(0.05)
            status = await orch.status()
            assert status["policy"] == "tangram" and status["objective"] == "step"
            # waiting: the one short of cores, the second search (the quota's rate)
            assert status["queues"]["env"] == [2, 4]
            assert status["quotas"] == {"search": [1, 1]}
            assert status["running_total"] == 4 and len(status["running"]) == 4
            assert [r[5] for r in status["running"]] == sorted((r[5] for r in status["running"]), reverse=True)
            assert {r[2] for r in status["running"]} == {"", "search"}
            assert status["last_minute"]["ended"] == 3 and status["last_minute"]["act_p99"] is not None
            assert ["node0", "cpu", 0.875] in status["utilisation"]  # 3 x 0.5 + 0.25 of 2 cores
            assert status["services"] == {}
            for h in (*long, queued, *searches):
                h.cancel()

    run(main())


def test_metrics_served_over_http() -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        config = tangram.RuntimeConfig(metrics_port=port)
        async with Orchestrator(config, inventory=inventory(), default_managers=False,
                                managers={"cpu": MockManager()}) as orch:
            await orch.run(Call(runtime=0.0))
            def scrape() -> bytes:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
                    return response.read()

            body = await asyncio.to_thread(scrape)
            assert b"tangram_action_completion_seconds_bucket" in body

    run(main())


def test_config_file_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tangram.toml"
    path.write_text("""
policy = "fifo"
[[quotas]]
name = "search"
rate = 5
burst = 1
[managers.api]
max_threads = 4
[inventory]
nodes = [{ name = "n0", resources = { cpu = 2, memory = 1024 } }]
""")
    config = tangram.RuntimeConfig.from_file(path)
    assert config.policy == "fifo" and config.inventory is not None
    assert config.inventory.quotas[0].name == "search"
    orch = Orchestrator(config, default_managers=False)
    assert set(orch.managers) == {"api"} and orch.managers["api"].max_threads == 4  # type: ignore[attr-defined]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[quotas]]\nname = "q"\nrpm = 3\n')
    with pytest.raises(tangram.ValidationError, match=r"quotas\[0\]\.rpm"):
        tangram.RuntimeConfig.from_file(bad)


def test_managers_are_plugins_by_name_and_entry_point(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from importlib.metadata import EntryPoint

    from tangram.runtime.managers import base as registry

    class Echo(tangram.ResourceManager):
        name = "echo"

        async def execute(self, action, placement):  # type: ignore[no-untyped-def]
            return ("echo", action.call.args)

    # An installed package declares it under the entry-point group "tangram.managers".
    module = type(sys)("echo_plugin")
    module.Echo = Echo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "echo_plugin", module)
    ep = EntryPoint("echo", "echo_plugin:Echo", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else [])
    assert registry.manager_class("echo") is Echo
    with pytest.raises(ManagerError, match="no resource manager named 'nope'.*echo"):
        registry.manager_class("nope")

    async def main() -> None:
        config = tangram.RuntimeConfig(managers={"echo": {}})
        async with Orchestrator(config, inventory=inventory(), default_managers=False) as orch:
            assert await orch.run(Call(args=(1, 2), manager="echo")) == ("echo", (1, 2))

    run(main())
    with pytest.raises(ManagerError, match=r"managers\.echo"):
        Orchestrator(tangram.RuntimeConfig(managers={"echo": {"bogus": 1}}), inventory=inventory(),
                     default_managers=False)


# A config's quotas and services are never silently dropped: with an explicit inventory
# (which carries its own) they are refused, naming the config's field.
def test_config_quotas_beside_an_explicit_inventory_are_refused() -> None:
    config = tangram.RuntimeConfig(quotas=[tangram.Quota("search", rate=5)])
    with pytest.raises(tangram.ValidationError) as info:
        Orchestrator(config, inventory=inventory())
    assert info.value.field == "config.quotas"
    with pytest.raises(tangram.ValidationError) as info:
        Orchestrator(tangram.RuntimeConfig(services=[tangram.Service("rm", memory=1024)]), inventory=inventory())
    assert info.value.field == "config.services"
