"""The service router: which copy of a replicated service runs a call, and how long the
services take to restore and offload.

Contract.
  Owns       the core's service instances (a replicated service's copies each count as
             one, in the inventory's order) and their restore and offload seconds: learned
             from the ones measured (here or in earlier runs sharing the estimates
             database), else as the inventory declares them.
  Calls      the estimates (keys "service:<name>:restore" and ":offload", shared by a
             service's copies) and the core's set_service_times.
  Invariant  the core plans every instance with the latest times: all of them at start,
             and a service's copies again each time one of its operations is measured.
"""

from __future__ import annotations

import dataclasses

from .. import _core
from .._model import Inventory
from .call import Call
from ..estimates import RunTimeEstimates


class ServiceRouter:
    def __init__(self, inventory: Inventory, estimates: RunTimeEstimates, core: _core.Scheduler) -> None:
        instances = inventory.service_instances
        self.names = [name for name, _ in instances]  # per core service: its instance's name
        self.specs = [spec for _, spec in instances]  # per core service: its Service
        self.estimates = estimates
        self.core = core
        for service in range(len(self.names)):  # times learned in earlier runs
            self._apply_times(service)

    def replica(self, call: Call, service: int) -> int:
        """The copy of a replicated service the core started `call` on (`service`, its
        START's), or -1 when that is the instance the call named itself."""
        return service if self.names[service] != call.service else -1

    def running_call(self, call: Call, replica: int) -> Call:
        """The call as its manager runs it: naming its copy when the core routed it to one
        (the caller's call keeps the name: a requeue routes it again)."""
        if replica < 0:
            return call
        return dataclasses.replace(call, service=self.names[replica])

    def service_time(self, service: int, what: str) -> float:
        """An instance's "restore" or "offload" seconds, as the core plans them."""
        estimate = self.estimates.plan(self._time_key(service, what), f"service-{what}", False, 0.0)
        if estimate.source == "learned":
            return float(estimate.model)
        declared = self.specs[service]
        return float(declared.restore_seconds if what == "restore" else declared.offload)

    def learn(self, service: int, what: str, seconds: float) -> None:
        """A measured restore or offload of instance `service`: every copy of its service
        plans with what it teaches."""
        self.estimates.learn(self._time_key(service, what), f"service-{what}", False, seconds, None)
        name = self.specs[service].name
        for sibling, spec in enumerate(self.specs):
            if spec.name == name:
                self._apply_times(sibling)

    def _time_key(self, service: int, what: str) -> str:
        return f"service:{self.specs[service].name}:{what}"  # replicas share theirs

    def _apply_times(self, service: int) -> None:
        self.core.set_service_times(service, self.service_time(service, "restore"), self.service_time(service, "offload"))
