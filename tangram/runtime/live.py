"""One live action's book-keeping, shared by the orchestrator's pieces: the dispatcher
(tangram.runtime.dispatch), the action runner (tangram.runtime.runner) and the listeners
(tangram.runtime.listeners). It lives from the action's submit to its one terminal state."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from .call import Call, Placement
from ..estimates import Estimate
from .managers.base import ResourceManager
from .records import ActionRecord

if TYPE_CHECKING:
    from .orchestrator import Orchestrator


class ActionHandle:
    """A submitted action: its id, and a future with its result. Awaitable."""

    __slots__ = ("id", "future", "_orch")

    def __init__(self, action_id: int, future: asyncio.Future[Any], orch: "Orchestrator") -> None:
        self.id = action_id
        self.future = future
        self._orch = orch

    def cancel(self) -> bool:
        """Cancels the action wherever it is; False when it had already ended."""
        return self._orch.cancel(self.id)

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.future.__await__()


class ActionState:
    """A live action as the orchestrator tracks it (the caller holds its ActionHandle)."""

    __slots__ = ("id", "call", "future", "manager", "template", "record", "in_core", "running", "task",
                 "timer", "cancel_reason", "watch", "placement", "estimate", "replica", "generation")

    def __init__(self, action_id: int, call: Call, future: asyncio.Future[Any], manager: ResourceManager,
                 template: int, generation: int, record: ActionRecord, estimate: Estimate,
                 watch: Callable[[asyncio.Future[Any]], None]) -> None:
        self.id = action_id
        self.call = call
        self.future = future
        self.manager = manager
        self.template = template  # its call's encoded template (CallEncoder.template)
        self.generation = generation  # of its template (CallEncoder.generation when it was made)
        self.record = record  # its outcome set means it has ended
        self.estimate = estimate  # the run time it is planned with, and where that came from
        self.replica = -1  # running: the copy of a replicated service the core started it on
        self.in_core = False  # submitted to the core (else still in the pending batch)
        self.running = False
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.cancel_reason: str | None = None  # "timeout", "cancelled", "closed" or "requeue"
        self.watch = watch  # the future's done callback that turns a caller's cancel into ours
        self.placement: Placement | None = None  # while it runs: what it was given (resizes change it)
