"""The orchestrator's event loop: events handed to the core in batches, and the core's
decisions dispatched to whoever carries each out.

Every event (a submit, an action ending, a cancel, a grant limit) is queued and the
queues are flushed once per event-loop iteration, so a burst of submits is one call into
the core. Its decisions go out in the order it gave them: a start or a reject to the
action runner, a resize to the running action, a restore or an eviction to DeviceOps.

Contract.
  Owns       the queues of events not yet given to the core, the flush queued for the
             next iteration, the core's wake-up timer, and the started orchestrator's
             links to the core (Scheduler, CallEncoder), the ActionRunner and DeviceOps
             (a Dispatcher is made by Orchestrator.start).
  Calls      the core: its raw event API (Scheduler.core) for the per-action events, the
             Scheduler for inventory changes (node names, a joining Node's encoding);
             nothing else reaches the core for decisions. Then the runner and DeviceOps
             with each decision.
  Invariants
    - a flush hands the core its queued limits, then completions, cancels and submits:
      a limit before the completion of the same action (which the core would no longer
      know), an action's completion before its resubmission (a requeue)
    - an action the core decided on is handled at once, within the call that decided it
    - the wake-up timer is armed for the core's next wake-up after every batch
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .._errors import TangramError, ValidationError
from .._model import Node
from .._records import DISCARD, EVICT, REJECT, RESIZE, RESTORE, START, decisions
from ..scheduler import Scheduler
from .device_ops import DeviceOps
from .encode import CallEncoder, call_field_names
from .listeners import ActionListener
from .live import ActionState
from .managers.base import GpuCapabilities, ResourceManager
from .runner import ActionRunner
from .service_router import ServiceRouter

_BEHIND = re.compile(r"^waiting behind \d+ earlier actions? of the same shape;")


class Dispatcher:
    def __init__(self, loop: asyncio.AbstractEventLoop, scheduler: Scheduler, router: ServiceRouter,
                 services: ResourceManager | None, gpus: Mapping[int, GpuCapabilities], live: dict[int, ActionState],
                 listeners: Sequence[ActionListener], is_running: Callable[[], bool]) -> None:
        self.loop = loop
        self.t0 = loop.time()
        self.scheduler = scheduler
        self.core = scheduler.core
        self.is_running = is_running  # the orchestrator's state is "running" (not closing)
        self.router = router
        self.devices = DeviceOps(loop, services, gpus, router, self.service_restored)
        # A GPU call's process holds a CUDA context beside what it allocates: the core counts it.
        self.encoder = CallEncoder(scheduler.encoder, self.devices.process_gpu_memory)
        nodes = scheduler.inventory.nodes
        self.encoder.set_gpus(float(g.memory) for n in nodes for g in n.gpus)
        self.runner = ActionRunner(self, live, listeners, router, [n.name for n in nodes], scheduler.encoder.kind_index)
        self.pending_submit: list[ActionState] = []
        self.pending_complete: list[int] = []
        self.pending_cancel: list[int] = []
        self.pending_limit: dict[int, float] = {}  # running action id -> its latest limit
        self._flush_handle: asyncio.Handle | None = None  # the flush queued for the next iteration
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def now(self) -> float:
        """Seconds since the start: the orchestrator's clock, and the core's."""
        return self.loop.time() - self.t0

    # ---------------------------------------------------------------- queues
    def submit(self, lv: ActionState) -> None:
        self.pending_submit.append(lv)
        self._kick()

    def completed(self, action_id: int) -> None:
        self.pending_complete.append(action_id)
        self._kick()

    def limit(self, action_id: int, amount: float) -> None:
        self.pending_limit[action_id] = amount
        self._kick()

    def withdraw(self, lv: ActionState) -> None:
        """Takes a waiting action out of the core's queue (by a cancel at the next flush)
        or out of the batch not yet flushed."""
        if lv.in_core:
            self.pending_cancel.append(lv.id)
            lv.in_core = False
            self._kick()
        else:
            try:
                self.pending_submit.remove(lv)
            except ValueError:  # in the batch being submitted now, which skips an action that has ended
                pass

    def _kick(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._queued_flush)

    def _queued_flush(self) -> None:
        self._flush_handle = None
        self.flush()

    # ---------------------------------------------------------------- batches
    def flush_queued(self) -> None:
        """flush, when anything is queued."""
        if (self._flush_handle is not None or self.pending_submit or self.pending_complete or self.pending_cancel
                or self.pending_limit):
            self.flush()

    def flush(self) -> None:
        """Hands every queued event to the core in batches and acts on its decisions."""
        if self._flush_handle is not None:  # called directly: the queued one has nothing left to do
            self._flush_handle.cancel()
            self._flush_handle = None
        now = self.now()
        if self.pending_limit:  # before the completions: an action ended since is still running in the core
            limits, self.pending_limit = self.pending_limit, {}
            live = self.runner.live
            ids = [i for i in limits if (lv := live.get(i)) is not None and lv.running]
            if ids:
                self._handle(self.core.limit(_ids(ids), np.asarray([limits[i] for i in ids], dtype=np.float64), now))
        # Cancels before completions: what a completion frees must not go to an action
        # withdrawn meanwhile (runner.start skips it, and the cores would sit idle until
        # its cancel came).
        if self.pending_cancel:
            ids, self.pending_cancel = self.pending_cancel, []
            self._handle(self.core.cancel(_ids(ids), now))
        if self.pending_complete:
            ids, self.pending_complete = self.pending_complete, []
            self._handle(self.core.complete(_ids(ids), now))
        if self.pending_submit:
            batch, self.pending_submit = self.pending_submit, []
            self._submit_batch(batch, now)
            # No action waiting to be submitted holds a template now, and only submits
            # (a call's, a requeue's) make templates.
            self.encoder.collect()
        self._arm_timer()

    def _submit_batch(self, batch: list[ActionState], now: float) -> None:
        encoder = self.encoder
        generation = encoder.generation
        for lv in batch:  # requeued since its templates were dropped: encoded again
            if lv.generation != generation:
                lv.template, lv.generation = encoder.template(lv.call, lv.estimate.model), generation
        try:
            records = encoder.records([lv.template for lv in batch], [lv.id for lv in batch],
                                      [lv.call.trajectory for lv in batch])
            decided = self.core.submit(records, now)
        except Exception:
            # One bad action fails the whole batch (the core takes a batch whole; a value
            # out of the record's range fails the copy): submit one by one, so only the
            # bad ones end, each with its error, and the rest of the batch proceeds.
            for lv in batch:
                if lv.record.outcome is not None:  # ended meanwhile (an action started here cancelled it)
                    continue
                try:
                    decided = self.core.submit(encoder.records([lv.template], [lv.id], [lv.call.trajectory]), now)
                except TangramError as e:
                    self.runner.finish(lv, "failed", error=call_field_names(e))
                    continue
                except Exception as e:
                    self.runner.finish(lv, "failed", error=ValidationError(
                        "call", f"cannot be encoded for the core: {type(e).__name__}: {e}"))
                    continue
                lv.in_core = True
                self._handle(decided)
            self._note_wait_reasons(batch)
            return
        for lv in batch:
            lv.in_core = True
        self._handle(decided)
        self._note_wait_reasons(batch)

    def _note_wait_reasons(self, batch: list[ActionState]) -> None:
        # Actions of one shape in one batch wait for the same reason: ask the core once
        # per shape (an explanation costs microseconds; a burst has thousands of actions).
        reasons: dict[int, str] = {}
        for lv in batch:
            if lv.in_core and not lv.running and lv.record.outcome is None:
                reason = reasons.get(lv.template)
                if reason is None:
                    reason = reasons[lv.template] = _BEHIND.sub("waiting", self.core.explain(lv.id))
                lv.record.wait_reason = reason

    def _handle(self, records: np.ndarray) -> None:
        if not len(records):
            return
        runner = self.runner
        for decision in decisions(records):
            kind = decision.kind
            if kind == START:
                runner.start(decision)
            elif kind == REJECT:
                runner.reject(decision.action, self.core.message(decision.reason))
            elif kind == RESIZE:
                runner.resize(decision.action, decision.grant, decision.elastic_kind)
            elif kind == RESTORE:
                self.devices.restore(decision.service, decision.node, decision.device)
            elif kind == EVICT:
                self.devices.evict(decision.service, decision.node, decision.device, decision.reason == DISCARD)

    # ---------------------------------------------------------------- other events
    def service_restored(self, service: int, node: int, device: int) -> None:
        """A restore is done: the service is ready now, if the core planned it later."""
        if self.is_running():
            self._handle(self.core.service_restored(service, node, device, max(self.now(), self.core.now)))
            self.flush()

    def end_trajectory(self, trajectory: int) -> None:
        self.flush()  # its completions first
        self._handle(self.core.end_trajectories(_ids([trajectory]), self.now()))

    def set_node_online(self, node: str | int, online: bool) -> None:
        self.flush()  # queued completions and cancels first
        self._handle(self.scheduler.set_node_online(node, online, self.now()).array)
        self._arm_timer()

    def set_device_online(self, node: str | int, device: int, online: bool) -> None:
        self.flush()
        names = self.runner.node_names
        index = node if isinstance(node, int) else names.index(node) if node in names else -1
        self.devices.set_device_online(index, device, online)  # before the core's evictions reach it
        self._handle(self.scheduler.set_device_online(node, device, online, self.now()).array)
        self._arm_timer()

    def add_node(self, node: Node) -> int:
        self.flush()
        index, decided = self.scheduler.add_node(node, self.now())
        self.runner.node_names.append(node.name)
        self.encoder.set_gpus([*self.encoder.gpus, *(float(g.memory) for g in node.gpus)])
        self._handle(decided.array)
        self._arm_timer()
        return index

    def _arm_timer(self) -> None:
        wakeup = self.core.next_wakeup
        if wakeup is None or wakeup >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wakeup
        self._timer = self.loop.call_at(self.t0 + wakeup, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        self._handle(self.core.tick(max(self.now(), self.core.now)))
        self.flush()

    # ---------------------------------------------------------------- the close
    async def close(self, drain: bool) -> None:
        """Ends every live action (see ActionRunner.end_all), hands the core their ends,
        and waits for the device operations decided."""
        await self.runner.end_all(drain)
        self.flush()
        await self.devices.drain()

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _ids(ids: list[int]) -> Any:
    return np.asarray(ids, dtype=np.uint64)
