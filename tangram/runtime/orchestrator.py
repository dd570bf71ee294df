"""The orchestrator: the scheduler core on the wall clock, carried out by resource managers.

One tool call is one awaited call:

    async with tangram.Orchestrator() as orch:          # this machine, no configuration
        result = await orch.run(Call(command="pytest -q", resources={"cpu": 1},
                                     elastic="cpu", max_units=8, runtime=Amdahl(20, 0.9),
                                     trajectory=7, timeout=120))

How it works. Every event (a submit, an action ending, a cancel, a timer) is queued and
the queue is flushed once per event-loop iteration, so a burst of submits is one batched
call into the core. The core answers with decisions: `start` creates one task that awaits
the action's manager (`execute`), `restore`/`evict` go to the GPU manager in order per
device, `reject` ends the action as infeasible. When `execute` returns or raises, the
action's result or typed error is set on its future and its completion is queued for the
core. Timeouts and cancels are one mechanism: the task is cancelled, the manager kills
the work and releases it, and the action ends as ActionTimeout or ActionCancelled.
Every submitted action ends in exactly one terminal state; `close` ends the rest.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import dataclasses
import itertools
import logging
import math
import re
import sys
import traceback
from typing import Any, Iterable, Mapping, Sequence

from .._errors import TangramError, UnknownNameError, ValidationError
from .._model import Inventory, Node
from .._model import given as _given
from .._records import DISCARD, EVICT, REJECT, RESIZE, RESTORE, START, Decision, decisions
from ..scheduler import Scheduler, integer_in, record_limits
from .call import Call, Placement, manager_for, validate_call
from .config import RuntimeConfig
from .encode import CallEncoder, call_field_names
from .estimates import SAVE_EVERY, Estimate, RunTimeEstimates
from .holds import Backoffs, QuotaHold, check_backoff_seconds
from .errors import (
    ActionCancelled,
    ActionError,
    ActionFailed,
    ActionInfeasible,
    ActionTimeout,
    ManagerError,
    outcome_of,
)
from .manager import LiveAction, ResourceManager, manager_class
from .records import ActionRecord, Metrics, RecordLog

log = logging.getLogger("tangram.runtime")

DEFAULT_MANAGERS = ("cpu", "gpu", "api")
_BEHIND = re.compile(r"^waiting behind \d+ earlier actions? of the same shape;")
_ID_MAX = record_limits("id")[1]
_TRAJECTORY_MAX = record_limits("trajectory")[1]


class OrchestratorClosed(TangramError, RuntimeError):
    """The orchestrator is not running (not started yet, or closed)."""


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


class _Live:
    """Book-keeping of one live action (the orchestrator's, not the caller's)."""

    __slots__ = ("id", "call", "future", "manager", "template", "record", "in_core", "running", "task",
                 "timer", "cancel_reason", "watch", "placement", "estimate", "replica", "generation")

    def __init__(self, action_id: int, call: Call, future: asyncio.Future[Any], manager: ResourceManager,
                 template: int, record: ActionRecord, estimate: Estimate) -> None:
        self.id = action_id
        self.call = call
        self.future = future
        self.manager = manager
        self.template = template
        self.record = record
        self.estimate = estimate  # the run time it is planned with, and where that came from
        self.replica = -1  # running: the copy of a replicated service the core started it on
        self.generation = 0  # of its template (CallEncoder.generation when it was made)
        self.in_core = False  # submitted to the core (else still in the pending batch)
        self.running = False
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.cancel_reason: str | None = None  # "timeout", "cancelled" or "closed"
        self.watch: Any = None  # the future's done callback that turns a caller's cancel into ours
        self.placement: Placement | None = None  # while it runs: what it was given (resizes change it)


class Orchestrator:
    """Schedules live actions with the core and runs them through resource managers.

    Construct with a RuntimeConfig (or nothing: this machine, policy `tangram`), then
    `await start()` or use `async with`. Managers: the built-ins "cpu", "gpu" and "api"
    are made from the config's `managers` options; instances passed in `managers`
    replace or add to them (a MockManager for tests, a third-party plugin); with
    `default_managers=False` only those and the config's are made.

    All methods run on the event loop that started it (use SyncOrchestrator from other
    threads).
    """

    def __init__(self, config: RuntimeConfig | None = None, *, inventory: Inventory | None = None,
                 policy: str | None = None, managers: Sequence[ResourceManager] | Mapping[str, ResourceManager] = (),
                 default_managers: bool = True, metrics: bool = True) -> None:
        self.config = config if config is not None else RuntimeConfig()
        if inventory is not None and (self.config.quotas or self.config.services):
            raise ValidationError("config.quotas" if self.config.quotas else "config.services",
                                  "an inventory given as `inventory=` carries its own quotas and services; put "
                                  "these into it (Inventory(..., quotas=..., services=...)) rather than the config")
        self.inventory = inventory if inventory is not None else self.config.resolved_inventory()
        self.policy = policy if policy is not None else self.config.policy
        self.managers: dict[str, ResourceManager] = {}
        given = dict(managers) if isinstance(managers, Mapping) else {m.name: m for m in managers}
        for name in dict.fromkeys([*(DEFAULT_MANAGERS if default_managers else ()), *self.config.managers]):
            if name not in given:
                self.managers[name] = self._make_manager(name)
        self.managers.update(given)
        self.records = RecordLog(self.config.max_records)
        self.quota_backoffs = Backoffs()  # per quota: the next pause of a throttle without retry_after
        self._paused_until: dict[str, float] = {}  # per quota: when its latest backoff ends (for status)
        self.estimates = RunTimeEstimates(self.config.estimates)
        self._save_timer: asyncio.TimerHandle | None = None
        self.metrics = Metrics(self) if metrics else None
        if self.metrics is not None:
            self.records.add_listener(self.metrics.observe)
        self.scheduler: Scheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._live: dict[int, _Live] = {}
        self._pending_submit: list[_Live] = []
        self._pending_complete: list[int] = []
        self._pending_cancel: list[int] = []
        self._pending_limit: dict[int, float] = {}  # running action id -> its latest limit
        self._flush_handle: asyncio.Handle | None = None  # the flush queued for the next iteration
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._device_ops: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._service_ops: collections.Counter[int] = collections.Counter()  # restores and evictions decided, per service
        # The latest eviction decided on each (node, device) while its offload runs: the core
        # frees an evicted service's memory when it decides, so an action placed into that
        # memory starts only once the offload (and every device op before it) is done.
        self._offloads: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._counts: dict[str, list[int]] = {}  # kind -> [waiting, running]
        self._state = "new"
        self._metrics_server: Any = None

    def _make_manager(self, name: str) -> ResourceManager:
        options = dict(self.config.managers.get(name, {}))
        if name == "gpu" and self.config.service_hooks and "services" not in options:
            options["services"] = self.config.service_hooks
        cls = manager_class(name)
        try:
            return cls(**options)
        except TypeError as e:
            raise ManagerError(f"managers.{name}", f"bad options for {cls.__name__}: {e}") from None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "Orchestrator":
        if self._state != "new":
            raise OrchestratorClosed("orchestrator", f"cannot start: it is {self._state}")
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self.scheduler = Scheduler(self.inventory, self.policy, **self.config.scheduler_options())
        self._core = self.scheduler.core
        self._encoder = CallEncoder(self.scheduler.encoder)
        self._node_names = [n.name for n in self.inventory.nodes]
        self._kind_index = self.scheduler.encoder.kind_index
        instances = self.inventory.service_instances
        self._service_names = [name for name, _ in instances]
        self._service_specs = [spec for _, spec in instances]  # per core service: its Service
        for service in range(len(self._service_names)):  # times learned in earlier runs
            self._apply_service_times(service)
        self._cpu = self._kind_index.get("cpu", -1)
        self._memory = self._kind_index.get("memory", -1)
        for m in self.managers.values():
            m.attach(self.inventory)
            m.bind(self)
        # A GPU call's process holds a CUDA context beside what it allocates: the core counts it.
        self._encoder.process_gpu_memory = float(getattr(self.managers.get("gpu"), "context_mib", 0.0) or 0.0)
        self._encoder.set_gpus(float(g.memory) for n in self.inventory.nodes for g in n.gpus)
        started: list[ResourceManager] = []
        try:
            for m in self.managers.values():
                await m.start()
                started.append(m)
        except BaseException:
            for m in reversed(started):
                await m.close()
            self._state = "closed"
            raise
        if self.config.metrics_port is not None and self.metrics is not None:
            self._metrics_server = self.metrics.serve(self.config.metrics_port)
        if self.estimates.path is not None:
            self._save_timer = self._loop.call_later(SAVE_EVERY, self._save_estimates)
        self._state = "running"
        return self

    @property
    def state(self) -> str:
        """Where it is in its life: "new", "running" (once started), "closing", "closed"."""
        return self._state

    async def __aenter__(self) -> "Orchestrator":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, drain: bool = False) -> None:
        """Stops accepting actions and ends every live one: with `drain`, running and
        waiting actions finish first; otherwise waiting actions end as ActionCancelled and
        running ones are killed (ActionCancelled, "orchestrator closed"). Then closes the
        managers. Idempotent."""
        if self._state in ("closing", "closed"):
            return
        if self._state == "new":
            self.estimates.close()
            self._state = "closed"
            return
        self._state = "closing"
        try:
            if drain:
                while self._live:
                    await asyncio.gather(*[asyncio.shield(lv.future) for lv in list(self._live.values())],
                                         return_exceptions=True)
            for lv in list(self._live.values()):
                self._cancel(lv, "closed")
            tasks = [lv.task for lv in self._live.values() if lv.task is not None]
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            self._flush()
            if self._background:
                await asyncio.gather(*self._background, return_exceptions=True)
        finally:  # whatever went wrong above, the managers' processes and pools go
            if self._timer is not None:
                self._timer.cancel()
            for m in self.managers.values():
                try:
                    await m.close()
                except Exception:  # one manager failing to close must not leak the others
                    traceback.print_exc()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            if self._save_timer is not None:
                self._save_timer.cancel()
            try:
                self.estimates.close()
            except Exception as e:  # as in _save_estimates: the run's results stand
                log.warning("estimates: cannot save to %s: %s: %s", self.estimates.path, type(e).__name__, e)
            self._state = "closed"

    # ---------------------------------------------------------------- API
    def submit(self, call: Call, action_id: int | None = None) -> ActionHandle:
        """Queues one action; returns at once with its handle. Raises a typed error naming
        the field for a bad call (a field of the wrong type or out of range, nothing its
        manager can run, an unknown kind, service, quota or manager, a bound below the
        minimum...). The core checks the rest (upper bounds, a service with an affinity...)
        when the batch is flushed; such an error ends that action alone, with that error."""
        if self._state != "running":
            raise OrchestratorClosed("orchestrator", f"cannot submit: it is {self._state}")
        validate_call(call)
        name = manager_for(call)
        manager = self.managers.get(name)
        if manager is None:
            raise ManagerError("call.manager", f"no manager {name!r} in this orchestrator (have: {', '.join(self.managers)})")
        estimate = self.estimates.estimate(call)
        template = self._encoder.template(call, estimate.model)
        manager.check_call(call)
        if action_id is None:
            action_id = next(self._ids)
        elif not (type(action_id) is int and 0 <= action_id <= _ID_MAX):
            raise ValidationError("action_id", f"must be an integer in [0, {_ID_MAX}], got {_given(action_id)}")
        elif action_id in self._live:
            raise ValidationError("action_id", f"action {action_id} is live")
        future = self._loop.create_future()  # type: ignore[union-attr]
        record = ActionRecord(action_id, call.kind, call.trajectory, name, self._now(),
                              estimate=_DECLARED if estimate.source == "declared" else estimate.describe(),
                              quota=call.quota or "")
        lv = _Live(action_id, call, future, manager, template, record, estimate)
        lv.generation = self._encoder.generation
        self._live[action_id] = lv
        lv.watch = lambda f, i=action_id: self._on_future_done(f, i)
        future.add_done_callback(lv.watch)
        self._pending_submit.append(lv)
        self._count(call.kind, 0, +1)
        self._kick()
        return ActionHandle(action_id, future, self)

    async def run(self, call: Call) -> Any:
        """Submits `call` and awaits its result (or its typed error). Cancelling the
        awaiting task cancels the action."""
        return await self.submit(call).future

    async def map(self, calls: Iterable[Call]) -> list[Any]:
        """Runs many calls at once (one batch into the core); results in order. Errors are
        returned in place, as exception objects, not raised."""
        handles = [self.submit(c) for c in calls]
        return await asyncio.gather(*(h.future for h in handles), return_exceptions=True)

    def reserve_id(self) -> int:
        """An action id no other action of this orchestrator gets (thread-safe)."""
        return next(self._ids)

    def flush(self) -> None:
        """Hands queued submits, completions and cancels to the core now rather than at
        the next event-loop iteration (a no-op when nothing is queued). For a caller that
        must know its submits have had their start decisions (the server, before it
        queues its writes); others need not call it."""
        if (self._flush_handle is not None or self._pending_submit or self._pending_complete or self._pending_cancel
                or self._pending_limit):
            self._flush()

    def cancel(self, action_id: int) -> bool:
        """Ends a live action as ActionCancelled (killing it if it runs). False if it is
        not live."""
        lv = self._live.get(action_id)
        if lv is None:
            return False
        self._cancel(lv, "cancelled")
        return True

    async def end_trajectory(self, trajectory: int) -> None:
        """The trajectory's last action is done: releases its slot in the core and its
        per-trajectory state in every manager (its sandbox)."""
        if not integer_in(trajectory, 0, _TRAJECTORY_MAX):
            raise ValidationError("trajectory", f"must be an integer in [0, {_TRAJECTORY_MAX}], "
                                                f"got {_given(trajectory)}")
        self._flush()  # its completions first
        self._handle(self._core.end_trajectories(_ids([trajectory]), self._now()))
        await asyncio.gather(*(m.end_trajectory(trajectory) for m in self.managers.values()))

    # explain, queue_lengths and utilisation are coroutines because a Client's must be
    # (tangram.OrchestratorAPI); here they answer at once, from the synchronous readers
    # below (`*_now`), which the server and the metrics use directly.
    async def explain(self, action_id: int) -> str:
        """Why a live action waits (or where it runs), from the core; and, on a line of its
        own, the run time it is planned with and where that came from."""
        return self.explain_now(action_id)

    async def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """kind -> (waiting, running)."""
        return self.queue_lengths_now()

    async def utilisation(self) -> dict[tuple[str, str], float]:
        """(node, resource) -> share of its capacity held by running actions."""
        return self.utilisation_now()

    def explain_now(self, action_id: int) -> str:
        """`explain`, answered synchronously."""
        lv = self._live.get(action_id)
        if lv is None:
            return f"action {action_id} is not live"
        if not lv.in_core:
            return f"submitted; the core sees it at the next flush\n{lv.estimate.describe()}"
        return f"{self._core.explain(action_id)}\n{lv.estimate.describe()}"

    def queue_lengths_now(self) -> dict[str, tuple[int, int]]:
        """`queue_lengths`, answered synchronously."""
        return {k: (v[0], v[1]) for k, v in self._counts.items()}

    def utilisation_now(self) -> dict[tuple[str, str], float]:
        """`utilisation`, answered synchronously."""
        out: dict[tuple[str, str], float] = {}
        if self.scheduler is None:
            return out
        for n, node in enumerate(self.inventory.nodes):
            for kind, cap in node.resources.items():
                if cap > 0:
                    out[(node.name, kind)] = 1.0 - self.scheduler.free(n, kind) / cap
        return out

    async def status(self, running_limit: int = 20) -> dict[str, Any]:
        """A snapshot for a live view (`tangram top`): status_now's."""
        return self.status_now(running_limit)

    def status_now(self, running_limit: int = 20) -> dict[str, Any]:
        """What is happening now, as plain data (it travels to a Client as is):

          time, policy, objective   the clock (seconds since start) and the policy
          queues       kind -> [waiting, running]
          quotas       quota -> [waiting, running] (actions admitted under it)
          quota_limits quota -> its limits as configured ("rate" per second, "burst",
                       "max_concurrency", "tokens_per_minute"; 0: none), what it would admit
                       now ("requests_now" back to back by its rate, "tokens_now" of its
                       budget; None: no such limit) and "paused_for", the seconds left of a
                       backoff (back_off_quota; 0: none)
          running      the `running_limit` longest-running actions: [id, kind, quota, node,
                       elastic grant (0: not elastic), seconds running], longest first
          services     service instance -> [state, device]: "resident", "restoring",
                       "evicting", "offloaded" or "not loaded" (the GPU manager's view)
          utilisation  [node, resource, share held]
          last_minute  actions ended in the last 60 s: count, per second, ACT p50 and p99
        """
        now = self._now() if self._loop is not None else 0.0
        quotas: dict[str, list[int]] = {q.name: [0, 0] for q in self.inventory.quotas}
        running = []
        for lv in self._live.values():
            quota = lv.call.quota
            if quota is not None and quota in quotas:
                quotas[quota][1 if lv.running else 0] += 1
            if lv.running and lv.record.start is not None:
                running.append([lv.id, lv.call.kind, quota or "", lv.record.node, lv.record.grant,
                                now - lv.record.start])
        running.sort(key=lambda r: -r[5])
        service_states = getattr(self.managers.get("gpu"), "service_states", None)  # the GPU manager's
        states = service_states() if service_states is not None else {}
        acts = sorted(self.records.recent_acts(now - 60.0))
        pick = lambda q: acts[min(len(acts) - 1, int(q * len(acts)))] if acts else None  # noqa: E731
        return {
            "time": now,
            "policy": self.policy,
            "objective": self.scheduler.policy.objective if self.scheduler is not None else None,
            "queues": {k: list(v) for k, v in self.queue_lengths_now().items()},
            "quotas": quotas,
            "quota_limits": {q.name: self._quota_limits(q, now) for q in self.inventory.quotas},
            "running": running[:running_limit],
            "running_total": len(running),
            "services": {name: list(v) for name, v in states.items()},
            "utilisation": [[node, kind, share] for (node, kind), share in sorted(self.utilisation_now().items())],
            "last_minute": {"ended": len(acts), "per_second": len(acts) / 60.0, "act_p50": pick(0.5),
                            "act_p99": pick(0.99)},
        }

    def _quota_limits(self, quota: Any, now: float) -> dict[str, Any]:
        snapshot = self.scheduler.quota_snapshot(quota.name, now) if self.scheduler is not None else {}
        return {"rate": quota.rate, "burst": quota.burst, "max_concurrency": quota.max_concurrency,
                "tokens_per_minute": quota.tokens_per_minute, "requests_now": snapshot.get("requests"),
                "tokens_now": snapshot.get("tokens"), "paused_for": max(0.0, self._paused_until.get(quota.name, 0.0) - now)}

    def now(self) -> float:
        """The orchestrator's clock: seconds since start (the core's time)."""
        return self._now()

    def advertise(self, host: str, port: int) -> None:
        """Where clients reach this orchestrator: a server calls it once it listens. Nothing
        to do here; the Ray backend publishes it to the cluster, where a Client made without
        an address on any worker finds it (tangram.server.discovery)."""

    # ---------------------------------------------------------------- quota holds
    def quota(self, name: str, tokens: int = 0, trajectory: int = 0, kind: str = "hold") -> QuotaHold:
        """A hold of the API quota `name` for work tangram does not run (a hosted sandbox's
        creation, an API the rollout calls itself): `async with orch.quota("e2b-create"):`
        waits until the quota admits it, as any request of the quota, and gives the slot back
        on leaving; `Throttled` raised inside pauses the quota for every caller
        (tangram.runtime.holds)."""
        if self._state != "running":
            raise OrchestratorClosed("orchestrator", f"cannot hold a quota: it is {self._state}")
        if "api" not in self.managers:
            raise ManagerError("managers", "a quota hold is an action of the 'api' manager, and this orchestrator has "
                                           f"none (have: {', '.join(self.managers)})")
        return QuotaHold(self, name, tokens, trajectory, kind)

    async def back_off_quota(self, name: str, seconds: float | None = None) -> float:
        """The API behind quota `name` answered "too many requests": it admits nothing new
        for `seconds` (None: the next step of its exponential backoff), for every caller;
        requests in flight run on. Returns the pause."""
        return self.back_off_quota_now(name, seconds)

    def back_off_quota_now(self, name: str, seconds: float | None = None) -> float:
        """back_off_quota, from the orchestrator's own loop."""
        if self.scheduler is None or self._state != "running":
            raise OrchestratorClosed("orchestrator", f"cannot back off a quota: it is {self._state}")
        if not isinstance(name, str) or name not in {q.name for q in self.inventory.quotas}:
            raise UnknownNameError("quota", f"no quota named {name!r}")
        now = self._now()
        if seconds is None and self._paused_until.get(name, 0.0) > now:
            # Paused already: the throttles of requests sent before the pause answer for
            # the same burst, not a new one, so the backoff does not step up for each.
            return self._paused_until[name] - now
        pause = self.quota_backoffs.next(name) if seconds is None else check_backoff_seconds(seconds, "retry_after")
        until = now + pause
        self.scheduler.back_off_quota(name, until)
        self._paused_until[name] = max(self._paused_until.get(name, 0.0), until)
        return pause

    # ---------------------------------------------------------------- node changes
    # For managers of clusters whose nodes come and go (tangram.ray). Nothing calls these
    # on a fixed inventory.
    def set_node_online(self, node: str | int, online: bool) -> None:
        """Takes a node out of placement (False) or back in (True). Actions running there
        are not ended by this: whoever took the node offline ends each of them (its
        manager fails them, or `requeue`s them)."""
        self._flush()  # queued completions and cancels first
        self._handle(self.scheduler.set_node_online(node, online, self._now()).array)  # type: ignore[union-attr]
        self._arm_timer()

    def set_device_online(self, node: str | int, device: int, online: bool) -> None:
        """Takes one GPU out of placement (False: it needs a reset, as after a fatal Xid
        error) or back in (True). Its memory is fenced off; actions running there are not
        ended by this, and services resident there are evicted once their actions end."""
        if self._state != "running":
            return
        self._flush()
        index = node if isinstance(node, int) else self._node_names.index(node) if node in self._node_names else -1
        gpu = self.managers.get("gpu")
        if gpu is not None and getattr(gpu, "node", None) == index and hasattr(gpu, "set_device_online"):
            gpu.set_device_online(device, online)  # before the core's evictions reach it
        self._handle(self.scheduler.set_device_online(node, device, online, self._now()).array)  # type: ignore[union-attr]
        self._arm_timer()

    def add_node(self, node: Node) -> int:
        """Adds a node (online) to the core's inventory; returns its index. Waiting work
        may start there at once. Managers are not told: the one that found the node
        calls this."""
        self._flush()
        index, decisions = self.scheduler.add_node(node, self._now())  # type: ignore[union-attr]
        self.inventory = self.scheduler.inventory  # type: ignore[union-attr]
        self._node_names.append(node.name)
        self._encoder.set_gpus([*self._encoder.gpus, *(float(g.memory) for g in node.gpus)])
        self._handle(decisions.array)
        self._arm_timer()
        return index

    def live_call(self, action_id: int) -> Call | None:
        """The call of a live action (waiting or running); None once it has ended."""
        lv = self._live.get(action_id)
        return None if lv is None else lv.call

    def waiting_calls(self) -> dict[int, Call]:
        """Live actions that have not started: action id -> call."""
        return {lv.id: lv.call for lv in self._live.values() if not lv.running}

    def requeue(self, action_id: int, call: Call | None = None) -> bool:
        """A live action goes back to the queue instead of ending: when running, its
        manager task is cancelled (the manager stops the work) and its resources return to
        the core; it is then submitted again with the same id and future (with `call`, when
        given, replacing its call: e.g. without the affinity to a lost node). False if it
        is not live (or already being cancelled)."""
        lv = self._live.get(action_id)
        if lv is None or lv.cancel_reason is not None or lv.record.outcome is not None:
            return False
        if call is not None:
            validate_call(call)
            estimate = self.estimates.estimate(call)
            template = self._encoder.template(call, estimate.model)
            lv.manager.check_call(call)
            lv.template, lv.generation = template, self._encoder.generation
            lv.call, lv.estimate = call, estimate
        if not lv.running:  # waiting: in the core's queue, or in the next batch
            self._withdraw(lv)
            self._pending_submit.append(lv)
            return True
        lv.cancel_reason = "requeue"
        if lv.task is not None:  # else its first step is running now: _start cancels its task
            lv.task.cancel()
        return True

    def limit_grant(self, action_id: int, amount: float) -> bool:
        """A running elastic action can use at most `amount` units of its elastic kind from
        now on (its manager heard it from the action's process: a worker pool with fewer
        tasks left than cores), or more again. At the next flush the core bounds its grant
        by that: a grant above it drops at once and the units go to what waits. The amount
        is kept within the call's minimum and `max_units` (what the process can use does
        not change what it declared). False if the action is not running or not elastic."""
        lv = self._live.get(action_id)
        if lv is None or not lv.running or lv.cancel_reason is not None or lv.call.elastic is None:
            return False
        amount = float(amount)
        if not math.isfinite(amount):
            raise ValidationError("amount", f"{amount!r} is not a finite number of units")
        lowest = float(lv.call.resources.get(lv.call.elastic, 0.0))
        self._pending_limit[action_id] = min(max(amount, lowest), float(lv.call.max_units))  # type: ignore[arg-type]
        self._kick()
        return True

    def abort(self, action_id: int, error: ActionError) -> bool:
        """Ends a waiting action now with `error` (a manager's verdict: e.g. the node its
        affinity names is gone). False if it is not waiting."""
        lv = self._live.get(action_id)
        if lv is None or lv.running or lv.record.outcome is not None:
            return False
        self._withdraw(lv)
        self._finish(lv, outcome_of(error), error=error)
        return True

    # ---------------------------------------------------------------- events
    def _now(self) -> float:
        return self._loop.time() - self._t0  # type: ignore[union-attr]

    def _kick(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._queued_flush)  # type: ignore[union-attr]

    def _queued_flush(self) -> None:
        self._flush_handle = None
        self._flush()

    def _flush(self) -> None:
        """Hands every queued event to the core in batches and acts on its decisions."""
        if self._flush_handle is not None:  # called directly: the queued one has nothing left to do
            self._flush_handle.cancel()
            self._flush_handle = None
        now = self._now()
        if self._pending_limit:  # before the completions: an action ended since is still running in the core
            limits, self._pending_limit = self._pending_limit, {}
            ids = [i for i in limits if (lv := self._live.get(i)) is not None and lv.running]
            if ids:
                self._handle(self._core.limit(_ids(ids), _amounts([limits[i] for i in ids]), now))
        if self._pending_complete:
            ids, self._pending_complete = self._pending_complete, []
            self._handle(self._core.complete(_ids(ids), now))
        if self._pending_cancel:
            ids, self._pending_cancel = self._pending_cancel, []
            self._handle(self._core.cancel(_ids(ids), now))
        if self._pending_submit:
            batch, self._pending_submit = self._pending_submit, []
            self._submit_batch(batch, now)
        self._encoder.collect()  # no action waiting to be submitted holds a template now
        self._arm_timer()

    def _submit_batch(self, batch: list[_Live], now: float) -> None:
        generation = self._encoder.generation
        for lv in batch:  # requeued since its templates were dropped: encoded again
            if lv.generation != generation:
                lv.template, lv.generation = self._encoder.template(lv.call, lv.estimate.model), generation
        try:
            records = self._encoder.records([lv.template for lv in batch], [lv.id for lv in batch],
                                            [lv.call.trajectory for lv in batch])
            decisions = self._core.submit(records, now)
        except Exception:
            # One bad action fails the whole batch (the core takes a batch whole; a value
            # out of the record's range fails the copy): submit one by one, so only the
            # bad ones end, each with its error, and the rest of the batch proceeds.
            for lv in batch:
                if lv.record.outcome is not None:  # ended meanwhile (an action started here cancelled it)
                    continue
                try:
                    decisions = self._core.submit(self._encoder.records([lv.template], [lv.id], [lv.call.trajectory]),
                                                  now)
                except TangramError as e:
                    self._finish(lv, "failed", error=call_field_names(e))
                    continue
                except Exception as e:
                    self._finish(lv, "failed", error=ValidationError("call", f"cannot be encoded for the core: "
                                                                             f"{type(e).__name__}: {e}"))
                    continue
                lv.in_core = True
                self._handle(decisions)
            self._note_wait_reasons(batch)
            return
        for lv in batch:
            lv.in_core = True
        self._handle(decisions)
        self._note_wait_reasons(batch)

    def _note_wait_reasons(self, batch: list[_Live]) -> None:
        # Actions of one shape in one batch wait for the same reason: ask the core once
        # per shape (an explanation costs microseconds; a burst has thousands of actions).
        reasons: dict[int, str] = {}
        for lv in batch:
            if lv.in_core and not lv.running and lv.record.outcome is None:
                reason = reasons.get(lv.template)
                if reason is None:
                    reason = reasons[lv.template] = _BEHIND.sub("waiting", self._core.explain(lv.id))
                lv.record.wait_reason = reason

    def _handle(self, records: Any) -> None:
        if not len(records):
            return
        for decision in decisions(records):
            kind = decision.kind
            if kind == START:
                self._start(self._live[decision.action], decision)
            elif kind == REJECT:
                lv = self._live[decision.action]
                lv.in_core = False  # the core forgot it
                self._finish(lv, "infeasible", error=ActionInfeasible(lv.id, self._core.message(decision.reason)))
            elif kind == RESIZE:
                lv = self._live.get(decision.action)
                if lv is not None:  # else it ended and its completion is still on the way to the core
                    self._resize(lv, decision.grant, decision.elastic_kind)
            elif kind == RESTORE:
                self._device_op("restore", decision.service, decision.node, decision.device)
            elif kind == EVICT:
                self._device_op("evict", decision.service, decision.node, decision.device,
                                discard=decision.reason == DISCARD)

    def _start(self, lv: _Live, decision: Decision) -> None:
        node, device, service = decision.node, decision.device, decision.service
        # A call naming a replicated service runs on the copy the core routed it to.
        lv.replica = service if service >= 0 and self._service_names[service] != lv.call.service else -1
        call = lv.call
        resources = call.resources
        cores = float(resources.get("cpu", 0.0))
        memory = float(resources.get("memory", 0.0))
        elastic_kind = decision.elastic_kind
        if elastic_kind >= 0:
            grant = decision.grant
            if elastic_kind == self._cpu:
                cores = grant
            elif elastic_kind == self._memory:
                memory = grant
        else:
            grant = float(resources.get(call.elastic, 0.0)) if call.elastic else 0.0
        placement = Placement(lv.id, node, self._node_names[node], device if device >= 0 else None,
                              grant, cores, memory, float(call.gpu_memory),
                              self._gpu_env(lv, node, device) if device >= 0 else {})
        lv.placement = placement
        record = lv.record
        record.start = self._now()
        record.node = placement.node_name
        record.device = placement.device
        record.grant = grant
        if lv.estimate.source != "declared":  # its run informs the estimate from now on
            self.estimates.started(lv.id, lv.estimate.key, call.kind, call.elastic is not None, grant, record.start)
        lv.running = True
        self._count(call.kind, 0, -1)
        self._count(call.kind, 1, +1)
        # The first step of the manager's execute runs now (an eager start): an action that
        # ends without suspending (a no-op, a cached answer, a failed precondition) is
        # finished here, with no event-loop hop; one that suspends continues in its task.
        # Python 3.12+: asyncio's eager task, so the first step runs as the action's task
        # (asyncio.current_task(), wait_for and timeout work there); 3.11: the first step
        # runs before the task exists (_Resume).
        offload = self._offloads.get((node, device)) if device >= 0 and call.gpu_memory > 0 else None
        coro = self._execute(lv, placement, offload)
        context = contextvars.copy_context()
        if _EAGER_TASKS:
            task = asyncio.Task(coro, loop=self._loop, context=context, eager_start=True)  # type: ignore[call-arg]
            if task.done():
                return  # it ended; _execute has finished it
            lv.task = task
        else:
            try:
                waiting_on = context.run(coro.send, None)
            except StopIteration:
                return  # it ended; _execute has finished it
            except asyncio.CancelledError:
                return  # raised by the manager itself: _execute has finished it (cancelled)
            lv.task = self._loop.create_task(_Resume(coro, waiting_on), context=context)  # type: ignore[union-attr]
        if lv.cancel_reason is not None:  # cancelled (or requeued) during that first step
            lv.task.cancel()
        elif call.timeout is not None:
            lv.timer = self._loop.call_later(call.timeout, self._cancel, lv, "timeout")  # type: ignore[union-attr]

    def _resize(self, lv: _Live, grant: float, elastic_kind: int) -> None:
        """The core changed a running elastic action's grant: its manager applies it to the
        running work (the record keeps the latest grant)."""
        old = lv.placement
        if old is None:
            return
        changes: dict[str, float] = {"grant": grant}
        if elastic_kind == self._cpu:
            changes["cores"] = grant
        elif elastic_kind == self._memory:
            changes["memory"] = grant
        lv.placement = dataclasses.replace(old, **changes)
        self.estimates.resized(lv.id, grant, self._now())
        lv.record.grant = grant
        try:
            lv.manager.resize(LiveAction(lv.id, self._running_call(lv)), lv.placement)
        except Exception as e:  # the action runs on at its old share; the core's accounting moved
            log.warning("managers.%s: resize of action %d to %g failed: %s: %s", lv.manager.name, lv.id, grant,
                        type(e).__name__, e)

    def _gpu_env(self, lv: _Live, node: int, device: int) -> Mapping[str, str]:
        gpu = self.managers.get("gpu")
        if gpu is None or lv.manager is gpu or not hasattr(gpu, "device_environment"):
            return {}
        if getattr(lv.manager, "gpu_env_on_node", False):  # e.g. a Ray node agent computes it on its node
            return {}
        return gpu.device_environment(node, device, float(lv.call.gpu_memory))  # type: ignore[attr-defined]

    async def _execute(self, lv: _Live, placement: Placement, offload: asyncio.Task[None] | None = None) -> None:
        try:
            if offload is not None:  # its memory is still being freed (asyncio.wait: a cancel leaves the offload be)
                await asyncio.wait((offload,))
            result = await lv.manager.execute(LiveAction(lv.id, self._running_call(lv)), placement)
        except asyncio.CancelledError:
            reason = lv.cancel_reason
            if reason is None:
                self._finish(lv, "cancelled", error=ActionCancelled(lv.id, "the runtime was shut down"))
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if reason == "requeue":
                self._requeue(lv)
                return
            if reason == "timeout":
                self._finish(lv, "timeout", error=ActionTimeout(lv.id, f"ran past its timeout of {lv.call.timeout:g} s; killed"))
            else:
                self._finish(lv, "cancelled", error=ActionCancelled(lv.id, "cancelled while running" if reason == "cancelled"
                                                                     else "the orchestrator closed while it ran"))
        except ActionError as e:
            self._finish(lv, outcome_of(e), error=e)
        except Exception as e:  # a manager's own bug or a function's error it did not wrap
            self._finish(lv, "failed", error=ActionFailed(lv.id, f"{type(e).__name__}: {e}", type(e).__name__,
                                                           traceback.format_exc()))
        else:
            self._finish(lv, "ok", result=result)

    def _requeue(self, lv: _Live) -> None:
        """The end of `requeue`: the core completes the run, then gets the action again."""
        if lv.timer is not None:
            lv.timer.cancel()
            lv.timer = None
        lv.running = False
        lv.task = None
        lv.cancel_reason = None
        self.estimates.finished(lv.id, self._now(), ok=False)  # its run ended unfinished
        lv.in_core = False
        record = lv.record
        record.start = record.node = record.device = record.grant = None
        self._count(lv.call.kind, 1, -1)
        self._count(lv.call.kind, 0, +1)
        self._pending_complete.append(lv.id)
        self._pending_submit.append(lv)
        self._kick()

    def _cancel(self, lv: _Live, reason: str) -> None:
        if lv.record.outcome is not None:
            return
        if lv.running:
            if lv.cancel_reason is None:
                lv.cancel_reason = reason
                if lv.task is not None:  # else its first step is running now: _start cancels its task
                    lv.task.cancel()
            return
        error = ActionCancelled(lv.id, "cancelled while waiting" if reason == "cancelled" else "the orchestrator closed")
        self._withdraw(lv)
        self._finish(lv, "cancelled", error=error)

    def _withdraw(self, lv: _Live) -> None:
        """Takes a waiting action out of the core's queue (by a cancel at the next flush)
        or out of the batch not yet flushed."""
        if lv.in_core:
            self._pending_cancel.append(lv.id)
            lv.in_core = False
            self._kick()
        else:
            try:
                self._pending_submit.remove(lv)
            except ValueError:  # in the batch being submitted now, which skips an action that has ended
                pass

    def _on_future_done(self, future: asyncio.Future[Any], action_id: int) -> None:
        # The caller cancelled the future (e.g. its awaiting task was cancelled): cancel
        # the action itself.
        if future.cancelled():
            lv = self._live.get(action_id)
            if lv is not None:
                self._cancel(lv, "cancelled")

    def _finish(self, lv: _Live, outcome: str, result: Any = None, error: BaseException | None = None) -> None:
        """The action's one terminal state."""
        record = lv.record
        if record.outcome is not None:
            return
        record.outcome = outcome
        record.end = self._now()
        if error is not None:
            record.error = str(error)
        if lv.timer is not None:
            lv.timer.cancel()
        kind = lv.call.kind
        if lv.running:
            if lv.estimate.source != "declared":
                self.estimates.finished(lv.id, record.end, ok=outcome == "ok")
            self._count(kind, 1, -1)
            self._pending_complete.append(lv.id)
            self._kick()
        else:
            self._count(kind, 0, -1)
        del self._live[lv.id]
        if not lv.future.done():
            # Ended here, so the caller-cancel watch has nothing left to do: removing it
            # spares a callback (an event-loop handle) per action.
            lv.future.remove_done_callback(lv.watch)
            if error is None:
                lv.future.set_result(result)
            else:
                lv.future.set_exception(error)
        self.records.finish(record)

    def _save_estimates(self) -> None:
        self._save_timer = self._loop.call_later(SAVE_EVERY, self._save_estimates)  # type: ignore[union-attr]
        try:
            self.estimates.save()
        except Exception as e:  # a full disk or a locked file loses a save, not the run
            log.warning("estimates: cannot save to %s: %s: %s", self.estimates.path, type(e).__name__, e)

    def _count(self, kind: str, column: int, delta: int) -> None:
        counts = self._counts.get(kind)
        if counts is None:
            counts = self._counts[kind] = [0, 0]
        counts[column] += delta

    def _device_op(self, op: str, service: int, node: int, device: int, discard: bool = False) -> None:
        """Restores and evictions on one device run in the order the core decided them. A
        restore done is reported to the core (ready now, if it planned later), and the
        seconds the manager measured teach the service's restore and offload times."""
        manager = self.managers.get("gpu")
        if manager is None:
            # Service calls routed to another manager (Call.manager): residency is then the
            # core's bookkeeping only, and nothing is there to carry it out.
            return
        previous = self._device_ops.get((node, device))
        self._service_ops[service] += 1
        decided = self._service_ops[service]

        async def run() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            name = self._service_names[service]
            seconds = await (manager.evict(name, node, device, discard) if op == "evict"
                             else manager.restore(name, node, device))
            if isinstance(seconds, (int, float)):
                self._learn_service_time(service, "restore" if op == "restore" else "offload", float(seconds))
            # Reported only while it is the service's latest operation: the core may since have
            # decided its eviction and another restore, which this report must not mark done.
            if op == "restore" and self._state == "running" and self._service_ops[service] == decided:
                self._handle(self._core.service_restored(service, node, device, max(self._now(), self._core.now)))
                self._flush()

        task = self._loop.create_task(run())  # type: ignore[union-attr]
        self._device_ops[(node, device)] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if op == "evict":
            key = (node, device)
            self._offloads[key] = task
            task.add_done_callback(lambda t: self._offloads.pop(key) if self._offloads.get(key) is t else None)

    # ---------------------------------------------------------------- replicas
    def _running_call(self, lv: _Live) -> Call:
        """The call as its manager runs it: naming the copy the core routed it to when it
        named a replicated service (lv.call keeps the name: a requeue routes it again)."""
        if lv.replica < 0:
            return lv.call
        return dataclasses.replace(lv.call, service=self._service_names[lv.replica])

    # ---------------------------------------------------------------- service times
    def _service_time_key(self, service: int, what: str) -> str:
        return f"service:{self._service_specs[service].name}:{what}"  # replicas share theirs

    def _service_time(self, service: int, what: str) -> float:
        """A service's restore or offload seconds: learned from the ones measured (here or
        in earlier runs sharing the estimates database), else as the inventory declares."""
        estimate = self.estimates.plan(self._service_time_key(service, what), f"service-{what}", False, 0.0)
        if estimate.source == "learned":
            return float(estimate.model)
        declared = self._service_specs[service]
        return float(declared.restore_seconds if what == "restore" else declared.offload)

    def _learn_service_time(self, service: int, what: str, seconds: float) -> None:
        self.estimates.learn(self._service_time_key(service, what), f"service-{what}", False, seconds, None)
        name = self._service_specs[service].name
        for sibling, spec in enumerate(self._service_specs):  # its replicas share the estimate
            if spec.name == name:
                self._apply_service_times(sibling)

    def _apply_service_times(self, service: int) -> None:
        restore, offload = self._service_time(service, "restore"), self._service_time(service, "offload")
        self._core.set_service_times(service, restore, offload)

    def _arm_timer(self) -> None:
        wakeup = self._core.next_wakeup
        if wakeup is None or wakeup >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wakeup
        self._timer = self._loop.call_at(self._t0 + wakeup, self._on_timer)  # type: ignore[union-attr]

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        self._handle(self._core.tick(max(self._now(), self._core.now)))
        self._flush()


_DECLARED = "declared"  # a record's `estimate` for a call that declared its run time
_EAGER_TASKS = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)
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


def _ids(ids: list[int]) -> Any:
    import numpy as np

    return np.asarray(ids, dtype=np.uint64)


def _amounts(values: list[float]) -> Any:
    import numpy as np

    return np.asarray(values, dtype=np.float64)
