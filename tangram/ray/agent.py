"""The node agent: one Ray actor per Ray node, owning that node's sandboxes (and GPU
services).

It is an async actor: every method runs on the actor's own event loop, where a CpuManager
(and optionally a GpuManager) runs exactly as it does under a local orchestrator. The
driver's RayManager talks to it in batches only:

  run(batch, wait)  starts [(action id, pickled Call, Placement), ...] and returns the
                    completions of the batch's actions that end within `wait` s (it
                    returns at the first such completion, or after `wait` s with none):
                    a quick action costs one actor round trip, like a Ray task
  poll(timeout)     long poll: waits until something finished (or `timeout` s) and returns
                    every completion since the last poll, as (id, kind, payload) tuples;
                    it carries every completion that run() did not return (each action's
                    completion travels exactly once, by one of the two)
  cancel(ids)       cancels those actions (the sandbox's process group is killed); each
                    still reports one completion, of kind "cancelled"
  end_trajectories(ids), restore/evict (GPU services), close()

Errors travel as plain tuples (the typed errors' constructors do not round-trip through
pickle) and are rebuilt on the driver by `rebuild_error`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import traceback
from typing import Any, Mapping, Sequence

import cloudpickle

from .._model import Inventory, Node
from ..runtime.call import Call, Placement
from ..runtime.errors import ActionCrashed, ActionError, ActionFailed, ResourceLimitExceeded
from ..runtime.managers.base import LiveAction

Completion = tuple[int, str, Any]  # (action id, "ok" | "error" | "cancelled", result or error tuple)


def error_tuple(error: BaseException) -> tuple[Any, ...]:
    """A typed action error as a picklable tuple (see rebuild_error)."""
    if isinstance(error, ResourceLimitExceeded):
        return ("ResourceLimitExceeded", error.reason, error.limit)
    if isinstance(error, ActionCrashed):
        return ("ActionCrashed", error.reason, error.exit_code, error.signal)
    if isinstance(error, ActionFailed):
        return ("ActionFailed", error.reason, error.error_type, error.remote_traceback)
    if isinstance(error, ActionError):
        return ("ActionFailed", error.reason, type(error).__name__, "")
    return ("ActionFailed", f"{type(error).__name__}: {error}", type(error).__name__,
            "".join(traceback.format_exception(error)))


def rebuild_error(action_id: int, t: Sequence[Any]) -> ActionError:
    kind = t[0]
    if kind == "ResourceLimitExceeded":
        return ResourceLimitExceeded(action_id, t[1], t[2])
    if kind == "ActionCrashed":
        return ActionCrashed(action_id, t[1], exit_code=t[2], signal=t[3])
    return ActionFailed(action_id, t[1], t[2], t[3])


@dataclasses.dataclass(eq=False)
class _Reply:
    """What one waiting run() returns: the completions of its batch that ended so far."""

    wake: asyncio.Future[None]
    done: list[Completion] = dataclasses.field(default_factory=list)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def pack_batch(batch: Sequence[tuple[int, bytes, Placement]], wait: float) -> bytes:
    """run()'s argument. Ray's own serialization of a list of tuples costs a few hundred
    microseconds more per call than one plain pickle passed as bytes."""
    return pickle.dumps((batch, wait), protocol=pickle.HIGHEST_PROTOCOL)


def pack_completions(done: Sequence[Completion]) -> bytes:
    """Completions as one pickle of (action id, pickled completion) pairs: each completion
    pickled on its own (plain pickle, cloudpickle if it must), so a result that cannot be
    sent back, or loaded on the driver, fails its own action, never the others."""
    out = []
    for c in done:
        try:
            blob = pickle.dumps(c, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            try:
                blob = cloudpickle.dumps(c, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                blob = pickle.dumps((c[0], "error", ("ActionFailed", f"the result cannot be sent back from the "
                                    f"node: {type(e).__name__}: {e}", type(e).__name__, "")))
        out.append((c[0], blob))
    return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_completions(data: bytes) -> list[Completion]:
    out: list[Completion] = []
    for action_id, blob in pickle.loads(data):
        try:
            out.append(pickle.loads(blob))
        except Exception as e:
            out.append((action_id, "error", ("ActionFailed", f"the result cannot be loaded on the driver: "
                        f"{type(e).__name__}: {e}", type(e).__name__, "")))
    return out


class NodeAgent:
    """The actor class (wrapped with ray.remote by the RayManager)."""

    def __init__(self, node_name: str, node_id: str, cpu: Mapping[str, Any] | None = None,
                 gpu: Mapping[str, Any] | None = None) -> None:
        self.node_name = node_name
        self.node_id = node_id
        self.cpu_options = dict(cpu or {})
        self.gpu_options = dict(gpu) if gpu is not None else None
        self.cpu: Any = None
        self.gpu: Any = None
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._running: dict[int, tuple[Call, Placement, Any]] = {}  # what a resize needs
        self._cancelled_early: set[int] = set()
        self._done: list[Completion] = []
        # Actions whose run() is still waiting to return their completion itself (id ->
        # that run's reply): their completions go there, not to the poll.
        self._held: dict[int, _Reply] = {}
        self._wake: asyncio.Event | None = None
        self.batches = 0

    async def start(self, resources: Mapping[str, float], gpus: Sequence[float] = ()) -> dict[str, Any]:
        """Starts the managers for this node (as node 0 of a one-node inventory)."""
        from ..runtime.managers.cpu import CpuManager

        self._wake = asyncio.Event()
        env = dict(self.cpu_options.pop("env", {}) or {})
        env.setdefault("TANGRAM_NODE", self.node_name)
        env.setdefault("TANGRAM_RAY_NODE_ID", self.node_id)
        self.cpu = CpuManager(env=env, **self.cpu_options)
        from .._model import Gpu

        inventory = Inventory(nodes=[Node(self.node_name, dict(resources), [Gpu(m) for m in gpus])])
        self.cpu.attach(inventory)
        await self.cpu.start()
        if self.gpu_options is not None:
            from ..runtime.managers.gpu import GpuManager

            self.gpu = GpuManager(**self.gpu_options)
            self.gpu.attach(inventory)
            await self.gpu.start()
        import ray

        return {"node": self.node_name, "node_id": self.node_id, "pid": os.getpid(), "cpus": self.cpu.cpus,
                "ray_node_id": ray.get_runtime_context().get_node_id(),
                "isolation": self.cpu.describe()["isolation"]}

    # ------------------------------------------------------------------ actions
    async def run(self, message: bytes) -> bytes:
        """Starts a batch: `message` is pack_batch(batch, wait). Each call comes pickled on
        its own (cloudpickle), so one that cannot be loaded here fails alone. Then waits up
        to `wait` s for the first of the batch's actions to end, and returns (packed) the
        completions of those that have ended by then (a cancelled one included); the
        others come by poll."""
        batch, wait = pickle.loads(message)
        return pack_completions(await self._run(batch, wait))

    async def _run(self, batch: Sequence[tuple[int, bytes, Placement]], wait: float) -> list[Completion]:
        self.batches += 1
        loop = asyncio.get_running_loop()
        if not batch:
            return []
        held = self._held
        reply = _Reply(loop.create_future())
        ids = [b[0] for b in batch]
        for action_id in ids:
            held[action_id] = reply
        timer = None
        try:
            for action_id, blob, placement in batch:
                if action_id in self._cancelled_early:
                    self._cancelled_early.discard(action_id)
                    self._finish((action_id, "cancelled", None))
                    continue
                try:
                    call = cloudpickle.loads(blob)
                except Exception as e:
                    self._finish((action_id, "error", ("ActionFailed", f"the call cannot be loaded on node "
                                  f"{self.node_name}: {type(e).__name__}: {e}", type(e).__name__, "")))
                    continue
                self._tasks[action_id] = loop.create_task(self._execute(action_id, call, placement))
            if wait > 0 and not reply.done:
                timer = loop.call_later(wait, _wake, reply.wake)
                await reply.wake
        except BaseException:
            # Interrupted (the agent is closing): what ended goes by poll after all.
            for completion in reply.done:
                self._finish_by_poll(completion)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            for action_id in ids:  # whatever did not end by now comes by poll
                if held.get(action_id) is reply:
                    del held[action_id]
        return reply.done

    async def _execute(self, action_id: int, call: Call, placement: Placement) -> None:
        try:
            manager = self.cpu
            if call.service is not None:
                if self.gpu is None:
                    raise ActionFailed(action_id, f"node {self.node_name} runs no GPU services", "ManagerError")
                manager = self.gpu
            elif placement.device is not None and self.gpu is not None and placement.gpu_memory > 0:
                # The GPU grant's environment, computed here, on the node that has the device.
                env = dict(placement.env)
                env.update(self.gpu.device_environment(0, placement.device, placement.gpu_memory))
                placement = dataclasses.replace(placement, env=env)
            self._running[action_id] = (call, placement, manager)
            result = await manager.execute(LiveAction(action_id, call), placement)
        except asyncio.CancelledError:
            self._finish((action_id, "cancelled", None))
        except BaseException as e:  # noqa: BLE001 - every outcome goes back as one completion
            self._finish((action_id, "error", error_tuple(e)))
        else:
            self._finish((action_id, "ok", result))
        finally:
            self._tasks.pop(action_id, None)
            self._running.pop(action_id, None)

    def resize(self, items: Sequence[tuple[int, float, float]]) -> None:
        """(action, grant, cores) of running actions whose grant the core changed: their
        manager applies each (one that already ended is skipped)."""
        for action_id, grant, cores in items:
            running = self._running.get(action_id)
            if running is None:
                continue
            call, placement, manager = running
            placement = dataclasses.replace(placement, grant=grant, cores=cores)
            self._running[action_id] = (call, placement, manager)
            manager.resize(LiveAction(action_id, call), placement)

    def _finish(self, completion: Completion) -> None:
        reply = self._held.pop(completion[0], None)
        if reply is not None:  # its run() is still waiting: it returns it
            reply.done.append(completion)
            _wake(reply.wake)
            return
        self._finish_by_poll(completion)

    def _finish_by_poll(self, completion: Completion) -> None:
        self._done.append(completion)
        assert self._wake is not None
        self._wake.set()

    async def poll(self, timeout: float = 1.0) -> bytes:
        """Every completion since the last poll (packed); waits up to `timeout` s for the
        first."""
        assert self._wake is not None
        if not self._done:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        done, self._done = self._done, []
        self._wake.clear()
        return pack_completions(done)

    async def cancel(self, ids: Sequence[int]) -> None:
        for action_id in ids:
            task = self._tasks.get(action_id)
            if task is None:
                self._cancelled_early.add(action_id)  # its run() has not arrived yet
            else:
                task.cancel()

    async def end_trajectories(self, ids: Sequence[int]) -> None:
        await asyncio.gather(*(self.cpu.end_trajectory(t) for t in ids))
        if self.gpu is not None:
            await asyncio.gather(*(self.gpu.end_trajectory(t) for t in ids))

    async def restore(self, service: str, device: int) -> float | None:
        return await self.gpu.restore(service, 0, device)

    async def evict(self, service: str, device: int, discard: bool = False) -> float | None:
        return await self.gpu.evict(service, 0, device, discard)

    # ------------------------------------------------------------------ state
    def describe(self) -> dict[str, Any]:
        return {"node": self.node_name, "running": len(self._tasks), "batches": self.batches,
                "sandboxes": self.cpu.sandbox_count if self.cpu is not None else 0,
                "usage": self.cpu.usage if self.cpu is not None else {}}

    def sandbox_dir(self, trajectory: int) -> str:
        return self.cpu.sandbox_dir(trajectory)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.gpu is not None:
            await self.gpu.close()
        if self.cpu is not None:
            await self.cpu.close()
