"""The GPU manager: CUDA devices and slices of them, and GPU services (reward models).

Devices (`tangram.devices`)
    The manager schedules the devices `tangram.devices.discover()` finds (NVML, or the
    fake inventory TANGRAM_FAKE_GPUS declares), the same list `Inventory.local()` gives
    its GPUs from, unless it is handed its own `devices`. `GpuDevice`, `discover`,
    `parse_fake` and `FAKE_ENV` are importable from here too.

Grants (`grant_environment`)
    A placement on a device is carried to the action's process by its environment:
    CUDA_VISIBLE_DEVICES is the device's UUID (GPU-... for a whole GPU, MIG-... for a MIG
    instance), which stays right whatever the process's device numbering. A memory slice
    of a shared (non-MIG) GPU is enforced only where an MPS control daemon answers
    (`mps_active`): CUDA_MPS_PINNED_DEVICE_MEM_LIMIT caps its memory, and the daemon's pipe
    directory goes with it (a sandbox's environment is scrubbed). Compute is shared as MPS
    shares it, without a thread cap. Without MPS a slice is a scheduling share: the core
    never over-commits the device, but nothing stops a process from using more.

Services (`ServiceHooks`, `GpuManager`)
    A service (a reward model) is user code behind five blocking hooks: load (once, on its
    first residency), offload (device -> host memory), restore (host -> device), batch
    (one output per input) and close. The core decides residency and eviction; the manager
    runs the hooks (in one worker thread per service, so the hooks of one service never
    overlap) and batches the service's concurrent actions onto its resident instance.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ..._model import Inventory
from ...devices import FAKE_ENV, VISIBLE_ENV, GpuDevice, discover, parse_fake, visible
from ..call import Call, Placement, require_service_input
from ..errors import ActionFailed, ManagerError
from .base import GpuCapabilities, LiveAction, ResourceManager
from .gpu_devices import FATAL_XIDS, XidWatch, grant_environment, mib_text, mps_active, mps_pipe_directory
from .hooks import FunctionService, ServiceHooks

log = logging.getLogger("tangram.gpu")

# ------------------------------------------------------------------ services






_UNLOADED = object()


@dataclass(eq=False)
class _Request:
    action_id: int
    input: Any
    future: asyncio.Future[Any]


@dataclass(eq=False)
class _Residency:
    device: int
    ready: asyncio.Future[BaseException | None]  # None: resident; an exception: it failed


@dataclass(eq=False)
class _ServiceState:
    name: str
    hooks: ServiceHooks
    max_batch: int = 1
    handle: Any = _UNLOADED
    residency: _Residency | None = None
    evicting: int | None = None  # the device its offload (or discard) is running on
    awaiting: dict[int, asyncio.Future[BaseException | None]] = field(default_factory=dict)
    released: asyncio.Event | None = None  # set whenever the residency ends
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: collections.Counter[int] = field(default_factory=collections.Counter)  # device -> executes
    queue: collections.deque[_Request] = field(default_factory=collections.deque)
    flusher: asyncio.Task[None] | None = None
    executor: concurrent.futures.ThreadPoolExecutor | None = None
    batch_executor: concurrent.futures.ThreadPoolExecutor | None = None  # concurrent batches
    in_flight: set[asyncio.Task[None]] = field(default_factory=set)  # concurrent batches running
    batches: int = 0
    stuck: str | None = None  # a hook ran past hook_timeout: its thread still runs it
    suspect: str | None = None  # an Xid on its device: check its health before the next batch
    checking: asyncio.Future[None] | None = None  # a health check (and restart) in progress
    process_device: int | None = None  # the device its loaded instance was last made resident on
    restarts: int = 0
    restart_failed_at: float | None = None  # monotonic time of its last failed restart (retried later)


# What a CUDA context takes on a device, in MiB, when nothing better is known: about 300 to
# 600 MiB on recent GPUs with CUDA 12's lazy module loading, more with eager loading or
# large libraries; bench/gpu_check.py's context_cost measures it on a machine.
CUDA_CONTEXT_MIB = 512.0

class HookTimeout(RuntimeError):
    """A service hook ran past the GPU manager's hook_timeout."""


def _number_option(value: Any, field: str, requirement: str, ok: Callable[[float], bool]) -> float:
    """A manager option as a finite float meeting `ok`, else a ManagerError naming it."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or not ok(number):
        raise ManagerError(field, f"must be {requirement}, got {number!r}")
    return number


def _resolve_hooks(name: str, hooks: Any) -> ServiceHooks:
    if isinstance(hooks, str):
        import importlib

        module, _, attr = hooks.partition(":")
        try:
            hooks = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ManagerError(f"services.{name}", f"cannot import {hooks!r}: {e}") from None
        if isinstance(hooks, type) and issubclass(hooks, ServiceHooks):
            try:
                hooks = hooks()
            except Exception as e:
                raise ManagerError(f"services.{name}", f"cannot construct {hooks.__name__}(): {e}") from e
    if not isinstance(hooks, ServiceHooks):
        raise ManagerError(f"services.{name}", f"expected a ServiceHooks instance (or 'module:attr' naming one), "
                                               f"got {hooks!r}")
    return hooks


class GpuManager(ResourceManager, GpuCapabilities):
    """Runs GPU services' actions on their resident instances, and gives GPU grants.

    Options: `services` maps each service of the inventory to its ServiceHooks (or a
    "module:attr" string naming one). `devices`: the device table of the node this manager
    runs on, index i being the inventory's GPU i there; by default `discover()`. It may
    also be a list of MiB (fake devices), a TANGRAM_FAKE_GPUS-style spec string, or
    "inventory" (fake devices mirroring the inventory's GPUs: an explicit choice for
    machines without a GPU). `batch_window`: seconds a batch waits for more requests
    after the first (0: only the requests issued in the same event-loop iteration join).
    `node`: the inventory node (index or name) that is this machine. `mps`: whether MPS
    enforces memory slices; by default whether its control daemon is reachable.
    `hook_timeout`: seconds any one hook call may take (None: no limit). A hook past it
    fails what waited for it (a restore's waiting actions, a batch's actions, an eviction:
    a ManagerError), and the service is out of use from then on: its hooks run one at a
    time in its own thread, which a Python thread cannot be made to leave, so every later
    call of the service fails at once, naming the hook that did not return (and the
    process exits only once it has returned). `context_mib`: device memory a GPU action's
    process takes beyond what it allocates (its CUDA context), which the core adds to every
    GPU action without a service; by default CUDA_CONTEXT_MIB on NVML devices, 0 on fake or
    given ones (bench/gpu_check.py measures it on a real GPU). `watch_xids`: watch NVML's critical Xid
    events of the NVML devices (`XidWatch`): services on a device that reported one are
    checked before their next batch and restarted when unhealthy, a device-fatal one
    (FATAL_XIDS) takes the device out of placement; the events are in describe().

    A service action (`call.service`) takes its input as its one positional argument and
    returns the output its service's `batch` hook gave for it. GPU actions without a
    service run in the CPU manager; `device_environment` gives the environment that
    carries their grant.
    """

    name: ClassVar[str] = "gpu"
    # A failed restart leaves the service resident for the core, failing its actions at
    # once; a request arriving this many seconds after the failure tries the load again.
    RESTART_RETRY_SECONDS: ClassVar[float] = 10.0

    def __init__(self, services: Mapping[str, Any] | None = None,
                 devices: Sequence[GpuDevice | float] | str | None = None,
                 batch_window: float = 0.0, node: int | str = 0, mps: bool | None = None,
                 hook_timeout: float | None = 600.0, watch_xids: bool = True,
                 context_mib: float | None = None) -> None:
        services = dict(services or {})
        self.hooks: dict[str, ServiceHooks] = {str(k): _resolve_hooks(str(k), v) for k, v in services.items()}
        self.batch_window = _number_option(batch_window, "batch_window", "a non-negative number of seconds",
                                           lambda x: x >= 0)
        self.hook_timeout = None if hook_timeout is None else _number_option(
            hook_timeout, "hook_timeout", "a positive number of seconds or None", lambda x: x > 0)
        self._devices_option = devices
        self._node_option = node
        self._mps_option = mps
        self.devices: list[GpuDevice] = []
        self.node = 0
        self.mps = False
        self.mps_pipe = mps_pipe_directory()
        self._services: dict[str, _ServiceState] = {}
        self._offloading: dict[int, set[asyncio.Future[None]]] = {}
        self._attached = False
        self.watch_xids = bool(watch_xids)
        self._context_option = None if context_mib is None else _number_option(
            context_mib, "context_mib", "a non-negative number of MiB or None", lambda x: x >= 0)
        self.context_mib = 0.0
        self._xid_watch: XidWatch | None = None
        self.xid_events: list[dict[str, Any]] = []
        self.offline_devices: set[int] = set()  # out of placement (a fatal Xid): their state is gone

    # ---------------------------------------------------------------- setup
    def check_call(self, call: Call) -> None:
        require_service_input(call)

    def attach(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.node = self._resolve_node(inventory)
        declared = [s.name for s in inventory.services]
        for name in declared:
            if name not in self.hooks:
                raise ManagerError(f"services.{name}", f"the inventory declares service {name!r} but no hooks "
                                                       f"were given for it (GpuManager(services={{...}}))")
        for name in self.hooks:
            if name not in declared:
                raise ManagerError(f"services.{name}", f"hooks were given for service {name!r}, which the "
                                                       f"inventory does not declare")
        gpus = list(inventory.nodes[self.node].gpus) if inventory.nodes else []
        self.devices = self._resolve_devices(gpus, inventory.nodes[self.node].name if inventory.nodes else "")
        self.mps = mps_active() if self._mps_option is None else bool(self._mps_option)
        self.mps_pipe = mps_pipe_directory()
        if self._context_option is not None:
            self.context_mib = self._context_option
        else:  # real GPUs: a context's typical cost; fake or given ones: none
            self.context_mib = CUDA_CONTEXT_MIB if any(d.source == "nvml" for d in self.devices) else 0.0
        # One state per instance the core schedules (a replicated service's replicas share
        # its hooks object: each load returns the handle of its own instance).
        self._services = {name: _ServiceState(name, self.hooks[s.name], max(1, int(s.max_batch)))
                          for name, s in inventory.service_instances}
        self._attached = True

    def _resolve_node(self, inventory: Inventory) -> int:
        node = self._node_option
        names = [n.name for n in inventory.nodes]
        if isinstance(node, str):
            if node not in names:
                raise ManagerError("node", f"no node named {node!r} in the inventory (nodes: {', '.join(names)})")
            return names.index(node)
        if isinstance(node, bool) or not isinstance(node, int) or not (0 <= node < max(1, len(names))):
            raise ManagerError("node", f"expected a node index below {len(names)} or a node name, got {node!r}")
        return node

    def _resolve_devices(self, gpus: list[Any], node_name: str) -> list[GpuDevice]:
        option = self._devices_option
        if option is None:
            if not gpus:
                return []  # the inventory schedules no GPU here: nothing to discover
            devices = discover()
            hint = (f" (set {FAKE_ENV}, e.g. {FAKE_ENV}={','.join(mib_text(g.memory) for g in gpus)}, "
                    f"or pass devices= to the gpu manager, for a machine without GPUs)")
        elif isinstance(option, str):
            if option == "inventory":
                devices = [GpuDevice(i, f"GPU-fake-{i}", "Fake GPU", float(g.memory), i, source="fake")
                           for i, g in enumerate(gpus)]
            else:
                devices = parse_fake(option, "devices")
            hint = ""
        else:
            devices = []
            for i, d in enumerate(option):
                if isinstance(d, GpuDevice):
                    if d.index != i:
                        raise ManagerError(f"devices[{i}].index", f"device {d.uuid} has index {d.index}, expected {i}")
                    devices.append(d)
                elif isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d) and d > 0:
                    devices.append(GpuDevice(i, f"GPU-fake-{i}", "Fake GPU", float(d), i, source="fake"))
                else:
                    raise ManagerError(f"devices[{i}]", f"expected a GpuDevice or a positive MiB value, got {d!r}")
            hint = ""
        if len(devices) != len(gpus):
            found = ", ".join(f"{d.uuid} ({mib_text(d.memory_mib)} MiB)" for d in devices) or "none"
            raise ManagerError("devices", f"the inventory declares {len(gpus)} GPU(s) on node {node_name!r}, but "
                                          f"the gpu manager has {len(devices)}: {found}{hint}")
        for g, d in zip(gpus, devices):
            if float(g.memory) > d.memory_mib * (1 + 1e-9):
                raise ManagerError(f"devices[{d.index}]", f"the inventory declares {mib_text(g.memory)} MiB on GPU "
                                                          f"{d.index} of node {node_name!r}, but {d.uuid} has "
                                                          f"{mib_text(d.memory_mib)} MiB")
        return devices

    def _state(self, service: str) -> _ServiceState:
        if not self._attached:
            raise ManagerError("managers.gpu", "attach() was not called")
        st = self._services.get(service)
        if st is None:
            raise ManagerError(f"services.{service}", f"no service named {service!r} "
                                                      f"(known: {', '.join(self._services) or 'none'})")
        return st

    def _check_device(self, node: int, device: int, what: str) -> GpuDevice:
        if node != self.node:
            raise ManagerError("node", f"{what} on node {node}, but this gpu manager runs node {self.node}")
        if not (0 <= device < len(self.devices)):
            raise ManagerError("devices", f"{what} on device {device}; node {self.node} has {len(self.devices)}")
        return self.devices[device]

    async def _call(self, st: _ServiceState, fn: Callable[..., Any], *args: Any,
                    executor: concurrent.futures.Executor | None = None) -> Any:
        """A hook call in the service's thread (or `executor`), within its hook timeout."""
        if st.stuck is not None:
            raise HookTimeout(st.stuck)
        if executor is None:
            if st.executor is None:
                st.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tangram-gpu-{st.name}")
            executor = st.executor
        timeout = st.hooks.hook_timeout if st.hooks.hook_timeout is not None else self.hook_timeout
        future = asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            st.stuck = (f"its {getattr(fn, '__name__', 'hook')} hook ran past hook_timeout={timeout:g} s "
                        f"and still runs; the service is out of use")
            log.error("services.%s: %s", st.name, st.stuck)
            raise HookTimeout(st.stuck) from None

    # ---------------------------------------------------------------- residency
    async def restore(self, service: str, node: int, device: int) -> float | None:
        """Make `service` resident on `device`: its `load` hook the first time, else its
        `restore` hook. Actions placed there wait until the hook returns. A restore while
        the service is still resident elsewhere waits for that residency to be evicted
        (the orchestrator orders operations per device, not across devices). Returns the
        seconds the restore hook took (None for a load, or when already resident)."""
        st = self._state(service)
        dev = self._check_device(node, device, f"restore of {service!r}")
        loop = asyncio.get_running_loop()
        while st.residency is not None and st.residency.device != device:
            if st.released is None:
                st.released = asyncio.Event()
            st.released.clear()
            await st.released.wait()
        r = st.residency
        if r is not None:  # already resident (or restoring) here
            if not r.ready.done():
                await asyncio.shield(r.ready)
            if r.ready.result() is None:
                return None
            st.residency = None  # it failed: try again
        ready = st.awaiting.pop(device, None) or loop.create_future()
        if ready.done():
            ready = loop.create_future()
        st.residency = _Residency(device, ready)
        offloads = list(self._offloading.get(device, ()))
        first = st.handle is _UNLOADED
        try:
            async with st.lock:
                if offloads:  # another service's memory on this device is still being freed
                    await asyncio.gather(*(asyncio.shield(f) for f in offloads))
                began = time.perf_counter()
                if first:
                    st.handle = await self._call(st, st.hooks.load, dev)
                else:
                    first = await self._call(st, st.hooks.restore, st.handle, dev) is False  # a fresh load
                seconds = time.perf_counter() - began
                st.process_device = device
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_result(RuntimeError("the restore was cancelled"))
            raise
        except Exception as e:
            if not ready.done():
                ready.set_result(e)
            hook = "load" if st.handle is _UNLOADED else "restore"
            raise ManagerError(f"services.{service}", f"{hook} hook failed on device {device} ({dev.uuid}): "
                                                      f"{type(e).__name__}: {e}") from e
        ready.set_result(None)
        return None if first else seconds

    async def evict(self, service: str, node: int, device: int, discard: bool = False) -> float | None:
        """Offload `service` from `device` (its `offload` hook). The core never evicts a
        service with running actions there: that is a ManagerError. Returns the seconds
        the offload hook took (None when its restore had failed: nothing was resident).
        `discard`: its state is given up instead (the core's kDiscard): its `close` hook
        runs, and its next restore is a load; also for a service not resident, whose
        process sleeps on `device` (an unmovable one giving its process up)."""
        st = self._state(service)
        self._check_device(node, device, f"eviction of {service!r}")
        if st.active[device]:
            raise ManagerError(f"services.{service}", f"evict from device {device} while {st.active[device]} of its "
                                                      f"actions run there")
        r = st.residency
        if discard and (r is None or r.device != device):  # its asleep process on `device`
            done_asleep: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._offloading.setdefault(device, set()).add(done_asleep)
            try:
                async with st.lock:
                    if st.residency is None and st.process_device == device:
                        await self._give_up(st, f"its process asleep on device {device} is given up")
            finally:
                done_asleep.set_result(None)
                self._offloading[device].discard(done_asleep)
            return None
        if r is None or r.device != device:
            where = "offloaded" if r is None else f"resident on device {r.device}"
            raise ManagerError(f"services.{service}", f"evict from device {device}, but it is {where}")
        st.residency = None
        st.evicting = device
        if st.released is not None:
            st.released.set()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._offloading.setdefault(device, set()).add(done)
        try:
            async with st.lock:  # after an in-flight restore of it
                if not r.ready.done():  # defensive: the restore always settles before releasing the lock
                    await asyncio.shield(r.ready)
                if r.ready.result() is not None:
                    return None  # its restore failed: nothing is resident
                if discard or device in self.offline_devices:  # its state is given up
                    await self._give_up(st, f"device {device} is out of placement" if not discard
                                        else "its state is discarded")
                    return None
                began = time.perf_counter()
                try:
                    await self._call(st, st.hooks.offload, st.handle)
                except Exception as e:
                    raise ManagerError(f"services.{service}", f"offload hook failed on device {device}: "
                                                              f"{type(e).__name__}: {e}") from e
                return time.perf_counter() - began
        finally:
            if st.evicting == device:
                st.evicting = None
            if not done.done():
                done.set_result(None)
            self._offloading[device].discard(done)

    def service_states(self) -> dict[str, tuple[str, int | None]]:
        """Each service instance: ("resident" | "restoring" | "evicting", its device), or
        ("offloaded" | "not loaded", None)."""
        out: dict[str, tuple[str, int | None]] = {}
        for name, st in self._services.items():
            r = st.residency
            if r is not None:
                out[name] = ("resident" if r.ready.done() and r.ready.result() is None else "restoring", r.device)
            elif st.evicting is not None:
                out[name] = ("evicting", st.evicting)
            else:
                out[name] = ("not loaded" if st.handle is _UNLOADED else "offloaded", None)
        return out

    def resident(self, service: str) -> int | None:
        """The device `service` is resident on (its hook has returned), or None."""
        r = self._state(service).residency
        return r.device if r is not None and r.ready.done() and r.ready.result() is None else None

    # ---------------------------------------------------------------- actions
    async def execute(self, action: LiveAction, placement: Placement) -> Any:
        call = action.call
        aid = action.id
        if call.service is None:
            raise ActionFailed(aid, "the gpu manager runs GPU service actions only; GPU actions without a service "
                                    "run in the CPU manager, with Placement.env carrying the grant "
                                    "(CUDA_VISIBLE_DEVICES and MPS limits, from GpuManager.device_environment)")
        st = self._services.get(call.service)
        if st is None:
            raise ActionFailed(aid, f"service: no service named {call.service!r} in the gpu manager")
        if call.fn is not None or call.command is not None:
            raise ActionFailed(aid, f"fn: a call to service {call.service!r} runs the service's batch hook; give its "
                                    f"input as the one positional argument, without fn or command")
        if len(call.args) != 1 or call.kwargs:
            raise ActionFailed(aid, f"args: a call to service {call.service!r} takes exactly one positional argument "
                                    f"(its input) and no keyword arguments; got {len(call.args)} and "
                                    f"{len(call.kwargs)}")
        device = placement.device
        if placement.node != self.node or device is None or not (0 <= device < len(self.devices)):
            raise ActionFailed(aid, f"placement: service {call.service!r} placed on node {placement.node} device "
                                    f"{device}; this gpu manager runs the {len(self.devices)} device(s) of node "
                                    f"{self.node}")
        loop = asyncio.get_running_loop()
        st.active[device] += 1
        try:
            r = st.residency
            if r is not None and r.device == device:
                ready = r.ready
            else:  # its restore here is still to come
                ready = st.awaiting.get(device)
                if ready is None or ready.done():
                    ready = st.awaiting[device] = loop.create_future()
            if not ready.done():
                await asyncio.shield(ready)
            error = ready.result()
            if error is not None and await self._retry_restart(st, device):
                r = st.residency
                error = r.ready.result() if r is not None and r.device == device else error
            if error is not None:
                raise ActionFailed(aid, f"service {call.service!r} could not be made resident on device {device}: "
                                        f"{type(error).__name__}: {error}", type(error).__name__)
            request = _Request(aid, call.args[0], loop.create_future())
            st.queue.append(request)
            if st.flusher is None or st.flusher.done():
                st.flusher = loop.create_task(self._flush(st))
            try:
                return await request.future
            except asyncio.CancelledError:
                try:
                    st.queue.remove(request)
                except ValueError:
                    pass  # its batch is in flight: its output is dropped
                raise
        finally:
            st.active[device] -= 1

    async def _flush(self, st: _ServiceState) -> None:
        """Runs the service's queued requests, a batch at a time (or, for hooks with
        concurrent_batches, each batch as soon as it is formed, beside those in flight)."""
        while st.queue:
            await asyncio.sleep(0)  # let the requests started in this iteration join
            if self.batch_window > 0:
                await asyncio.sleep(self.batch_window)
            if st.checking is not None:  # its queue waits for the checked (or restarted) instance
                await asyncio.shield(st.checking)
            if st.suspect is not None and st.residency is not None:
                await self._check_health(st, st.suspect, self._begin_check(st))
            r = st.residency
            if r is not None and r.ready.done() and r.ready.result() is not None:  # its restart failed
                error = r.ready.result()
                while st.queue:
                    request = st.queue.popleft()
                    if not request.future.done():
                        request.future.set_exception(ActionFailed(
                            request.action_id, f"service {st.name!r} could not be made resident on device {r.device}: "
                                               f"{type(error).__name__}: {error}", type(error).__name__))
                break
            batch: list[_Request] = []
            while st.queue and len(batch) < st.max_batch:
                request = st.queue.popleft()
                if not request.future.done():
                    batch.append(request)
            if not batch:
                continue
            if st.hooks.concurrent_batches:
                if st.batch_executor is None:
                    st.batch_executor = concurrent.futures.ThreadPoolExecutor(
                        st.max_batch, thread_name_prefix=f"tangram-gpu-{st.name}-batch")
                task = asyncio.get_running_loop().create_task(self._run_batch(st, batch, st.batch_executor))
                st.in_flight.add(task)
                task.add_done_callback(st.in_flight.discard)
            else:
                await self._run_batch(st, batch)

    async def _run_batch(self, st: _ServiceState, batch: list[_Request],
                         executor: concurrent.futures.Executor | None = None) -> None:
        st.batches += 1
        n = len(batch)
        try:
            outputs = await self._call(st, st.hooks.batch, st.handle, [r.input for r in batch], executor=executor)
            if not isinstance(outputs, (list, tuple)):
                raise TypeError(f"it returned {type(outputs).__name__}, not a list of outputs")
        except asyncio.CancelledError:
            for r in batch:
                r.future.cancel()
            raise
        except Exception as e:
            tb = traceback.format_exc()
            # Before its actions learn of the failure (and their callers send more): later
            # batches wait for the check.
            check = None if isinstance(e, HookTimeout) else self._begin_check(st)
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(ActionFailed(r.action_id, f"service {st.name!r}: its batch hook raised on a "
                                                                     f"batch of {n}: {type(e).__name__}: {e}",
                                                        type(e).__name__, tb))
            if check is not None or st.checking is not None:
                await self._check_health(st, f"its batch hook raised {type(e).__name__}: {e}", check)
            return
        if len(outputs) != n:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(ActionFailed(r.action_id, f"service {st.name!r}: its batch hook returned "
                                                                     f"{len(outputs)} outputs for {n} inputs "
                                                                     f"(expected one per input)", "ValueError"))
            return
        for r, out in zip(batch, outputs):
            if not r.future.done():
                r.future.set_result(out)

    # ---------------------------------------------------------------- health
    def _begin_check(self, st: _ServiceState) -> asyncio.Future[None] | None:
        """Marks a health check of the service as begun (its batches wait for it): the
        future to settle when it ends, or None when one is already in progress."""
        if st.checking is not None:
            return None
        st.checking = asyncio.get_running_loop().create_future()
        return st.checking

    async def _check_health(self, st: _ServiceState, why: str, mine: asyncio.Future[None] | None) -> None:
        """Asks the service's `healthy` hook; an unhealthy (or unanswering) service is
        restarted in place. `mine`: this check's mark (_begin_check); None: another check
        is in progress, and this waits for it."""
        if mine is None:
            if st.checking is not None:
                await asyncio.shield(st.checking)
            return
        try:
            st.suspect = None
            if st.handle is _UNLOADED or st.residency is None or st.stuck is not None:
                return
            device = st.residency.device
            if device in self.offline_devices:  # no restart on a GPU that needs a reset
                loop = asyncio.get_running_loop()
                failed: asyncio.Future[BaseException | None] = loop.create_future()
                failed.set_result(RuntimeError(f"device {device} is out of placement ({why})"))
                st.residency = _Residency(device, failed)
                async with st.lock:
                    await self._give_up(st, why)
                return
            try:
                ok = bool(await self._call(st, st.hooks.healthy, st.handle))
                problem = "its healthy hook said no"
            except HookTimeout:
                return  # out of use already
            except Exception as e:
                ok, problem = False, f"its healthy hook raised {type(e).__name__}: {e}"
            if not ok:
                await self._restart(st, f"{why}; {problem}")
        finally:
            st.checking = None
            mine.set_result(None)

    async def _restart(self, st: _ServiceState, why: str) -> None:
        """`close`, then `load` on its device: the core still holds it resident there.
        Actions arriving meanwhile wait for the new instance; a failed load fails them
        (and the service's next restore loads it again)."""
        r = st.residency
        if r is None:
            return
        device = r.device
        ready: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        st.residency = _Residency(device, ready)
        log.warning("services.%s: restarting it on device %d: %s", st.name, device, why)
        async with st.lock:  # batches still in flight on the broken instance fail
            if st.handle is not _UNLOADED:
                try:
                    await self._call(st, st.hooks.close, st.handle)
                except Exception as e:
                    log.warning("services.%s: close hook failed before its restart: %s: %s", st.name,
                                type(e).__name__, e)
            st.handle = _UNLOADED
            try:
                st.handle = await self._call(st, st.hooks.load, self.devices[device])
            except asyncio.CancelledError:
                ready.set_result(RuntimeError("its restart was cancelled"))
                raise
            except Exception as e:
                ready.set_result(e)
                st.restart_failed_at = time.monotonic()
                log.error("services.%s: its restart failed: load hook raised %s: %s", st.name,
                          type(e).__name__, e)
            else:
                ready.set_result(None)
                st.process_device = device
                st.restart_failed_at = None
                st.restarts += 1

    async def _retry_restart(self, st: _ServiceState, device: int) -> bool:
        """After a failed restart the core still holds the service resident, and its
        actions fail at once; one arriving RESTART_RETRY_SECONDS after the failure loads it
        again (one retry at a time). Whether a retry was made (and waited for)."""
        r = st.residency
        if (st.restart_failed_at is None or r is None or r.device != device or device in self.offline_devices
                or st.stuck is not None or time.monotonic() - st.restart_failed_at < self.RESTART_RETRY_SECONDS):
            return False
        mine = self._begin_check(st)
        if mine is None:  # a check or retry is in progress: wait for it
            if st.checking is not None:
                await asyncio.shield(st.checking)
            return True
        try:
            await self._restart(st, "its last restart failed; trying again")
        finally:
            st.checking = None
            mine.set_result(None)
        return True

    async def _give_up(self, st: _ServiceState, why: str) -> None:
        """Closes the service's instance (its next restore loads it afresh). Under st.lock."""
        if st.handle is _UNLOADED:
            return
        log.warning("services.%s: closing it: %s", st.name, why)
        try:
            await self._call(st, st.hooks.close, st.handle)
        except Exception as e:
            log.warning("services.%s: close hook failed: %s: %s", st.name, type(e).__name__, e)
        st.handle = _UNLOADED
        st.process_device = None

    def set_device_online(self, device: int, online: bool) -> None:
        """The orchestrator took `device` out of placement (False) or put it back: on an
        offline device a service's eviction closes it instead of offloading it, and an
        unhealthy one is not restarted there."""
        (self.offline_devices.discard if online else self.offline_devices.add)(device)

    def device_fault(self, device: int, xid: int) -> None:
        """An Xid error reported on `device` (XidWatch): every service resident there is
        checked before its next batch (and restarted if unhealthy); the error is kept for
        describe(). After a device-fatal Xid (FATAL_XIDS) the device needs a reset, which
        tangram never does: it is taken out of placement (Orchestrator.set_device_online),
        until someone puts it back."""
        fatal = xid in FATAL_XIDS
        self.xid_events.append({"device": device, "xid": xid, "fatal": fatal, "time": time.time()})
        (log.error if fatal else log.warning)("device %d (%s): Xid %d%s", device, self.devices[device].uuid, xid,
                                             ": it needs a reset; out of placement" if fatal else "")
        if fatal:
            self.offline_devices.add(device)
            if self.orchestrator is not None:
                self.orchestrator.set_device_online(self.node, device, False)
        for st in self._services.values():
            if st.residency is not None and st.residency.device == device:
                st.suspect = f"Xid {xid} on device {device}"
                if st.queue and (st.flusher is None or st.flusher.done()):
                    st.flusher = asyncio.get_running_loop().create_task(self._flush(st))

    # ---------------------------------------------------------------- grants
    def device_environment(self, node: int | Placement, device: int | None = None,
                           gpu_memory: float | None = None) -> dict[str, str]:
        """The environment carrying a GPU grant: `device_environment(node, device,
        gpu_memory_mib)` or `device_environment(placement)`. Empty when no device."""
        if isinstance(node, Placement):
            node, device, gpu_memory = node.node, node.device, node.gpu_memory
        if device is None or device < 0:
            return {}
        dev = self._check_device(node, device, "a GPU grant")
        return grant_environment(dev, float(gpu_memory or 0.0), self.mps, self.mps_pipe)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Starts watching Xid errors of the NVML devices (`watch_xids`)."""
        if self.watch_xids and any(d.source == "nvml" for d in self.devices):
            self._xid_watch = XidWatch(self.devices, self.device_fault, asyncio.get_running_loop())
            self._xid_watch.start()

    async def close(self) -> None:
        """Runs every loaded service's `close` hook, then stops the worker threads."""
        if self._xid_watch is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._xid_watch.stop)
            self._xid_watch = None
        errors: list[tuple[str, BaseException]] = []
        for st in self._services.values():
            if st.flusher is not None and not st.flusher.done():
                st.flusher.cancel()
                await asyncio.gather(st.flusher, return_exceptions=True)
            for task in list(st.in_flight):
                task.cancel()
            await asyncio.gather(*st.in_flight, return_exceptions=True)
            for fut in st.awaiting.values():
                if not fut.done():
                    fut.set_result(RuntimeError("the gpu manager closed"))
            async with st.lock:
                if st.handle is not _UNLOADED:
                    try:
                        await self._call(st, st.hooks.close, st.handle)
                    except Exception as e:
                        errors.append((st.name, e))
                    st.handle = _UNLOADED
                st.residency = None
            for pool in (st.executor, st.batch_executor):
                if pool is not None:
                    pool.shutdown(wait=False)
            st.executor = st.batch_executor = None
        if errors:
            name, e = errors[0]
            raise ManagerError(f"services.{name}", f"close hook failed: {type(e).__name__}: {e}"
                                                   + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")) from e

    def describe(self) -> Mapping[str, Any]:
        sources = sorted({d.source for d in self.devices})
        return {
            "node": self.node,
            "source": "none" if not sources else sources[0] if len(sources) == 1 else "mixed",
            "devices": [d.describe() for d in self.devices],
            "mig": any(d.mig for d in self.devices),
            "mps": self.mps,
            "slices": f"memory enforced by MPS (pinned memory limit; daemon at {self.mps_pipe}), compute shared"
                      if self.mps else "scheduling shares only (no MPS daemon)",
            "batch_window": self.batch_window,
            "hook_timeout": self.hook_timeout,
            "context_mib": self.context_mib,
            "services": {name: {"max_batch": st.max_batch, "resident_on": self.resident(name), "batches": st.batches,
                                "restarts": st.restarts, "out_of_use": st.stuck}
                         for name, st in self._services.items()},
            "xid_watch": self._xid_watch.watching if self._xid_watch is not None else [],
            "xid_events": list(self.xid_events),
        }


__all__ = ["CUDA_CONTEXT_MIB", "FAKE_ENV", "FATAL_XIDS", "VISIBLE_ENV", "FunctionService", "GpuDevice", "GpuManager", "HookTimeout",
           "ServiceHooks", "XidWatch", "discover", "grant_environment", "mps_active", "mps_pipe_directory", "parse_fake",
           "visible"]
