"""The action runner: each live action from its submit to its one terminal state.

Contract.
  Owns       the live actions (`live`: id -> ActionState) and each one's life: its future
             and record made at submit, its placement and manager task at start, its
             timeout, the way a cancel or a requeue takes through its task, its end.
  Calls      the managers (execute, resize), the listeners at each step of a life
             (tangram.runtime.listeners), the ServiceRouter (the copy a start runs on),
             DeviceOps (a grant's GPU environment, an offload to wait for before the run),
             and the dispatcher's queues (submit, completed, withdraw).
  Invariants
    - every action ends exactly once (`finish`: its record's outcome set, its future
      done); it is in `live` until then
    - a running action ends only through its task, so its manager has stopped the work
      first: cancels, timeouts, requeues and the close each cancel the task with a
      reason, which the task turns into the action's end
    - the core hears of an action's end once it ran (a completion), or of its withdrawal
      while it waits (a cancel): one of the two
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import dataclasses
import logging
import sys
import traceback
from typing import TYPE_CHECKING, Any, Sequence

from .._records import Decision
from .call import Call, Placement
from .errors import ActionCancelled, ActionError, ActionFailed, ActionInfeasible, ActionTimeout, outcome_of
from ..estimates import DECLARED, Estimate
from .listeners import ActionListener, hooks
from .live import ActionState
from .managers.base import LiveAction, ResourceManager
from .records import ActionRecord
from .service_router import ServiceRouter

if TYPE_CHECKING:
    from .dispatch import Dispatcher

log = logging.getLogger("tangram.runtime")

_EAGER_TASKS = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)


class ActionRunner:
    def __init__(self, dispatcher: Dispatcher, live: dict[int, ActionState], listeners: Sequence[ActionListener],
                 router: ServiceRouter, node_names: list[str], kind_index: dict[str, int]) -> None:
        self.dispatcher = dispatcher
        self.loop = dispatcher.loop
        self.now = dispatcher.now
        self.devices = dispatcher.devices
        self.encoder = dispatcher.encoder
        self.live = live
        self.on_submitted = hooks(listeners, "submitted")
        self.on_started = hooks(listeners, "started")
        self.on_resized = hooks(listeners, "resized")
        self.on_requeued = hooks(listeners, "requeued")
        self.on_finished = hooks(listeners, "finished")
        self.router = router
        self.node_names = node_names  # by the core's node index (nodes that join are appended)
        self.cpu = kind_index.get("cpu", -1)
        self.memory = kind_index.get("memory", -1)

    def admit(self, action_id: int, call: Call, manager: ResourceManager, manager_name: str, template: int,
              estimate: Estimate) -> ActionState:
        """A new action, queued for the core's next batch."""
        future = self.loop.create_future()
        record = ActionRecord(action_id, call.kind, call.trajectory, manager_name, self.now(),
                              estimate=DECLARED if estimate.source == DECLARED else estimate.describe(),
                              quota=call.quota or "")
        lv = ActionState(action_id, call, future, manager, template, self.encoder.generation, record, estimate,
                         lambda future, i=action_id: self._on_future_done(future, i))  # cheaper than a partial
        self.live[action_id] = lv
        future.add_done_callback(lv.watch)
        for hook in self.on_submitted:
            hook(lv)
        self.dispatcher.submit(lv)
        return lv

    # ---------------------------------------------------------------- the core's decisions
    def start(self, decision: Decision) -> None:
        lv = self.live.get(decision.action)
        if lv is None:
            # Withdrawn (cancelled while waiting) since the core last heard of it: a timer's
            # or a restore's pass may start it before the queued cancel reaches the core,
            # and that cancel gives back what this start took. Raising here would lose the
            # rest of the batch's decisions, and the actions they start would wait for good.
            return
        node, device = decision.node, decision.device
        call = lv.call
        service = decision.service
        lv.replica = self.router.replica(call, service) if service >= 0 else -1
        resources = call.resources
        cores = float(resources.get("cpu", 0.0))
        memory = float(resources.get("memory", 0.0))
        elastic_kind = decision.elastic_kind
        if elastic_kind >= 0:
            grant = decision.grant
            if elastic_kind == self.cpu:
                cores = grant
            elif elastic_kind == self.memory:
                memory = grant
        else:
            grant = float(resources.get(call.elastic, 0.0)) if call.elastic else 0.0
        gpu_memory = float(call.gpu_memory)
        placement = lv.placement = Placement(
            lv.id, node, self.node_names[node], device if device >= 0 else None, grant, cores, memory, gpu_memory,
            self.devices.environment(lv.manager, node, device, gpu_memory) if device >= 0 else {})
        lv.running = True
        now = self.now()
        for hook in self.on_started:
            hook(lv, now)
        # Its memory may still be being freed: the offload of the service evicted there.
        offload = self.devices.offload_on(node, device) if device >= 0 and gpu_memory > 0 else None
        # The first step of the manager's execute runs now (an eager start), in a copy of
        # the current context: an action that ends without suspending (a no-op, a cached
        # answer, a failed precondition) is finished here, with no event-loop hop; one that
        # suspends continues in its task. Python 3.12+: asyncio's eager task, so the first
        # step runs as the action's task (asyncio.current_task(), wait_for and timeout
        # work there); 3.11: the first step runs before the task exists (_Resume).
        coro = self._execute(lv, placement, offload)
        context = contextvars.copy_context()
        if _EAGER_TASKS:
            task = asyncio.Task(coro, loop=self.loop, context=context, eager_start=True)  # type: ignore[call-arg]
            if task.done():
                return  # it ended; _execute has finished it
        else:
            try:
                waiting_on = context.run(coro.send, None)
            except StopIteration:
                return  # it ended; _execute has finished it
            except asyncio.CancelledError:
                return  # raised by the manager itself: _execute has finished it (cancelled)
            task = self.loop.create_task(_Resume(coro, waiting_on), context=context)
        lv.task = task
        if lv.cancel_reason is not None:  # cancelled (or requeued) during that first step
            task.cancel()
        elif call.timeout is not None:
            lv.timer = self.loop.call_later(call.timeout, self.cancel, lv, "timeout")

    def reject(self, action_id: int, reason: str) -> None:
        lv = self.live[action_id]
        lv.in_core = False  # the core forgot it
        self.finish(lv, "infeasible", error=ActionInfeasible(action_id, reason))

    def resize(self, action_id: int, grant: float, elastic_kind: int) -> None:
        """The core changed a running elastic action's grant: its manager applies it to the
        running work."""
        lv = self.live.get(action_id)
        if lv is None or lv.placement is None:
            return  # it ended, and its completion is still on the way to the core
        old = lv.placement
        if elastic_kind == self.cpu:
            placement = dataclasses.replace(old, grant=grant, cores=grant)
        elif elastic_kind == self.memory:
            placement = dataclasses.replace(old, grant=grant, memory=grant)
        else:
            placement = dataclasses.replace(old, grant=grant)
        lv.placement = placement
        now = self.now()
        for hook in self.on_resized:
            hook(lv, now)
        try:
            lv.manager.resize(LiveAction(lv.id, self.router.running_call(lv.call, lv.replica)), placement)
        except Exception as e:  # the action runs on at its old share; the core's accounting moved
            log.warning("managers.%s: resize of action %d to %g failed: %s: %s", lv.manager.name, lv.id, grant,
                        type(e).__name__, e)

    # ---------------------------------------------------------------- a run
    async def _execute(self, lv: ActionState, placement: Placement, offload: asyncio.Task[None] | None) -> None:
        try:
            if offload is not None:  # asyncio.wait: a cancel leaves the offload be
                await asyncio.wait((offload,))
            result = await lv.manager.execute(LiveAction(lv.id, self.router.running_call(lv.call, lv.replica)),
                                              placement)
        except asyncio.CancelledError:
            reason = lv.cancel_reason
            if reason is None:
                self.finish(lv, "cancelled", error=ActionCancelled(lv.id, "the runtime was shut down"))
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if reason == "requeue":
                self._requeued(lv)
            elif reason == "timeout":
                self.finish(lv, "timeout",
                            error=ActionTimeout(lv.id, f"ran past its timeout of {lv.call.timeout:g} s; killed"))
            else:
                why = "cancelled while running" if reason == "cancelled" else "the orchestrator closed while it ran"
                self.finish(lv, "cancelled", error=ActionCancelled(lv.id, why))
        except ActionError as e:
            self.finish(lv, outcome_of(e), error=e)
        except Exception as e:  # a manager's own bug or a function's error it did not wrap
            self.finish(lv, "failed", error=ActionFailed(lv.id, f"{type(e).__name__}: {e}", type(e).__name__,
                                                          traceback.format_exc()))
        else:
            self.finish(lv, "ok", result=result)

    def _requeued(self, lv: ActionState) -> None:
        """The end of a running action's requeue: the core completes the run, then gets
        the action again."""
        if lv.timer is not None:
            lv.timer.cancel()
            lv.timer = None
        now = self.now()
        for hook in self.on_requeued:
            hook(lv, now)
        lv.running = False
        lv.task = None
        lv.cancel_reason = None
        lv.in_core = False
        self.dispatcher.completed(lv.id)
        self.dispatcher.submit(lv)

    # ---------------------------------------------------------------- ends
    def requeue(self, lv: ActionState) -> None:
        """Back to the core's queue: a waiting action at once; a running one once its task
        has stopped (see _requeued)."""
        if not lv.running:  # in the core's queue, or in the next batch
            self.dispatcher.withdraw(lv)
            self.dispatcher.submit(lv)
            return
        lv.cancel_reason = "requeue"
        if lv.task is not None:  # else its first step is running now: start cancels its task
            lv.task.cancel()

    def cancel(self, lv: ActionState, reason: str) -> None:
        if lv.record.outcome is not None:
            return
        if lv.running:
            if lv.cancel_reason is None:
                lv.cancel_reason = reason
                if lv.task is not None:  # else its first step is running now: start cancels its task
                    lv.task.cancel()
            return
        error = ActionCancelled(lv.id, "cancelled while waiting" if reason == "cancelled" else "the orchestrator closed")
        self.dispatcher.withdraw(lv)
        self.finish(lv, "cancelled", error=error)

    def abort(self, lv: ActionState, error: ActionError) -> None:
        """Ends a waiting action with `error`."""
        self.dispatcher.withdraw(lv)
        self.finish(lv, outcome_of(error), error=error)

    def _on_future_done(self, future: asyncio.Future[Any], action_id: int) -> None:
        # The caller cancelled the future (e.g. its awaiting task was cancelled): cancel
        # the action itself.
        if future.cancelled():
            lv = self.live.get(action_id)
            if lv is not None:
                self.cancel(lv, "cancelled")

    def finish(self, lv: ActionState, outcome: str, result: Any = None, error: BaseException | None = None) -> None:
        """The action's one terminal state."""
        record = lv.record
        if record.outcome is not None:
            return
        record.outcome = outcome
        record.end = now = self.now()
        if error is not None:
            record.error = str(error)
        if lv.timer is not None:
            lv.timer.cancel()
        if lv.running:
            self.dispatcher.completed(lv.id)
        del self.live[lv.id]
        if not lv.future.done():
            # Ended here, so the caller-cancel watch has nothing left to do: removing it
            # spares a callback (an event-loop handle) per action.
            lv.future.remove_done_callback(lv.watch)
            if error is None:
                lv.future.set_result(result)
            else:
                lv.future.set_exception(error)
        for hook in self.on_finished:
            hook(lv, now)

    async def end_all(self, drain: bool) -> None:
        """The close: with `drain`, every live action finishes first; then the rest are
        cancelled (running ones killed), and their tasks awaited."""
        if drain:
            while self.live:
                await asyncio.gather(*[asyncio.shield(lv.future) for lv in list(self.live.values())],
                                     return_exceptions=True)
        for lv in list(self.live.values()):
            self.cancel(lv, "closed")
        tasks = [lv.task for lv in self.live.values() if lv.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------- eager starts
_STEPPED = object()


class _Resume(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A task's body that continues `coro`, whose first step already ran (an eager start)
    and yielded `waiting_on`, what it awaits: the task's first step gets `waiting_on`
    back; every later send and throw goes through to `coro`. A cancel that arrives
    before that first step also cancels `waiting_on`, as a task waiting on it would."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro: Any, waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def send(self, value: Any) -> Any:
        waiting_on = self.waiting_on
        if waiting_on is not _STEPPED:
            self.waiting_on = _STEPPED
            return waiting_on
        return self.coro.send(value)

    def throw(self, error: Any, *rest: Any) -> Any:
        waiting_on = self.waiting_on
        if waiting_on is not _STEPPED:
            self.waiting_on = _STEPPED
            if isinstance(error, asyncio.CancelledError) and isinstance(waiting_on, asyncio.Future):
                waiting_on.cancel()
        return self.coro.throw(error, *rest)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Any:
        raise TypeError("a task's body, not to be awaited")
