"""The live runtime: the orchestrator (this folder), its resource managers (managers/:
CPU sandboxes, GPU services, API quotas) and the sandboxes CPU actions run in (sandbox/),
carrying the core's decisions out on real resources.

How it works. Every event (a submit, an action ending, a cancel, a timer) is queued and
the queue is flushed once per event-loop iteration, so a burst of submits is one batched
call into the core. The core answers with decisions: `start` creates one task that awaits
the action's manager (`execute`), `restore`/`evict` go to the GPU manager in order per
device, `reject` ends the action as infeasible. When `execute` returns or raises, the
action's result or typed error is set on its future and its completion is queued for the
core. Timeouts and cancels are one mechanism: the task is cancelled, the manager kills
the work and releases it, and the action ends as ActionTimeout or ActionCancelled.
Every submitted action ends in exactly one terminal state; `close` ends the rest.

The orchestrator's pieces, each module's docstring giving its contract (what it owns,
what it may call, its invariants):

  orchestrator    the public face and the lifecycle
  dispatch        the event loop: queued events into the core, its decisions dispatched
  runner          each action from its submit to its one terminal state
  device_ops      restores and evictions in order per device, offload waits, GPU grants
  service_router  replicated services' copies, the services' learned restore times
  listeners       the records and queue lengths, the learned run times
  status          the status snapshot, the utilisation
  live            one live action's state and its caller's handle, which they share

Its public names are imported on first use: code running inside a sandbox imports
tangram.runtime.sandbox's inside_* modules through this package, and must not load the
orchestrator (asyncio, NumPy, the compiled core) it never uses.
"""

from .._lazy import lazy_names

# Each public name and its module here.
_LAZY = {
    "Call": "call", "CommandResult": "call", "Placement": "call",
    "RuntimeConfig": "config",
    "ActionCancelled": "errors", "ActionCrashed": "errors", "ActionError": "errors", "ActionFailed": "errors",
    "ActionInfeasible": "errors", "ActionTimeout": "errors", "ManagerError": "errors",
    "ResourceLimitExceeded": "errors",
    "LiveAction": "managers.base", "MockManager": "managers.base", "ResourceManager": "managers.base",
    "manager_class": "managers.base", "register_manager": "managers.base",
    "ActionHandle": "live", "Orchestrator": "orchestrator", "OrchestratorClosed": "errors",
    "ActionRecord": "records",
    "SyncHandle": "sync", "SyncOrchestrator": "sync",
}
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
