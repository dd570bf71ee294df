"""A naive, pure-Python reference of the core's scheduling rules.

`ReferenceScheduler` takes the same keyword arguments as `tangram._core.Scheduler` (less
`decision_dtype`) and answers the same events with the same DECISION_DTYPE records. It is
written for clarity, not speed: the differential tests hold the optimised C++ core
(csrc/tangram/scheduler.cc) to it decision for decision, and the benchmarks use it as
the baseline. Policies "tangram" and "fifo" are supported; model callbacks are not.

Rules, in words:

* Units. Quantities are integers in milli-units, `to_milli(x) = floor(x * 1000 + 0.5)`;
  time is integer nanoseconds, `to_ns(s) = floor(s * 1e9 + 0.5)`. Decisions carry
  `grant = grant_milli / 1000` and `time = ns / 1e9`.
* Run time. `seconds(a, u)`: constant `s`; Amdahl `s * ((1 - p) + p * (min / u))`; table:
  piecewise linear in `u / 1000` through the points, flat outside. A non-elastic action
  is evaluated at u = min = 1000. `est_ns = to_ns(seconds(a, min))`.
* Order. Waiting actions go by (-priority, key, seq), seq counting accepted submits.
  tangram: `key = est_ns + (submit_ns * aging_permille) // 1000`, aging_permille =
  to_milli(aging); fifo: key = 0.
* Classes. Waiting actions with identical admission constraints (demand vector, gpu
  memory, partition, affinity, service, quota, tokens) form a class; once one of a class
  fails in a pass, the rest of the class is not tried in that pass.
* Infeasible at submit. An action is rejected at once (rejects come first in the output,
  in submit order) when no node's capacity covers its demand (on its affinity node if it
  has one; including the node's largest GPU >= gpu_memory when the inventory has GPUs), or
  when its tokens exceed its quota's tokens_per_minute; a service action when no device
  has memory >= service memory + gpu_memory on a node whose capacity covers the demand.
* Restore order (tangram only). Before the walk, offloaded services with waiting
  actions are restored (Restore, below, for the service's first waiting action in
  order): starving first (that action has waited >= starvation_ns), then most waiting
  actions per (restore_ns + queued est_ns // max_batch), cross-multiplied, then index.
* A pass walks the waiting actions once in order. For each (skipping blocked classes):
  1. its quota already blocked in this pass: blocked.
  2. a service action: a ready service whose device is smaller than service memory +
     the action's gpu_memory is moved (evicted, then restored) once nothing of it runs
     (until then: blocked); an offloaded service is restored (below; none possible:
     blocked); a service still restoring, or running max_batch actions: blocked. It may
     run only on its service's node and device.
  3. candidates: the first `candidates` nodes in index order (just the scope node with an
     affinity or a service; nodes held back by a starving action are skipped) whose free
     vector covers the demand and, for a non-service action, whose largest free GPU
     memory >= gpu_memory; a service action also needs gpu_memory free on its device.
  4. none, and it needs GPU memory: evict services for it by the greedy plan (below) and
     try again.
     Still none: if it has waited >= starvation_seconds, it is starving: with a scope
     node that node is held back from every later action in the pass; without one the
     pass halts. Either way the action is blocked.
  5. quota admission (below); refused: the quota is blocked for the rest of the pass.
  6. best fit: the candidate with the least sum over kinds with capacity > 0 of
     `((free - demand) * 1024) // capacity`, first on ties; a non-service GPU action takes
     the node's device with the least memory left over (first on ties). The grant is the
     elastic minimum (0 in the record of a non-elastic action).
  Every class blocked for resources (and a halt) makes its scope node (or, without one,
  every node) "contended"; one waiting for its quota or its service does not.
* Spare units (tangram only). After the walk, on each node in index order that is not
  contended, elastic actions started in this pass get one more unit (min(1000, max -
  grant)) at a time: each round to the one with the largest gain = t(g) - t(g + step)
  (first in start order on ties), among those where free room allows it, t(g) > 0,
  gain >= min_relative_gain * t(g) and gain > 0; until nobody qualifies.
* Restore. Candidate devices: memory >= service + gpu_memory and a node whose capacity
  covers the demand. Prefer a device with room now, minimising (node lacks free room for
  the demand now, memory left over), first device on ties. Otherwise evict on one device:
  eligible victims are other services resident there with nothing running and ready
  since before the last pass (so never one still restoring, nor one whose actions have
  not yet had a pass to start), ranked idle (nothing waiting) first, then by queued est_ns per restore_ns
  (max 1) ascending (cross-multiplied integers), then index; take victims in rank order
  until the room suffices; choose the device minimising (node lacks room now, victims
  with waiting actions, their queued ns, victim count, device). Evict decisions (time =
  now) precede the restore decision (time = ready = now + restore_ns).
* GPU room for an action. A service action short of gpu_memory on its service's device
  evicts there by the same greedy plan (its own service kept). Any other GPU action
  evicts on the device with the cheapest plan (victims with waiting actions, queued ns,
  count, device) among devices with memory >= gpu_memory on nodes in its scope, not held
  back, where the rest of its demand fits now; only plans that evict someone.
* Quotas (exact integers). GCRA: interval = max(1, to_ns(1 / rate)), tolerance = (burst -
  1) * interval; refused while now < tat - tolerance (until tat - tolerance); a start sets
  tat = max(tat, now) + interval. Concurrency: refused while max_concurrency actions of
  the quota run (until: never). Tokens: a bucket of tokens_per_minute * 60e9 units
  refilled by tokens_per_minute per ns elapsed (capped); a request needs tokens * 60e9;
  refused until now + ceil(shortfall / tokens_per_minute). Checked in that order.
* next_wakeup: after each pass, the earliest ready time of a restoring service or the
  "until" time of a quota refused in the pass; None when there is none.
* Validation raises tangram._errors types and applies nothing of a refused batch.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ._errors import DuplicateIdError, InvalidStateError, UnknownActionError, UnknownNameError, ValidationError
from ._records import (
    ACTION_HEADER_SIZE, DECISION_DTYPE, EVICT, MODEL_AMDAHL, MODEL_CALLBACK, MODEL_CONSTANT, MODEL_TABLE, REJECT,
    RESTORE, START,
)

MAX_MILLI = 10**15  # 1e12 base units
MAX_SECONDS = 1e9
ELASTIC_STEP = 1000
NS_PER_MINUTE = 60_000_000_000
STARTED, BLOCKED, WAITS, HALT = "started", "blocked", "waits", "halt"  # WAITS: for a quota or a service


def to_milli(x: float) -> int:
    return math.floor(x * 1000.0 + 0.5)


def to_ns(seconds: float) -> int:
    return math.floor(seconds * 1e9 + 0.5)


def _covers(have: Sequence[int], need: Sequence[int]) -> bool:
    return all(h >= n for h, n in zip(have, need))


def _checked_milli(value: float, field: str) -> int:
    if not math.isfinite(value):
        raise ValidationError(field, "must be a finite number")
    if value < 0:
        raise ValidationError(field, "must not be negative")
    if value > 1e12:
        raise ValidationError(field, "is absurdly large (over 1e12 units)")
    return to_milli(value)


class _Quota:
    """One API quota's admission state (quota.cc). `running` is passed in by the caller."""

    def __init__(self, spec: tuple, field: str) -> None:
        name, rate, burst, max_concurrency, tpm = spec
        if not name:
            raise ValidationError(f"{field}.name", "a quota needs a name")
        if not math.isfinite(rate) or not 0 <= rate <= 1e9:
            raise ValidationError(f"{field}.rate", "must be a finite number in [0, 1e9]")
        if not 1 <= burst <= 1_000_000_000:
            raise ValidationError(f"{field}.burst", "must be in [1, 1e9]")
        if max_concurrency < 0:
            raise ValidationError(f"{field}.max_concurrency", "must be non-negative")
        if not 0 <= tpm <= 100_000_000:
            raise ValidationError(f"{field}.tokens_per_minute", "must be in [0, 1e8]")
        self.name, self.max_concurrency, self.tpm = name, max_concurrency, tpm
        self.interval = max(1, to_ns(1.0 / rate)) if rate > 0 else 0
        self.tolerance = (burst - 1) * self.interval
        self.tat = 0
        self.capacity = tpm * NS_PER_MINUTE
        self.level = self.capacity
        self.refilled_at = 0
        self.until: int | None = None  # when the last refusal lifts; None: never by time

    def refill(self, now: int) -> None:
        if now > self.refilled_at:
            self.level = min(self.capacity, self.level + (now - self.refilled_at) * self.tpm)
            self.refilled_at = now

    def admits(self, now: int, tokens: int, running: int) -> bool:
        self.until = None
        if self.max_concurrency > 0 and running >= self.max_concurrency:
            return False
        if self.interval > 0 and now < self.tat - self.tolerance:
            self.until = self.tat - self.tolerance
            return False
        if self.tpm > 0:
            self.refill(now)
            need = tokens * NS_PER_MINUTE
            if self.level < need:
                self.until = now + -(-(need - self.level) // self.tpm)
                return False
        return True

    def take(self, now: int, tokens: int) -> None:
        if self.interval > 0:
            self.tat = max(self.tat, now) + self.interval
        if self.tpm > 0:
            self.refill(now)
            self.level -= tokens * NS_PER_MINUTE


@dataclass
class _Service:
    name: str
    memory: int
    restore_ns: int
    max_batch: int
    device: int = -1  # global device index while resident or restoring
    ready_ns: int = 0


@dataclass
class _Action:
    id: int
    trajectory: int
    demand: tuple
    gpu_memory: int
    elastic_kind: int
    elastic_max: int
    model: tuple  # (kind, seconds, parallel_fraction, table)
    affinity: int
    service: int
    quota: int
    tokens: int
    priority: int = 0
    submit_ns: int = 0
    est_ns: int = 0
    order: tuple = ()
    running: bool = False
    node: int = -1
    device: int = -1  # global device index
    grant: int = 0

    @property
    def cls(self) -> tuple:
        return (self.demand, self.gpu_memory, 0, self.affinity, self.service, self.quota, self.tokens)

    @property
    def minimum(self) -> int:
        return 1000 if self.elastic_kind < 0 else self.demand[self.elastic_kind]


class _Pass:
    """Scratch state of one scheduling pass."""

    def __init__(self) -> None:
        self.blocked_classes: set = set()
        self.blocked_quotas: set = set()
        self.held_nodes: set = set()  # held back by a starving action
        self.contended_nodes: set = set()
        self.contended_all = False
        self.started: list = []  # (action, index of its decision)


def _first_repeat(ids: list[int]) -> int | None:
    """The first position whose id already appeared earlier in the batch, or None."""
    seen: set[int] = set()
    for i, x in enumerate(ids):
        if x in seen:
            return i
        seen.add(x)
    return None


class ReferenceScheduler:
    """The scheduling rules of tangram._core.Scheduler, naively (see the module docstring)."""

    def __init__(self, *, kinds, node_names, capacity, gpus, quotas, services, policy, aging, candidates,
                 min_relative_gain, starvation_seconds, trajectory_slot_cpu=0, pools=()) -> None:
        capacity = np.asarray(capacity, dtype=np.int64)
        N, K = len(node_names), len(kinds)
        if capacity.ndim != 2 or capacity.shape != (N, K):
            raise ValidationError("inventory.capacity", "must be a nodes x kinds array")
        if len(gpus) != N:
            raise ValidationError("inventory.gpus", "needs one list per node")
        if policy in ("trajectory", "isolated"):
            raise NotImplementedError(f"the reference implements the tangram and fifo policies, not {policy!r}")
        if policy not in ("tangram", "fifo"):
            raise UnknownNameError("policy", f"unknown policy {policy!r}")
        if K == 0:
            raise ValidationError("inventory.kinds", "at least one resource kind is needed")
        if any(not k for k in kinds) or len(set(kinds)) != K:
            raise ValidationError("inventory.kinds", "kind names must be non-empty and unique")
        if N == 0:
            raise ValidationError("inventory.nodes", "at least one node is needed")
        self.kinds, self.K, self.N = list(kinds), K, N
        self.capacity = [[int(v) for v in row] for row in capacity]
        if any(not 0 <= v <= MAX_MILLI for row in self.capacity for v in row):
            raise ValidationError("inventory.capacity", "must be in [0, 1e12] units")
        self.free = [list(row) for row in self.capacity]
        # GPUs, numbered globally node by node.
        self.dev_node, self.dev_local, self.dev_total = [], [], []
        for n, mems in enumerate(gpus):
            for g, m in enumerate(mems):
                if not 0 < m <= MAX_MILLI:
                    raise ValidationError(f"inventory.nodes[{n}].gpus[{g}].memory", "must be in (0, 1e12] MiB")
                self.dev_node.append(n)
                self.dev_local.append(g)
                self.dev_total.append(int(m))
        self.dev_free = list(self.dev_total)
        self.has_gpus = bool(self.dev_node)
        self.quotas = []
        for q, spec in enumerate(quotas):
            self.quotas.append(_Quota(spec, f"inventory.quotas[{q}]"))
            if any(o.name == spec[0] for o in self.quotas[:-1]):
                raise ValidationError(f"inventory.quotas[{q}].name", f"duplicate quota {spec[0]!r}")
        self.services = []
        for s, (name, memory, restore_seconds, max_batch) in enumerate(services):
            f = f"inventory.services[{s}]"
            if any(o.name == name for o in self.services):
                raise ValidationError(f"{f}.name", f"duplicate service {name!r}")
            if not 0 <= memory <= MAX_MILLI:
                raise ValidationError(f"{f}.memory", "must be in [0, 1e12] MiB")
            if not math.isfinite(restore_seconds) or not 0 <= restore_seconds <= MAX_SECONDS:
                raise ValidationError(f"{f}.restore_seconds", "must be a finite number in [0, 1e9]")
            if max_batch < 1:
                raise ValidationError(f"{f}.max_batch", "must be at least 1")
            if not self.has_gpus:
                raise ValidationError(f, "a GPU service needs at least one GPU in the inventory")
            self.services.append(_Service(name, int(memory), to_ns(restore_seconds), int(max_batch)))
        pf = f"policy({policy})"
        if not math.isfinite(aging) or not 0 <= aging <= 4:
            raise ValidationError(f"{pf}.aging", "must be a finite number in [0, 4]")
        if not 1 <= candidates <= 1024:
            raise ValidationError(f"{pf}.candidates", "must be in [1, 1024]")
        if not math.isfinite(min_relative_gain) or not 0 <= min_relative_gain <= 1:
            raise ValidationError(f"{pf}.min_relative_gain", "must be a finite number in [0, 1]")
        if not math.isfinite(starvation_seconds) or not 0 < starvation_seconds <= MAX_SECONDS:
            raise ValidationError(f"{pf}.starvation_seconds", "must be a finite number in (0, 1e9]")
        self.policy, self.candidates, self.min_relative_gain = policy, int(candidates), float(min_relative_gain)
        self.aging_permille = to_milli(aging)
        self.starvation_ns = to_ns(starvation_seconds)
        self.tables: list[list[tuple[float, float]]] = []
        self.actions: dict[int, _Action] = {}  # live actions, by id
        self.seq = 0
        self.now_ns = 0
        self.prev_pass_ns = -1  # when the last pass ran: a service ready since then is not evictable yet
        self.wakeup_ns: int | None = None
        self.messages: list[str] = []

    # ------------------------------------------------------------ models
    def add_table(self, points) -> int:
        pts = [(float(u), float(s)) for u, s in points]
        if not pts:
            raise ValidationError("table", "a table needs at least one point")
        for i, (u, s) in enumerate(pts):
            if not math.isfinite(u) or not 0 < u <= 1e12:
                raise ValidationError(f"table[{i}].units", "must be a finite number in (0, 1e12]")
            if not math.isfinite(s) or not 0 <= s <= MAX_SECONDS:
                raise ValidationError(f"table[{i}].seconds", "must be a finite number in [0, 1e9]")
            if i > 0 and not u > pts[i - 1][0]:
                raise ValidationError(f"table[{i}].units", "units must rise strictly from point to point")
        self.tables.append(pts)
        return len(self.tables) - 1

    def _model_seconds(self, model: tuple, units: int, minimum: int) -> float:
        kind, seconds, p, table = model
        if kind == MODEL_CONSTANT:
            return seconds
        if kind == MODEL_AMDAHL:
            return seconds * ((1.0 - p) + p * (float(minimum) / float(units)))
        t = self.tables[table]
        x = float(units) / 1000.0
        if x <= t[0][0]:
            return t[0][1]
        if x >= t[-1][0]:
            return t[-1][1]
        i = bisect.bisect_right([u for u, _ in t], x)  # first point strictly above x
        (lo_u, lo_s), (hi_u, hi_s) = t[i - 1], t[i]
        return lo_s + (hi_s - lo_s) * ((x - lo_u) / (hi_u - lo_u))

    def _seconds(self, a: _Action, units: int) -> float:
        if a.elastic_kind < 0:
            return self._model_seconds(a.model, 1000, 1000)
        return self._model_seconds(a.model, units, a.minimum)

    # ------------------------------------------------------------ events
    def _time(self, now: float) -> int:
        now = float(now)
        if not math.isfinite(now) or not 0 <= now <= MAX_SECONDS:
            raise ValidationError("now", "must be a finite time in [0, 1e9] seconds")
        return to_ns(now)

    def _begin(self, t: int) -> None:
        if t < self.now_ns:
            raise ValidationError("now", "time went backwards")

    def submit(self, records: np.ndarray, now: float) -> np.ndarray:
        t = self._time(now)
        records = np.asarray(records)
        if records.ndim != 1 or records.dtype.itemsize != ACTION_HEADER_SIZE + 8 * self.K:
            raise ValidationError("actions", "expected a 1-d array of the scheduler's action dtype")
        batch = [self._decode(r, f"actions[{i}]") for i, r in enumerate(records)]
        self._begin(t)
        for i, a in enumerate(batch):
            if a.id in self.actions:
                raise DuplicateIdError(f"actions[{i}].id", f"action {a.id} is already live")
            self._validate(a, f"actions[{i}]")
        repeat = _first_repeat([a.id for a in batch])
        if repeat is not None:
            raise DuplicateIdError(f"actions[{repeat}].id", f"action {batch[repeat].id} appears twice in the batch")
        self._start_event(t)
        out = []
        for a in batch:
            why = self._infeasible(a)
            if why:
                out.append(self._decision(REJECT, action=a.id, time=t, reason=len(self.messages)))
                self.messages.append(f"action {a.id} can never run: {why}")
                continue
            a.submit_ns = t
            a.est_ns = to_ns(self._seconds(a, a.minimum))
            key = a.est_ns + (t * self.aging_permille) // 1000 if self.policy == "tangram" else 0
            a.order = (-a.priority, key, self.seq)
            self.seq += 1
            self.actions[a.id] = a
        return self._pass(out)

    def complete(self, ids: Iterable[int], now: float) -> np.ndarray:
        ids = self._ids(ids, self._start_check(now), running_only=True)
        for i in ids:
            self._finish(self.actions.pop(i))
        return self._pass([])

    def cancel(self, ids: Iterable[int], now: float) -> np.ndarray:
        ids = self._ids(ids, self._start_check(now), running_only=False)
        for i in ids:
            a = self.actions.pop(i)
            if a.running:
                self._finish(a)
        return self._pass([])

    def end_trajectories(self, ids: Iterable[int], now: float) -> np.ndarray:
        t = self._start_check(now)
        for i, traj in enumerate(int(x) for x in ids):
            live = sum(1 for a in self.actions.values() if a.trajectory == traj)
            if live:
                raise InvalidStateError(f"trajectories[{i}]", f"trajectory {traj} still has {live} live action(s)")
        self._start_event(t)
        return self._pass([])

    def tick(self, now: float) -> np.ndarray:
        self._start_event(self._start_check(now))
        return self._pass([])

    def _start_check(self, now: float) -> int:
        t = self._time(now)
        self._begin(t)
        return t

    def _start_event(self, t: int) -> None:
        self.messages = []
        self.now_ns = t

    def _ids(self, ids: Iterable[int], t: int, running_only: bool) -> list[int]:
        ids = [int(x) for x in ids]
        for i, x in enumerate(ids):
            if x not in self.actions:
                raise UnknownActionError(f"ids[{i}]", f"action {x} is not live (never submitted, or already ended)")
            if running_only and not self.actions[x].running:
                raise InvalidStateError(f"ids[{i}]", f"action {x} has not started")
        repeat = _first_repeat(ids)
        if repeat is not None:
            raise DuplicateIdError(f"ids[{repeat}]", f"action {ids[repeat]} appears twice in the batch")
        self._start_event(t)
        return ids

    def _finish(self, a: _Action) -> None:
        free = self.free[a.node]
        for k in range(self.K):
            free[k] += a.demand[k]
        if a.elastic_kind >= 0:
            free[a.elastic_kind] += a.grant - a.minimum
        if a.device >= 0 and a.gpu_memory > 0:
            self.dev_free[a.device] += a.gpu_memory

    # ------------------------------------------------------------ validation
    def _decode(self, r: np.void, f: str) -> _Action:
        model = int(r["model"])
        if model > MODEL_CALLBACK:
            raise ValidationError(f"{f}.model", f"unknown model kind {model}")
        ek = int(r["elastic_kind"])
        demand = tuple(_checked_milli(float(v), f"{f}.demand.{k}") for v, k in zip(r["demand"], self.kinds))
        a = _Action(
            id=int(r["id"]), trajectory=int(r["trajectory"]), demand=demand,
            gpu_memory=_checked_milli(float(r["gpu_memory"]), f"{f}.gpu_memory"), elastic_kind=ek,
            elastic_max=_checked_milli(float(r["elastic_max"]), f"{f}.elastic_max") if ek >= 0 else 0,
            model=(model, float(r["seconds"]), float(r["parallel_fraction"]), int(r["table"])),
            affinity=int(r["affinity"]), service=int(r["service"]), quota=int(r["quota"]), tokens=int(r["tokens"]),
            priority=int(r["priority"]),
        )
        if model == MODEL_CALLBACK and int(r["callback"]) != 0:
            raise NotImplementedError("the reference does not call native cost-model callbacks")
        return a

    def _validate(self, a: _Action, f: str) -> None:
        def bad(field: str, why: str) -> None:
            raise ValidationError(f"{f}.{field}", why)

        if a.gpu_memory > 0 and not self.has_gpus and a.service < 0:
            bad("gpu_memory", "the inventory has no GPU")
        if a.elastic_kind != -1:
            if not 0 <= a.elastic_kind < self.K:
                bad("elastic_kind", f"no kind with index {a.elastic_kind}")
            if a.minimum <= 0:
                bad("demand", "the elastic kind needs a positive minimum")
            if a.elastic_max < a.minimum:
                bad("elastic_max", "the elastic upper bound is below the minimum demand")
            if a.elastic_max > MAX_MILLI:
                bad("elastic_max", "must be at most 1e12 units")
        kind, seconds, p, table = a.model
        if kind in (MODEL_CONSTANT, MODEL_AMDAHL):
            if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS:
                bad("model.seconds", "must be a finite number in [0, 1e9]")
            if kind == MODEL_AMDAHL and not 0 <= p <= 1:
                bad("model.parallel_fraction", "must be in [0, 1]")
        elif kind == MODEL_TABLE and not 0 <= table < len(self.tables):
            bad("model.table", f"no table with id {table}")
        elif kind == MODEL_CALLBACK:
            bad("model.callback", "is null")
        if a.affinity != -1 and not 0 <= a.affinity < self.N:
            raise UnknownNameError(f"{f}.affinity_node", f"no node with index {a.affinity}")
        if a.service != -1:
            if not 0 <= a.service < len(self.services):
                raise UnknownNameError(f"{f}.service", f"no service with index {a.service}")
            if a.affinity != -1:
                bad("affinity_node", "cannot be combined with a service")
        if a.quota != -1 and not 0 <= a.quota < len(self.quotas):
            raise UnknownNameError(f"{f}.quota", f"no quota with index {a.quota}")
        if not 0 <= a.tokens <= 10**12:
            bad("tokens", "must be in [0, 1e12]")
        if a.tokens > 0 and a.quota == -1:
            bad("tokens", "tokens need a quota to draw from")
        t = self._seconds(a, a.minimum)
        if not math.isfinite(t) or not 0 <= t <= MAX_SECONDS:
            bad("model", "run time at the minimum grant is not a finite number in [0, 1e9] s")

    def _node_max_gpu(self, n: int, table: list[int]) -> int:
        return max((table[d] for d in self._devices_of(n)), default=0)

    def _devices_of(self, n: int) -> list[int]:
        return [d for d in range(len(self.dev_node)) if self.dev_node[d] == n]

    def _infeasible(self, a: _Action) -> str:
        if a.service >= 0:
            svc = self.services[a.service]
            if not any(self.dev_total[d] >= svc.memory + a.gpu_memory and _covers(self.capacity[self.dev_node[d]], a.demand)
                       for d in range(len(self.dev_node))):
                return f"no device has room for service {svc.name!r} beside a node that fits the demand"
        else:
            nodes = range(self.N) if a.affinity < 0 else [a.affinity]
            if not any(_covers(self.capacity[n], a.demand) and self._node_max_gpu(n, self.dev_total) >= a.gpu_memory
                       for n in nodes):
                return "demand does not fit " + ("on any node" if a.affinity < 0 else "on its affinity node")
        if a.quota >= 0 and self.quotas[a.quota].tpm and a.tokens > self.quotas[a.quota].tpm:
            return f"needs {a.tokens} tokens, more than quota {self.quotas[a.quota].name!r} grants per minute"
        return ""

    # ------------------------------------------------------------ the pass
    def _pass(self, out: list) -> np.ndarray:
        p = _Pass()
        if self.policy == "tangram":
            self._restore_queues(out)
        for a in sorted((a for a in self.actions.values() if not a.running), key=lambda a: a.order):
            if a.cls in p.blocked_classes:
                continue
            outcome = self._try(a, p, out)
            if outcome == STARTED:
                continue
            if outcome == HALT:
                p.contended_all = True
                break
            p.blocked_classes.add(a.cls)
            if outcome == WAITS:  # for a quota or a service: no claim on spare units
                continue
            scope = self._scope_node(a)
            if scope < 0:
                p.contended_all = True
            else:
                p.contended_nodes.add(scope)
        if self.policy == "tangram" and p.started:
            self._grant_spare(p, out)
        times = [s.ready_ns for s in self.services if s.device >= 0 and s.ready_ns > self.now_ns]
        times += [self.quotas[q].until for q in p.blocked_quotas if self.quotas[q].until is not None]
        self.wakeup_ns = min(times, default=None)
        self.prev_pass_ns = self.now_ns
        arr = np.zeros(len(out), dtype=DECISION_DTYPE)
        for i, d in enumerate(out):
            arr[i] = (d["action"], d["grant"], d["grant"] / 1000.0, d["time"] / 1e9, d["kind"], d["node"],
                      d["device"], d["service"], d["elastic_kind"], d["reason"])
        return arr

    @staticmethod
    def _decision(kind: int, *, action=0, node=-1, device=-1, service=-1, elastic_kind=-1, grant=0, time=0,
                  reason=-1) -> dict:
        return dict(kind=kind, action=action, node=node, device=device, service=service,
                    elastic_kind=elastic_kind, grant=grant, time=time, reason=reason)

    def _scope_node(self, a: _Action) -> int:
        """The one node the action is confined to (its service's, or its affinity), or -1."""
        if a.service >= 0:
            d = self.services[a.service].device
            return -1 if d < 0 else self.dev_node[d]
        return a.affinity

    def _running(self, **match) -> int:
        return sum(1 for a in self.actions.values() if a.running and all(getattr(a, k) == v for k, v in match.items()))

    def _try(self, a: _Action, p: _Pass, out: list) -> str:
        now = self.now_ns
        if a.quota >= 0 and a.quota in p.blocked_quotas:
            return WAITS
        device = -1
        if a.service >= 0:
            svc = self.services[a.service]
            if svc.device >= 0 and svc.ready_ns <= now and self.dev_total[svc.device] < svc.memory + a.gpu_memory:
                if self._running(service=a.service) > 0:  # move it once its batch is done
                    return WAITS
                self._evict(a.service, out)
            if svc.device < 0 and not self._restore(a, out):
                return WAITS
            if svc.ready_ns > now or self._running(service=a.service) >= svc.max_batch:
                return WAITS
            device = svc.device
        scope = self._scope_node(a)
        cands = []
        for n in range(self.N) if scope < 0 else [scope]:
            if len(cands) == self.candidates:
                break
            if n in p.held_nodes or not _covers(self.free[n], a.demand):
                continue
            if device < 0 and self._node_max_gpu(n, self.dev_free) < a.gpu_memory:
                continue
            cands.append(n)
        if device >= 0 and self.dev_free[device] < a.gpu_memory:
            cands = []
        if not cands and a.gpu_memory > 0 and self._make_gpu_room(a, scope, device, p, out):
            return self._try(a, p, out)
        if not cands:
            if now - a.submit_ns >= self.starvation_ns:  # starving: first claim on its bins
                if scope < 0:
                    return HALT
                p.held_nodes.add(scope)
            return BLOCKED
        if a.quota >= 0:
            q = self.quotas[a.quota]
            if not q.admits(now, a.tokens, self._running(quota=a.quota)):
                p.blocked_quotas.add(a.quota)
                return WAITS
            q.take(now, a.tokens)

        def score(n: int) -> int:
            return sum(((self.free[n][k] - a.demand[k]) * 1024) // self.capacity[n][k]
                       for k in range(self.K) if self.capacity[n][k] > 0)

        node = min(cands, key=score)  # first on ties
        if device < 0 and a.gpu_memory > 0:
            fitting = [d for d in self._devices_of(node) if self.dev_free[d] >= a.gpu_memory]
            device = min(fitting, key=lambda d: self.dev_free[d] - a.gpu_memory)
        for k in range(self.K):
            self.free[node][k] -= a.demand[k]
        if a.gpu_memory > 0:
            self.dev_free[device] -= a.gpu_memory
        a.running, a.node, a.device = True, node, device
        a.grant = a.minimum if a.elastic_kind >= 0 else 0
        p.started.append((a, len(out)))
        out.append(self._decision(START, action=a.id, node=node, device=self.dev_local[device] if device >= 0 else -1,
                                  service=a.service, elastic_kind=a.elastic_kind, grant=a.grant, time=now))
        return STARTED

    def _restore_queues(self, out: list) -> None:
        """tangram: offloaded services with waiting actions are restored before the walk, in
        queue order: starving first (their first waiting action in policy order has waited
        starvation_ns), then most waiting actions per (restore_ns + queued est_ns //
        max_batch) (cross-multiplied integers), then index; each with its first waiting
        action in policy order as the one it is restored for."""
        waiting = sorted((a for a in self.actions.values() if not a.running), key=lambda a: a.order)
        heads: dict[int, _Action] = {}
        for a in waiting:
            if a.service >= 0 and self.services[a.service].device < 0 and a.service not in heads:
                heads[a.service] = a
        if not heads:
            return
        n = {s: sum(1 for a in waiting if a.service == s) for s in heads}
        span = {s: self.services[s].restore_ns
                + sum(a.est_ns for a in waiting if a.service == s) // self.services[s].max_batch for s in heads}
        starving = {s: self.now_ns - heads[s].submit_ns >= self.starvation_ns for s in heads}

        def rank(x: int, y: int) -> int:
            if starving[x] != starving[y]:
                return -1 if starving[x] else 1
            lhs, rhs = n[x] * span[y], n[y] * span[x]
            if lhs != rhs:
                return -1 if lhs > rhs else 1
            return -1 if x < y else (1 if x > y else 0)

        for s in sorted(heads, key=functools.cmp_to_key(rank)):
            if self.services[s].device < 0:
                self._restore(heads[s], out)

    def _plan_room(self, d: int, need: int, keep: int) -> tuple[bool, int, int, list[int]]:
        """Greedy victims on device d for `need`: (enough, busy victims, their queued ns, victims)."""
        waiting = [b for b in self.actions.values() if not b.running]
        n_waiting = {o: sum(1 for b in waiting if b.service == o) for o in range(len(self.services))}
        queued = {o: sum(b.est_ns for b in waiting if b.service == o) for o in range(len(self.services))}

        def rank(x: int, y: int) -> int:  # idle first, then least queued work per restore ns
            if (n_waiting[x] == 0) != (n_waiting[y] == 0):
                return -1 if n_waiting[x] == 0 else 1
            lhs = queued[x] * max(self.services[y].restore_ns, 1)
            rhs = queued[y] * max(self.services[x].restore_ns, 1)
            if lhs != rhs:
                return -1 if lhs < rhs else 1
            return -1 if x < y else (1 if x > y else 0)

        room, victims = self.dev_free[d], []
        idle = sorted((o for o, svc in enumerate(self.services) if o != keep and svc.device == d
                       and self._running(service=o) == 0 and svc.ready_ns <= self.prev_pass_ns),
                      key=functools.cmp_to_key(rank))
        for o in idle:
            if room >= need:
                break
            room += self.services[o].memory
            victims.append(o)
        return (room >= need, sum(1 for o in victims if n_waiting[o] > 0), sum(queued[o] for o in victims), victims)

    def _evict(self, s: int, out: list) -> None:
        d = self.services[s].device
        self.services[s].device = -1
        self.dev_free[d] += self.services[s].memory
        out.append(self._decision(EVICT, node=self.dev_node[d], device=self.dev_local[d], service=s, time=self.now_ns))

    def _restore(self, a: _Action, out: list) -> bool:
        """Make a's service resident somewhere, evicting greedily if needed."""
        s = a.service
        svc = self.services[s]
        need = svc.memory
        usable = [d for d in range(len(self.dev_node))
                  if self.dev_total[d] >= need + a.gpu_memory and _covers(self.capacity[self.dev_node[d]], a.demand)]

        def busy_node(d: int) -> int:  # 1 when the action's demand does not fit the node now
            return 0 if _covers(self.free[self.dev_node[d]], a.demand) else 1

        room_now = [(busy_node(d), self.dev_free[d] - need, d) for d in usable if self.dev_free[d] >= need]
        if room_now:
            target = min(room_now)[2]
        else:
            plans = []
            for d in usable:
                ok, busy, queued, victims = self._plan_room(d, need, s)
                if ok:
                    plans.append(((busy_node(d), busy, queued, len(victims), d), victims))
            if not plans:
                return False
            (*_, target), victims = min(plans)
            for v in victims:
                self._evict(v, out)
        svc.device, svc.ready_ns = target, self.now_ns + svc.restore_ns
        self.dev_free[target] -= need
        out.append(self._decision(RESTORE, node=self.dev_node[target], device=self.dev_local[target], service=s,
                                  time=svc.ready_ns))
        return True

    def _make_gpu_room(self, a: _Action, scope: int, device: int, p: _Pass, out: list) -> bool:
        """Evict services (greedy plan) for the GPU memory `a` needs: on its service's device, or on
        the device with the cheapest plan among nodes (not held back) where the rest of its
        demand fits now."""
        if device >= 0:
            if self.dev_free[device] >= a.gpu_memory:
                return False  # it waits for something else
            ok, _, _, victims = self._plan_room(device, a.gpu_memory, a.service)
            if not ok:
                return False
        else:
            plans = []
            for n in range(self.N) if scope < 0 else [scope]:
                if n in p.held_nodes or not _covers(self.free[n], a.demand):
                    continue
                for d in self._devices_of(n):
                    if self.dev_total[d] >= a.gpu_memory:
                        ok, busy, queued, victims = self._plan_room(d, a.gpu_memory, -1)
                        if ok and victims:
                            plans.append(((busy, queued, len(victims), d), victims))
            if not plans:
                return False
            victims = min(plans)[1]
        for v in victims:
            self._evict(v, out)
        return True

    def _grant_spare(self, p: _Pass, out: list) -> None:
        """Spare elastic units on uncontended nodes, one unit at a time, largest gain first."""
        if p.contended_all:
            return
        for node in sorted({a.node for a, _ in p.started}):
            if node in p.contended_nodes:
                continue
            members = [(a, i) for a, i in p.started if a.node == node and a.elastic_kind >= 0]
            free = self.free[node]
            while True:
                best, best_gain = None, 0.0
                for a, i in members:
                    step = min(ELASTIC_STEP, a.elastic_max - a.grant)
                    if step <= 0 or free[a.elastic_kind] < step:
                        continue
                    now_s = self._seconds(a, a.grant)
                    gain = now_s - self._seconds(a, a.grant + step)
                    if not now_s > 0 or not gain >= self.min_relative_gain * now_s or not gain > 0:
                        continue
                    if best is None or gain > best_gain:
                        best, best_gain = (a, i), gain
                if best is None:
                    break
                a, i = best
                step = min(ELASTIC_STEP, a.elastic_max - a.grant)
                a.grant += step
                free[a.elastic_kind] -= step
                out[i]["grant"] = a.grant

    # ------------------------------------------------------------ queries
    @property
    def next_wakeup(self) -> float | None:
        return None if self.wakeup_ns is None else self.wakeup_ns / 1e9

    @property
    def now(self) -> float:
        return self.now_ns / 1e9

    @property
    def waiting_count(self) -> int:
        return sum(1 for a in self.actions.values() if not a.running)

    @property
    def running_count(self) -> int:
        return sum(1 for a in self.actions.values() if a.running)

    @property
    def message_count(self) -> int:
        return len(self.messages)

    def message(self, reason: int) -> str:
        if not 0 <= reason < len(self.messages):
            raise ValidationError("reason", f"no message with index {reason} in the last call")
        return self.messages[reason]

    def state(self, action_id: int) -> int:
        a = self.actions.get(int(action_id))
        return 0 if a is None else (2 if a.running else 1)

    def explain(self, action_id: int) -> str:
        a = self.actions.get(int(action_id))
        if a is None:
            return f"action {action_id} is not live (never submitted, or already ended)"
        return f"running on node {a.node}" if a.running else "waiting"

    def free_milli(self, node: int, kind: int) -> int:
        return self.free[node][kind]

    def gpu_free(self, node: int, device: int) -> int:
        return self.dev_free[self._devices_of(node)[device]]

    def service_location(self, service: int) -> tuple[int, int]:
        d = self.services[service].device
        return (-1, -1) if d < 0 else (self.dev_node[d], self.dev_local[d])
