"""`tangram serve --ray`: one scheduler for every node of a Ray cluster, reached by client
processes and the Sandbox Fusion endpoint alike, and a second server on the same cluster
refused. A real local Ray cluster of two worker nodes, started by the test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

ray = pytest.importorskip("ray")
from ray import cluster_utils  # noqa: E402

import cloudpickle  # noqa: E402
from test_holds import _overlaps  # noqa: E402
from test_server import Served  # noqa: E402

# Ray workers cannot import this test module: its functions travel by value (Ray pickles
# remote functions with its own copy of cloudpickle).
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

STORE = 100 * 1024**2
CORES = 2  # per worker node


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=CORES, object_store_memory=STORE)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


CLIENT = textwrap.dedent("""
    import asyncio, sys, tangram
    async def main():
        async with tangram.Client(sys.argv[1]) as client:
            calls = [tangram.Call(command=["sleep", "0.4"], trajectory=t, resources={"cpu": 1}, runtime=0.4)
                     for t in range(6)]
            results = await client.map(calls)
            assert all(r.returncode == 0 for r in results), results
            print("done", flush=True)
    asyncio.run(main())
""")


def _from_a_ray_worker() -> tuple[str, int]:
    """Runs on one of the cluster's workers: a Client made without an address."""
    import asyncio

    import tangram

    async def go() -> tuple[str, int]:
        async with tangram.Client() as client:
            return client.found_by, await client.run(tangram.Call(fn=max, args=(42, 7), trajectory=99))

    return asyncio.run(go())


def _run_code(address: str, code: str, **fields: str) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{address}/run_code", method="POST",
                                     data=json.dumps({"code": code, "language": "python", **fields}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


# Invariant: with --ray, every action of every client and of the Sandbox Fusion endpoint is
# placed by the server's one core on the cluster's nodes (one action log holds them all), and
# no node ever runs more one-core actions than it has cores; a second server on the cluster
# is refused, naming the first.
def test_one_server_schedules_the_whole_cluster(cluster: Any, tmp_path: Path) -> None:
    log = tmp_path / "actions.jsonl"
    served = Served(None, "--ray", cluster.address, "--grace", "0", "--sandbox-fusion-port", "0",
                    "--log-actions", str(log), start_timeout=120.0)
    try:
        assert served.proc.stdout is not None
        fusion_line = served.proc.stdout.readline()
        fusion = fusion_line.split("http://")[1].split("/")[0]
        scheduling = served.proc.stdout.readline()
        assert "scheduling the Ray cluster" in scheduling and scheduling.count(f"({CORES} cpu") == 2, scheduling
        workers = re.findall(rf"(\S+) \({CORES} cpu", scheduling)

        second = subprocess.run([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--ray",
                                 cluster.address], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "already scheduled by tangram serve" in second.stderr, second.stderr

        clients = [subprocess.Popen([sys.executable, "-P", "-c", CLIENT, served.address], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for _ in range(2)]
        fusion_results = [_run_code(fusion, f"print({i} * 7)") for i in range(4)]
        homed = [_run_code(fusion, "print('home')", session_id=f"home{n}", node=workers[n]) for n in (1, 0, 1, 0, 1, 0)]
        assert [r["run_result"]["stdout"] for r in homed] == ["home\n"] * 6
        for proc in clients:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0 and out == "done\n", err
        assert [r["run_result"]["stdout"] for r in fusion_results] == [f"{i * 7}\n" for i in range(4)]

        # A worker of the cluster finds the server with no address and no variable set.
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            task = ray.remote(num_cpus=0, runtime_env={"env_vars": {"TANGRAM_ADDRESS": ""}})(_from_a_ray_worker)
            found_by, value = ray.get(task.remote(), timeout=120)
        finally:
            ray.shutdown()
        assert found_by.startswith("advertised on the Ray cluster by tangram serve") and value == 42, found_by
    finally:
        assert served.stop() == 0, served.stderr

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2 * 6 + 4 + 6 + 1 and all(r["outcome"] == "ok" for r in records)
    connections = {r["id"] >> 32 for r in records}
    assert len(connections) == 4  # two clients, the Ray worker's and the endpoint: one core's ids
    by_trajectory: dict[int, list[str]] = {}
    for r in records:
        by_trajectory.setdefault(r["trajectory"], []).append(r["node"])
    assert [workers[0]] * 3 in by_trajectory.values() and [workers[1]] * 3 in by_trajectory.values()  # homed sessions
    nodes = {r["node"] for r in records}
    assert len(nodes) == 2, nodes  # both worker nodes took work
    for node in nodes:
        spans = [(r["start"], r["end"]) for r in records if r["node"] == node]
        assert _overlaps(spans) <= CORES, node


# Invariant: the claim dies with its server: after a server is killed (SIGKILL: no cleanup),
# a new one on the same cluster starts once Ray has noticed, and schedules as before.
def test_a_killed_servers_claim_is_freed(cluster: Any) -> None:
    import signal
    import time

    first = Served(None, "--ray", cluster.address, "--grace", "0", start_timeout=120.0)
    first.stop(signal.SIGKILL)
    deadline = time.monotonic() + 60.0
    while True:
        try:
            second = Served(None, "--ray", cluster.address, "--grace", "0", start_timeout=120.0)
            break
        except AssertionError as e:  # refused while Ray still has the dead driver's claim
            assert "already scheduled by tangram serve" in str(e), e
            assert time.monotonic() < deadline, "the killed server's claim was never freed"
            time.sleep(1.0)
    try:
        done = subprocess.run([sys.executable, "-P", "-c", CLIENT, second.address], capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    finally:
        assert second.stop() == 0, second.stderr


# Invariant: when the cluster's head is lost, Ray ends the server's driver once it cannot
# reach the head for gcs_rpc_server_reconnect_timeout_s (60 s by default; 5 s here), and
# every client's pending action and later call ends with ConnectionLost (docs/ray.md).
def test_the_heads_loss_ends_the_server_and_its_clients_calls_with_connection_lost() -> None:
    import asyncio
    import time

    import tangram

    own = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
    own.add_node(num_cpus=CORES, object_store_memory=STORE)
    own.wait_for_nodes()
    served = Served(None, "--ray", own.address, "--grace", "0", start_timeout=120.0,
                    env={"RAY_gcs_rpc_server_reconnect_timeout_s": "5"})
    try:
        async def main() -> None:
            async with tangram.Client(served.address) as client:
                assert await client.run(tangram.Call(fn=max, args=(6, 7), trajectory=1)) == 7
                pending = client.submit(tangram.Call(command=["sleep", "60"], trajectory=1))
                await asyncio.sleep(0.5)
                own.remove_node(own.head_node, allow_graceful=False)
                lost = time.monotonic()
                with pytest.raises(tangram.ConnectionLost):
                    await asyncio.wait_for(pending, 60)
                assert time.monotonic() - lost < 30
                with pytest.raises(tangram.ConnectionLost):
                    await client.run(tangram.Call(fn=max, args=(6, 7), trajectory=2))

        asyncio.run(main())
        served.proc.wait(timeout=30)  # Ray ended the driver
    finally:
        served.stop()
        try:
            own.shutdown()
        except Exception:  # its head is gone already
            pass
