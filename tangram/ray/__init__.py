"""tangram on Ray: one scheduler core for the nodes of a Ray cluster.

    import ray, tangram
    from tangram.ray import RayOrchestrator

    ray.init(address="auto")
    async with RayOrchestrator(on_node_loss="requeue") as orch:
        result = await orch.run(tangram.Call(command="pytest -q", trajectory=7, ...))

The core places every action on a node; one node agent per Ray node (an async actor
pinned to the node) runs it in that node's sandboxes; starts and completions travel in
batches, one actor call per node per event-loop iteration. Nodes that die leave the
core's inventory and their actions fail or are re-queued (`on_node_loss`); nodes that
join add capacity. docs/ray.md has the details. Needs `pip install '.[ray]'`.
"""

from .claim import ClusterClaimed
from .manager import (NodeLost, RayManager, RayOrchestrator, cluster_inventory, cluster_nodes, connect_orchestrator,
                      node_name)

__all__ = ["ClusterClaimed", "connect_orchestrator", "NodeLost", "RayManager", "RayOrchestrator", "cluster_inventory", "cluster_nodes", "node_name"]
