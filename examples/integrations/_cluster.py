"""A cluster for the multi-node examples: a local Ray cluster of two worker nodes on this
machine (as `ray start` on two hosts would make), one `tangram serve --ray` scheduling
both, and the script connected to it as the framework's trainer (its Ray driver) is.

The framework's rollout and reward workers are Ray actors, one pinned to each node; they
are given no address: a `tangram.Client` made on a Ray worker finds the server the
cluster advertises (docs/ray.md). At the end, the server's action log shows what one
scheduler placed where.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import ray
from ray import cluster_utils
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

CORES = 2  # per worker node


@contextlib.contextmanager
def tangram_on_a_cluster() -> Iterator[Path]:
    """Starts the cluster and the server; yields the server's action log, complete once
    the block has ended (the server has stopped)."""
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 100 * 1024**2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=CORES, object_store_memory=100 * 1024**2)
    cluster.wait_for_nodes()
    log = Path(tempfile.mkdtemp()) / "actions.jsonl"
    server = subprocess.Popen([sys.executable, "-m", "tangram", "serve", "--port", "0", "--grace", "0", "--ray",
                               cluster.address, "--log-actions", str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 120)
        line = server.stdout.readline() if ready else ""
        match = re.search(r"listening on (\S+)", line)
        if match is None:
            raise SystemExit(f"tangram serve --ray did not start: {line!r}")
        print(f"tangram serve --ray at {match.group(1)}: {server.stdout.readline().strip()}")
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield log
        finally:
            ray.shutdown()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
        cluster.shutdown()


def on_every_node(work: Callable[[int], Any]) -> list[Any]:
    """Runs `work(i)` in a Ray actor pinned to each worker node, as a framework places its
    rollout workers; returns their results."""
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]

    @ray.remote(num_cpus=0)
    class Worker:
        def run(self, i: int) -> Any:
            return work(i)

    workers = [Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
               for node in nodes]
    return ray.get([w.run.remote(i) for i, w in enumerate(workers)], timeout=300)


def report(log: Path) -> None:
    """What the one scheduler did: actions, clients, nodes, and the most actions a node ran
    at once against its cores."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by_node: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        by_node.setdefault(r["node"], []).append((r["start"], r["end"]))
    most = {}
    for node, spans in by_node.items():
        events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
        level = peak = 0
        for _, step in events:
            level += step
            peak = max(peak, level)
        most[node] = peak
    clients = {r["id"] >> 32 for r in records}
    print(f"one scheduler: {len(records)} actions from {len(clients)} clients on {len(by_node)} nodes; "
          f"most at once per node: {max(most.values())} (cores per node: {CORES})")
