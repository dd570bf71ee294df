"""tangram on Ray: the core places actions across the nodes of a Ray cluster; one node agent
per node runs them. See docs/ray.md."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import cloudpickle

from .._model import Gpu, Inventory, Node, Quota, Service
from ..runtime.managers.api import ApiManager
from ..runtime.call import Call, Placement, manager_for, require_fn_or_command, require_service_input
from ..runtime.config import RuntimeConfig
from ..runtime.errors import ActionCrashed, ActionFailed, ManagerError
from ..runtime.managers.base import Host, LiveAction, ResourceManager
from ..runtime.live import ActionHandle
from ..runtime.orchestrator import Orchestrator
from .agent import NodeAgent, pack_batch, rebuild_error, unpack_completions
from .claim import ClusterClaimed, advertise, claim_cluster, release_claim

log = logging.getLogger("tangram.ray")

ON_NODE_LOSS = ("fail", "requeue")


class NodeLost(ActionCrashed):
    """The Ray node running the action (or its node agent) was lost; the action's work is
    gone with it. Recorded with outcome "crashed"."""

    def __init__(self, action_id: int, reason: str, node: str = "") -> None:
        super().__init__(action_id, reason)
        self.node = node


def _require_ray() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - exercised only without ray
        raise ManagerError("managers.ray", "the Ray backend needs ray: pip install 'ray>=2.9' (from a checkout: pip install '.[ray]')") from None
    if not ray.is_initialized():
        raise ManagerError("managers.ray", "ray is not initialised: call ray.init(...) first")
    return ray


def node_name(info: Mapping[str, Any]) -> str:
    """The inventory name of a Ray node (an entry of ray.nodes()): "<hostname>/<first 12
    hex digits of its node id>", stable for the node's lifetime and unique in practice."""
    return f"{info['NodeManagerHostname']}/{info['NodeID'][:12]}"


def _node_of(info: Mapping[str, Any], gpu_memory: float) -> Node:
    res = info.get("Resources", {})
    resources = {"cpu": float(res.get("CPU", 0.0)), "memory": float(int(res.get("memory", 0.0) // 2**20))}
    gpus = [Gpu(gpu_memory) for _ in range(int(res.get("GPU", 0)))]
    return Node(node_name(info), resources, gpus)


def cluster_nodes() -> list[dict[str, Any]]:
    """The alive nodes of the connected Ray cluster (ray.nodes() entries), by node id."""
    ray = _require_ray()
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def cluster_inventory(quotas: Sequence[Quota] = (), services: Sequence[Service] = (),
                      gpu_memory: float = 16384.0) -> Inventory:
    """The inventory of the connected Ray cluster: one node per alive Ray node (named by
    `node_name`), with its logical CPUs ("cpu"), its Ray `memory` resource in MiB
    ("memory") and one GPU of `gpu_memory` MiB per Ray GPU (Ray does not report GPU
    memory). Nodes are ordered by node id."""
    nodes = [_node_of(n, gpu_memory) for n in cluster_nodes()]
    if not nodes:
        raise ManagerError("managers.ray", "the Ray cluster has no alive node")
    return Inventory(nodes=nodes, quotas=list(quotas), services=list(services))


@dataclass(eq=False)
class _NodeState:
    name: str
    node_id: str
    index: int  # the core's node index
    agent: Any
    pending: list[tuple[int, bytes, Placement]] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    resizes: list[tuple[int, float, float]] = field(default_factory=list)  # (action, grant, cores)
    inflight: dict[int, asyncio.Future[tuple[str, Any]]] = field(default_factory=dict)
    poller: asyncio.Task[None] | None = None
    lost: bool = False
    dispatched: int = 0
    batches: int = 0
    largest: int = 0  # most actions in one batch
    by_reply: int = 0  # completions that came back in their batch's reply
    by_poll: int = 0  # ... by the long poll
    stray: int = 0  # completions for no action waiting here (e.g. after cancel_grace)
    cpu: float = 0.0  # its cores in the inventory
    info: dict[str, Any] = field(default_factory=dict)  # what the agent reported at start


class RayManager(ResourceManager):
    """Runs actions on the node agents of a Ray cluster, in batches.

    Options (the config's `[managers.ray]` table, or keywords):
      on_node_loss     "fail" (default): actions running on a lost node end with NodeLost
                       (an ActionCrashed), waiting ones whose affinity names it too;
                       "requeue": they go back to the queue (without that affinity) and
                       run elsewhere, in a fresh sandbox: at least once, since one may have
                       finished there with only its reply lost; a running call with
                       `idempotent=False` ends with NodeLost instead. Either way the node
                       leaves the core's inventory (offline) when the manager is bound to
                       an orchestrator (`bind`: every orchestrator binds its managers at its start).
      sticky           True (default): a trajectory's actions go to the node of its first
                       placement, where its sandbox lives (RayOrchestrator sets Call.affinity)
      cpu, gpu         options of each agent's CpuManager / GpuManager (gpu None: no GPU
                       services on the agents)
      monitor_interval seconds between looks at ray.nodes() for lost and joining nodes
                       (0 disables the monitor; an agent's death is noticed regardless)
      poll_timeout     seconds an agent holds a completion long-poll open
      reply_wait       seconds a batch's actor call waits on the agent for the first of its
                       actions to end: those ended by then come back in its reply (a quick
                       action costs one actor round trip), the rest by the long poll
      cancel_grace     seconds a cancel waits for the agent to confirm the kill
      gpu_memory       MiB per GPU of joining nodes (Ray does not report it)
      exclusive        True (default): claim the cluster as it starts, so that a second
                       tangram scheduler on it stops with ClusterClaimed instead of booking
                       the same cores (tangram.ray.claim); False skips the claim
      serves           what this scheduler serves, shown to a second one refused by the claim
                       (tangram serve sets its address)
    """

    name = "ray"
    gpu_env_on_node = True  # the agent computes a GPU grant's environment on its node

    def __init__(self, on_node_loss: str = "fail", sticky: bool = True, cpu: Mapping[str, Any] | None = None,
                 gpu: Mapping[str, Any] | None = None, monitor_interval: float = 1.0, poll_timeout: float = 1.0,
                 cancel_grace: float = 5.0, gpu_memory: float = 16384.0, reply_wait: float = 0.005,
                 exclusive: bool = True, serves: str = "") -> None:
        if on_node_loss not in ON_NODE_LOSS:
            raise ManagerError("managers.ray.on_node_loss", f"{on_node_loss!r} is not one of {', '.join(ON_NODE_LOSS)}")
        for name, v in (("monitor_interval", monitor_interval), ("poll_timeout", poll_timeout),
                        ("cancel_grace", cancel_grace), ("reply_wait", reply_wait)):
            if not isinstance(v, (int, float)) or v < 0:
                raise ManagerError(f"managers.ray.{name}", f"must be a non-negative number of seconds, got {v!r}")
        self.on_node_loss = on_node_loss
        self.sticky = bool(sticky)
        self.cpu_options = dict(cpu or {})
        self.gpu_options = dict(gpu) if gpu is not None else None
        self.monitor_interval = float(monitor_interval)
        self.poll_timeout = float(poll_timeout)
        self.cancel_grace = float(cancel_grace)
        self.reply_wait = float(reply_wait)
        self.gpu_memory = float(gpu_memory)
        self.exclusive = bool(exclusive)
        self.serves = str(serves)
        self._claim: Any = None  # the cluster's claim while this manager runs (exclusive)
        self.nodes: dict[str, _NodeState] = {}  # by name, lost ones included
        self._by_index: dict[int, _NodeState] = {}
        self._known_ids: set[str] = set()
        self._sticky: dict[int, str] = {}  # trajectory -> node name of its sandbox
        self._trajectory_nodes: dict[int, set[str]] = {}
        self._flush_scheduled = False
        self._monitor: asyncio.Task[None] | None = None
        self._joining: set[asyncio.Task[None]] = set()
        self._state = "new"
        self.lost_nodes: list[str] = []
        self.joined_nodes: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def check_call(self, call: Call) -> None:
        # A node agent runs services as the gpu manager does and everything else in a
        # sandbox, as the cpu manager does.
        (require_service_input if call.service is not None else require_fn_or_command)(call)

    def attach(self, inventory: Inventory) -> None:
        super().attach(inventory)
        self._attached = inventory

    def bind(self, orchestrator: Host) -> None:
        """Lets the manager tell the orchestrator about node changes (offline, joined) and
        requeue actions; the orchestrator binds it at its start."""
        self.orchestrator = orchestrator

    async def start(self) -> None:
        if self._state != "new":
            return
        ray = _require_ray()
        self._loop = asyncio.get_running_loop()
        if self.exclusive:
            self._claim = await asyncio.to_thread(claim_cluster, ray, self.serves)
        try:
            await self._start_agents(ray)
        except BaseException:
            self._release()
            raise
        if self.monitor_interval > 0:
            self._monitor = self._loop.create_task(self._watch())
        self._state = "running"

    def advertise(self, host: str, port: int) -> None:
        """Publishes the server's address in the cluster's claim (tangram.ray.claim.advertise)."""
        if self._claim is not None:
            advertise(_require_ray(), self._claim, host, port)

    def _release(self) -> None:
        if self._claim is not None:
            release_claim(_require_ray(), self._claim)
            self._claim = None

    async def _start_agents(self, ray: Any) -> None:
        alive = {node_name(n): n for n in await asyncio.to_thread(cluster_nodes)}
        self._known_ids = {n["NodeID"] for n in alive.values()}
        missing = [n.name for n in self._attached.nodes if n.name not in alive]
        if missing:
            raise ManagerError("managers.ray", f"inventory nodes {missing} are not alive Ray nodes (alive: "
                               f"{', '.join(alive)}); build the inventory with tangram.ray.cluster_inventory()")
        self._actor_class = ray.remote(NodeAgent)
        states = [self._make_agent(alive[node.name], index) for index, node in enumerate(self._attached.nodes)]
        await asyncio.gather(*(self._start_agent(st, node) for st, node in zip(states, self._attached.nodes)))
        for st in states:
            self._add_state(st)

    def _make_agent(self, info: Mapping[str, Any], index: int) -> _NodeState:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = node_name(info)
        agent = self._actor_class.options(
            num_cpus=0, max_concurrency=10_000, max_restarts=0, name=None, enable_task_events=False,
            scheduling_strategy=NodeAffinitySchedulingStrategy(info["NodeID"], soft=False),
        ).remote(name, info["NodeID"], self.cpu_options, self.gpu_options)
        return _NodeState(name, info["NodeID"], index, agent)

    async def _start_agent(self, st: _NodeState, node: Node) -> None:
        st.cpu = float(node.resources.get("cpu", 0.0))
        st.info = await st.agent.start.remote(dict(node.resources), [g.memory for g in node.gpus])

    def _add_state(self, st: _NodeState) -> None:
        self.nodes[st.name] = st
        self._by_index[st.index] = st
        st.poller = self._loop.create_task(self._poll(st))

    async def close(self) -> None:
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        self._state = "closed"
        if self._monitor is not None:
            self._monitor.cancel()
        for t in list(self._joining):
            t.cancel()
        import ray

        live = [st for st in self.nodes.values() if not st.lost]
        for st in live:
            if st.poller is not None:
                st.poller.cancel()
        closing = [asyncio.wait_for(_await_ref(st.agent.close.remote()), 30) for st in live]
        await asyncio.gather(*closing, return_exceptions=True)
        for st in self.nodes.values():
            try:
                ray.kill(st.agent)
            except Exception:  # already dead
                pass
        self._release()

    # ------------------------------------------------------------------ actions
    async def execute(self, action: LiveAction, placement: Placement) -> Any:
        st = self._by_index.get(placement.node)
        if st is None or st.lost:
            raise NodeLost(action.id, f"node {placement.node_name} is lost", placement.node_name)
        call = action.call
        if self.sticky:
            self._sticky.setdefault(call.trajectory, st.name)
        self._trajectory_nodes.setdefault(call.trajectory, set()).add(st.name)
        try:  # pickled here, one by one: a call that cannot travel fails alone, at once
            blob = cloudpickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ActionFailed(action.id, f"the call cannot be sent to node {st.name}: {type(e).__name__}: {e}",
                               type(e).__name__) from None
        future: asyncio.Future[tuple[str, Any]] = self._loop.create_future()
        st.inflight[action.id] = future
        st.pending.append((action.id, blob, dataclasses.replace(placement, node=0)))
        self._kick()
        try:
            kind, payload = await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done() and not st.lost:
                st.cancels.append(action.id)
                self._kick()
                try:  # the agent confirms the kill: the cores are really free again
                    await asyncio.wait_for(asyncio.shield(future), self.cancel_grace)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
            raise
        finally:
            st.inflight.pop(action.id, None)
        if kind == "ok":
            return payload
        if kind == "lost":
            raise NodeLost(action.id, payload, st.name)
        if kind == "cancelled":  # not asked for by this side: the agent was closing
            raise ActionCrashed(action.id, f"cancelled on node {st.name} (its agent is closing)")
        raise rebuild_error(action.id, payload)

    def _kick(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One actor call per node per event-loop iteration, carrying every start (and
        every cancel) queued for it since the last flush."""
        self._flush_scheduled = False
        for st in self.nodes.values():
            if st.lost:
                continue
            if st.pending:
                batch, st.pending = st.pending, []
                ref = st.agent.run.remote(pack_batch(batch, self.reply_wait))
                st.dispatched += len(batch)
                st.batches += 1
                st.largest = max(st.largest, len(batch))
                ids = [b[0] for b in batch]
                loop = self._loop
                # The reply is handled by a callback on the loop, not a task awaiting the
                # ref: one event-loop step less between the reply and the action's end.
                # (The callback holds the ref: the reply stays alive until it is read.)
                ref.future().add_done_callback(
                    lambda f, st=st, ids=ids, ref=ref, loop=loop: _call_soon_threadsafe(loop, self._delivered, st, f, ids))
            if st.cancels:
                ids, st.cancels = st.cancels, []
                st.agent.cancel.remote(ids)
            if st.resizes:  # after the starts of this flush: an actor runs its calls in order
                resizes, st.resizes = st.resizes, []
                st.agent.resize.remote(resizes)

    def _delivered(self, st: _NodeState, reply: concurrent.futures.Future[bytes], ids: list[int]) -> None:
        """The batch's reply: the completions of its actions that ended quickly (the rest
        come by poll). A batch that did not reach its agent fails its actions (an agent
        that died is a lost node; the poller notices that too)."""
        if self._state == "closed" or st.lost:
            return
        try:
            data = reply.result()
        except BaseException as e:  # noqa: BLE001 - whatever it is, the batch's actions end
            if _actor_gone(e):
                self._lose(st, f"its node agent died ({type(e).__name__})")
                return
            for action_id in ids:
                future = st.inflight.get(action_id)
                if future is not None and not future.done():
                    future.set_result(("error", ("ActionFailed", f"the batch did not reach node {st.name}: "
                                                 f"{type(e).__name__}: {e}", type(e).__name__, "")))
            return
        st.by_reply += _complete(st, unpack_completions(data))

    async def _poll(self, st: _NodeState) -> None:
        """Completions come back in batches: one long poll in flight per agent."""
        while not st.lost and self._state != "closed":
            try:
                reply = await st.agent.poll.remote(self.poll_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor died (RayActorError, ActorDiedError...)
                if self._state != "closed":
                    self._lose(st, f"its node agent died ({type(e).__name__})")
                return
            st.by_poll += _complete(st, unpack_completions(reply))

    def resize(self, action: LiveAction, placement: Placement) -> None:
        """Sent to the action's node agent with the next flush, which applies it there."""
        st = self._by_index.get(placement.node)
        if st is not None and not st.lost and action.id in st.inflight:
            st.resizes.append((action.id, placement.grant, placement.cores))
            self._kick()

    async def restore(self, service: str, node: int, device: int) -> float | None:
        st = self._by_index.get(node)
        if st is None or st.lost:
            return None  # the core evicts services of offline nodes; nothing to do there
        return await st.agent.restore.remote(service, device)

    async def evict(self, service: str, node: int, device: int, discard: bool = False) -> float | None:
        st = self._by_index.get(node)
        if st is None or st.lost:
            return None
        return await st.agent.evict.remote(service, device, discard)

    async def end_trajectory(self, trajectory: int) -> None:
        self._sticky.pop(trajectory, None)
        names = self._trajectory_nodes.pop(trajectory, set())
        calls = [_await_ref(self.nodes[n].agent.end_trajectories.remote([trajectory]))
                 for n in names if not self.nodes[n].lost]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("ending trajectory %d: %s", trajectory, r)

    # ------------------------------------------------------------------ nodes
    def trajectory_node(self, trajectory: int) -> str | None:
        """The node of the trajectory's sandbox (its first placement), while sticky."""
        return self._sticky.get(trajectory)

    def home_for(self, trajectory: int) -> str | None:
        """The node a trajectory's actions are pinned to: its sandbox's node; for a new
        trajectory, the node with the fewest trajectories per core (sandboxes are spread:
        the core's best fit would pack new trajectories onto one node, and stickiness would
        keep them there). None when no node has cores."""
        home = self._sticky.get(trajectory)
        if home is not None:
            return home
        counts: dict[str, int] = {}
        for name in self._sticky.values():
            counts[name] = counts.get(name, 0) + 1
        best = None
        for st in self.nodes.values():
            if st.lost or st.cpu <= 0:
                continue
            key = ((counts.get(st.name, 0) + 1) / st.cpu, st.index)
            if best is None or key < best[0]:
                best = (key, st.name)
        if best is None:
            return None
        self._sticky[trajectory] = best[1]
        return best[1]

    def node_of(self, name: str) -> _NodeState:
        return self.nodes[name]

    def _lose(self, st: _NodeState, why: str) -> None:
        """The node is gone: it leaves placement; its actions fail or go back to the queue."""
        if st.lost:
            return
        st.lost = True
        self.lost_nodes.append(st.name)
        log.warning("node %s lost: %s; %d running action(s) %s", st.name, why, len(st.inflight),
                    "re-queued (failed if not idempotent)" if self.on_node_loss == "requeue" else "failed")
        for t in [t for t, n in self._sticky.items() if n == st.name]:
            del self._sticky[t]
        for names in self._trajectory_nodes.values():
            names.discard(st.name)
        # The orchestrator, when this manager is bound to a running one.
        orch = self.orchestrator if self.orchestrator is not None and self.orchestrator.state == "running" else None
        reason = f"node {st.name} was lost: {why}"
        requeue = self.on_node_loss == "requeue"
        try:
            if orch is not None:
                orch.set_node_online(st.name, False)
            for action_id, future in list(st.inflight.items()):
                lost = reason
                if orch is not None and requeue:
                    if not _idempotent(orch, action_id):
                        # It may have run there, or even finished with only its reply lost.
                        lost = f"{reason}; not rerun elsewhere because the call is not idempotent (Call.idempotent=False)"
                    elif orch.requeue(action_id, _without_affinity(orch, action_id, st.name)):
                        continue
                if not future.done():
                    future.set_result(("lost", lost))
            if orch is not None:
                # Waiting actions whose affinity names the lost node could never start.
                for action_id, call in orch.waiting_calls().items():
                    if call.affinity != st.name:
                        continue
                    if requeue:
                        orch.requeue(action_id, dataclasses.replace(call, affinity=None))
                    else:
                        orch.abort(action_id, NodeLost(action_id, f"{reason} (the node its affinity names)", st.name))
        finally:  # whatever failed above, no action of the node is left hanging
            for future in st.inflight.values():
                if not future.done():
                    future.set_result(("lost", reason))
            st.pending.clear()
            st.cancels.clear()
        if st.poller is not None and st.poller is not asyncio.current_task():
            st.poller.cancel()
        try:
            import ray

            ray.kill(st.agent)
        except Exception:
            pass

    async def _watch(self) -> None:
        while self._state != "closed":
            await asyncio.sleep(self.monitor_interval)
            try:
                alive = {n["NodeID"]: n for n in await asyncio.to_thread(cluster_nodes)}
            except Exception as e:  # the GCS is unreachable for a moment: look again later
                log.warning("ray.nodes() failed: %s", e)
                continue
            for st in list(self.nodes.values()):
                if not st.lost and st.node_id not in alive:
                    self._lose(st, "Ray reports the node dead")
            for node_id, info in alive.items():
                if node_id not in self._known_ids:
                    self._known_ids.add(node_id)
                    task = self._loop.create_task(self._join(info))
                    self._joining.add(task)
                    task.add_done_callback(self._joining.discard)

    async def _join(self, info: Mapping[str, Any]) -> None:
        """A node joined: start its agent, then add it to the core (when bound)."""
        node = _node_of(info, self.gpu_memory)
        orch = self.orchestrator
        if orch is None or orch.state != "running":
            log.warning("node %s joined, but the manager is not bound to a running orchestrator", node.name)
            return
        st = self._make_agent(info, -1)
        try:
            await self._start_agent(st, node)
        except Exception as e:
            log.warning("node %s joined, but its agent did not start: %s", node.name, e)
            return
        if self._state == "closed" or orch.state != "running":
            return
        st.index = orch.add_node(node)
        self._add_state(st)
        self.joined_nodes.append(node.name)
        log.info("node %s joined as node %d", node.name, st.index)

    def describe(self) -> Mapping[str, Any]:
        return {"nodes": {n: {"lost": st.lost, "dispatched": st.dispatched, "batches": st.batches,
                              "largest_batch": st.largest, "by_reply": st.by_reply, "by_poll": st.by_poll,
                              "stray": st.stray}
                          for n, st in self.nodes.items()},
                "on_node_loss": self.on_node_loss, "sticky": self.sticky}


def _complete(st: _NodeState, done: Sequence[tuple[int, str, Any]]) -> int:
    """Ends the futures of completions that came back (by a batch's reply or a poll; the
    agent sends each completion once, by one of them). Returns how many ended one."""
    n = 0
    for action_id, kind, payload in done:
        future = st.inflight.get(action_id)
        if future is not None and not future.done():
            future.set_result((kind, payload))
            n += 1
        else:
            st.stray += 1
    return n


def _idempotent(orch: Host, action_id: int) -> bool:
    call = orch.live_call(action_id)
    return call is None or call.idempotent


def _without_affinity(orch: Host, action_id: int, node: str) -> Call | None:
    call = orch.live_call(action_id)
    if call is None or call.affinity != node:
        return None
    return dataclasses.replace(call, affinity=None)


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody waits for this any more
        pass


def _actor_gone(error: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(error, RayActorError)


async def _await_ref(ref: Any) -> Any:
    return await ref


class RayOrchestrator(Orchestrator):
    """An Orchestrator over the connected Ray cluster: inventory from `cluster_inventory`
    (unless given), one RayManager serving the "cpu", "gpu" and "ray" manager names, an
    ApiManager on the driver for quota calls. It binds the manager (node changes reach
    the core) and, while `sticky`, sets each call's affinity to its trajectory's sandbox
    node once the trajectory has been placed. Call `ray.init` first."""

    def __init__(self, config: RuntimeConfig | None = None, *, inventory: Inventory | None = None,
                 policy: str | None = None, quotas: Sequence[Quota] = (), services: Sequence[Service] = (),
                 managers: Mapping[str, ResourceManager] | None = None, metrics: bool = True,
                 **ray_options: Any) -> None:
        config = config if config is not None else RuntimeConfig()
        options = {**dict(config.managers.get("ray", {})), **ray_options}
        self.ray = RayManager(**options)
        if inventory is None:
            # The config's quotas and services join the cluster's inventory (an explicit
            # inventory must carry its own: the Orchestrator refuses to drop them).
            inventory = cluster_inventory([*config.quotas, *quotas], [*config.services, *services],
                                          gpu_memory=self.ray.gpu_memory)
            config = dataclasses.replace(config, quotas=[], services=[])
        given: dict[str, ResourceManager] = {"cpu": self.ray, "gpu": self.ray, "ray": self.ray, "api": ApiManager()}
        given.update(managers or {})
        super().__init__(config, inventory=inventory, policy=policy, managers=given, default_managers=False,
                         metrics=metrics)

    def advertise(self, host: str, port: int) -> None:
        """Clients on the cluster's workers find the server here (tangram.server.discovery)."""
        self.ray.advertise(host, port)

    def submit(self, call: Call, action_id: int | None = None) -> ActionHandle:
        if self.ray.sticky and call.affinity is None and isinstance(call, Call) and \
                self.managers.get(manager_for(call)) is self.ray and call.service is None:
            node = self.ray.home_for(call.trajectory)
            if node is not None:
                call = dataclasses.replace(call, affinity=node)
        return super().submit(call, action_id)


def connect_orchestrator(address: str, config: RuntimeConfig, policy: str | None = None,
                         serves: str = "") -> RayOrchestrator:
    """`tangram serve --ray ADDRESS`: connects this process to the Ray cluster at `address`
    ("auto": the one this host belongs to) and makes its RayOrchestrator (claiming the
    cluster as it starts, for `serves`)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - exercised only without ray
        raise ManagerError("--ray", "the Ray backend needs ray: pip install 'ray>=2.9' (from a checkout: pip install "
                                    "'.[ray]')") from None
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ManagerError("--ray", f"cannot connect to a Ray cluster at {address!r}: {e} (start one with "
                                    "`ray start --head`, or give its address: --ray HOST:PORT)") from None
    return RayOrchestrator(config, policy=policy, serves=serves)


__all__ = ["ClusterClaimed", "connect_orchestrator", "NodeLost", "RayManager", "RayOrchestrator", "cluster_inventory", "cluster_nodes", "node_name"]
