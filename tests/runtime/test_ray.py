"""The Ray backend on a multi-node Ray cluster started on this machine (ray.cluster_utils):
placement across nodes, trajectory affinity, node agents lost mid-run (failed or re-queued,
nothing lost) and nodes joining.

One cluster for the module: a head node without CPUs (the driver's) and two worker nodes
of 2 logical CPUs each, small object stores. Each test starts its own RayOrchestrator."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import cloudpickle
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs ray (pip install '.[ray]')")
cluster_utils = pytest.importorskip("ray.cluster_utils", reason="ray.cluster_utils is missing from this ray")

from tangram import ActionCancelled, Call, Quota, RuntimeConfig  # noqa: E402
from tangram.ray import NodeLost, RayOrchestrator, cluster_inventory, node_name  # noqa: E402
from tangram.runtime import ActionRecord  # noqa: E402

STORE = 100 * 1024**2
# The node agents cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
    workers = [c.add_node(num_cpus=2, object_store_memory=STORE) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def worker_names() -> list[str]:
    return [n.name for n in cluster_inventory().nodes if n.resources.get("cpu", 0) > 0]


def where() -> tuple[str, str, list[int], str]:
    """Run inside an action: the node the agent says, the Ray node id it runs under, the
    CPUs this process is pinned to, the cores granted."""
    return (os.environ["TANGRAM_NODE"], os.environ["TANGRAM_RAY_NODE_ID"], sorted(os.sched_getaffinity(0)),
            os.environ["TANGRAM_CORES"])


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return os.environ["TANGRAM_NODE"]


def ended_once(records: list[ActionRecord], ids: set[int]) -> None:
    seen = [r.id for r in records if r.id in ids]
    assert sorted(seen) == sorted(ids), "every action ends exactly once"


def test_cluster_inventory_lists_every_alive_node(cluster) -> None:  # type: ignore[no-untyped-def]
    inv = cluster_inventory()
    assert len(inv.nodes) == 3
    assert sorted(n.resources["cpu"] for n in inv.nodes) == [0.0, 2.0, 2.0]
    assert all(n.resources["memory"] > 0 for n in inv.nodes)
    alive = {node_name(n) for n in ray.nodes() if n["Alive"]}
    assert {n.name for n in inv.nodes} == alive


def test_placement_across_nodes_with_pinning_inside_the_action(cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with RayOrchestrator(monitor_interval=0) as orch:
            names = worker_names()
            # Four 1-core actions of 0.5 s on 2 x 2 cores: all at once, two per node.
            results = await orch.map([Call(fn=lambda: (where(), time.sleep(0.5))[0], trajectory=t, runtime=0.5)
                                      for t in range(1, 5)])
            nodes = [r[0] for r in results]
            assert sorted(nodes) == sorted(names * 2)
            for (node, ray_node_id, cpus, cores), record in zip(results, sorted(orch.records, key=lambda r: r.id)):
                assert record.node == node  # where the core placed it is where it ran
                agent = orch.ray.node_of(node)
                assert agent.info["ray_node_id"] == ray_node_id == agent.node_id  # the agent is on that Ray node
                assert cores == "1" and cpus == sorted(agent.info["cpus"])  # one core granted, idle ones usable
            # A burst goes out in batches: the 16 that fit at once in one actor call per node.
            burst = await orch.map([Call(fn=os.getpid, trajectory=100 + i, resources={"cpu": 0.25}, runtime=0.01)
                                    for i in range(40)])
            assert all(isinstance(p, int) for p in burst)
            stats = orch.ray.describe()["nodes"]
            dispatched = sum(s["dispatched"] for s in stats.values())
            batches = sum(s["batches"] for s in stats.values())
            assert dispatched == 44 and batches < dispatched, stats
            assert max(s["largest_batch"] for s in stats.values()) >= 8, stats

    asyncio.run(main())


def delivery(orch: RayOrchestrator) -> dict[str, int]:
    stats = orch.ray.describe()["nodes"].values()
    return {k: sum(s[k] for s in stats) for k in ("dispatched", "by_reply", "by_poll", "stray")}


def test_the_objective_reaches_the_cluster_scheduler(cluster) -> None:  # type: ignore[no-untyped-def]
    # As tests/runtime/test_server.py's serve test: one request a second at quota "api";
    # under objective "act" trajectory 1's second request passes trajectory 2's first.
    async def main() -> tuple[float, float]:
        config = RuntimeConfig(objective="act", quotas=[Quota("api", rate=1.0, burst=1)])
        async with RayOrchestrator(config, monitor_interval=0) as orch:
            assert orch.scheduler.policy.objective == "act"
            await orch.run(Call(fn=time.monotonic, quota="api", trajectory=1))
            second = orch.submit(Call(fn=time.monotonic, quota="api", trajectory=2))
            await asyncio.sleep(0.05)
            further = orch.submit(Call(fn=time.monotonic, quota="api", trajectory=1))
            result = await second, await further
            # A hold of the cluster's quota (work the caller runs itself) is admitted by the
            # same scheduler, after the requests before it.
            async with orch.quota("api", trajectory=3):
                held = time.monotonic()
            assert held > max(result)
            return result

    second_started, further_started = asyncio.run(main())
    assert further_started < second_started


def test_quick_actions_end_in_their_batch_reply_slow_ones_by_poll_each_exactly_once(cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with RayOrchestrator(monitor_interval=0, reply_wait=0.5) as orch:
            # Sandboxes first (starting one can take longer than reply_wait on a busy machine).
            await orch.map([Call(fn=nap, args=(0,), trajectory=t, runtime=0.001) for t in range(1, 13)])
            before = delivery(orch)
            for _ in range(5):  # one at a time: each comes back in its own batch's reply
                assert await orch.run(Call(fn=nap, args=(0,), trajectory=1, resources={"cpu": 0.1}, runtime=0.001))
            d = delivery(orch)
            assert d["by_reply"] == before["by_reply"] + 5 and d["by_poll"] == before["by_poll"], (before, d)
            # A burst mixing quick actions with slow ones (longer than reply_wait), in the
            # same batches: the quick ones that end by the batch's reply come with it, the
            # rest by poll; every action ends once, with its own result.
            calls = [Call(fn=lambda i=i: (i, nap(1.0 if i % 2 else 0)), trajectory=i + 1, resources={"cpu": 0.25},
                          runtime=1.0 if i % 2 else 0.001) for i in range(12)]
            handles = [orch.submit(c) for c in calls]
            results = await asyncio.gather(*(h.future for h in handles))
            assert [r[0] for r in results] == list(range(12))
            ended_once(list(orch.records), {h.id for h in handles})
            b, d = d, delivery(orch)
            assert d["dispatched"] == 29 and d["by_reply"] + d["by_poll"] == 29 and d["stray"] == 0, d
            assert d["by_poll"] - b["by_poll"] >= 6 and d["by_reply"] - b["by_reply"] >= 1, (b, d)
            assert all(r.outcome == "ok" for r in orch.records)
            # A cancel of an action whose batch reply has already gone: it ends by poll.
            h = orch.submit(Call(fn=nap, args=(30,), trajectory=1, runtime=30))
            await asyncio.sleep(1.5)  # past reply_wait
            t = time.perf_counter()
            assert h.cancel()
            with pytest.raises(ActionCancelled):
                await h
            assert time.perf_counter() - t < 3
            assert delivery(orch)["by_poll"] == d["by_poll"] + 1
        async with RayOrchestrator(monitor_interval=0, reply_wait=60) as orch:
            # A cancel while the batch's run() still waits on the agent: the "cancelled"
            # completion comes back in that reply, once; the sandbox is usable again.
            h = orch.submit(Call(fn=nap, args=(30,), trajectory=2, runtime=30))
            await asyncio.sleep(0.5)
            t = time.perf_counter()
            assert h.cancel()
            with pytest.raises(ActionCancelled):
                await h
            assert time.perf_counter() - t < 3
            assert await orch.run(Call(fn=nap, args=(0,), trajectory=2, runtime=0.001))
            assert delivery(orch) == {"dispatched": 2, "by_reply": 2, "by_poll": 0, "stray": 0}
            ended_once(list(orch.records), {r.id for r in orch.records})
            assert sorted(r.outcome for r in orch.records) == ["cancelled", "ok"]

    asyncio.run(main())


def test_trajectory_sticks_to_its_sandbox_node_and_files_persist(cluster) -> None:  # type: ignore[no-untyped-def]
    def write() -> str:
        with open("state", "w") as f:
            f.write(os.environ["TANGRAM_NODE"])
        return os.environ["TANGRAM_NODE"]

    def read() -> tuple[str, str]:
        with open("state") as f:
            return f.read(), os.environ["TANGRAM_NODE"]

    async def main() -> None:
        async with RayOrchestrator(monitor_interval=0) as orch:
            home = await orch.run(Call(fn=write, trajectory=7, runtime=0.1))
            other = next(n for n in worker_names() if n != home)
            for _ in range(3):
                # Load on the home node tempts the core elsewhere; the trajectory stays home.
                busy = [orch.submit(Call(fn=nap, args=(0.3,), trajectory=50 + i, affinity=home, runtime=0.3))
                        for i in range(2)]
                saved, ran_on = await orch.run(Call(fn=read, trajectory=7, runtime=0.1))
                assert saved == home and ran_on == home
                assert {await h for h in busy} == {home}
            # An explicit affinity is honoured too.
            assert await orch.run(Call(fn=nap, args=(0,), trajectory=8, affinity=other)) == other
            await orch.end_trajectory(7)
            assert orch.ray.trajectory_node(7) is None
            assert all(r.outcome == "ok" for r in orch.records)

    asyncio.run(main())


def test_agent_killed_mid_run_fails_its_actions_and_a_joining_node_gets_work(cluster) -> None:  # type: ignore[no-untyped-def]
    c, workers = cluster

    async def main() -> None:
        async with RayOrchestrator(monitor_interval=0.3, on_node_loss="fail") as orch:
            names = worker_names()
            handles = [orch.submit(Call(fn=nap, args=(3.0,), trajectory=t, runtime=3.0)) for t in range(1, 5)]
            await asyncio.sleep(1.0)  # all four run: two per node
            assert sum(r for _w, r in (await orch.queue_lengths()).values()) == 4
            victim = names[0]
            ray.kill(orch.ray.node_of(victim).agent)
            results = await asyncio.gather(*(h.future for h in handles), return_exceptions=True)
            lost = [r for r in results if isinstance(r, NodeLost)]
            assert len(lost) == 2 and all(e.node == victim for e in lost)
            assert [r for r in results if not isinstance(r, Exception)] == [names[1]] * 2
            ended_once(list(orch.records), {h.id for h in handles})
            assert sorted(r.outcome for r in orch.records) == ["crashed", "crashed", "ok", "ok"]
            # Its capacity is gone: new work goes to the surviving node only.
            assert not orch.scheduler.node_online(victim)
            again = await orch.map([Call(fn=nap, args=(0.1,), trajectory=10 + t, runtime=0.1) for t in range(4)])
            assert set(again) == {names[1]}
            # A node joins: the monitor starts its agent and the core places work on it.
            joined = c.add_node(num_cpus=2, object_store_memory=STORE)
            for _ in range(200):
                if orch.ray.joined_nodes:
                    break
                await asyncio.sleep(0.1)
            assert len(orch.ray.joined_nodes) == 1
            new = orch.ray.joined_nodes[0]
            assert orch.scheduler.node_online(new) and new in [n.name for n in orch.inventory.nodes]
            spread = await orch.map([Call(fn=nap, args=(0.5,), trajectory=20 + t, runtime=0.5) for t in range(4)])
            assert new in spread and set(spread) <= {names[1], new}  # new sandboxes go to the emptier node
            workers.append(joined)

    asyncio.run(main())


def test_node_removed_mid_run_requeues_its_actions_which_complete_elsewhere(cluster) -> None:  # type: ignore[no-untyped-def]
    c, workers = cluster

    async def main() -> None:
        async with RayOrchestrator(monitor_interval=0.3, on_node_loss="requeue") as orch:
            names = worker_names()
            assert len(names) >= 2
            victim_node = workers[0]
            victim = next(n for n in names if orch.ray.node_of(n).node_id == victim_node.node_id)
            calls = [Call(fn=nap, args=(2.0,), trajectory=t, runtime=2.0, affinity=victim if t < 2 else None)
                     for t in range(2 * len(names))]
            handles = [orch.submit(call) for call in calls]
            await asyncio.sleep(1.0)
            running_on_victim = [r for r in orch._live.values() if r.running and r.record.node == victim]
            assert running_on_victim
            c.remove_node(victim_node)
            workers.remove(victim_node)
            results = await asyncio.gather(*(h.future for h in handles), return_exceptions=True)
            assert not [r for r in results if isinstance(r, Exception)], results
            assert victim not in results  # nothing completed on the removed node
            ended_once(list(orch.records), {h.id for h in handles})
            assert all(r.outcome == "ok" and r.node != victim for r in orch.records)
            assert not orch.scheduler.node_online(victim)
            assert orch.ray.lost_nodes == [victim]

    asyncio.run(main())


def note_then_nap(path: str, slow_on: str) -> str:
    """Appends the node it runs on to `path` (the cluster's nodes share this machine's
    filesystem: one line per run), then naps: long on `slow_on`, briefly elsewhere."""
    node = os.environ["TANGRAM_NODE"]
    with open(path, "a") as f:
        f.write(node + "\n")
    return nap(60.0 if node == slow_on else 0.1)


def runs(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


# Under on_node_loss="requeue", a lost node's running actions are rerun elsewhere only when
# their call is idempotent: the idempotent one runs again (twice in all) and succeeds on
# another node; the non-idempotent one ran once and ends NodeLost, saying why it was not
# rerun. Each ends exactly once.
def test_requeue_reruns_only_idempotent_calls(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, workers = cluster
    while len(workers) < 2:  # one to lose, one to rerun on (earlier tests may have removed some)
        workers.append(c.add_node(num_cpus=2, object_store_memory=STORE))
    c.wait_for_nodes()

    async def main() -> None:
        # The runs are counted in a file under this machine's /tmp, which a namespaced
        # sandbox does not see: these sandboxes are bare processes.
        async with RayOrchestrator(monitor_interval=0.3, on_node_loss="requeue", cpu={"isolation": "process"}) as orch:
            victim_node = workers[0]
            victim = next(n for n in worker_names() if orch.ray.node_of(n).node_id == victim_node.node_id)
            again, once = str(tmp_path / "idempotent"), str(tmp_path / "not-idempotent")
            handles = [orch.submit(Call(fn=note_then_nap, args=(again, victim), trajectory=1, affinity=victim,
                                        runtime=60)),
                       orch.submit(Call(fn=note_then_nap, args=(once, victim), trajectory=2, affinity=victim,
                                        runtime=60, idempotent=False))]
            for _ in range(600):  # both have started on the victim
                if runs(again) and runs(once):
                    break
                await asyncio.sleep(0.1)
            assert runs(again) == [victim] and runs(once) == [victim]
            c.remove_node(victim_node)
            workers.remove(victim_node)
            rerun, lost = await asyncio.gather(*(h.future for h in handles), return_exceptions=True)
            assert isinstance(lost, NodeLost) and lost.node == victim and "not idempotent" in str(lost), lost
            assert isinstance(rerun, str) and rerun != victim, rerun
            assert runs(again) == [victim, rerun] and runs(once) == [victim]
            ended_once(list(orch.records), {h.id for h in handles})
            assert sorted(r.outcome for r in orch.records) == ["crashed", "ok"]

    asyncio.run(main())
