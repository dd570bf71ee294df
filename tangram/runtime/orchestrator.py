"""The orchestrator: the scheduler core on the wall clock, carried out by resource managers.

One tool call is one awaited call:

    async with tangram.Orchestrator() as orch:          # this machine, no configuration
        result = await orch.run(Call(command="pytest -q", resources={"cpu": 1},
                                     elastic="cpu", max_units=8, runtime=Amdahl(20, 0.9),
                                     trajectory=7, timeout=120))

How it works, and its pieces: tangram.runtime's docstring.

Contract.
  Owns       the managers, configuration, inventory, records, estimates and metrics; the
             live actions (shared with the runner); the state ("new", "running",
             "closing", "closed"); from start, the Dispatcher.
  Calls      the managers' lifecycle hooks (attach, bind, start, close, check_call,
             end_trajectory), the Dispatcher and its runner for all that moves an action,
             the Scheduler for queries and a quota's backoff.
  Invariant  a call is checked (its fields, its manager, its encoding) before it is
             queued, and nothing is queued unless the state is "running".
"""

from __future__ import annotations

import asyncio
import itertools
import math
import traceback
from typing import Any, Iterable, Mapping, Sequence

from .._errors import UnknownNameError, ValidationError
from .._model import Inventory, Node
from .._model import given as _given
from ..scheduler import Scheduler, integer_in, record_limits
from .call import SERVICES_MANAGER, Call, manager_for, validate_call
from .config import RuntimeConfig
from .device_ops import gpu_managers
from .dispatch import Dispatcher
from .errors import ActionError, ManagerError, OrchestratorClosed
from ..estimates import Estimate, RunTimeEstimates
from .holds import Backoffs, QuotaHold
from .listeners import EstimateReporter, RecordKeeper
from .live import ActionHandle, ActionState
from .managers.base import ResourceManager, make_managers
from .records import Metrics, RecordLog
from .service_router import ServiceRouter
from .status import snapshot, utilisation

DEFAULT_MANAGERS = ("cpu", "gpu", "api")
_ID_MAX = record_limits("id")[1]
_TRAJECTORY_MAX = record_limits("trajectory")[1]


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
        self.managers = make_managers(self.config, managers, DEFAULT_MANAGERS if default_managers else ())
        self.records = RecordLog(self.config.max_records)
        self.quota_backoffs = Backoffs()  # per quota: the next pause of a throttle without retry_after
        self.estimates = RunTimeEstimates(self.config.estimates)
        self.metrics = Metrics(self) if metrics else None
        if self.metrics is not None:
            self.records.add_listener(self.metrics.observe)
        self.scheduler: Scheduler | None = None
        self._ids = itertools.count(1)
        self._live: dict[int, ActionState] = {}
        self._record_keeper = RecordKeeper(self.records, self._live)
        self._learning = EstimateReporter(self.estimates)
        self._dispatch: Dispatcher | None = None  # from start: the event loop
        self._state = "new"
        self._metrics_server: Any = None

    def _dispatcher(self, doing: str, running: bool = False) -> Dispatcher:
        """The event loop, which exists once started (closed or not: a live action has one);
        with `running`, only while the state is "running"."""
        run = self._dispatch
        if run is None or (running and self._state != "running"):
            raise OrchestratorClosed("orchestrator", f"cannot {doing}: it is {self._state}")
        return run

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "Orchestrator":
        if self._state != "new":
            raise OrchestratorClosed("orchestrator", f"cannot start: it is {self._state}")
        loop = asyncio.get_running_loop()
        self.scheduler = scheduler = Scheduler(self.inventory, self.policy, **self.config.scheduler_options())
        router = ServiceRouter(self.inventory, self.estimates, scheduler.core)
        for m in self.managers.values():
            m.attach(self.inventory)
            m.bind(self)
        self._dispatch = Dispatcher(loop, scheduler, router, self.managers.get(SERVICES_MANAGER),
                                    gpu_managers(self.managers.values()), self._live,
                                    (self._learning, self._record_keeper),
                                    lambda: self._state == "running")
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
        self._learning.save_periodically(loop)
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
        run = self._dispatch
        if run is None:
            self._learning.close()
            self._state = "closed"
            return
        self._state = "closing"
        try:
            await run.close(drain)
        finally:  # whatever went wrong above, the managers' processes and pools go
            run.stop_timer()
            for m in self.managers.values():
                try:
                    await m.close()
                except Exception:  # one manager failing to close must not leak the others
                    traceback.print_exc()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            self._learning.close()
            self._state = "closed"

    # ---------------------------------------------------------------- API
    def submit(self, call: Call, action_id: int | None = None) -> ActionHandle:
        """Queues one action; returns at once with its handle. Raises a typed error naming
        the field for a bad call (a field of the wrong type or out of range, nothing its
        manager can run, an unknown kind, service, quota or manager, a bound below the
        minimum...). The core checks the rest (upper bounds, a service with an affinity...)
        when the batch is flushed; such an error ends that action alone, with that error."""
        run = self._dispatch
        if run is None or self._state != "running":  # _dispatcher's check, inline: every submit passes here
            raise OrchestratorClosed("orchestrator", f"cannot submit: it is {self._state}")
        validate_call(call)
        name = manager_for(call)
        manager = self.managers.get(name)
        if manager is None:
            raise ManagerError("call.manager", f"no manager {name!r} in this orchestrator (have: {', '.join(self.managers)})")
        estimate = self.estimates.estimate(call)  # _checked's steps, inline: every submit passes here
        template = run.encoder.template(call, estimate.model)
        manager.check_call(call)
        if action_id is None:
            action_id = next(self._ids)
        elif not (type(action_id) is int and 0 <= action_id <= _ID_MAX):
            raise ValidationError("action_id", f"must be an integer in [0, {_ID_MAX}], got {_given(action_id)}")
        elif action_id in self._live:
            raise ValidationError("action_id", f"action {action_id} is live")
        lv = run.runner.admit(action_id, call, manager, name, template, estimate)
        return ActionHandle(action_id, lv.future, self)

    def _checked(self, run: Dispatcher, call: Call, manager: ResourceManager) -> tuple[Estimate, int]:
        """A valid call's planned run time and encoded template, once its manager accepts it."""
        estimate = self.estimates.estimate(call)
        template = run.encoder.template(call, estimate.model)
        manager.check_call(call)
        return estimate, template

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
        if self._dispatch is not None:
            self._dispatch.flush_queued()

    def cancel(self, action_id: int) -> bool:
        """Ends a live action as ActionCancelled (killing it if it runs). False if it is
        not live."""
        lv = self._live.get(action_id)
        if lv is None:
            return False
        self._dispatcher("cancel").runner.cancel(lv, "cancelled")
        return True

    async def end_trajectory(self, trajectory: int) -> None:
        """The trajectory's last action is done: releases its slot in the core and its
        per-trajectory state in every manager (its sandbox)."""
        if not integer_in(trajectory, 0, _TRAJECTORY_MAX):
            raise ValidationError("trajectory", f"must be an integer in [0, {_TRAJECTORY_MAX}], "
                                                f"got {_given(trajectory)}")
        self._dispatcher("end a trajectory").end_trajectory(trajectory)
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
        return f"{self._dispatcher('explain').scheduler.explain(action_id)}\n{lv.estimate.describe()}"

    def queue_lengths_now(self) -> dict[str, tuple[int, int]]:
        """`queue_lengths`, answered synchronously."""
        return self._record_keeper.queue_lengths()

    def utilisation_now(self) -> dict[tuple[str, str], float]:
        """`utilisation`, answered synchronously."""
        return utilisation(self.scheduler, self.inventory)

    async def status(self, running_limit: int = 20) -> dict[str, Any]:
        """A snapshot for a live view (`tangram top`): status_now's."""
        return self.status_now(running_limit)

    def status_now(self, running_limit: int = 20) -> dict[str, Any]:
        """What is happening now, as plain data: tangram.runtime.status documents it."""
        return snapshot(self, self._live.values(), self._dispatch, running_limit)

    def now(self) -> float:
        """The orchestrator's clock: seconds since start (the core's time)."""
        return self._dispatcher("tell the time").now()

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
        self._dispatcher("hold a quota", running=True)
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
        run = self._dispatcher("back off a quota", running=True)
        if not isinstance(name, str) or name not in {q.name for q in self.inventory.quotas}:
            raise UnknownNameError("quota", f"no quota named {name!r}")
        pause, until = self.quota_backoffs.pause(name, seconds, run.now())
        if until is not None:
            run.scheduler.back_off_quota(name, until)
        return pause

    # ---------------------------------------------------------------- node changes
    # For managers of clusters whose nodes come and go (tangram.ray). Nothing calls these
    # on a fixed inventory.
    def set_node_online(self, node: str | int, online: bool) -> None:
        """Takes a node out of placement (False) or back in (True). Actions running there
        are not ended by this: whoever took the node offline ends each of them (its
        manager fails them, or `requeue`s them)."""
        self._dispatcher("set a node online").set_node_online(node, online)

    def set_device_online(self, node: str | int, device: int, online: bool) -> None:
        """Takes one GPU out of placement (False: it needs a reset, as after a fatal Xid
        error) or back in (True). Its memory is fenced off; actions running there are not
        ended by this, and services resident there are evicted once their actions end."""
        if self._state == "running":
            self._dispatcher("set a device online").set_device_online(node, device, online)

    def add_node(self, node: Node) -> int:
        """Adds a node (online) to the core's inventory; returns its index. Waiting work
        may start there at once. Managers are not told: the one that found the node
        calls this."""
        run = self._dispatcher("add a node")
        index = run.add_node(node)
        self.inventory = run.scheduler.inventory
        return index

    # ---------------------------------------------------------------- live actions
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
        run = self._dispatcher("requeue")
        if call is not None:
            validate_call(call)
            estimate, template = self._checked(run, call, lv.manager)
            lv.template, lv.generation = template, run.encoder.generation
            lv.call, lv.estimate = call, estimate
        run.runner.requeue(lv)
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
        self._dispatcher("limit a grant").limit(action_id, min(max(amount, lowest), float(lv.call.max_units)))  # type: ignore[arg-type]
        return True

    def abort(self, action_id: int, error: ActionError) -> bool:
        """Ends a waiting action now with `error` (a manager's verdict: e.g. the node its
        affinity names is gone). False if it is not waiting."""
        lv = self._live.get(action_id)
        if lv is None or lv.running or lv.record.outcome is not None:
            return False
        self._dispatcher("abort").runner.abort(lv, error)
        return True
