"""tangram.Scheduler: the C++ core in virtual time, with a Pythonic face."""

from __future__ import annotations

import collections.abc
import math
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Iterator, Mapping, Sequence, overload

import numpy as np

from . import _core
from ._errors import TangramError, UnknownNameError, ValidationError
from ._model import Action, Amdahl, Constant, Inventory, Native, Node, Table, check_integer, check_number, given
from ._records import (
    ACTION_HEADER_SIZE,
    DECISION_DTYPE,
    DECISION_KINDS,
    DISCARD,
    EVICT,
    MODEL_AMDAHL,
    MODEL_CALLBACK,
    MODEL_CONSTANT,
    MODEL_TABLE,
    REJECT,
    RESIZE,
    START,
    action_dtype,
    empty_actions,
)
from ._records import Decision as DecisionRecord
from ._records import decisions as decision_records

# The built-in policies' names, from the core's one table of them (csrc/tangram/policy.cc).
POLICIES: tuple[str, ...] = _core.POLICIES
OBJECTIVES = ("step", "act")  # Policy.objective
MAX_SAMPLED_STEPS = 4096

assert _core.ACTION_HEADER_SIZE == ACTION_HEADER_SIZE
assert _core.DECISION_SIZE == DECISION_DTYPE.itemsize


@dataclass(frozen=True)
class Policy:
    """A scheduling policy and its knobs (csrc/tangram/policy.h documents each; every one
    has a default, so each policy runs by name alone).

    trajectory_slot_cpu  "trajectory": cores in each trajectory's slot (default 1.0: one
                         core per trajectory, the fixed sandbox the policy stands for).
                         Each node holds as many slots as fit its cores, counted from the
                         value given (cores / n gives n slots), each of that many cores
                         rounded to the milli-core as demands are; its other kinds are
                         divided evenly among them. Set it to the sandbox size you compare
                         against: Scheduler(inv, "trajectory", trajectory_slot_cpu=4).
    min_relative_gain    "optimus" (gain rule "relative"): a spare elastic unit is granted
                         only if it cuts the run time by at least this fraction of it.
                         tangram's gain rule ("wait") has no threshold: a unit must save
                         the action more than the wait it causes the others on its node
                         (docs/scheduling.md, "The gain rule").
    pools                "isolated": task pool -> weight; every node is divided among the
                         pools in proportion, and an action runs in the pool named by its
                         `task`. Default {0: 1.0}: one pool of whole nodes for task 0, the
                         task of every Action by default and of every live Call. Dedicated
                         shares: Scheduler(inv, "isolated", pools={0: 1.0, 1: 3.0}).
    objective            what the order serves (docs/scheduling.md, "Objectives"): "step"
                         (default), the step a synchronous trainer waits for: a quota's
                         queue keeps arrival order, so every trajectory progresses, and a
                         GPU service's queue whose arrivals have stopped starts its long
                         actions early enough for its drain ("Service tails"); "act",
                         the mean ACT an asynchronous trainer (partial rollouts) waits for:
                         a quota's queue serves the trajectories that have started the most
                         actions first (order rule "progress"), so trajectories finish
                         sooner and fewer wait, at the cost of the step and the p99 when
                         the quota is saturated. "act" changes an "estimate" order: the
                         `tangram` policy's (others keep theirs, and refuse it).
    """

    name: str = "tangram"
    aging: float = 0.5
    candidates: int = 4
    min_relative_gain: float = 0.05
    starvation_seconds: float = 60.0
    trajectory_slot_cpu: float = 1.0
    pools: Mapping[int, float] = field(default_factory=lambda: {0: 1.0})
    objective: str = "step"

    def __post_init__(self) -> None:
        # Types here; the core checks the ranges when a scheduler is built.
        if self.name not in POLICIES:
            raise UnknownNameError("policy.name", f"unknown policy {self.name!r} (one of {', '.join(POLICIES)})")
        for option in ("aging", "min_relative_gain", "starvation_seconds", "trajectory_slot_cpu"):
            check_number(getattr(self, option), f"policy.{option}")
        check_integer(self.candidates, "policy.candidates", bits=32)
        if self.objective not in OBJECTIVES:
            raise ValidationError("policy.objective", f"must be one of {', '.join(map(repr, OBJECTIVES))}, "
                                                      f"got {self.objective!r}")
        if self.objective == "act" and _core.POLICY_RULES[self.name]["order"] != "estimate":
            raise ValidationError("policy.objective", f"'act' reorders a shortest-first policy (tangram); policy "
                                                      f"{self.name!r} keeps its order "
                                                      f"({_core.POLICY_RULES[self.name]['order']!r})")

    def rules(self) -> dict[str, str] | None:
        """The row of rules the core runs when it is not the named policy's own: with
        objective "act", the policy's row with order "progress". None: the built-in row."""
        if self.objective == "step":
            return None
        return {**_core.POLICY_RULES[self.name], "order": "progress"}


@dataclass(frozen=True)
class Decision:
    # "start", "restore", "evict", "reject", or "resize": a running action's elastic grant
    # changed (its node, and `grant` its new total; under a policy whose resize rule is
    # "malleable", tangram's among them). Its remaining work then runs at the new grant.
    kind: str
    action: int | None
    node: int | None
    device: int | None
    service: str | None
    grant: float  # units of the elastic kind granted; 0.0 when the action is not elastic
    time: float  # start or resize time, or when a restored service is ready
    # Why a rejected action can never run; "discard" for an evict whose service's state is
    # given up (its process closed: its next restore is a fresh load), not offloaded.
    reason: str | None = None


class Decisions(Sequence[Decision]):
    """One event's decisions: `array` (DECISION_DTYPE records) for bulk use, or iterate
    for Decision objects."""

    def __init__(self, array: np.ndarray, messages: Sequence[str], services: Sequence[str]) -> None:
        self.array = array
        self._messages = messages
        self._services = services

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, i: int) -> Decision: ...
    @overload
    def __getitem__(self, i: slice) -> list[Decision]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return list(map(self._readable, decision_records(self.array[i])))
        return next(map(self._readable, decision_records(self.array[[i]])))

    def __iter__(self) -> Iterator[Decision]:
        return map(self._readable, decision_records(self.array))

    def _readable(self, r: DecisionRecord) -> Decision:
        kind = r.kind
        none = lambda v: None if v < 0 else v  # noqa: E731
        return Decision(
            kind=DECISION_KINDS[kind],
            action=r.action if kind in (START, REJECT, RESIZE) else None,
            node=none(r.node),
            device=none(r.device),
            service=self._services[r.service] if r.service >= 0 else None,
            grant=r.grant,
            time=r.time,
            reason=(self._messages[r.reason] if kind == REJECT
                    else "discard" if kind == EVICT and r.reason == DISCARD else None),
        )

    def of_kind(self, kind: str) -> np.ndarray:
        return self.array[self.array["kind"] == DECISION_KINDS.index(kind)]

    def __repr__(self) -> str:
        return f"Decisions({list(self)!r})"


_POLICY_OPTIONS = tuple(f.name for f in fields(Policy) if f.name != "name")


def resolve_policy(policy: str | Policy, overrides: Mapping[str, object]) -> Policy:
    """The policy with its options: a Policy, or a name whose options are the defaults,
    either with `overrides` (Scheduler's keyword arguments, RuntimeConfig.policy_options)."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise UnknownNameError("policy", f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
        policy = Policy(name=policy)
    elif not isinstance(policy, Policy):
        raise ValidationError("policy", f"expected a policy name or a tangram.Policy, got {type(policy).__name__}")
    unknown = [k for k in overrides if k not in _POLICY_OPTIONS]
    if unknown:
        raise UnknownNameError(f"policy.{unknown[0]}", f"no such policy option (options: {', '.join(_POLICY_OPTIONS)})")
    if "pools" in overrides:  # from a config file: keys as integers
        overrides = {**overrides, "pools": dict(_pools(overrides["pools"]))}
    return replace(policy, **overrides) if overrides else policy


def _service_tuples(inventory: Inventory) -> list[tuple]:
    """The core's services: one per copy of each Service, with the index of its group's first
    copy (-1 for the first and for an unreplicated service) and whether it is surplus (a
    copy beyond `replicas`)."""
    out: list[tuple] = []
    for i, s in enumerate(inventory.services):
        f = f"inventory.services[{i}]"
        spec = (_milli(s.memory, f"{f}.memory"), float(s.restore_seconds), int(s.max_batch), float(s.offload),
                _milli(s.asleep_memory, f"{f}.asleep_memory"), bool(s.movable), _milli(s.host_memory, f"{f}.host_memory"))
        first = len(out)
        out += [(name, *spec, first if r > 0 else -1, r >= s.replicas) for r, name in enumerate(s.instances)]
    return out


def _pools(pools: object) -> list[tuple[int, float]]:
    """The isolated policy's (task pool, weight) pairs; keys may be digit strings, as TOML
    and JSON keys arrive. The core checks the weights' range."""
    if not isinstance(pools, Mapping):
        raise ValidationError("policy.pools", f"expected a mapping of task pool to weight, e.g. {{0: 1.0, 1: 3.0}}, "
                                              f"got {type(pools).__name__}")
    out: list[tuple[int, float]] = []
    for task, weight in pools.items():
        key = int(task) if isinstance(task, str) and task.isdigit() else task
        if not integer_in(key, *_COUNTS["task"]):
            raise ValidationError(f"policy.pools[{task!r}]", f"a task pool is an action's task: an integer in "
                                                             f"[{_COUNTS['task'][0]}, {_COUNTS['task'][1]}]")
        if not isinstance(weight, numbers.Real) or isinstance(weight, bool):
            raise ValidationError(f"policy.pools[{task!r}]", f"the weight must be a number, got {weight!r}")
        if any(key == k for k, _ in out):
            raise ValidationError(f"policy.pools[{task!r}]", f"task pool {key} is given twice")
        out.append((key, float(weight)))
    return out


def core_arguments(inventory: Inventory, policy: Policy) -> dict[str, object]:
    """The inventory and policy as the compiled core (and the reference) take them."""
    kinds = inventory.kinds
    if not inventory.nodes:
        raise ValidationError("inventory.nodes", "at least one node is needed")
    capacity = np.zeros((len(inventory.nodes), len(kinds)), dtype=np.int64)
    for n, node in enumerate(inventory.nodes):
        for k, kind in enumerate(kinds):
            capacity[n, k] = _milli(node.resources.get(kind, 0), f"inventory.nodes[{n}].resources.{kind}")
    return dict(
        kinds=kinds,
        node_names=[n.name for n in inventory.nodes],
        capacity=capacity,
        gpus=[[_milli(g.memory, f"inventory.nodes[{n}].gpus[{i}].memory") for i, g in enumerate(node.gpus)]
              for n, node in enumerate(inventory.nodes)],
        quotas=[(q.name, float(q.rate), int(q.burst), int(q.max_concurrency), int(q.tokens_per_minute))
                for q in inventory.quotas],
        services=_service_tuples(inventory),
        offload_memory=[-1 if n.offload_memory is None else _milli(n.offload_memory, f"inventory.nodes[{i}].offload_memory")
                        for i, n in enumerate(inventory.nodes)],
        policy=policy.name,
        aging=float(policy.aging),
        candidates=int(policy.candidates),
        min_relative_gain=float(policy.min_relative_gain),
        starvation_seconds=float(policy.starvation_seconds),
        trajectory_slot_cpu=_real(policy.trajectory_slot_cpu, "policy.trajectory_slot_cpu"),
        pools=_pools(policy.pools),
        rules=None if (rules := policy.rules()) is None else list(rules.items()),
    )


def record_limits(name: str) -> tuple[int, int]:
    """The integers an action record's field holds (the core's record layout is the one
    definition of these ranges; the orchestrator, the server and the client check against
    it before a value reaches the record)."""
    info = np.iinfo(_RECORD_HEADER[name])
    return int(info.min), int(info.max)


_RECORD_HEADER = action_dtype(0)
_COUNTS = {name: (0, record_limits(name)[1]) for name in ("id", "trajectory", "task", "tokens")}
_PRIORITY = record_limits("priority")
_INDEX_MAX = record_limits("affinity")[1]
_ADDRESS_MAX = record_limits("callback")[1]


def integer_in(value: object, low: int, high: int) -> bool:
    """An integer (not a bool) in [low, high]."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= high


def _real(value: object, name: str) -> float:
    """A finite, non-negative number for a float64 field of the record (the core checks
    the upper bounds, with the same wording)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValidationError(name, f"must be a number, got {given(value)}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float64
        v = math.inf
    if not math.isfinite(v):
        raise ValidationError(name, f"must be a finite number, got {given(value)}")
    if v < 0:
        raise ValidationError(name, f"must not be negative, got {given(value)}")
    return v


def _milli(value: object, name: str) -> int:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValidationError(name, f"must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or v > 1e12:
        raise ValidationError(name, f"must be a finite number in [0, 1e12], got {value!r}")
    return math.floor(v * 1000.0 + 0.5)


class RecordEncoder:
    """Turns Action objects into the core's bulk records, registering tables as needed."""

    def __init__(self, inventory: Inventory, add_table) -> None:  # type: ignore[no-untyped-def]
        self.kinds = inventory.kinds
        self.kind_index = {k: i for i, k in enumerate(self.kinds)}
        self.node_index = {n.name: i for i, n in enumerate(inventory.nodes)}
        self.service_index = {name: i for i, (name, _) in enumerate(inventory.service_instances)}
        # A replicated service's name: the index of its first copy. An Action naming it may
        # run on any copy: the core routes it at submit (any_replica).
        self.service_groups = {s.name: self.service_index[s.instances[0]] for s in inventory.services if s.copies > 1}
        self.quota_index = {q.name: i for i, q in enumerate(inventory.quotas)}
        self.dtype = action_dtype(len(self.kinds))
        self._add_table = add_table
        self._tables: dict[tuple[tuple[float, float], ...], int] = {}
        self.natives: dict[int, Native] = {}

    def table_id(self, points: tuple[tuple[float, float], ...]) -> int:
        tid = self._tables.get(points)
        if tid is None:
            tid = self._tables[points] = self._add_table(list(points))
        return tid

    def encode(self, actions: Sequence[Action]) -> np.ndarray:
        rec = empty_actions(len(self.kinds), len(actions), self.dtype)
        for i, a in enumerate(actions):
            try:
                self._encode_one(rec[i], a, f"actions[{i}]")
            except TangramError:
                raise
            except Exception as e:  # a value no check above foresaw: still a typed error naming the action
                raise ValidationError(f"actions[{i}]", f"cannot be encoded for the core: "
                                                       f"{type(e).__name__}: {e}") from None
        return rec

    def _lookup(self, table: Mapping[str, int], name: object, what: str, fld: str) -> int:
        if not isinstance(name, str):
            raise ValidationError(fld, f"must be the name of a {what}, got {given(name)}")
        if name not in table:
            raise UnknownNameError(fld, f"no {what} named {name!r} (known: {', '.join(map(str, table)) or 'none'})")
        return table[name]  # type: ignore[index]

    def _encode_one(self, r: np.void, a: Action, f: str) -> None:
        if not isinstance(a, Action):
            raise ValidationError(f, f"expected a tangram.Action, got {type(a).__name__}")
        for fld, (low, high) in _COUNTS.items():
            v = getattr(a, fld)
            if not integer_in(v, low, high):
                raise ValidationError(f"{f}.{fld}", f"must be an integer in [{low}, {high}], got {given(v)}")
        r["id"], r["trajectory"], r["task"], r["tokens"] = a.id, a.trajectory, a.task, a.tokens
        if not integer_in(a.priority, *_PRIORITY):
            raise ValidationError(f"{f}.priority", f"must be a 32-bit integer, got {given(a.priority)}")
        r["priority"] = a.priority
        if not isinstance(a.demand, collections.abc.Mapping):
            raise ValidationError(f"{f}.demand", f"must be a mapping of resource kind to units, got {given(a.demand)}")
        demand = np.zeros(len(self.kinds))
        for kind, v in a.demand.items():
            k = self._lookup(self.kind_index, kind, "resource kind", f"{f}.demand")
            demand[k] = _real(v, f"{f}.demand.{kind}")
        r["demand"] = demand
        r["gpu_memory"] = _real(a.gpu_memory, f"{f}.gpu_memory")
        minimum = 1.0
        if a.elastic is not None:
            k = self._lookup(self.kind_index, a.elastic, "resource kind", f"{f}.elastic")
            r["elastic_kind"] = k
            minimum = float(demand[k])
            if a.max_units is None:
                raise ValidationError(f"{f}.max_units", "an elastic action needs an upper bound")
            r["elastic_max"] = _real(a.max_units, f"{f}.max_units")
        elif a.max_units is not None:
            raise ValidationError(f"{f}.max_units", "an upper bound needs an elastic kind")
        if a.affinity is not None:
            if isinstance(a.affinity, str):
                r["affinity"] = self._lookup(self.node_index, a.affinity, "node", f"{f}.affinity")
            elif integer_in(a.affinity, 0, _INDEX_MAX):
                r["affinity"] = a.affinity
            else:
                raise ValidationError(f"{f}.affinity", f"must be a node name or index, got {given(a.affinity)}")
        if a.service is not None:
            first = self.service_groups.get(a.service) if isinstance(a.service, str) else None
            if first is not None:
                r["service"], r["any_replica"] = first, 1
            else:
                r["service"] = self._lookup(self.service_index, a.service, "service", f"{f}.service")
        if a.quota is not None:
            r["quota"] = self._lookup(self.quota_index, a.quota, "quota", f"{f}.quota")
        self._encode_model(r, a, f, minimum)

    def _encode_model(self, r: np.void, a: Action, f: str, minimum: float) -> None:
        m = a.runtime
        if isinstance(m, numbers.Real) and not isinstance(m, bool):
            r["model"], r["seconds"] = MODEL_CONSTANT, _real(m, f"{f}.runtime.seconds")
        elif isinstance(m, Constant):
            r["model"], r["seconds"] = MODEL_CONSTANT, _real(m.seconds, f"{f}.runtime.seconds")
        elif isinstance(m, Amdahl):
            r["model"], r["seconds"] = MODEL_AMDAHL, _real(m.seconds, f"{f}.runtime.seconds")
            r["parallel_fraction"] = _real(m.parallel_fraction, f"{f}.runtime.parallel_fraction")
        elif isinstance(m, Table):
            r["model"], r["table"] = MODEL_TABLE, self.table_id(m.points)
        elif isinstance(m, Native):
            if not integer_in(m.address, 0, _ADDRESS_MAX):
                raise ValidationError(f"{f}.runtime.address",
                                      f"must be a native function's address, got {given(m.address)}")
            r["model"], r["callback"] = MODEL_CALLBACK, m.address
            self.natives[m.address] = m  # the core holds only the address: keep the code alive
        elif callable(m):
            # The documented slower path: sample the callable at every grant the core can
            # choose (whole units from the minimum up to the bound) into a table.
            top = minimum
            if a.elastic is not None:
                top = float(a.max_units)  # type: ignore[arg-type]
                if not minimum > 0:
                    raise ValidationError(f"{f}.demand.{a.elastic}", "the elastic kind needs a positive minimum")
                if not math.isfinite(top) or top < minimum:
                    raise ValidationError(f"{f}.max_units", f"must be a finite bound at least the minimum "
                                          f"({minimum:g}), got {a.max_units!r}")
            if top - minimum > MAX_SAMPLED_STEPS:
                raise ValidationError(f"{f}.runtime", f"a plain Python callable is sampled at each unit; "
                                      f"the elastic range exceeds {MAX_SAMPLED_STEPS} units: compile it with "
                                      "tangram.cost_model instead")
            units = [minimum + i for i in range(int(top - minimum) + 1)]
            if units[-1] != top:
                units.append(top)
            points = []
            for u in units:
                try:
                    s = m(u)
                except Exception as e:
                    raise ValidationError(f"{f}.runtime", f"the callable raised {type(e).__name__}: {e} for {u} "
                                                          "units") from None
                try:
                    points.append((u, _real(s, f"{f}.runtime")))
                except ValidationError:
                    raise ValidationError(f"{f}.runtime", f"the callable returned {given(s)} for {u} units") from None
            r["model"], r["table"] = MODEL_TABLE, self.table_id(tuple(points))
        else:
            raise ValidationError(f"{f}.runtime", f"expected seconds or a model, got {type(m).__name__}")


class Scheduler:
    """The scheduler core in virtual time.

    Feed it events with the caller's clock (`now`, seconds, never decreasing): submit,
    complete, cancel, end_trajectories, tick. Each returns the Decisions of the pass that
    follows. Actions go in as `tangram.Action` objects or, in bulk, as a NumPy array of
    `self.action_dtype` (see `self.new_actions`).
    """

    def __init__(self, inventory: Inventory, policy: str | Policy = "tangram", **policy_options: object) -> None:
        self.inventory = inventory
        self.policy = resolve_policy(policy, policy_options)
        self._core = _core.Scheduler(**core_arguments(inventory, self.policy), decision_dtype=DECISION_DTYPE)
        self._encoder = RecordEncoder(inventory, self._core.add_table)
        self._services = [name for name, _ in inventory.service_instances]
        self.kinds = self._encoder.kinds

    # ---------------------------------------------------------------- events
    @property
    def action_dtype(self) -> np.dtype:
        return self._encoder.dtype

    @property
    def core(self) -> _core.Scheduler:
        """The compiled scheduler underneath: bulk records in, decision arrays out, errors
        named by record fields. The runtime drives it directly with records it encodes."""
        return self._core

    @property
    def encoder(self) -> RecordEncoder:
        """What turns Actions into this scheduler's records (its kinds, tables, services)."""
        return self._encoder

    def new_actions(self, count: int) -> np.ndarray:
        """Blank bulk records: fill id, demand, seconds... and pass them to submit()."""
        return empty_actions(len(self.kinds), count, self._encoder.dtype)

    def submit(self, actions: Action | Iterable[Action] | np.ndarray, now: float) -> Decisions:
        if isinstance(actions, np.ndarray):
            # Identity first: comparing structured dtypes field by field costs a microsecond.
            if actions.dtype is not self._encoder.dtype and actions.dtype != self._encoder.dtype:
                raise ValidationError("actions", f"array dtype must be Scheduler.action_dtype, got {actions.dtype}")
            records = actions if actions.flags.c_contiguous else np.ascontiguousarray(actions)
        else:
            batch = [actions] if isinstance(actions, Action) else list(actions)
            records = self._encoder.encode(batch)
            try:
                return self._wrap(self._core.submit(records, now))
            except TangramError as e:
                raise action_field_names(e) from None
        return self._wrap(self._core.submit(records, now))

    def complete(self, ids: int | Iterable[int], now: float) -> Decisions:
        return self._wrap(self._core.complete(_ids(ids), now))

    def cancel(self, ids: int | Iterable[int], now: float) -> Decisions:
        return self._wrap(self._core.cancel(_ids(ids), now))

    def limit(self, ids: int | Iterable[int], limits: float | Iterable[float], now: float) -> Decisions:
        """Running elastic actions can use at most `limits` units of their elastic kind from
        now on (a worker pool with fewer tasks left than its grant; more again, up to the
        maximum it was submitted with, when it gets more). A grant above its limit drops to
        it at once (a resize decision); under a malleable policy one below it may grow to it
        as units free up. Returns the decisions: those resizes, then the pass's."""
        limits = [limits] if isinstance(limits, (int, float)) else list(limits)
        return self._wrap(self._core.limit(_ids(ids), np.asarray(limits, dtype=np.float64), now))

    def end_trajectories(self, ids: int | Iterable[int], now: float) -> Decisions:
        return self._wrap(self._core.end_trajectories(_ids(ids), now))

    def tick(self, now: float) -> Decisions:
        return self._wrap(self._core.tick(now))

    # ---------------------------------------------------------------- services
    def service_restored(self, service: int | str, node: int | str, device: int, now: float) -> Decisions:
        """The runtime finished restoring `service` on (node, device) sooner than the core
        planned: it is ready now (its waiting actions need not wait out restore_seconds).
        A report matching no restore in progress changes nothing. Returns the decisions of
        the pass that follows."""
        return self._wrap(self._core.service_restored(self._service(service), self._node(node), int(device), now))

    def back_off_quota(self, quota: int | str, until: float) -> None:
        """The API behind `quota` answered "too many requests": it admits nothing new before
        `until` (the scheduler's clock, seconds; a later backoff extends the pause, an earlier
        one changes nothing), its waiting requests held as by its rate. No decisions: a
        backoff only holds actions back."""
        self._core.back_off_quota(self._quota(quota), float(until))

    def quota_snapshot(self, quota: int | str, now: float) -> dict[str, float | int | None]:
        """What `quota` would admit at `now`, for a live view (nothing changes): "requests"
        its rate lets start back to back (None: no rate limit), whole "tokens" of its budget
        (None: no budget), "paused_until" (None: no backoff ahead of `now`)."""
        requests, tokens, paused_until = self._core.quota_snapshot(self._quota(quota), float(now))
        return {"requests": None if requests < 0 else requests, "tokens": None if tokens < 0 else tokens,
                "paused_until": paused_until if paused_until > now else None}

    def set_service_times(self, service: int | str, restore_seconds: float, offload_seconds: float) -> None:
        """New estimates of a service's restore and offload times (seconds, as measured),
        for the restores and evictions decided from now on."""
        self._core.set_service_times(self._service(service), float(restore_seconds), float(offload_seconds))

    # ---------------------------------------------------------------- node membership
    def set_node_online(self, node: int | str, online: bool, now: float) -> Decisions:
        """Takes a node out of placement (False) or brings it back (True). An offline node
        gets no new placements; actions still running there keep their resources until
        they are completed or cancelled (the core never ends them itself). Actions that fit
        only there wait for it. Returns the decisions of the pass that follows."""
        return self._wrap(self._core.set_node_online(self._node(node), bool(online), now))

    def set_device_online(self, node: int | str, device: int, online: bool, now: float) -> Decisions:
        """Takes one GPU out of placement (False: it needs a reset) or brings it back. Its
        memory is fenced off: nothing new goes there, services resident there are evicted
        once their actions there end, and actions running there keep their memory until
        they end. Returns the decisions of the pass that follows."""
        return self._wrap(self._core.set_device_online(self._node(node), int(device), bool(online), now))

    def device_online(self, node: int | str, device: int) -> bool:
        return self._core.device_online(self._node(node), int(device))

    def add_node(self, node: Node, now: float) -> tuple[int, Decisions]:
        """Appends a node (online) to the inventory and returns (its index, the decisions
        of the pass that follows: waiting work may start there). Its resources must use the
        inventory's kinds (a kind it lacks is 0); existing indices do not change."""
        if not isinstance(node, Node):
            raise ValidationError("node", f"expected a tangram.Node, got {type(node).__name__}")
        if not isinstance(node.name, str) or not node.name:
            raise ValidationError("node.name", f"must be a non-empty string, got {node.name!r}")
        unknown = [k for k in node.resources if k not in self._encoder.kind_index]
        if unknown:
            raise UnknownNameError("node.resources", f"kinds {unknown} are not in the inventory "
                                   f"({', '.join(self.kinds)}); a joining node cannot add a kind")
        capacity = [_milli(node.resources.get(k, 0), f"node.resources.{k}") for k in self.kinds]
        gpus = [_milli(g.memory, f"node.gpus[{i}].memory") for i, g in enumerate(node.gpus)]
        offload = -1 if node.offload_memory is None else _milli(node.offload_memory, "node.offload_memory")
        index, array = self._core.add_node(node.name, capacity, gpus, now, offload)
        self.inventory = Inventory(nodes=[*self.inventory.nodes, node], quotas=self.inventory.quotas,
                                   services=self.inventory.services)
        self._encoder.node_index[node.name] = index
        return index, self._wrap(array)

    def node_online(self, node: int | str) -> bool:
        return self._core.node_online(self._node(node))

    def _node(self, node: int | str) -> int:
        if isinstance(node, str):
            if node not in self._encoder.node_index:
                raise UnknownNameError("node", f"no node named {node!r}")
            return self._encoder.node_index[node]
        return node

    def table(self, points: Sequence[tuple[float, float]]) -> int:
        """Registers a (units, seconds) table for bulk records; returns its id."""
        return self._encoder.table_id(Table(points).points)

    def _wrap(self, array: np.ndarray) -> Decisions:
        count = self._core.message_count  # rejection messages of the last call
        messages = [self._core.message(i) for i in range(count)] if count else []
        return Decisions(array, messages, self._services)

    # ---------------------------------------------------------------- queries
    @property
    def next_wakeup(self) -> float | None:
        """When a tick could start something (a restore ends, a quota refills), or None."""
        return self._core.next_wakeup

    @property
    def now(self) -> float:
        return self._core.now

    @property
    def waiting(self) -> int:
        return self._core.waiting_count

    @property
    def running(self) -> int:
        return self._core.running_count

    def explain(self, action_id: int) -> str:
        """Why the action waits, in words (or where it runs)."""
        return self._core.explain(action_id)

    def state(self, action_id: int) -> str:
        return ("unknown", "waiting", "running")[self._core.state(action_id)]

    def free(self, node: int, kind: str) -> float:
        return self._core.free(node, self._kind(kind)) / 1000.0

    def gpu_free(self, node: int, device: int) -> float:
        return self._core.gpu_free(node, device) / 1000.0

    def service_location(self, service: str) -> tuple[int, int] | None:
        node, device = self._core.service_location(self._service(service))
        return None if node < 0 else (node, device)

    def trajectory_slot(self, trajectory: int) -> int | None:
        """Under "trajectory": the node of the slot the trajectory holds, or None when it holds
        none (not started, ended, or running only in slots lent to it)."""
        node = self._core.trajectory_slot_node(trajectory)
        return None if node < 0 else node

    def runtime(self, action_id: int, units: float) -> float:
        """Seconds the live action's model gives for `units` of its elastic kind."""
        return self._core.runtime(action_id, units)

    def check_invariants(self) -> None:
        self._core.check_invariants()

    def _kind(self, kind: str) -> int:
        if kind not in self._encoder.kind_index:
            raise UnknownNameError("kind", f"no resource kind named {kind!r}")
        return self._encoder.kind_index[kind]

    def _quota(self, quota: int | str) -> int:
        return _index_of("quota", quota, self._encoder.quota_index)

    def _service(self, service: int | str) -> int:
        return _index_of("service", service, self._encoder.service_index)


def _index_of(what: str, name: int | str, index: dict[str, int]) -> int:
    """A quota's or service's index: given as one, or looked up by its name."""
    if not isinstance(name, str):
        return int(name)
    if name not in index:
        raise UnknownNameError(what, f"no {what} named {name!r}")
    return index[name]


# Record fields named as the Action attributes that fill them.
_RECORD_TO_ACTION_FIELD = {".elastic_max": ".max_units", ".affinity_node": ".affinity", ".model": ".runtime"}


def action_field_names(error: TangramError) -> TangramError:
    """The core's error about a record field, named by the Action attribute that fills it
    (the runtime's encoder renames it once more, to the Call's fields)."""
    field = error.field
    for record_name, action_name in _RECORD_TO_ACTION_FIELD.items():
        if record_name in field:
            field = field.replace(record_name, action_name)
    return type(error)(field, error.reason) if field != error.field else error


def _ids(ids: int | Iterable[int]) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids
    if isinstance(ids, numbers.Integral):
        ids = [ids]
    try:
        return np.asarray(list(ids), dtype=np.uint64)
    except (OverflowError, ValueError, TypeError) as e:
        raise ValidationError("ids", f"must be non-negative integers ({e})") from None
