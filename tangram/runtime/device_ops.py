"""Device operations: the core's restores and evictions of GPU services, carried out in
order per device, and what a GPU grant needs from the managers of the GPUs.

Contract.
  Owns       per (node, device): the latest restore or eviction (each waits for the one
             before it) and the latest eviction while its offload runs; per service: how
             many operations were decided for it; the tasks running them.
  Calls      the services' manager (the one service calls go to by default, "gpu") to
             restore and evict, the ServiceRouter to learn the seconds they took, the
             GpuCapabilities of the GPU managers (one per node, found once at start), and
             `restored` (the dispatcher) when a restore is done.
  Invariants
    - operations on one device run in the order the core decided them, one at a time
    - a restore is reported done only while it is its service's latest operation: the
      core may since have decided its eviction and another restore, which that report
      must not mark ready
    - the core frees an evicted service's memory as it decides the eviction, so an action
      placed into that memory waits for the offload (`offload_on`) before it runs
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable, Iterable, Mapping

from .managers.base import GpuCapabilities, ResourceManager
from .service_router import ServiceRouter

Device = tuple[int, int]  # (node, device)


def gpu_managers(managers: Iterable[ResourceManager]) -> dict[int, GpuCapabilities]:
    """The managers with GPU capabilities, by the node whose devices each manages (the
    first of each node)."""
    found: dict[int, GpuCapabilities] = {}
    for manager in managers:
        if isinstance(manager, GpuCapabilities):
            found.setdefault(manager.node, manager)
    return found


class DeviceOps:
    def __init__(self, loop: asyncio.AbstractEventLoop, services: ResourceManager | None,
                 gpus: Mapping[int, GpuCapabilities], router: ServiceRouter,
                 restored: Callable[[int, int, int], None]) -> None:
        self.loop = loop
        # None: service calls are routed to other managers (Call.manager); residency is
        # then the core's bookkeeping alone, with nothing to carry it out.
        self.services = services
        self.gpus = gpus
        self.router = router
        self.restored = restored  # (service, node, device): a restore is done
        self._last: dict[Device, asyncio.Task[None]] = {}
        self._offloads: dict[Device, asyncio.Task[None]] = {}
        self._decided: collections.Counter[int] = collections.Counter()  # restores and evictions, per service
        self._running: set[asyncio.Task[None]] = set()

    @property
    def process_gpu_memory(self) -> float:
        """The most device memory a GPU action's process holds beyond its allocations."""
        return max((float(gpu.context_mib or 0.0) for gpu in self.gpus.values()), default=0.0)

    def restore(self, service: int, node: int, device: int) -> None:
        self._decide("restore", service, (node, device), False)

    def evict(self, service: int, node: int, device: int, discard: bool) -> None:
        task = self._decide("offload", service, (node, device), discard)
        if task is not None:
            key = (node, device)
            self._offloads[key] = task
            task.add_done_callback(lambda t: self._offloads.pop(key) if self._offloads.get(key) is t else None)

    def offload_on(self, node: int, device: int) -> asyncio.Task[None] | None:
        """The eviction still offloading from (node, device), if any."""
        return self._offloads.get((node, device))

    def _decide(self, op: str, service: int, where: Device, discard: bool) -> asyncio.Task[None] | None:
        manager = self.services
        if manager is None:
            return None
        previous = self._last.get(where)
        self._decided[service] += 1
        task = self.loop.create_task(self._run(manager, op, service, where, discard, previous, self._decided[service]))
        self._last[where] = task
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def _run(self, manager: ResourceManager, op: str, service: int, where: Device, discard: bool,
                   previous: asyncio.Task[None] | None, decided: int) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        name = self.router.names[service]
        node, device = where
        seconds = await (manager.restore(name, node, device) if op == "restore"
                         else manager.evict(name, node, device, discard))
        if isinstance(seconds, (int, float)):
            self.router.learn(service, op, float(seconds))
        if op == "restore" and self._decided[service] == decided:
            self.restored(service, node, device)

    async def drain(self) -> None:
        """Waits for every operation decided so far (their errors are theirs)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    # ---------------------------------------------------------------- GPU managers
    def environment(self, manager: ResourceManager, node: int, device: int, gpu_memory: float) -> Mapping[str, str]:
        """The environment that carries a GPU grant on (node, device) to an action of
        `manager`: none when the GPU manager runs the action itself, or `manager` puts it
        there on its node."""
        gpu = self.gpus.get(node)
        if gpu is None or gpu is manager or manager.gpu_env_on_node:
            return {}
        return gpu.device_environment(node, device, gpu_memory)

    def set_device_online(self, node: int, device: int, online: bool) -> None:
        gpu = self.gpus.get(node)
        if gpu is not None:
            gpu.set_device_online(device, online)

    def service_states(self) -> dict[str, Any]:
        """Each service instance: [state, device], from the GPU managers."""
        return {name: list(state) for gpu in self.gpus.values() for name, state in gpu.service_states().items()}
