"""The orchestrator with its real managers: sandbox processes, the local search server's
own rate limit, the reward service, and the demo end to end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

import tangram
from tangram import Amdahl, Call, Inventory, Orchestrator, Quota, RuntimeConfig, Service, ValidationError
from tangram.demo import search, server_stats, start_search_server, stop_search_server
from tangram.runtime import ActionCancelled, ActionFailed, ActionTimeout, CommandResult
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.managers.gpu import FunctionService, GpuManager, ServiceHooks
from tangram.runtime.managers.base import MockManager

CORES = len(os.sched_getaffinity(0))


def local_inventory(quotas=(), services=(), gpus=()):  # type: ignore[no-untyped-def]
    return Inventory.uniform(1, {"cpu": CORES, "memory": 4096}, gpus=gpus, quotas=quotas, services=services)


def assert_idle(orch: Orchestrator) -> None:
    assert not orch._live
    assert orch.scheduler is not None and orch.scheduler.waiting == 0 and orch.scheduler.running == 0
    assert orch.scheduler.free(0, "cpu") == pytest.approx(CORES)
    cpu = orch.managers.get("cpu")
    if isinstance(cpu, CpuManager):
        assert all(v == 0 for v in cpu.usage.values())


def test_elastic_grant_and_pinning_seen_inside_the_action() -> None:
    async def main() -> None:
        async with Orchestrator(inventory=local_inventory(), default_managers=False,
                                config=RuntimeConfig(managers={"cpu": {}})) as orch:
            call = Call(command=["/bin/sh", "-c", "echo $TANGRAM_CORES; grep Cpus_allowed_list /proc/self/status"],
                        resources={"cpu": 1}, elastic="cpu", max_units=CORES, runtime=Amdahl(2.0, 0.9),
                        trajectory=1)
            result = await orch.run(call)
            assert isinstance(result, CommandResult) and result.returncode == 0
            cores, allowed = result.stdout.decode().split("\n")[:2]
            assert int(cores) == CORES  # nobody else waits: the whole elastic bound
            assert allowed.split(":")[1].strip() == (f"0-{CORES - 1}" if CORES > 1 else "0")
            # Then a non-elastic action of the same trajectory: one core granted, every idle one usable.
            one = await orch.run(Call(fn=lambda: (os.environ["TANGRAM_CORES"], sorted(os.sched_getaffinity(0))),
                                      resources={"cpu": 1}, trajectory=1))
            assert one == ("1", list(range(CORES)))
            record = list(orch.records)[0]
            assert record.grant == CORES and record.node == "node0"
            await asyncio.sleep(0)
            assert_idle(orch)

    asyncio.run(main())


def test_timeout_kills_the_process_tree_and_the_next_action_runs() -> None:
    async def main() -> None:
        async with Orchestrator(inventory=local_inventory(), default_managers=False,
                                config=RuntimeConfig(managers={"cpu": {}})) as orch:
            cpu = orch.managers["cpu"]
            assert isinstance(cpu, CpuManager)
            started = time.perf_counter()
            with pytest.raises(ActionTimeout):
                await orch.run(Call(command="sleep 30 & sleep 30 & echo started > marker; wait", timeout=0.5,
                                    trajectory=2))
            assert time.perf_counter() - started < 5
            for _ in range(100):
                if not [p for p in cpu.processes() if p]:
                    break
                await asyncio.sleep(0.05)
            assert cpu.processes() == []  # the sleeps died with the sandbox
            # The trajectory goes on in a fresh sandbox over the same files.
            assert await orch.run(Call(fn=lambda: open("marker").read().strip(), trajectory=2)) == "started"
            await asyncio.sleep(0)
            assert_idle(orch)
            assert [r.outcome for r in orch.records] == ["timeout", "ok"]

    asyncio.run(main())


def test_cancelling_a_running_command() -> None:
    async def main() -> None:
        async with Orchestrator(inventory=local_inventory(), default_managers=False,
                                config=RuntimeConfig(managers={"cpu": {}})) as orch:
            handle = orch.submit(Call(command=["sleep", "30"], trajectory=3))
            await asyncio.sleep(0.5)
            assert "running" in await orch.explain(handle.id)
            handle.cancel()
            with pytest.raises(ActionCancelled):
                await handle
            await asyncio.sleep(0)
            assert_idle(orch)
            cpu = orch.managers["cpu"]
            await orch.end_trajectory(3)
            assert cpu.processes() == []  # type: ignore[attr-defined]

    asyncio.run(main())


def test_quota_rate_observed_at_the_server() -> None:
    """The search server enforces its own token bucket (rate 20/s, burst 3) and answers
    429 beyond it. The core's quota has the same rate and one request less of burst: the
    headroom a client-side limiter needs for the jitter between admission and arrival."""
    rate, burst, calls = 20.0, 2, 24
    server = subprocess.Popen([sys.executable, "-P", "-m", "tangram.demo.search_server", "--rate", str(rate), "--burst",
                               str(burst + 1)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().split()[1])  # type: ignore[union-attr]

        async def main() -> float:
            quota = Quota("search", rate=rate, burst=burst, max_concurrency=4)
            async with Orchestrator(inventory=local_inventory(quotas=[quota]), default_managers=False,
                                    config=RuntimeConfig(managers={"api": {}})) as orch:
                started = time.perf_counter()
                results = await orch.map([Call(fn=search, args=(port, f"prime {i}"), quota="search",
                                               resources={"cpu": 0.01}, runtime=0.02, kind="search")
                                          for i in range(calls)])
                elapsed = time.perf_counter() - started
                assert all(isinstance(r, list) and r for r in results), [r for r in results if not isinstance(r, list)]
                waited = [r for r in orch.records if "quota" in r.wait_reason]
                assert len(waited) >= calls - burst - 4  # most of them waited for the quota, visibly
                return elapsed

        elapsed = asyncio.run(main())
        stats = server_stats(port)
        assert stats["requests"] == calls and stats["rejected"] == 0
        assert stats["max_in_window"] <= rate * stats["window"] + burst
        assert elapsed >= (calls - burst) / rate * 0.9
    finally:
        stop_search_server(server)


def test_reward_service_batches_on_its_device() -> None:
    batches: list[int] = []

    def score_batch(inputs: list[str]) -> list[float]:
        batches.append(len(inputs))
        return [json.loads(x)["passed"] / json.loads(x)["total"] for x in inputs]

    async def main() -> None:
        service = Service("reward", memory=1024, restore_seconds=0.05, max_batch=4)
        inventory = local_inventory(services=[service], gpus=[8192])
        gpu = GpuManager(services={"reward": FunctionService(batch_fn=score_batch)}, devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"gpu": gpu}) as orch:
            reports = [json.dumps({"passed": i, "total": 10}) for i in range(10)]
            scores = await orch.map([Call(args=(r,), service="reward", resources={}, gpu_memory=64, kind="reward")
                                     for r in reports])
            assert scores == [i / 10 for i in range(10)]
            assert sum(batches) == 10 and max(batches) <= 4 and len(batches) < 10

    asyncio.run(main())


def test_gpu_action_placed_into_evicted_memory_starts_after_the_offload() -> None:
    """The core frees an evicted service's memory when it decides; the action it places
    there starts only when the service's offload has returned (on hardware, sooner is an
    out-of-memory error). A 40,000 MiB action beside a 60,000 MiB service on an 81,920 MiB
    device: the idle service is evicted for it, and its offload takes 0.3 s."""
    offloaded: list[float] = []

    class SlowOffload(ServiceHooks):
        def load(self, device):  # type: ignore[no-untyped-def]
            return "weights"

        def offload(self, handle):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            offloaded.append(time.perf_counter())

        def restore(self, handle, device):  # type: ignore[no-untyped-def]
            pass

        def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
            return inputs

    async def main() -> None:
        inventory = local_inventory(services=[Service("big", memory=60000, restore_seconds=0.0)], gpus=[81920])
        managers = {"gpu": GpuManager(services={"big": SlowOffload()}, devices="inventory"), "mock": MockManager()}
        async with Orchestrator(inventory=inventory, default_managers=False, managers=managers) as orch:
            assert await orch.run(Call(args=("x",), service="big", resources={}, gpu_memory=64, kind="reward")) == "x"
            started = await orch.run(Call(fn=time.perf_counter, resources={}, gpu_memory=40000, manager="mock"))
            record = [r for r in orch.records if r.kind == "env"][-1]
            assert record.device == 0 and record.outcome == "ok"
            assert orch.scheduler is not None and orch.scheduler.service_location("big") is None  # evicted for it
            assert len(offloaded) == 1 and started >= offloaded[0]
            # Timed out while it waits for the next offload: a timeout, and the offload
            # still runs to its end.
            assert await orch.run(Call(args=("y",), service="big", resources={}, gpu_memory=64, kind="reward")) == "y"
            with pytest.raises(ActionTimeout):
                await orch.run(Call(fn=time.perf_counter, resources={}, gpu_memory=40000, manager="mock", timeout=0.05))
            assert [r.outcome for r in orch.records if r.kind == "env"][-1] == "timeout"
            for _ in range(100):
                if len(offloaded) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(offloaded) == 2

    asyncio.run(main())


def test_a_restore_done_early_is_ready_at_once_and_its_measured_time_is_learned(tmp_path) -> None:
    """The core plans a restore as restore_seconds long; the service's actions start when
    the restore hook has returned, not when that estimate runs out (a 30 s guess for a
    0.05 s restore here). The measured restore and offload times replace the declared ones,
    and persist in the estimates database for the next run."""
    class TimedHooks(ServiceHooks):
        def load(self, device):  # type: ignore[no-untyped-def]
            return "weights"

        def offload(self, handle):  # type: ignore[no-untyped-def]
            time.sleep(0.02)

        def restore(self, handle, device):  # type: ignore[no-untyped-def]
            time.sleep(0.05)

        def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
            return inputs

    database = tmp_path / "estimates.sqlite"

    async def main() -> float:
        inventory = local_inventory(services=[Service("reward", memory=6000, restore_seconds=30.0)], gpus=[8000])
        managers = {"gpu": GpuManager(services={"reward": TimedHooks()}, devices="inventory"), "mock": MockManager()}
        async with Orchestrator(inventory=inventory, default_managers=False, managers=managers,
                                config=RuntimeConfig(estimates=str(database))) as orch:
            began = time.perf_counter()
            assert await orch.run(Call(args=("a",), service="reward", resources={}, kind="reward")) == "a"  # load
            # A plain action needing the service's memory evicts it; the next call restores it.
            await orch.run(Call(fn=lambda: None, resources={}, gpu_memory=4000, manager="mock", runtime=0.01))
            assert orch.scheduler is not None and orch.scheduler.service_location("reward") is None
            assert await orch.run(Call(args=("b",), service="reward", resources={}, kind="reward")) == "b"
            elapsed = time.perf_counter() - began
            learned = {e["key"]: e for e in orch.estimates.entries()}
            assert {"service:reward:restore", "service:reward:offload"} <= set(learned)
            assert 0.04 <= orch._dispatch.router.service_time(0, "restore") < 1.0
            assert 0.01 <= orch._dispatch.router.service_time(0, "offload") < 1.0
            return elapsed

    assert asyncio.run(main()) < 30.0  # a load and a restore, neither waiting out the 30 s estimate

    async def again() -> None:  # a new run starts with the times learned before
        inventory = local_inventory(services=[Service("reward", memory=6000, restore_seconds=30.0)], gpus=[8000])
        managers = {"gpu": GpuManager(services={"reward": TimedHooks()}, devices="inventory")}
        async with Orchestrator(inventory=inventory, default_managers=False, managers=managers,
                                config=RuntimeConfig(estimates=str(database))) as orch:
            assert 0.04 <= orch._dispatch.router.service_time(0, "restore") < 1.0

    asyncio.run(again())


def test_calls_to_a_replicated_service_go_to_the_replica_that_serves_them_soonest() -> None:
    """Service(replicas=2) on two devices: a burst of calls naming the service is spread
    over both replicas (each its own instance, loaded on its own device), every output
    comes from the instance that ran it, and a lone call later goes to a resident replica
    with nothing queued."""
    class Instance(ServiceHooks):
        def load(self, device):  # type: ignore[no-untyped-def]
            return {"device": device.index}

        def offload(self, handle):  # type: ignore[no-untyped-def]
            pass

        def restore(self, handle, device):  # type: ignore[no-untyped-def]
            handle["device"] = device.index

        def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
            time.sleep(0.02)
            return [(handle["device"], x) for x in inputs]

    async def main() -> None:
        service = Service("rm", memory=600, restore_seconds=0.01, max_batch=2, replicas=2)
        inventory = local_inventory(services=[service], gpus=[1000, 1000])
        gpu = GpuManager(services={"rm": Instance()}, devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"gpu": gpu}) as orch:
            calls = [Call(args=(i,), service="rm", resources={}, kind="reward", runtime=0.02) for i in range(12)]
            outputs = await orch.map(calls)
            assert [x for _, x in outputs] == list(range(12))
            devices = [device for device, _ in outputs]
            assert devices.count(0) == devices.count(1) == 6  # balanced: whole batches of 2 each
            described = gpu.describe()["services"]
            assert {described["rm#0"]["resident_on"], described["rm#1"]["resident_on"]} == {0, 1}
            assert (await orch.run(calls[0]))[1] == 0
            assert (await orch.run(Call(args=(7,), service="rm#1", resources={}, kind="reward"))) == (1, 7)
            with pytest.raises(ValidationError):  # refused at submit: nothing routed
                orch.submit(Call(args=(1, 2), service="rm", resources={}, kind="reward"))
            with pytest.raises(ValidationError):
                orch.submit(calls[0], action_id=-1)

    asyncio.run(main())


def test_a_queue_brings_a_surplus_replica_and_memory_needed_evicts_it_first() -> None:
    """Service(replicas=1, max_replicas=2) and another service on two fake GPUs: a burst
    longer than a restore brings the second copy (its own load through the hooks, on the
    other device: never beside the first, calls served by both), and when the other service
    needs that device's memory, the surplus copy is evicted (offloaded through the hooks)."""
    events: list[tuple[str, int]] = []

    class Copy(ServiceHooks):
        loads = 0

        def load(self, device):  # type: ignore[no-untyped-def]
            Copy.loads += 1
            events.append(("load", Copy.loads - 1))
            return {"copy": Copy.loads - 1}

        def offload(self, handle):  # type: ignore[no-untyped-def]
            events.append(("offload", handle["copy"]))

        def restore(self, handle, device):  # type: ignore[no-untyped-def]
            events.append(("restore", handle["copy"]))

        def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
            time.sleep(0.1)
            return [(handle["copy"], x) for x in inputs]

    async def main() -> None:
        rm = Service("rm", memory=600, restore_seconds=0.05, max_batch=2, replicas=1, max_replicas=2)
        other = Service("other", memory=1000, restore_seconds=0.05)
        inventory = local_inventory(services=[rm, other], gpus=[700, 1300])  # the first copy: best fit
        gpu = GpuManager(services={"rm": Copy(), "other": FunctionService(lambda x: x)}, devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"gpu": gpu}) as orch:
            calls = [Call(args=(i,), service="rm", resources={}, kind="reward", runtime=0.3) for i in range(4)]
            outputs = await orch.map(calls)
            assert [x for _, x in outputs] == [0, 1, 2, 3]
            assert sorted(copy for copy, _ in outputs) == [0, 0, 1, 1]  # two calls each: a batch per copy
            assert events == [("load", 0), ("load", 1)]
            described = gpu.describe()["services"]
            assert described["rm#0"]["resident_on"] == 0 and described["rm#1"]["resident_on"] == 1
            assert await orch.run(Call(args=(5,), service="other", resources={}, kind="reward")) == 5
            assert events[-1] == ("offload", 1), events  # the surplus copy went, not the first
            described = gpu.describe()["services"]
            assert described["rm#0"]["resident_on"] == 0 and described["rm#1"]["resident_on"] is None
            assert len(orch.records) == 5 and all(r.outcome == "ok" for r in orch.records)
            assert_idle(orch)

    asyncio.run(main())


def test_a_gpu_actions_cuda_context_is_counted_on_its_device() -> None:
    """GpuManager(context_mib=500): the core counts each GPU action's process's CUDA context
    beside the memory it asks for, so two actions of 3,000 MiB do not share a 6,000 MiB
    device (6,000 + 2 x 500 > 6,000); an action asking for the whole device still gets it."""
    async def main() -> None:
        inventory = local_inventory(gpus=[6000, 6000])
        gpu = GpuManager(devices="inventory", context_mib=500)
        async with Orchestrator(inventory=inventory, default_managers=False,
                                managers={"gpu": gpu, "mock": MockManager()}) as orch:
            def call(mib: float) -> Call:
                return Call(fn=lambda: None, resources={}, gpu_memory=mib, manager="mock", runtime=0.2)

            first, second = orch.submit(call(3000)), orch.submit(call(3000))
            await asyncio.gather(first, second)
            devices = sorted(r.device for r in orch.records)
            assert devices == [0, 1]  # one per device: 3,500 + 3,500 would not fit one
            assert gpu.describe()["context_mib"] == 500
            await orch.run(call(6000))  # the whole device: not refused for its context
            assert [r.outcome for r in orch.records] == ["ok"] * 3

    asyncio.run(main())


def test_a_fatal_xid_takes_its_device_out_of_placement() -> None:
    """Xid 79 (fallen off the bus) reported on device 0: the orchestrator fences it off, so
    GPU actions go to device 1 only, until the device is put back after its reset."""
    async def main() -> None:
        inventory = local_inventory(gpus=[4000, 4000])
        gpu = GpuManager(devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False,
                                managers={"gpu": gpu, "mock": MockManager()}) as orch:
            def call() -> Call:
                return Call(fn=lambda: None, resources={}, gpu_memory=3000, manager="mock", runtime=0.05)

            gpu.device_fault(0, 79)
            assert orch.scheduler is not None and not orch.scheduler.device_online(0, 0)
            assert gpu.describe()["xid_events"][0]["fatal"]
            await asyncio.gather(*(orch.submit(call()) for _ in range(3)))
            assert [r.device for r in orch.records] == [1, 1, 1]  # one after another, on device 1
            gpu.device_fault(1, 13)  # an application's fault: the device stays in use
            assert orch.scheduler.device_online(0, 1)
            orch.set_device_online(0, 0, True)
            await asyncio.gather(*(orch.submit(call()) for _ in range(2)))
            assert sorted(r.device for r in list(orch.records)[-2:]) == [0, 1]

    asyncio.run(main())


def _cuda_device_and_pid() -> tuple[str, int]:
    """What a CUDA program sees: CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises
    in a process, and keeps that device (simulated by an environment variable set on first
    use, which lives as long as the process)."""
    return os.environ.setdefault("FAKE_CUDA_INITIALISED_ON", os.environ["CUDA_VISIBLE_DEVICES"]), os.getpid()


def test_each_gpu_function_action_gets_its_own_device_in_a_fresh_process() -> None:
    """A trajectory's GPU function actions on two devices, one after another in its
    sandbox: each runs in a process forked for it, so each sees its own device (a CUDA
    context made in the trajectory's long-lived worker would keep the first) and the state
    it made ends with it."""
    async def main() -> None:
        inventory = local_inventory(gpus=[1000, 1000])
        gpu = GpuManager(devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"gpu": gpu},
                                config=RuntimeConfig(managers={"cpu": {}})) as orch:
            def gpu_call(fn, trajectory: int) -> Call:  # type: ignore[no-untyped-def]
                return Call(fn=fn, resources={"cpu": 0.1}, gpu_memory=1000, trajectory=trajectory)

            worker_pid = await orch.run(Call(fn=os.getpid, resources={"cpu": 0.1}, trajectory=0))
            blocker = asyncio.ensure_future(orch.run(gpu_call(lambda: time.sleep(0.5), 1)))  # device 0
            await asyncio.sleep(0.2)
            first, first_pid = await orch.run(gpu_call(_cuda_device_and_pid, 0))  # device 1: 0 is taken
            await blocker
            second, second_pid = await orch.run(gpu_call(_cuda_device_and_pid, 0))  # device 0: the first free
            assert (first, second) == ("GPU-fake-1", "GPU-fake-0")
            assert worker_pid not in (first_pid, second_pid) and first_pid != second_pid
            after = await orch.run(Call(fn=lambda: (os.getpid(), os.environ.get("FAKE_CUDA_INITIALISED_ON")),
                                        resources={"cpu": 0.1}, trajectory=0))
            assert after == (worker_pid, None)  # the trajectory's worker never took a device
            with pytest.raises(ActionFailed, match="exit code 3"):  # its process dies: the action fails
                await orch.run(gpu_call(lambda: os._exit(3), 0))
            with pytest.raises(ActionFailed, match="ValueError: invalid literal"):
                await orch.run(gpu_call(lambda: int("no GPU"), 0))
            assert await orch.run(Call(fn=os.getpid, resources={"cpu": 0.1}, trajectory=0)) == worker_pid

    asyncio.run(main())


def test_demo_runs_end_to_end() -> None:
    """The README's main job, small: both policies, every action ok, the search server
    never over its limit."""
    proc = subprocess.run([sys.executable, "-P", "-m", "tangram", "demo", "--trajectories", "2"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ACT (action completion time)" in out  # the acronym is spelled out for a new user
    assert "tangram against trajectory: mean ACT" in out
    assert ", 0 rejected" in out
    assert "/sys/fs/cgroup" not in out  # this machine's cgroup paths only with --verbose
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    rows = [line.split() for line in lines[header + 1:header + 3]]
    assert [r[0] for r in rows] == ["trajectory", "tangram"]
    assert all(float(r[1]) > 0 for r in rows)  # average ACT, seconds


def test_demo_rollout_goes_on_after_a_failed_tool_call() -> None:
    """A tool call that fails (here: the search API is down) is an observation for the
    agent: the trajectory goes on to build, test and be scored, and the failure is in the
    records, not a crash of the rollout."""
    import socket

    from tangram.demo import rollout

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]

    class Progress:
        n = 0

        def update(self, k: int) -> None:
            self.n += k

    progress = Progress()
    run = asyncio.run(rollout("tangram", 1, closed_port, 0, progress))
    assert run.outcomes.get("failed", 0) == 1  # the search call, with the connection refused
    assert run.outcomes.get("ok", 0) >= 5  # write, build, run, test, reward
    assert run.rewards == [1.0]  # trajectory 0's solution is correct
    assert progress.n == sum(run.outcomes.values())


def test_search_server_rejects_beyond_its_limit() -> None:
    server, port = start_search_server()
    try:
        import urllib.error

        codes = []
        for _ in range(6):
            try:
                search(port, "x")
                codes.append(200)
            except urllib.error.HTTPError as e:
                codes.append(e.code)
        assert 429 in codes  # back to back, past the burst: the server itself refuses
        assert server_stats(port)["rejected"] == codes.count(429)
    finally:
        stop_search_server(server)


def test_a_cuda_context_never_makes_a_call_too_big_for_a_gpu_that_holds_it() -> None:
    """The context is added up to the smallest GPU that holds what the call asks for: a call
    for a whole 40,960 MiB GPU still fits it beside 81,920 MiB ones."""
    from tangram.runtime.encode import CallEncoder
    from tangram.scheduler import Scheduler

    inventory = Inventory([tangram.Node("small", {"cpu": 4}, [tangram.Gpu(40960)]),
                           tangram.Node("big", {"cpu": 4}, [tangram.Gpu(81920)])])
    encoder = CallEncoder(Scheduler(inventory).encoder, process_gpu_memory=512)
    encoder.set_gpus([81920, 40960])

    def planned(mib: float) -> float:
        slot = encoder.template(Call(fn=print, resources={}, gpu_memory=mib), 1.0)
        return float(encoder.records([slot], [1], [0])["gpu_memory"][0])

    assert planned(40960) == 40960 and planned(40700) == 40960 and planned(30000) == 30512
    assert planned(81500) == 81920 and planned(90000) == 90000  # too big for any: the core refuses it


def test_more_shapes_in_one_burst_than_templates_kept(monkeypatch) -> None:
    """A burst with more distinct call shapes than the encoder keeps templates for (here
    4): every action reaches the core with its own run time, none with another's template;
    the templates are dropped only once the burst is with the core."""
    import tangram.runtime.encode as encode

    monkeypatch.setattr(encode, "_MAX_TEMPLATES", 4)

    async def main() -> None:
        gate = asyncio.Event()

        async def held() -> None:
            await gate.wait()

        inventory = local_inventory()
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"mock": MockManager()}) as orch:
            handles = [orch.submit(Call(fn=held, resources={}, manager="mock", runtime=float(i + 1))) for i in range(10)]
            await asyncio.sleep(0.05)
            assert orch.scheduler is not None
            assert [orch.scheduler.runtime(h.id, 1.0) for h in handles] == [float(i + 1) for i in range(10)]
            assert orch._dispatch.encoder.generation == 1  # dropped after the burst was submitted
            gate.set()
            await asyncio.gather(*handles)
            assert await orch.run(Call(fn=lambda: 7, resources={}, manager="mock", runtime=3.5)) == 7

    asyncio.run(main())
