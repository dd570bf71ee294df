"""Resource managers: plugins that carry the core's decisions out on real resources.

The orchestrator owns the scheduler core and the event loop; a manager owns one family of
resources (CPU sandboxes, GPU services, API clients) and runs actions on them. Managers
are registered by name: the built-ins here, third-party ones through the entry-point group
"tangram.managers" (name = "module:Class"). The three built-ins use exactly this API.

Contract, for every hook: it runs on the orchestrator's event loop, in one thread; a hook
that has blocking work to do moves it to a thread or a process and awaits it.
"""

from __future__ import annotations

import abc
import asyncio
from collections import deque
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

from ..._model import Inventory, Node
from ..call import SERVICES_MANAGER, Call, Placement
from ..config import RuntimeConfig
from ..errors import ActionError, ManagerError

ENTRY_POINT_GROUP = "tangram.managers"


@dataclass(frozen=True)
class LiveAction:
    """An action as managers see it: the orchestrator's id and the caller's description."""

    id: int
    call: Call


class Host(Protocol):
    """The orchestrator as its managers see it (`ResourceManager.orchestrator`, set by
    `bind`): exactly the calls managers make back to it, each documented on Orchestrator."""

    @property
    def state(self) -> str: ...
    def limit_grant(self, action_id: int, amount: float) -> bool: ...
    def requeue(self, action_id: int, call: Call | None = None) -> bool: ...
    def abort(self, action_id: int, error: ActionError) -> bool: ...
    def live_call(self, action_id: int) -> Call | None: ...
    def waiting_calls(self) -> dict[int, Call]: ...
    def set_node_online(self, node: str | int, online: bool) -> None: ...
    def set_device_online(self, node: str | int, device: int, online: bool) -> None: ...
    def add_node(self, node: Node) -> int: ...


@runtime_checkable
class GpuCapabilities(Protocol):
    """What a manager of one node's GPUs offers the orchestrator beyond running actions
    (GpuManager declares it; the orchestrator looks for it once, at start):

      node                the inventory node whose devices it manages (known after `attach`)
      context_mib         device memory a GPU action's process holds beyond what it
                          allocates (its CUDA context): the core counts it in the grant
      device_environment  the environment that carries a GPU grant to a process the CPU
                          manager starts (CUDA_VISIBLE_DEVICES, MPS limits)
      service_states      each service instance: its state and device (`tangram top`)
      set_device_online   a device left placement (False) or came back (True)
    """

    node: int
    context_mib: float

    def device_environment(self, node: int, device: int, gpu_memory: float) -> Mapping[str, str]: ...
    def service_states(self) -> Mapping[str, tuple[str, int | None]]: ...
    def set_device_online(self, device: int, online: bool) -> None: ...


class ResourceManager(abc.ABC):
    """Base of every resource manager. Subclasses set `name` and implement `execute`.

    Lifecycle: constructed with keyword options (from the config's `managers.<name>`
    table), then `attach` and `bind` once, `start` once, any number of `execute`/`resize`/`restore`/
    `evict`/`end_trajectory` calls, `close` once.
    """

    name: ClassVar[str]
    # True: the manager puts a GPU grant's environment into the action's process itself,
    # where it runs (a Ray node agent, on its node): the orchestrator leaves it out of
    # Placement.env.
    gpu_env_on_node: ClassVar[bool] = False
    orchestrator: Host | None = None  # set by `bind`

    def attach(self, inventory: Inventory) -> None:
        """Called before `start` with the inventory the core schedules (node names and
        order, GPUs, services, quotas). Raise ManagerError for a setting that cannot work
        with it. Default: keep it as `self.inventory`."""
        self.inventory = inventory

    def bind(self, orchestrator: Host) -> None:
        """Called after `attach` with the orchestrator that runs this manager, so that the
        manager can tell it what it learns while actions run: a running action's limit on
        its own grant (`orchestrator.limit_grant`), lost nodes, requeues. Default: kept as
        `self.orchestrator`."""
        self.orchestrator = orchestrator

    async def start(self) -> None:
        """Acquire what the manager needs before the first action (pools, connections)."""

    def check_call(self, call: Call) -> None:
        """Called at submit, before the action is queued: raise a typed error naming the
        call's field (tangram.ValidationError) for a call this manager could never run
        (nothing to run, the wrong shape of input). Cheap and non-blocking: it runs for
        every submit. Default: every call is accepted, and `execute` decides."""

    @abc.abstractmethod
    async def execute(self, action: LiveAction, placement: Placement) -> Any:
        """Run one action where the core placed it, with what it was granted, and return its
        result (a function's return value, a CommandResult...).

        - Errors: raise ActionFailed, ActionCrashed or ResourceLimitExceeded (from
          tangram.runtime.errors); any other exception is reported as ActionFailed.
        - Cancellation (a caller's cancel, a timeout, shutdown) arrives as
          asyncio.CancelledError at the await point: stop the work (kill the whole process
          group), release what it held, then let the CancelledError propagate. The
          orchestrator turns it into ActionCancelled or ActionTimeout.
        - The resources in `placement` are the action's only while this call runs.
        - Its first step (up to the first await that suspends) runs as the orchestrator
          starts the action, inside the batch of start decisions (an eager start, in the
          action's own context): keep it short and non-blocking. On Python 3.12+ it is an
          asyncio eager task (the first step runs as the action's task); on 3.11 the first
          step runs before the task exists, so there it must not rely on
          asyncio.current_task() (asyncio.timeout, a TaskGroup). An action that returns
          without suspending ends then and there.
        """

    def resize(self, action: LiveAction, placement: Placement) -> None:
        """The core changed the grant of a running action (an elastic one): `placement` is
        its start placement with the new `grant` (and `cores` or `memory`, for an elastic
        CPU or memory grant). Apply it to the running work now and tell its process if it
        can listen. Synchronous and cheap: it runs inside the batch of decisions. It may
        come for an action whose `execute` has just returned: ignore it then. Default:
        nothing changes for the process (the core's accounting still moves)."""

    async def restore(self, service: str, node: int, device: int) -> float | None:
        """Make a GPU service resident on (node, device). Only managers of services get it.
        Returns the seconds its restore took, measured (the orchestrator learns the
        service's restore time from them), or None when nothing was measured (a first load,
        which is no restore, or a service already resident)."""
        raise ManagerError(f"managers.{self.name}", "this manager has no services to restore")

    async def evict(self, service: str, node: int, device: int, discard: bool = False) -> float | None:
        """Offload a resident GPU service from (node, device); none of its actions run.
        Returns the seconds its offload took, measured, or None. `discard`: give its state
        up instead (close it; its next restore is a load), also when it is not resident
        but its process sleeps on that device."""
        raise ManagerError(f"managers.{self.name}", "this manager has no services to evict")

    async def end_trajectory(self, trajectory: int) -> None:
        """The trajectory is over: release its per-trajectory state (sandbox, files)."""

    async def close(self) -> None:
        """Release everything. No action of this manager is running when it is called."""

    def describe(self) -> Mapping[str, Any]:
        """What this manager enforces, in words and numbers, for logs and the README."""
        return {}


class MockManager(ResourceManager):
    """For tests and benchmarks: runs a call's `fn` inline on the event loop (awaited when
    it is a coroutine function), or, for a call without one, sleeps its declared `runtime`
    when that is a number of seconds (nothing when it declares none or a model). Records
    its last `keep_events` hook calls in `events`."""

    name = "mock"

    def __init__(self, sleep: bool = True, keep_events: int = 10_000) -> None:
        self.sleep = sleep
        self.events: deque[tuple[Any, ...]] = deque(maxlen=keep_events)
        self.running = 0
        self.max_running = 0

    async def execute(self, action: LiveAction, placement: Placement) -> Any:
        self.events.append(("execute", action.id, placement))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            fn = action.call.fn
            if fn is None:
                seconds = action.call.runtime if isinstance(action.call.runtime, (int, float)) else 0.0
                if self.sleep and seconds > 0:
                    await asyncio.sleep(float(seconds))
                return None
            result = fn(*action.call.args, **action.call.kwargs)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        finally:
            self.running -= 1

    async def restore(self, service: str, node: int, device: int) -> float | None:
        self.events.append(("restore", service, node, device))
        return None

    async def evict(self, service: str, node: int, device: int, discard: bool = False) -> float | None:
        self.events.append(("discard" if discard else "evict", service, node, device))
        return None

    async def end_trajectory(self, trajectory: int) -> None:
        self.events.append(("end_trajectory", trajectory))


_BUILTIN: dict[str, str] = {
    "mock": "tangram.runtime.managers.base:MockManager",
    "cpu": "tangram.runtime.managers.cpu:CpuManager",
    "gpu": "tangram.runtime.managers.gpu:GpuManager",
    "api": "tangram.runtime.managers.api:ApiManager",
    "ray": "tangram.ray:RayManager",
}
_REGISTERED: dict[str, type[ResourceManager]] = {}


def register_manager(cls: type[ResourceManager]) -> type[ResourceManager]:
    """Registers a manager class under `cls.name` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, ResourceManager)):
        raise ManagerError("manager", f"{cls!r} is not a ResourceManager subclass")
    _REGISTERED[cls.name] = cls
    return cls


def _load(target: str, name: str) -> type[ResourceManager]:
    import importlib

    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, ResourceManager)):
        raise ManagerError(f"managers.{name}", f"{target} is not a ResourceManager subclass")
    return cls


def manager_class(name: str) -> type[ResourceManager]:
    """The manager class registered as `name`: registered in this process, built in, or
    declared by an installed package under the entry-point group "tangram.managers"."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        return _load(_BUILTIN[name], name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, ResourceManager)):
                raise ManagerError(f"managers.{name}", f"entry point {ep.value} is not a ResourceManager subclass")
            return cls
    known = sorted(set(_REGISTERED) | set(_BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    raise ManagerError(f"managers.{name}", f"no resource manager named {name!r}; known: {', '.join(known)}")


def make_managers(config: RuntimeConfig, given: Sequence[ResourceManager] | Mapping[str, ResourceManager],
                  defaults: Sequence[str]) -> dict[str, ResourceManager]:
    """An orchestrator's managers by name: `defaults` and those the config names, made from
    the config's options (the GPU manager with its service hooks), except where `given`
    (instances, by name or by their `name`) replaces them or adds others."""
    instances = dict(given) if isinstance(given, Mapping) else {m.name: m for m in given}
    managers: dict[str, ResourceManager] = {}
    for name in dict.fromkeys([*defaults, *config.managers]):
        if name in instances:
            continue
        options = dict(config.managers.get(name, {}))
        if name == SERVICES_MANAGER and config.service_hooks and "services" not in options:
            options["services"] = config.service_hooks
        cls = manager_class(name)
        try:
            managers[name] = cls(**options)
        except TypeError as e:
            raise ManagerError(f"managers.{name}", f"bad options for {cls.__name__}: {e}") from None
    managers.update(instances)
    return managers


__all__ = ["ENTRY_POINT_GROUP", "GpuCapabilities", "Host", "LiveAction", "ResourceManager", "MockManager", "make_managers",
           "register_manager", "manager_class"]
