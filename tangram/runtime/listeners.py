"""Listeners of the actions' lives: the records, the queue lengths and the learned run
times follow each action from what the orchestrator tells them.

Contract. The action runner (tangram.runtime.runner) calls every listener, in the order
given, at each step of an action's life:

  submitted  it is queued (its record made, nothing decided yet)
  started    it runs: `placement` set, `running` true
  resized    its grant changed: `placement` holds the new one
  requeued   its run ended unfinished and it waits again
  finished   its one terminal state: the record's outcome, end and error are set, the
             caller's future is done; `running` still says whether it ran

A listener only observes: it keeps its own tables and never calls back into the runner,
the dispatcher or the core. Each call is synchronous and cheap (it runs inside a batch of
decisions, once per action and step) and must not raise.

  RecordKeeper      the records: each ActionRecord's placement fields, the actions
                    waiting and running per kind (Orchestrator.queue_lengths, counted
                    from the live actions when asked), each finished record into the
                    RecordLog (and so to the log's own
                    listeners: the metrics, the server)
  EstimateReporter  the runs of calls planned with a learned run time, reported to the
                    RunTimeEstimates that learns from them; saves it every SAVE_EVERY s
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping, Sequence

from ..estimates import DECLARED, SAVE_EVERY, RunTimeEstimates
from .live import ActionState
from .records import RecordLog

log = logging.getLogger("tangram.runtime")


class ActionListener:
    """Base of the listeners: every step ignored. A listener overrides the steps it
    follows; the runner calls only those (`hooks`), since each call is per action."""

    def submitted(self, lv: ActionState) -> None:
        pass

    def started(self, lv: ActionState, now: float) -> None:
        pass

    def resized(self, lv: ActionState, now: float) -> None:
        pass

    def requeued(self, lv: ActionState, now: float) -> None:
        pass

    def finished(self, lv: ActionState, now: float) -> None:
        pass


def hooks(listeners: Sequence[ActionListener], step: str) -> tuple[Callable[..., None], ...]:
    """The listeners' methods for `step` ("started"...), in order, of those that follow it."""
    return tuple(getattr(listener, step) for listener in listeners
                 if getattr(type(listener), step) is not getattr(ActionListener, step))


class EstimateReporter(ActionListener):
    """Runs of learned calls, as they go, to the estimates (tangram.estimates)."""

    def __init__(self, estimates: RunTimeEstimates) -> None:
        self.estimates = estimates
        self._save_timer: asyncio.TimerHandle | None = None

    def started(self, lv: ActionState, now: float) -> None:
        if lv.estimate.source != DECLARED:
            call = lv.call
            assert lv.placement is not None
            self.estimates.started(lv.id, lv.estimate.key, call.kind, call.elastic is not None, lv.placement.grant,
                                   now)

    def resized(self, lv: ActionState, now: float) -> None:
        if lv.estimate.source != DECLARED:
            assert lv.placement is not None
            self.estimates.resized(lv.id, lv.placement.grant, now)

    def requeued(self, lv: ActionState, now: float) -> None:
        if lv.estimate.source != DECLARED:
            self.estimates.finished(lv.id, now, ok=False)  # a run ended unfinished says nothing of its time

    def finished(self, lv: ActionState, now: float) -> None:
        if lv.running and lv.estimate.source != DECLARED:
            self.estimates.finished(lv.id, now, ok=lv.record.outcome == "ok")

    def save_periodically(self, loop: asyncio.AbstractEventLoop) -> None:
        """Saves the estimates every SAVE_EVERY s on `loop` (when they have a database) until close."""
        if self.estimates.path is not None:
            self._save_timer = loop.call_later(SAVE_EVERY, self._save, loop)

    def _save(self, loop: asyncio.AbstractEventLoop) -> None:
        self._save_timer = loop.call_later(SAVE_EVERY, self._save, loop)
        try:
            self.estimates.save()
        except Exception as e:  # a full disk or a locked file loses a save, not the run
            log.warning("estimates: cannot save to %s: %s: %s", self.estimates.path, type(e).__name__, e)

    def close(self) -> None:
        """Stops the periodic saves and saves one last time."""
        if self._save_timer is not None:
            self._save_timer.cancel()
        try:
            self.estimates.close()
        except Exception as e:  # as in _save: the run's results stand
            log.warning("estimates: cannot save to %s: %s: %s", self.estimates.path, type(e).__name__, e)


class RecordKeeper(ActionListener):
    """The records of the actions: each ActionRecord's placement fields, the log of the
    finished records, and the number of actions waiting and running per kind. Those are
    counted from the live actions when asked (queue_lengths is read by a status or a
    metrics scrape, far less often than actions come and go, and counting per step cost
    each submit a call); a kind stays listed, at (0, 0), once an action of it has been."""

    def __init__(self, log: RecordLog, live: Mapping[int, ActionState]) -> None:
        self.log = log
        self.live = live  # the orchestrator's live actions, by id
        self.kinds_ended: set[str] = set()

    def queue_lengths(self) -> dict[str, tuple[int, int]]:
        counts = {kind: [0, 0] for kind in self.kinds_ended}
        for lv in list(self.live.values()):
            counts.setdefault(lv.call.kind, [0, 0])[1 if lv.running else 0] += 1
        return {kind: (waiting, running) for kind, (waiting, running) in counts.items()}

    def started(self, lv: ActionState, now: float) -> None:
        placement, record = lv.placement, lv.record
        assert placement is not None
        record.start = now
        record.node = placement.node_name
        record.device = placement.device
        record.grant = placement.grant

    def resized(self, lv: ActionState, now: float) -> None:
        assert lv.placement is not None
        lv.record.grant = lv.placement.grant

    def requeued(self, lv: ActionState, now: float) -> None:
        record = lv.record
        record.start = record.node = record.device = record.grant = None

    def finished(self, lv: ActionState, now: float) -> None:
        self.kinds_ended.add(lv.call.kind)
        self.log.finish(lv.record)
