"""One API, whichever front: `Orchestrator`, `Client` (and `RayOrchestrator`) satisfy
`tangram.OrchestratorAPI` member by member, the sync facades mirror it, the README's live
example runs unchanged against a `tangram serve`, and a Client's `records` are the
server's records of its own actions."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

import tangram
from tangram import Call, Client, Inventory, MockManager, Orchestrator, OrchestratorAPI, SyncClient, SyncOrchestrator
from tangram.runtime import ActionCancelled, ActionFailed, ActionInfeasible
from tangram.runtime.interface import ActionHandleAPI
from tangram.server import Server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

README = Path(__file__).resolve().parents[2] / "README.md"
LIFECYCLE = {"start", "__aenter__", "__aexit__"}  # the sync facades start in their constructor


def _members() -> tuple[list[str], list[str]]:
    """The Protocol's methods and its data members."""
    methods = [n for n, v in vars(OrchestratorAPI).items() if inspect.isfunction(v) and not n.startswith("_abc")
               and n not in ("__init__", "__subclasshook__")]
    return methods, list(OrchestratorAPI.__annotations__)


def _mock_orchestrator(cpu: float = 2) -> Orchestrator:
    return Orchestrator(inventory=Inventory.uniform(1, {"cpu": cpu, "memory": 4096}), default_managers=False,
                        managers={"cpu": MockManager()})


# Invariant: the Protocol lists what the task names (a guard against members dropping
# out of it silently).
def test_the_protocol_lists_the_whole_api() -> None:
    methods, data = _members()
    assert set(methods) == {"start", "close", "__aenter__", "__aexit__", "submit", "reserve_id", "run", "map",
                            "cancel", "end_trajectory", "explain", "queue_lengths", "utilisation", "status", "quota",
                            "back_off_quota"}
    assert data == ["records"]


# Invariant: both fronts are OrchestratorAPI instances at run time (runtime_checkable:
# every member present), before they start; their handles are ActionHandleAPI instances.
def test_both_fronts_and_their_handles_are_instances_of_the_protocol() -> None:
    assert isinstance(_mock_orchestrator(), OrchestratorAPI)
    assert isinstance(Client("127.0.0.1:1"), OrchestratorAPI)
    assert not isinstance(object(), OrchestratorAPI)

    async def main() -> None:
        async with _mock_orchestrator() as orch:
            async with Server(inventory=orch.inventory, port=0, default_managers=False,
                              managers={"cpu": MockManager()}) as server:
                async with Client("%s:%d" % server.address) as client:
                    for front in (orch, client):
                        handle = front.submit(Call(fn=lambda: 1))
                        assert isinstance(handle, ActionHandleAPI)
                        assert await handle == 1

    asyncio.run(main())


# Invariant: each member has the same shape on every front: a coroutine function where
# the Protocol's is one, a plain function where it is not, and at least the Protocol's
# parameters, by name.
def test_every_member_has_the_protocols_shape_on_every_front() -> None:
    from tangram.ray import RayOrchestrator

    methods, _ = _members()
    for cls in (Orchestrator, Client, RayOrchestrator):
        for name in methods:
            spec, impl = getattr(OrchestratorAPI, name), getattr(cls, name)
            assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(spec), (cls.__name__, name)
            wanted = [p for p in inspect.signature(spec).parameters if p != "self"]
            have = inspect.signature(impl).parameters
            assert all(p in have for p in wanted), (cls.__name__, name, wanted, list(have))


# Invariant: the thread-safe facades offer the same members as plain (blocking) methods,
# and the same `records`.
def test_the_sync_facades_mirror_the_protocol() -> None:
    methods, _ = _members()
    for cls in (SyncOrchestrator, SyncClient):
        for name in methods:
            if name in LIFECYCLE or name == "reserve_id":
                continue
            impl = getattr(cls, name)
            assert inspect.isfunction(impl) and not inspect.iscoroutinefunction(impl), (cls.__name__, name)
        assert isinstance(inspect.getattr_static(cls, "records"), property)
    with SyncOrchestrator(inventory=Inventory.uniform(1, {"cpu": 2, "memory": 4096}), default_managers=False,
                          managers={"cpu": MockManager()}) as orch:
        handle = orch.submit(Call(runtime=30.0, resources={"cpu": 2}))
        waiting = orch.submit(Call(runtime=0.0, resources={"cpu": 2}))
        assert orch.queue_lengths() == {"env": (1, 1)}
        assert orch.utilisation()[("node0", "cpu")] == 1.0
        assert "waiting" in orch.explain(waiting.id)
        handle.cancel()
        assert waiting.result(10) is None
        assert [r.outcome for r in orch.records] == ["cancelled", "ok"]


# ---------------------------------------------------------------- the README's live example

def _readme_live_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    found = [b for b in blocks if "tangram.Orchestrator() as orch" in b]
    assert len(found) == 1, "the README's live orchestrator example (`tangram.Orchestrator() as orch`)"
    return found[0]


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`tangram serve` as a user starts it: the default managers on this machine."""
    proc = subprocess.Popen([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--grace", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline(proc, 60.0)
        match = re.search(r"listening on (\S+)", line)
        assert match is not None, f"tangram serve did not start: {line!r}"
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr


# Invariant: the README's live example prints the same lines, as its comments say, run
# as written (in process) and with only `tangram.Orchestrator()` replaced by
# `tangram.Client(address)`: results, the sandbox kept across a trajectory, and records.
@pytest.mark.parametrize("front", ["Orchestrator", "Client"])
def test_the_readme_live_example_runs_on_both_fronts(front: str, request: pytest.FixtureRequest) -> None:
    code = _readme_live_example()
    if front == "Client":
        address = request.getfixturevalue("served")
        code = code.replace("tangram.Orchestrator()", f"tangram.Client({address!r})")
        assert f"tangram.Client({address!r}) as orch" in code
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    cores = min(8, len(os.sched_getaffinity(0)))
    assert done.stdout.splitlines() == [f"0 b'{cores}\\n'", "42", f"{float(cores)}"]


# ---------------------------------------------------------------- a client's records

def _comparable(record: tangram.ActionRecord) -> tuple[Any, ...]:
    # Everything but the trajectory, which the server numbers in the connection's space.
    return (record.id, record.kind, record.manager, record.submit, record.start, record.end, record.node,
            record.device, record.grant, record.outcome, record.wait_reason, record.error,
            record.estimate)


# Invariant: a Client's records are the server's records of that client's actions, field
# for field (the trajectory in the client's own numbering), for every terminal state:
# ok, failed, infeasible, cancelled while running, and one that waited (its wait reason).
def test_client_records_are_the_servers_records_of_its_actions() -> None:
    def boom() -> None:
        raise KeyError("missing")

    async def main() -> None:
        async with Server(inventory=Inventory.uniform(1, {"cpu": 2, "memory": 4096}), port=0,
                          default_managers=False, managers={"cpu": MockManager()}) as server:
            async with Client("%s:%d" % server.address) as client:
                assert len(client.records) == 0
                assert await client.run(Call(fn=lambda: 5, trajectory=3, kind="reward")) == 5
                with pytest.raises(ActionFailed):
                    await client.run(Call(fn=boom))
                with pytest.raises(ActionInfeasible):
                    await client.run(Call(resources={"cpu": 64}))
                blocker = client.submit(Call(runtime=30.0, resources={"cpu": 2}, trajectory=4))
                while "running" not in await client.explain(blocker.id):
                    await asyncio.sleep(0.01)
                waiter = client.submit(Call(runtime=0.0, resources={"cpu": 2}, elastic="cpu", max_units=2))
                while "waiting" not in await client.explain(waiter.id):
                    await asyncio.sleep(0.01)
                assert blocker.cancel()
                with pytest.raises(ActionCancelled):
                    await blocker
                assert await waiter is None
                mine = list(client.records)
                # A second client's actions are not the first one's records.
                async with Client("%s:%d" % server.address) as other:
                    await other.run(Call(fn=lambda: 1))
                    assert [r.id >> 32 for r in other.records] == [other.server_info["connection"]]
                theirs = {r.id: r for r in server.orchestrator.records}
        assert [r.outcome for r in mine] == ["ok", "failed", "infeasible", "cancelled", "ok"]
        assert [_comparable(r) for r in mine] == [_comparable(theirs[r.id]) for r in mine]
        assert [r.trajectory for r in mine] == [3, 0, 0, 4, 0]
        assert mine[0].kind == "reward" and mine[0].node == "node0" and mine[0].start is not None
        assert "KeyError" in mine[1].error
        assert mine[2].start is None and mine[2].grant is None and "can never run" in mine[2].error
        assert mine[4].grant == 2.0 and "resources" in mine[4].wait_reason
        # What each was planned with comes through too: declared, or learned (unknown at first).
        assert mine[3].estimate == mine[4].estimate == "declared"
        assert "unknown" in mine[0].estimate and "reward:" in mine[0].estimate

    asyncio.run(main())


# Invariant: with records=False the client keeps none (and the server sends none), and
# results are unaffected.
def test_client_records_can_be_turned_off() -> None:
    async def main() -> None:
        async with Server(inventory=Inventory.uniform(1, {"cpu": 2, "memory": 4096}), port=0,
                          default_managers=False, managers={"cpu": MockManager()}) as server:
            async with Client("%s:%d" % server.address, records=False) as client:
                assert await client.map([Call(fn=lambda i=i: i) for i in range(5)]) == [0, 1, 2, 3, 4]
                assert len(client.records) == 0 and list(client.records) == []
                assert len(server.orchestrator.records) == 5
            async with Client("%s:%d" % server.address, max_records=2) as client:
                await client.map([Call(fn=lambda i=i: i) for i in range(5)])
                assert len(client.records) == 2
        with pytest.raises(tangram.ValidationError, match="max_records"):
            Client(max_records=-1)

    asyncio.run(main())
