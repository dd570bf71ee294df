"""A naive, pure-Python reference of the core's scheduling rules.

`ReferenceScheduler` takes the same keyword arguments as `tangram._core.Scheduler` (less
`decision_dtype`; plus an optional `rules`) and answers the same events with the same
DECISION_DTYPE records and the same reject messages. It is written for clarity, not
speed: the differential tests hold the optimised C++ core (csrc/tangram/) to
it decision for decision, and the benchmarks use it as the baseline. It implements all
five policies; model callbacks are not supported.

A policy is a row of independent rules (`PolicyRules`; `POLICY_RULES` holds the five
built-in rows, taken from the core's one table of them). Passing `rules=` runs any row
under any name:

    policy       order     bins              spare        restore       service_devices  resize     gain
    tangram      estimate  node              uncontended  queues_first  any              malleable  wait
    fifo         arrival   node              none         on_demand     any              fixed      relative
    optimus      arrival   node              every_bin    on_demand     any              fixed      relative
    trajectory   arrival   trajectory_slots  none         on_demand     home             fixed      relative
    isolated     arrival   task_pools        none         on_demand     home             fixed      relative

Rules, in words:

* Units. Quantities are integers in milli-units, `to_milli(x) = floor(x * 1000 + 0.5)`;
  time is integer nanoseconds, `to_ns(s) = floor(s * 1e9 + 0.5)`. Decisions carry
  `grant = grant_milli / 1000` and `time = ns / 1e9`.
* Run time. `seconds(a, u)`: constant `s`; Amdahl `s * ((1 - p) + p * (min / u))`; table:
  piecewise linear in `u / 1000` through the points, flat outside. A non-elastic action
  is evaluated at u = min = 1000. `est_ns = to_ns(seconds(a, min))`; under resize
  "malleable" an elastic action's min is first rounded up to a whole unit (at most its max).
* Order. Waiting actions go by (-priority, key, seq), seq counting accepted submits.
  order "estimate": `key = est_ns + (now_ns * aging_permille) // 1000`, now_ns being the
  submit batch's time and aging_permille = to_milli(aging), without est_ns for an action
  under a quota (its queue keeps arrival order); order "arrival": key = 0; order "progress":
  as "estimate", less PROGRESS_CREDIT_NS x min(started, PROGRESS_CAP) for an action under a
  quota, started being the actions its trajectory has started since the scheduler was made
  or end_trajectories last named it.
* Service tails (order "estimate"). Every accepted action updates the scheduler's
  last_submit_ns and mean_gap_ns as a service's are updated by its actions. At each pass's
  start, per service with waiting actions: its tail holds when both the scheduler's and
  the service's mean_gap_ns >= 0 and (now - last) // 4 > mean_gap_ns, last being the
  scheduler's last_submit_ns and the service's last_request_ns; a service with none
  waiting is not in its tail. When that differs from
  the service's tail state, the state changes and its waiting actions not under a quota
  are re-keyed: first each to its order-"estimate" key; then, in its tail, taking them in
  order (those keys), W their summed est_ns, B the max_batch and before_j the est_ns of
  those ahead of action j: j with before_j > W - B x est_j takes the key of the first
  position i (in that order) with before_i >= W - B x est_j.
* Bins and partitions. Placement packs actions into bins; each bin belongs to one node
  and one partition, and a partition's bins go in node order (a node's bins in the order
  made). bins "node": one bin per node, one partition. bins "trajectory_slots" (needs a
  "cpu" kind and trajectory_slot_cpu > 0): one partition; each node is cut into
  `trajectory_slots(cpu, slot)` slots (the most that fit; slot_nano = floor(slot * 1e9 + 0.5),
  `(2 * cpu * 10**6) // (2 * slot_nano - 1)`) of `to_milli(slot)` cpu each, every other
  kind divided evenly (`capacity // slots`); a node too small has no bin. bins "task_pools": one partition
  per task pool (in the order given); each node is split among them by weight: per kind,
  pool p gets `(capacity * floor(weight_p / total * 1e6)) // 1e6`, then the units left
  over are spread evenly, the first `left % P` pools taking one more. An action's
  partition is its `task`'s pool (an unknown task is an UnknownNameError); `task` is a
  label otherwise. add_node makes a new node's bins the same way, after every existing bin.
* Trajectory slots. Under bins "trajectory_slots" a non-service action runs "in its
  trajectory's slot": the trajectory binds the bin its first such action starts in
  (unless lent, step 4), and keeps it (hidden from everyone else) until end_trajectories
  or until it gives it up (step 3); its later non-service actions may use only that bin
  ("fixed"), whatever their affinity. A slot let go while an action runs there in it as
  a lent slot is taken over by the lowest such action id's trajectory that holds none
  (that action then counts as in its own slot); else it is free, and the lent actions
  still running there finish in it as in any free bin. An elastic action
  started there takes the slot's free elastic units up to its max at once. Service
  actions run beside their service and bind nothing: in their own trajectory's slot when
  it is on that node, else in a bin no trajectory holds, else in another held slot.
* Home devices. service_devices "home": a dedicated deployment: each service runs its
  minimum copies only (a surplus copy is never routed to), and the i-th of those copies in
  service order may live only on device i % devices (devices as at construction); "any":
  every copy, on every device.
* Classes. Waiting actions with identical admission constraints (demand vector, gpu
  memory, partition, affinity, service, quota, tokens; plus the trajectory for an action
  in a trajectory slot) form a class; once one of a class fails in a pass, the rest of
  the class is not tried in that pass.
* Infeasible at submit. An action is rejected at once (rejects come first in the output,
  in submit order) when, by capacity alone, nothing could ever hold it: its tokens exceed
  its quota's tokens_per_minute; a service action when no device it may use has memory
  >= service memory + gpu_memory on a node with a bin of its partition whose capacity
  covers the demand; another action when no bin of its partition (on its affinity node,
  if it has one) has capacity covering the demand on a node whose largest GPU >=
  gpu_memory (checked only when the inventory has GPUs). Offline nodes count.
* Offline nodes. An offline node's bins take no placement and its GPUs no restore.
  A pass first evicts (in service order) every service resident on an offline node with
  none of its actions running; until then its actions wait for it.
* Asleep memory and movability. An eviction frees memory - asleep_memory (the rest stays
  on the device). A restore of an unmovable service (movable False) pins it to the device
  it goes to. While pinned, its restores consider only that device when it is usable (as
  in Restore, below, for the head); a restore there takes memory - asleep_memory. When the
  pinned device is not usable, it restores as a movable one would, taking its whole
  memory, and the device it leaves gets its asleep memory back.
* Offline devices. set_device_online(node, device, False) fences a device's memory off:
  its free memory, and whatever returns to it later (an action ending, an eviction), is
  fenced, not free; it takes no restore nor plan (as an offline node's), and a service
  resident there is evicted by the pass like one on an offline node. Back online, the
  fenced memory is free again. Either way a pass follows.
* Host memory of offloaded services. A node has offload_memory (-1: not limited); an
  eviction holds the victim's host_memory on its node until its next restore. Discards
  (EVICT with reason DISCARD: the state given up, all of the service's memory free, an
  unmovable one no longer pinned, nothing held) are: evictions from an offline node or
  device; a plan's victim whose host memory would not fit beside the plan's earlier
  victims' (less what the service being restored gives back there); a service moving off
  a device too small for an action when its state would not fit. When a plan's victims
  still leave it short, its unmovable victims (plan order) are discarded instead of
  offloaded until it is not, then idle unmovable services asleep on the device (service
  order) are discarded too, freeing their asleep memory (and host memory). A restore of an unmovable
  service away from its pinned device discards its process there first (an EVICT of a
  service not resident, reason DISCARD), after the restore's victims.
* Replicas. A service whose replica_of is another's is a copy of that one (its group's
  first copy); an action with any_replica names a group's first copy and is routed at
  submit, before its class and feasibility, to the copy with the least wait: (live
  actions of the copy, the batch's earlier ones included, // max_batch) x (their summed
  est_ns) // (their number) (0 with none), plus for a surplus copy until (0 resident, max(ready_ns - now,
  0) restoring, restore_ns offloaded); then the fewest live actions; then the lower index.
  An offloaded surplus copy is a candidate only while no other service's minimum copy (not
  surplus) is offloaded with waiting actions, and some online device holding no other
  copy of its group has dev_free plus (memory - asleep) of each quiet service there (nothing
  running or waiting, ready_ns <= the previous pass, and mean_gap_ns < 0 or (now -
  last_request_ns) // 4 > mean_gap_ns) >= its memory. Every pass, after the
  service tails' order and before anything else, each group with more than one copy (in
  first-copy order; which copies are candidates is settled at the group's start) routes
  its any_replica waiting actions again, in policy order, by the
  same wait, live counting each copy's running actions and the waiting ones before it (an
  action that named its copy stays and counts there, as does one whose class at the chosen
  copy is infeasible). A
  surplus copy is restored on a device where another copy of its group is resident only
  when no online device of its range without one could serve the action it is for.
  The start names the copy.
* Runtime reports. service_restored(s, node, device, now): if s is restoring on that
  device with ready > now, it is ready now, and the device's ops_end becomes now when it
  was that ready; then a pass. set_service_times(s, restore, offload) replaces its
  restore_ns and offload_ns (no pass).
* Restore order (restore "queues_first"). Before the walk, offloaded services with
  waiting actions are restored (Restore, below, for the service's first waiting action
  in order): starving first (that action has waited >= starvation_ns), then minimum
  copies before surplus ones, surplus ones by the live est_ns of their service's copies //
  max_batch, larger first; then most
  waiting actions per (restore_ns + queued est_ns // max_batch), cross-multiplied, then index;
  one whose first waiting action its quota would refuse now is left to the walk; and none
  while the first waiting action (in order) of some class without a service that needs
  gpu_memory has waited >= starvation_ns.
  Restore "on_demand": only the walk restores.
* Drains. A restore (for action a) that finds no device (Restore, below) when a has
  waited >= starvation_ns drains one of the devices it considered: on each, the services
  resident there other than a's, ready by the previous pass and for starvation_ns by now
  (one ready for less keeps its device; the end of that residency is a wakeup of the
  pass), sorted by running actions then index, are taken until the device's free memory plus what their evictions free
  covers what the restore takes there; of the devices where that suffices, the one whose
  taken services run the fewest actions (then the lowest index). For the rest of the pass
  each of those services starts at most its drain budget: set, when its unbroken run of
  passes with a drain begins (it was drained neither earlier in this pass nor in the
  previous one), to its waiting actions then; each start of its actions while it is
  drained spends one. The drains of a pass add up.
* A pass walks the waiting actions once in order. For each (skipping blocked classes):
  1. its quota already blocked in this pass: waits.
  2. a service action: a service resident on an offline node: waits. A ready service
     whose device could never serve the action (smaller than service memory + the
     action's gpu_memory, or on a node with no bin of the action's partition whose
     capacity covers its demand) is moved (evicted, then restored) once nothing of it
     runs and no other waiting action of it could run on that device, if the action's
     quota would admit it now (until then: waits; a refusing quota is blocked for the
     pass); an offloaded service is restored (below; none possible:
     waits) if the action's quota would admit it now (else the quota is blocked for the
     pass and it waits); a service still restoring, or running max_batch actions: waits.
     It may run only on its service's node and device.
  3. its bins: a slot bound to its trajectory that can never hold it (capacity, or its
     node's largest GPU below its gpu_memory) is first unbound when no non-borrowed
     action of its trajectory runs there. Then: its trajectory's slot if bound (fixed);
     else the bins of its partition on its scope node (its service's node, else its
     affinity node), or all of them.
     A scope node with no bin of its partition: no bins at all.
  4. candidates: a fixed slot if it is online and covers the demand (and, for a
     non-service action, its node's largest free GPU memory >= gpu_memory). Under
     trajectory slots a service action first takes its trajectory's held slot among its
     bins if that is online and covers the demand. Otherwise, unless its partition is held
     back: the first `candidates` bins in order that are not bound to a trajectory, on
     online nodes not held back, whose free vector covers the demand and, for a
     non-service action, whose node's largest free GPU memory >= gpu_memory; none, for a
     service action under trajectory slots: the first `candidates` of its other bins bound
     to a trajectory, online, covering the demand (held back or not); none, for an action
     in a trajectory slot whose trajectory holds none (and its partition is not held
     back): the first `candidates` of its bins bound to a trajectory, on online nodes not
     held back where no trajectory holding a slot has a live action, covering the demand,
     whose node's largest free GPU memory >= gpu_memory: "lent", it starts there binding
     nothing (and takes the slot's free elastic units as in its own). A service action
     also needs gpu_memory free on its device.
  5. none, it needs GPU memory, it has bins and its partition is not held back: evict
     services for it by the greedy plan (below; for a service action only if some bin of
     its on an online node not held back covers its demand now; for an action in a
     trajectory slot with none, lent slots count as its bins) and try it again from step 1.
     Still none, resize "malleable", it has bins and its partition is not held back: a
     shrink (below) on the first of its bins where one pays; then quota admission (step
     6; refused: it waits, nothing shrunk), the RESIZE decisions, and its start there
     (step 7 without best fit).
     Still none: if it has waited >= starvation_seconds, has no fixed slot and (while a
     node is offline) some bin of its on an online node could hold it by capacity, it is
     starving: with a scope node that node is held back from every later action in the
     pass; without one its partition is, and the pass halts when there is a single
     partition and bins are not trajectory slots. Either way it is blocked. A fixed slot
     is never held back.
  6. quota admission (below); refused: the quota is blocked for the rest of the pass, and
     the action waits.
  7. best fit: the candidate with the least sum over kinds with capacity > 0 of
     `((free - demand) * 1024) // capacity` (the bin's), first on ties; a non-service GPU
     action takes the node's device with the least memory left over (first on ties). The
     grant is the elastic minimum (0 in the record of a non-elastic action), plus the
     slot's free units for an elastic action in a trajectory slot. Otherwise, under resize
     "malleable" with spare other than "none", an elastic action whose minimum is not a
     whole unit (a multiple of 1000) is topped up: it takes step = grow step (below) once
     if the bin's free room holds it and the gain rule (below) passes it, with w = 1 and
     `others` the actions running on the bin.
  Every class blocked for resources (and a halt) makes its scope node (or, without one,
  its partition) "contended", and keeps its demand there: per kind, the most any such class
  asks for (a halt: all of every kind); one that waits for its quota or its service does
  not.
* Spare units (spare "uncontended": never into the room a waiting action asks for: a step
  must leave free, of its kind, what the bin's contended node and partition keep;
  "every_bin": on every bin; "none": never). After the walk, in each bin,
  elastic actions started there in this pass get one more step at a time (grow step: to
  the next whole unit, min(1000 - grant % 1000, max - grant)): each round to the one with
  the largest cut (first in start order on ties), among those where the bin's free room
  allows it and the gain rule passes it (w = 1; `others`: the actions running on the bin
  but itself); until nobody qualifies.
  The gain rule for a step of w's work left: t0 = seconds(g), t1 = seconds(g + step),
  cut = w * (t0 - t1); none unless w * t0 > 0 and cut > 0. gain "relative": cut >=
  min_relative_gain * (w * t0). gain "wait": with cap and free the bin's units of the
  elastic kind (before the step), cut > others * ((cap - free) / cap) * added / cap, where
  added = w * ((g + step) * t1 - g * t0) (floats, in that order).
* Resize "malleable". A running action keeps `work_left` (1.0 at its start) and `since`
  (its start, or its last grant change). Work left now, `w`: work_left if since == now;
  else 0.0 unless t = seconds(a, grant) > 0; else max(0, work_left - float(now - since)
  / 1e9 / t). Estimated finish (seconds): since / 1e9 + work_left * t if t > 0 and
  work_left > 0, else since / 1e9. A grant change at now
  sets work_left = w (at the old grant) and since = now, and gives a RESIZE decision
  (action, node, elastic kind, the new grant, time now). An action is resized at most
  once per pass, never in the pass that started it.
  Shrink, for a head with no candidates: its bins in order (a fixed slot: online only;
  else not bound, online, node not held back), and for a non-service action on a node
  whose largest free GPU memory >= gpu_memory (a service action: gpu_memory free on its
  device, or no shrink at all), where the units above their minimums of the elastic
  actions running there ("back", per kind) are not all 0 and free + back covers the
  demand on every kind. On such a bin: short[k] = max(0, demand - free); donors are the
  running elastic actions there of a kind k with short[k] > 0, above their minimum, not
  started or resized in this pass, each with its w. Repeatedly take step = shrink step
  (to the previous whole unit: min(grant % 1000 or 1000, grant - minimum)) from the donor
  with the least loss = w * (seconds(g - step) - seconds(g)) (g: its planned grant; NaN losses skipped; ties: lower id), reducing
  short of its kind (not below 0), until nothing is short (no donor left: no shrink on
  this bin). It pays when the summed loss < gain = max(0, the earliest estimated finish
  of the actions running on the bin - now / 1e9). The first bin where it pays is used; the shrunk actions'
  RESIZE decisions come in id order before the head's START.
  Grow, in the spare units step: the candidates of a bin are also, after its starts,
  the running actions (by id) on bins a complete or cancel freed room on in this event
  (online nodes only; "uncontended" as for starts), elastic, below their max, not
  started or resized in this pass, each with its w (1.0 for a start): the gain of a
  unit is cut = w * (t(g) - t(g + step)), judged by the gain rule with this w. After
  each bin, each running action that grew gets a RESIZE decision.
* Restore. Candidate devices (home only, under "home"): online, memory >= service +
  gpu_memory, on a node with a bin of the action's partition whose capacity covers the
  demand. A device's restores and offloads run one after another: each device keeps when
  its last one ends (ops_end); a restore begins at max(now, ops_end), an eviction adds the
  victim's offload_ns to max(now, ops_end). Prefer a device with room now, minimising (no
  unbound bin of the node in the partition has free room for the demand now, services
  resident on it with running or waiting actions, when the restore would begin, memory
  left over), first device on ties.
  Otherwise evict on one device: eligible victims are other services resident there with
  nothing running and ready since before the last pass (so never one still restoring,
  nor one whose actions have not yet had a pass to start), ranked idle (nothing waiting)
  first; idle ones surplus replicas first, then by popularity: never asked for first,
  then restore_ns over the expected gap until its next request, max(mean gap, now - last request, 1), ascending
  (cross-multiplied integers; at each accepted submit of one of its actions a service's
  mean gap becomes the gap since its last request, then (7 x mean + gap) // 8); then by
  queued est_ns per restore_ns (max 1) ascending (cross-multiplied integers), then index;
  take victims in rank order until the room suffices (still short: the victims that keep
  asleep memory are discarded instead, in victim order, until it suffices); a plan that
  falls short while a service there with nothing running became ready since the last
  pass (prev_pass < ready <= now) sets the pass's wakeup to now + 1 ns (when anything
  waits); choose the
  device minimising (node lacks room now, victims with waiting actions, their queued ns,
  when the restore would begin after the victims' offloads, likely restores, victim count,
  device), where likely restores is the float sum, in victim order, of restore_ns /
  expected gap over the idle victims asked for before. Evict decisions (time = now) precede
  the restore decision (time = ready = max(now, ops_end after the evictions) +
  restore_ns), and ops_end becomes ready.
* GPU room for an action. A service action short of gpu_memory on its service's device
  evicts there by the same greedy plan (its own service kept), if some bin of its on an
  online node not held back covers its demand now. Any other GPU action
  evicts on the device with the cheapest plan (victims with waiting actions, queued ns,
  likely restores, count, device) among devices with memory >= gpu_memory on the nodes of its bins (not
  bound to another trajectory unless lent to it, online, not held back; its own fixed slot
  is never held back, as in step 4) whose free vector covers its demand now; only plans
  that evict someone.
* Quotas (exact integers). GCRA: interval = max(1, to_ns(1 / rate)), tolerance = (burst -
  1) * interval; refused while now < tat - tolerance (until tat - tolerance); a start sets
  tat = max(tat, now) + interval. Concurrency: refused while max_concurrency actions of
  the quota run (until: never). Backoff: refused while now < paused_until (until
  paused_until); back_off_quota(q, until) sets paused_until = max(paused_until,
  to_ns(until)), no pass. Tokens: a bucket of tokens_per_minute * 60e9 units
  refilled by tokens_per_minute per ns elapsed (capped); a request needs tokens * 60e9;
  refused until now + ceil(shortfall / tokens_per_minute). Checked in that order.
* next_wakeup: after each pass, the earliest ready time of a restoring service, the
  "until" time of a quota refused in the pass, or the end of a residency that kept a
  service from a drain in the pass; None when there is none.
* Limit (any resize rule). limit(ids, limits): each running elastic action's max becomes
  its limit (milli, within [minimum, max as submitted]); under "malleable" its bin counts
  as freed in this event (its running actions are grow candidates); a grant above the
  limit drops to it (under "malleable" work_left = w and since = now), with a RESIZE
  decision, in batch order, before the pass's decisions; such an action counts as resized
  in the pass. Validation: now, limits' length, each limit a milli value, time order;
  then per id in order: live, started, elastic, limit in range; then repeats.
* Validation raises tangram._errors types and applies nothing of a refused batch.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Sequence

import numpy as np

from .. import _core
from .._errors import DuplicateIdError, InvalidStateError, UnknownActionError, UnknownNameError, ValidationError
from .._records import (
    ACTION_HEADER_SIZE, DECISION_DTYPE, DISCARD, EVICT, MODEL_AMDAHL, MODEL_CALLBACK, MODEL_CONSTANT, MODEL_TABLE, REJECT,
    RESIZE, RESTORE, START,
)

MAX_MILLI = 10**15  # 1e12 base units
_NO_SPARE = 2**63 - 1  # a need no bin's free room covers: no spare units there
MAX_SECONDS = 1e9
ELASTIC_STEP = 1000
NS_PER_MINUTE = 60_000_000_000
# order "progress": the key one more started action of its trajectory is worth to a request
# under a quota (100 s), and the most started actions counted (csrc/tangram/policy.h).
PROGRESS_CREDIT_NS = 100_000_000_000
PROGRESS_CAP = 1 << 20


def _grow_step(a: "_Action", grant: int) -> int:
    """Elastic grants move in whole base units: up to the next whole unit (a fractional
    minimum is topped up first), never past the maximum."""
    return min(ELASTIC_STEP - grant % ELASTIC_STEP, a.elastic_max - grant)


def _shrink_step(a: "_Action", grant: int) -> int:
    """Down to the previous whole unit, never below the minimum."""
    return min(grant % ELASTIC_STEP or ELASTIC_STEP, grant - a.minimum)


STARTED, BLOCKED, WAITS, HALT = "started", "blocked", "waits", "halt"  # WAITS: for a quota or a service


@dataclass(frozen=True)
class PolicyRules:
    """One policy as a row of independent rules (the module docstring says what each does)."""

    order: str  # "arrival" | "estimate" | "progress"
    bins: str  # "node" | "trajectory_slots" | "task_pools"
    spare: str  # "none" | "uncontended" | "every_bin"
    restore: str  # "on_demand" | "queues_first"
    service_devices: str  # "any" | "home"
    resize: str  # "fixed" | "malleable"
    gain: str  # "relative" | "wait" (needs resize "malleable")

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "order": ("arrival", "estimate", "progress"),
        "bins": ("node", "trajectory_slots", "task_pools"),
        "spare": ("none", "uncontended", "every_bin"),
        "restore": ("on_demand", "queues_first"),
        "service_devices": ("any", "home"),
        "resize": ("fixed", "malleable"),
        "gain": ("relative", "wait"),
    }

    def __post_init__(self) -> None:
        for name, allowed in self.CHOICES.items():
            if getattr(self, name) not in allowed:
                raise UnknownNameError(f"rules.{name}", f"{getattr(self, name)!r} is not one of {', '.join(allowed)}")


# The built-in policies are the core's rows (csrc/tangram/policy.cc, exported as
# _core.POLICY_RULES): the reference implements every rule on its own, but there is one
# list of policies. tests/cpp/test_policy_rows.cc pins each row.
POLICY_RULES: dict[str, PolicyRules] = {name: PolicyRules(**rules) for name, rules in _core.POLICY_RULES.items()}


def to_milli(x: float) -> int:
    return math.floor(x * 1000.0 + 0.5)


def trajectory_slots(cpu_milli: int, slot_cpu: float) -> int:
    """How many trajectory slots of `slot_cpu` cores a node of `cpu_milli` milli-cores holds:
    the most that fit, the slot taken at a billionth of a core with the benefit of its
    rounding there (so cpu / n gives n slots), in integers."""
    slot_nano = math.floor(slot_cpu * 1e9 + 0.5)
    return (2 * cpu_milli * 1_000_000) // (2 * slot_nano - 1)


def to_ns(seconds: float) -> int:
    return math.floor(seconds * 1e9 + 0.5)


def _covers(have: Sequence[int], need: Sequence[int]) -> bool:
    return all(h >= n for h, n in zip(have, need))


def _units(milli: int) -> str:
    """A milli-unit quantity in base units as the core prints a double (C++ `<<`: %g)."""
    return f"{milli / 1000.0:g}"


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
        self.paused_until = 0  # back_off(): nothing admitted before this
        self.until: int | None = None  # when the last refusal lifts; None: never by time

    def refill(self, now: int) -> None:
        if now > self.refilled_at:
            self.level = min(self.capacity, self.level + (now - self.refilled_at) * self.tpm)
            self.refilled_at = now

    def admits(self, now: int, tokens: int, running: int) -> bool:
        self.until = None
        if self.max_concurrency > 0 and running >= self.max_concurrency:
            return False
        if now < self.paused_until:
            self.until = self.paused_until
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
    offload_ns: int = 0
    asleep: int = 0  # milli-MiB kept on its device while offloaded (unmovable only)
    movable: bool = True
    home: int = -1  # its only device under service_devices "home"
    pinned: int = -1  # an unmovable one: the device its process runs on
    host: int = 0  # milli-MiB of host memory its offloaded state takes
    replica_of: int = -1  # the first copy of its replicated service (-1: none, or the first itself)
    surplus: bool = False  # a copy beyond the minimum: evicted first when idle
    host_node: int = -1  # offloaded: the node whose offload memory holds it
    device: int = -1  # global device index while resident or restoring
    ready_ns: int = 0
    last_request_ns: int = -1  # its latest action's submit (-1: never asked for)
    mean_gap_ns: int = -1  # between its actions' submits: (7 x before + gap) // 8 (-1: fewer than two)
    tail: bool = False  # order "estimate": its arrivals have stopped and its queue is re-keyed for the drain


@dataclass
class _Bin:
    node: int
    partition: int
    capacity: list
    free: list = field(default_factory=list)
    bound_to: int | None = None  # the trajectory whose slot it is


@dataclass
class _Action:
    id: int
    trajectory: int
    task: int
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
    any_replica: bool = False  # service names a replicated service's first copy; any copy will do
    partition: int = 0
    in_slot: bool = False  # runs in its trajectory's slot
    borrowed: bool = False  # started in a held slot lent to it (its trajectory held none)
    submit_ns: int = 0
    est_ns: int = 0
    order: tuple = ()
    running: bool = False
    bin: int = -1
    device: int = -1  # global device index
    grant: int = 0
    submitted_max: int = 0  # elastic_max as submitted (limit() lowers elastic_max)
    work_left: float = 1.0  # resize "malleable": the share of its work left at `since`
    since: int = 0  # its start, or its last grant change

    @property
    def cls(self) -> tuple:
        return (self.demand, self.gpu_memory, self.partition, self.affinity, self.service, self.quota, self.tokens,
                self.trajectory if self.in_slot else 0, self.in_slot)

    @property
    def minimum(self) -> int:
        return 1000 if self.elastic_kind < 0 else self.demand[self.elastic_kind]


class _Pass:
    """Scratch state of one scheduling pass."""

    def __init__(self) -> None:
        self.blocked_classes: set = set()
        self.blocked_quotas: set = set()
        self.held_nodes: set = set()  # held back by a starving action with a scope node
        self.held_partitions: set = set()  # held back by a starving action without one
        # contended node / partition -> the most of each kind a class waiting there asks for
        self.contended_nodes: dict[int, list[int]] = {}
        self.contended_partitions: dict[int, list[int]] = {}
        self.started: list = []  # (action, index of its decision)
        self.resized: set = set()  # ids of running actions whose grant changed in this pass

    @staticmethod
    def contend(where: dict[int, list[int]], key: int, demand: Sequence[int]) -> None:
        """A class waiting for room at `key` (a node, or a partition) keeps its demand, per
        kind, back from spare units there."""
        need = where.setdefault(key, [0] * len(demand))
        for k, x in enumerate(demand):
            need[k] = max(need[k], x)


def _first_repeat(ids: list[int]) -> int | None:
    """The first position whose id already appeared earlier in the batch, or None."""
    seen: set[int] = set()
    for i, x in enumerate(ids):
        if x in seen:
            return i
        seen.add(x)
    return None


def _policy_rules(policy: str, rules: PolicyRules | Sequence[tuple[str, str]] | None) -> PolicyRules:
    """The policy's row: `rules` as given ((rule, value) pairs, as the core takes them), or
    the named policy's."""
    if rules is not None and not isinstance(rules, PolicyRules):  # (rule, value) pairs, as the core takes them
        rules = PolicyRules(**dict(rules))
    if rules is None:
        if policy not in POLICY_RULES:
            raise UnknownNameError("policy", f"unknown policy {policy!r} ({', '.join(POLICY_RULES)})")
        rules = POLICY_RULES[policy]
    if rules.gain == "wait" and rules.resize != "malleable":
        raise ValidationError(f"policy({policy}).rules.gain", "'wait' needs resize 'malleable' (it counts the actions running on a bin)")
    return rules


class ReferenceScheduler:
    """The scheduling rules of tangram._core.Scheduler, naively (see the module docstring)."""

    def __init__(self, *, kinds, node_names, capacity, gpus, quotas, services, offload_memory, policy, aging,
                 candidates, min_relative_gain, starvation_seconds, trajectory_slot_cpu=0, pools=(),
                 rules: PolicyRules | Sequence[tuple[str, str]] | None = None) -> None:
        self.rules = rules = _policy_rules(policy, rules)
        capacity = np.asarray(capacity, dtype=np.int64)
        self._add_inventory(kinds, node_names, capacity, gpus, offload_memory)
        self._add_quotas(quotas)
        self._add_services(services)
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
        self.last_submit_ns = -1  # the latest accepted action's submit (-1: none yet)
        self.mean_gap_ns = -1  # between accepted actions' submits: (7 x before + gap) // 8 (-1: fewer than two)
        self.progress: dict[int, int] = {}  # order "progress": trajectory -> actions started
        self.starvation_ns = to_ns(starvation_seconds)
        self._add_bins(pf, capacity, trajectory_slot_cpu, pools)
        self.slot_of: dict[int, int] = {}  # trajectory -> the bin it holds
        self.tables: list[list[tuple[float, float]]] = []
        self.actions: dict[int, _Action] = {}  # live actions, by id
        self.seq = 0
        self.now_ns = 0
        self.prev_pass_ns = -1  # when the last pass ran: a service ready since then is not evictable yet
        self.spared_fresh = False  # this pass: a plan fell short sparing such a service
        self.draining: set[int] = set()  # services drained for a starving one (_drain), this pass
        self.drained_before: set[int] = set()  # ... and the pass before
        self.drain_starts: dict[int, int] = {}  # service -> starts left to it while drained
        self.wakeup_ns: int | None = None
        self.messages: list[str] = []
        self.freed_bins: set[int] = set()  # resize "malleable": bins a complete or cancel freed room on

    def _add_inventory(self, kinds, node_names, capacity, gpus, offload_memory) -> None:
        """The nodes with their capacities and host memory for offloads, and the GPUs."""
        N, K = len(node_names), len(kinds)
        if capacity.ndim != 2 or capacity.shape != (N, K):
            raise ValidationError("inventory.capacity", "must be a nodes x kinds array")
        if len(gpus) != N:
            raise ValidationError("inventory.gpus", "needs one list per node")
        if K == 0:
            raise ValidationError("inventory.kinds", "at least one resource kind is needed")
        if any(not k for k in kinds) or len(set(kinds)) != K:
            raise ValidationError("inventory.kinds", "kind names must be non-empty and unique")
        if N == 0:
            raise ValidationError("inventory.nodes", "at least one node is needed")
        self.kinds, self.K = list(kinds), K
        self.node_names: list[str] = []
        self.online: list[bool] = []
        self.offload_cap: list[int] = []  # per node: host memory for offloaded services (-1: not limited)
        self.offload_used: list[int] = []
        if offload_memory and len(offload_memory) != N:
            raise ValidationError("inventory.offload_memory", "needs one entry per node")
        for n in range(N):
            self._check_node(f"inventory.nodes[{n}]", [int(v) for v in capacity[n]], gpus[n],
                             int(offload_memory[n]) if offload_memory else -1)
            self._append_node(node_names[n], int(offload_memory[n]) if offload_memory else -1)
        # GPUs, numbered globally node by node.
        self.dev_node: list[int] = []
        self.dev_local: list[int] = []
        self.dev_total: list[int] = []
        for n, mems in enumerate(gpus):
            for g, m in enumerate(mems):
                self.dev_node.append(n)
                self.dev_local.append(g)
                self.dev_total.append(int(m))
        self.dev_free = list(self.dev_total)
        self.dev_ops_end = [0] * len(self.dev_total)  # per device: when its last restore or offload ends
        self.dev_offline = [False] * len(self.dev_total)  # out of placement: its memory fenced off
        self.dev_fenced = [0] * len(self.dev_total)

    def _add_quotas(self, quotas) -> None:
        self.quotas = []
        for q, spec in enumerate(quotas):
            self.quotas.append(_Quota(spec, f"inventory.quotas[{q}]"))
            if any(o.name == spec[0] for o in self.quotas[:-1]):
                raise ValidationError(f"inventory.quotas[{q}].name", f"duplicate quota {spec[0]!r}")

    def _add_services(self, services) -> None:
        self.services = []
        for s, (name, memory, restore_seconds, max_batch, offload_seconds, asleep, movable, host, replica_of,
                surplus) in enumerate(services):
            self._check_service(s, name, memory, restore_seconds, max_batch, offload_seconds, asleep, movable, host,
                                replica_of, surplus)
            self.services.append(_Service(name, int(memory), to_ns(restore_seconds), int(max_batch), to_ns(offload_seconds),
                                          int(asleep), bool(movable), host=int(host), replica_of=int(replica_of),
                                          surplus=bool(surplus)))

    def _check_service(self, s, name, memory, restore_seconds, max_batch, offload_seconds, asleep, movable, host,
                       replica_of, surplus) -> None:
        f = f"inventory.services[{s}]"
        if any(o.name == name for o in self.services):
            raise ValidationError(f"{f}.name", f"duplicate service {name!r}")
        if not 0 <= memory <= MAX_MILLI:
            raise ValidationError(f"{f}.memory", "must be in [0, 1e12] MiB")
        if not math.isfinite(restore_seconds) or not 0 <= restore_seconds <= MAX_SECONDS:
            raise ValidationError(f"{f}.restore_seconds", "must be a finite number in [0, 1e9]")
        if not math.isfinite(offload_seconds) or not 0 <= offload_seconds <= MAX_SECONDS:
            raise ValidationError(f"{f}.offload_seconds", "must be a finite number in [0, 1e9]")
        if max_batch < 1:
            raise ValidationError(f"{f}.max_batch", "must be at least 1")
        if not 0 <= host <= MAX_MILLI:
            raise ValidationError(f"{f}.host_memory", "must be in [0, 1e12] MiB")
        if not 0 <= asleep <= memory:
            raise ValidationError(f"{f}.asleep_memory", "must be in [0, memory]")
        if asleep > 0 and movable:
            raise ValidationError(f"{f}.asleep_memory", "memory kept while offloaded stays on its device: the "
                                                       "service must not be movable")
        if not self.dev_node:
            raise ValidationError(f, "a GPU service needs at least one GPU in the inventory")
        if replica_of != -1:
            first = self.services[replica_of] if 0 <= replica_of < s else None
            if first is None or first.replica_of != -1:
                raise ValidationError(f"{f}.replica_of",
                                      "must be the index of an earlier service that is not itself a replica")
            if (memory, max_batch, asleep, movable) != (first.memory, first.max_batch, first.asleep, first.movable):
                raise ValidationError(f"{f}.replica_of", "a replica must have its first copy's memory, max_batch, "
                                                         "asleep_memory and movable")
        elif surplus:
            raise ValidationError(f"{f}.surplus", "only a replica (replica_of set) can be surplus")

    def _add_bins(self, pf: str, capacity, trajectory_slot_cpu, pools) -> None:
        """The bins' options, then every node's bins, partition by partition."""
        rules, N = self.rules, len(self.node_names)
        self.slot_cpu_cores = float(trajectory_slot_cpu)
        self.pools = [(int(task), float(weight)) for task, weight in pools]
        self.pool_partition: dict[int, int] = {}
        partitions = 1
        if rules.bins == "trajectory_slots":
            if "cpu" not in self.kinds:
                raise UnknownNameError(pf, "trajectory slots need a 'cpu' kind")
            if not math.isfinite(self.slot_cpu_cores) or not 0 < self.slot_cpu_cores <= 1e12:
                raise ValidationError(f"{pf}.trajectory_slot_cpu", "must be a finite number in (0, 1e12]")
            if to_milli(self.slot_cpu_cores) < 1:
                raise ValidationError(f"{pf}.trajectory_slot_cpu", "must be at least 0.0005 cores (one milli-core)")
        elif rules.bins == "task_pools":
            if not self.pools:
                raise ValidationError(f"{pf}.pools", "task pools need at least one pool")
            for p, (task, weight) in enumerate(self.pools):
                if not math.isfinite(weight) or not 0 < weight <= 1e6:
                    raise ValidationError(f"{pf}.pools[{p}].weight", "must be a finite number in (0, 1e6]")
                if task in self.pool_partition:
                    raise ValidationError(f"{pf}.pools[{p}].task", f"duplicate task pool {task}")
                self.pool_partition[task] = p
            partitions = len(self.pools)
        self.n_partitions = partitions
        self.bins: list[_Bin] = []
        self.partition_bins: list[list[int]] = [[] for _ in range(partitions)]  # in order, node by node
        splits = [self._node_bins([int(v) for v in capacity[n]]) for n in range(N)]
        for p in range(partitions):
            for n in range(N):
                for cap in splits[n][p]:
                    self._append_bin(n, p, cap)
        if rules.bins == "trajectory_slots" and not self.bins:
            raise ValidationError(f"{pf}.trajectory_slot_cpu", "larger than every node's cpu: no slot fits")
        if rules.service_devices == "home":  # a dedicated deployment: the minimum copies, homed
            deployed = [svc for svc in self.services if not svc.surplus]
            for i, svc in enumerate(deployed if self.dev_node else []):
                svc.home = i % len(self.dev_node)

    # ------------------------------------------------------------ inventory
    @property
    def N(self) -> int:
        return len(self.node_names)

    @property
    def has_gpus(self) -> bool:
        return bool(self.dev_node)

    def _check_node(self, f: str, capacity: list[int], gpus: Sequence[int], offload: int = -1) -> None:
        """Validates one node's capacity, GPUs and offload memory (as the constructor and
        add_node do)."""
        if len(capacity) != self.K:
            raise ValidationError(f"{f}.capacity", f"has {len(capacity)} entries for {self.K} kinds")
        for k, v in enumerate(capacity):
            if not 0 <= v <= MAX_MILLI:
                raise ValidationError(f"{f}.capacity.{self.kinds[k]}", "must be in [0, 1e12] units")
        for g, m in enumerate(gpus):
            if not 0 < m <= MAX_MILLI:
                raise ValidationError(f"{f}.gpus[{g}].memory", "must be in (0, 1e12] MiB")
        if not -1 <= offload <= MAX_MILLI:
            raise ValidationError(f"{f}.offload_memory", "must be in [0, 1e12] MiB, or unlimited")

    def _node_bins(self, capacity: list[int]) -> list[list[list[int]]]:
        """Per partition, the capacities of one node's bins under the rules."""
        if self.rules.bins == "node":
            return [[list(capacity)]]
        if self.rules.bins == "trajectory_slots":
            cpu = self.kinds.index("cpu")
            slots = trajectory_slots(capacity[cpu], self.slot_cpu_cores)
            slot = to_milli(self.slot_cpu_cores)
            cap = [slot if k == cpu else (capacity[k] // slots if slots > 0 else 0) for k in range(self.K)]
            return [[list(cap) for _ in range(slots)]]
        # task pools: the floor of each share in parts per million, then what is left over
        # spread evenly, the first pools taking one more, so the shares sum to the node.
        total = 0.0
        for _, weight in self.pools:
            total += weight
        P = len(self.pools)
        shares = [[0] * self.K for _ in range(P)]
        for k in range(self.K):
            given = 0
            for p, (_, weight) in enumerate(self.pools):
                ppm = math.floor(weight / total * 1e6)
                shares[p][k] = (capacity[k] * ppm) // 1_000_000
                given += shares[p][k]
            left = capacity[k] - given
            for p in range(P):
                shares[p][k] += left // P + (1 if p < left % P else 0)
        return [[shares[p]] for p in range(P)]

    def _append_bin(self, node: int, partition: int, capacity: list[int]) -> None:
        """A bin at the end of its partition, all of its capacity free."""
        self.partition_bins[partition].append(len(self.bins))
        self.bins.append(_Bin(node, partition, list(capacity), list(capacity)))

    def _leaves(self, partition: int) -> list[int]:
        """The partition's bins in order (node by node)."""
        return self.partition_bins[partition]

    def _node_leaves(self, partition: int, node: int) -> list[int]:
        return [b for b in self._leaves(partition) if self.bins[b].node == node]

    def _bound(self, b: int) -> bool:
        return self.bins[b].bound_to is not None

    def _lends(self, n: int) -> bool:
        """Whether node n lends its held slots: no trajectory holding a slot there has a live
        action."""
        live = {a.trajectory for a in self.actions.values()}
        return not any(self.bins[b].node == n and t in live for t, b in self.slot_of.items())

    def _lent_to(self, a: _Action, b: int) -> bool:
        """Whether held slot b is lent to a: a runs in a trajectory slot, its trajectory holds
        none, and b's node lends."""
        return a.in_slot and a.trajectory not in self.slot_of and self._lends(self.bins[b].node)

    def _slot_never_holds(self, a: _Action, b: int) -> bool:
        """Whether slot b can never hold a: by capacity, or GPU memory no device of its node has."""
        return (not _covers(self.bins[b].capacity, a.demand)
                or (a.gpu_memory > 0 and bool(self.dev_total)
                    and self._node_max_gpu(self.bins[b].node, self.dev_total) < a.gpu_memory))

    def _devices_of(self, n: int) -> list[int]:
        return [d for d in range(len(self.dev_node)) if self.dev_node[d] == n]

    def _node_max_gpu(self, n: int, table: list[int]) -> int:
        return max((table[d] for d in self._devices_of(n)), default=0)

    def _service_devices(self, s: int) -> list[int]:
        home = self.services[s].home
        return [home] if home >= 0 else list(range(len(self.dev_node)))

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
            if a.any_replica:
                a.service = self._route_replica(a, t)
            a.partition = self.pool_partition[a.task] if self.rules.bins == "task_pools" else 0
            a.in_slot = self.rules.bins == "trajectory_slots" and a.service < 0
            why = self._infeasible(a)
            if why:
                out.append(self._decision(REJECT, action=a.id, time=t, reason=len(self.messages)))
                self.messages.append(f"action {a.id} can never run: {why}")
                continue
            a.submit_ns = t
            if self.last_submit_ns >= 0:
                gap = t - self.last_submit_ns
                self.mean_gap_ns = gap if self.mean_gap_ns < 0 else (7 * self.mean_gap_ns + gap) // 8
            self.last_submit_ns = t
            if a.service >= 0:
                svc = self.services[a.service]
                if svc.last_request_ns >= 0:
                    gap = t - svc.last_request_ns
                    svc.mean_gap_ns = gap if svc.mean_gap_ns < 0 else (7 * svc.mean_gap_ns + gap) // 8
                svc.last_request_ns = t
            a.est_ns = to_ns(self._seconds(a, self._order_units(a)))
            key = self._estimate_key(a) if self.rules.order in ("estimate", "progress") else 0
            if self.rules.order == "progress" and a.quota >= 0:
                key -= PROGRESS_CREDIT_NS * self.progress.get(a.trajectory, 0)
            a.order = (-a.priority, key, self.seq)
            self.seq += 1
            a.submitted_max = a.elastic_max
            self.actions[a.id] = a
        return self._pass(out)

    def _estimate_key(self, a: _Action) -> int:
        return (a.est_ns if a.quota == -1 else 0) + (a.submit_ns * self.aging_permille) // 1000

    def _order_service_tails(self) -> None:
        all_stopped = self.mean_gap_ns >= 0 and (self.now_ns - self.last_submit_ns) // 4 > self.mean_gap_ns
        for s, svc in enumerate(self.services):
            waiting = [a for a in self.actions.values() if not a.running and a.service == s]
            tail = (bool(waiting) and all_stopped
                    and svc.mean_gap_ns >= 0 and (self.now_ns - svc.last_request_ns) // 4 > svc.mean_gap_ns)
            if tail == svc.tail:
                continue
            svc.tail = tail
            queue = [a for a in waiting if a.quota == -1]
            for a in queue:
                a.order = (a.order[0], self._estimate_key(a), a.order[2])
            queue.sort(key=lambda a: a.order)
            before = [0]  # the work ahead of each position, shortest first
            for a in queue:
                before.append(before[-1] + a.est_ns)
            keys = [a.order[1] for a in queue]
            for j, a in enumerate(queue):
                latest = before[-1] - svc.max_batch * a.est_ns
                if tail and before[j] > latest:
                    i = next(i for i in range(j + 1) if before[i] >= latest)
                    a.order = (a.order[0], keys[i], a.order[2])

    def _group(self, first: int) -> list[int]:
        """The copies of the replica group whose first copy is `first`, in index order."""
        home = self.rules.service_devices == "home"  # surplus copies are never deployed there
        return [first] + [o for o, svc in enumerate(self.services)
                          if svc.replica_of == first and not (home and svc.surplus)]

    def _copy_reachable(self, copy: int) -> bool:
        """A minimum copy always; a surplus one resident or restoring, or with room."""
        svc = self.services[copy]
        return not svc.surplus or svc.device >= 0 or self._surplus_has_room(copy)

    def _soonest_copy(self, group: list[int], live: list[int], work: list[int], t: int,
                      reach: list[bool] | None = None) -> int:
        """Index in `group` of the copy where an action would start soonest: the least wait,
        whole batches of the copy's live actions times their mean est_ns (work: their sum),
        plus for a surplus copy how long until it can start anything (0 resident, the rest of
        its restore while restoring, its restore time otherwise); then the fewest live
        actions; then the lower copy."""
        best, best_key = 0, None
        for i, copy in enumerate(group):
            svc = self.services[copy]
            if not (reach[i] if reach is not None else self._copy_reachable(copy)):
                continue
            until = 0 if not svc.surplus else svc.restore_ns if svc.device < 0 else max(svc.ready_ns - t, 0)
            ahead = (live[i] // svc.max_batch) * work[i] // live[i] if live[i] else 0
            key = (until + ahead, live[i])
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _sibling_on(self, copy: int, d: int) -> bool:
        first = self.services[copy].replica_of if self.services[copy].replica_of >= 0 else copy
        return any(o != copy and self.services[o].device == d for o in self._group(first))

    def _surplus_has_room(self, copy: int) -> bool:
        """No other service's minimum copy waits offloaded, and an online device holding no
        other copy of its group has its memory free, or free once its quiet services go:
        nothing running or waiting, ready before the last pass, and fewer than two requests
        or none for 4 of their mean gaps."""
        busy = {a.service for a in self.actions.values()}
        first = self.services[copy].replica_of
        if any(not svc.surplus and svc.device < 0 and o != first and svc.replica_of != first
               and any(not a.running and a.service == o for a in self.actions.values())
               for o, svc in enumerate(self.services)):
            return False  # another service's minimum copy waits offloaded: its restore comes first
        need = self.services[copy].memory
        for d, free in enumerate(self.dev_free):
            if not self._device_online(d) or self._sibling_on(copy, d):
                continue
            idle = sum(o.memory - o.asleep for s, o in enumerate(self.services)
                       if o.device == d and s not in busy and o.ready_ns <= self.prev_pass_ns
                       and (o.mean_gap_ns < 0 or (self.now_ns - o.last_request_ns) // 4 > o.mean_gap_ns))
            if free + idle >= need:
                return True
        return False

    def _route_replica(self, a: _Action, t: int) -> int:
        """The copy of a's replicated service that would start it soonest (_soonest_copy),
        counting each copy's live actions, this batch's earlier ones included."""
        group = self._group(a.service)
        live = [sum(1 for b in self.actions.values() if b.service == copy) for copy in group]
        work = [sum(b.est_ns for b in self.actions.values() if b.service == copy) for copy in group]
        return group[self._soonest_copy(group, live, work, t)]

    def _rebind_replicas(self) -> None:
        """Each replicated service's first waiting actions (two batches of each copy), in
        policy order, go to the copy that would start each soonest, counting running actions
        and those placed before it; further back, only those at an unreachable copy move
        (after the first ones, in order). Then, when some are further back, an offloaded
        surplus copy with nothing queued that a new action would be routed to takes the last
        waiting action that did not name its copy."""
        for first, svc in enumerate(self.services):
            if svc.replica_of >= 0:
                continue
            group = self._group(first)
            waiting = sorted((a for a in self.actions.values() if not a.running and a.service in group),
                             key=lambda a: a.order)
            if len(group) < 2 or not waiting:
                continue
            reach = [self._copy_reachable(copy) for copy in group]  # settled once per group
            window = sum(2 * self.services[copy].max_batch for copy in group)
            whole = len(waiting) <= window
            if not whole:
                waiting = waiting[:window] + [a for a in waiting[window:] if not reach[group.index(a.service)]]
            live = [self._running(service=copy) for copy in group]
            work = [sum(b.est_ns for b in self.actions.values() if b.running and b.service == copy) for copy in group]
            for a in waiting:  # each counts where it ends up
                best = (self._soonest_copy(group, live, work, self.now_ns, reach) if a.any_replica
                        else group.index(a.service))
                if group[best] != a.service:
                    own = a.service
                    a.service = group[best]
                    if self._infeasible(a):
                        a.service = own
                        best = group.index(own)
                live[best] += 1
                work[best] += a.est_ns
            if not whole:
                self._call_in_surplus(group, reach)

    def _call_in_surplus(self, group: list[int], reach: list[bool]) -> None:
        for i, copy in enumerate(group):
            svc = self.services[copy]
            if (not svc.surplus or svc.device >= 0 or not reach[i]
                    or any(not a.running and a.service == copy for a in self.actions.values())):
                continue
            live = [sum(1 for b in self.actions.values() if b.service == c) for c in group]
            work = [sum(b.est_ns for b in self.actions.values() if b.service == c) for c in group]
            if self._soonest_copy(group, live, work, self.now_ns, reach) != i:
                continue
            movable = [a for a in self.actions.values() if not a.running and a.any_replica and a.service in group]
            if movable:
                last = max(movable, key=lambda a: a.order)
                own, last.service = last.service, copy
                if self._infeasible(last):
                    last.service = own

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

    def limit(self, ids: Iterable[int], limits: Iterable[float], now: float) -> np.ndarray:
        t = self._time(now)
        ids, limits = [int(x) for x in ids], [float(v) for v in limits]
        if len(limits) != len(ids):
            raise ValidationError("limits", f"has {len(limits)} entries for {len(ids)} ids")
        milli = [_checked_milli(v, f"limits[{i}]") for i, v in enumerate(limits)]
        self._begin(t)
        for i, (x, m) in enumerate(zip(ids, milli)):
            a = self.actions.get(x)
            if a is None:
                raise UnknownActionError(f"ids[{i}]", f"action {x} is not live (never submitted, or already ended)")
            if not a.running:
                raise InvalidStateError(f"ids[{i}]", f"action {x} has not started")
            if a.elastic_kind < 0:
                raise ValidationError(f"ids[{i}]", f"action {x} is not elastic")
            if not a.minimum <= m <= a.submitted_max:
                raise ValidationError(f"limits[{i}]", f"must be in [{_units(a.minimum)}, {_units(a.submitted_max)}] "
                                      "units: the action's minimum and the maximum it was submitted with")
        repeat = _first_repeat(ids)
        if repeat is not None:
            raise DuplicateIdError(f"ids[{repeat}]", f"action {ids[repeat]} appears twice in the batch")
        self._start_event(t)
        out: list = []
        resized = set()
        malleable = self.rules.resize == "malleable"
        for x, m in zip(ids, milli):
            a = self.actions[x]
            a.elastic_max = m
            if malleable:
                self.freed_bins.add(a.bin)
            if a.grant <= m:
                continue
            work = self._work_now(a) if malleable else 0.0
            self.bins[a.bin].free[a.elastic_kind] += a.grant - m
            a.grant = m
            if malleable:
                a.work_left, a.since = work, t
            resized.add(a.id)
            out.append(self._decision(RESIZE, action=a.id, node=self.bins[a.bin].node, elastic_kind=a.elastic_kind,
                                      grant=a.grant, time=t))
        return self._pass(out, resized)

    def end_trajectories(self, ids: Iterable[int], now: float) -> np.ndarray:
        t = self._start_check(now)
        ids = [int(x) for x in ids]
        for i, traj in enumerate(ids):
            live = sum(1 for a in self.actions.values() if a.trajectory == traj)
            if live:
                raise InvalidStateError(f"trajectories[{i}]", f"trajectory {traj} still has {live} live action(s)")
        self._start_event(t)
        for traj in ids:
            self.progress.pop(traj, None)
            if traj in self.slot_of:  # its slot is free again (or taken over)
                self._free_slot(self.slot_of.pop(traj))
        return self._pass([])

    def _free_slot(self, b: int) -> None:
        """Slot b's holder let it go: it is free, unless an action runs there in it as a lent
        slot; then the lowest id's trajectory among those holding no slot takes it over."""
        heirs = [a for a in self.actions.values() if a.running and a.bin == b and a.in_slot and a.borrowed
                 and a.trajectory not in self.slot_of]
        if not heirs:
            self.bins[b].bound_to = None
            return
        heir = min(heirs, key=lambda a: a.id)
        heir.borrowed = False
        self.slot_of[heir.trajectory] = b
        self.bins[b].bound_to = heir.trajectory

    def tick(self, now: float) -> np.ndarray:
        self._start_event(self._start_check(now))
        return self._pass([])

    def service_restored(self, service: int, node: int, device: int, now: float) -> np.ndarray:
        t = self._start_check(now)
        if not 0 <= service < len(self.services):
            raise UnknownNameError("service", f"no service with index {service}")
        d = self._global_device(node, device)
        self._start_event(t)
        svc = self.services[service]
        if svc.device == d and svc.ready_ns > t:
            if self.dev_ops_end[d] == svc.ready_ns:
                self.dev_ops_end[d] = t
            svc.ready_ns = t
        return self._pass([])

    def back_off_quota(self, quota: int, until: float) -> None:
        if not 0 <= quota < len(self.quotas):
            raise UnknownNameError("quota", f"no quota with index {quota}")
        until = float(until)
        if not math.isfinite(until) or not 0 <= until <= MAX_SECONDS:
            raise ValidationError("until", "must be a finite time in [0, 1e9] seconds")
        q = self.quotas[quota]
        q.paused_until = max(q.paused_until, to_ns(until))

    def set_service_times(self, service: int, restore_seconds: float, offload_seconds: float) -> None:
        if not 0 <= service < len(self.services):
            raise UnknownNameError("service", f"no service with index {service}")
        for name, value in (("restore_seconds", restore_seconds), ("offload_seconds", offload_seconds)):
            if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
                raise ValidationError(name, "must be a finite number in [0, 1e9]")
        self.services[service].restore_ns = to_ns(restore_seconds)
        self.services[service].offload_ns = to_ns(offload_seconds)

    def set_node_online(self, node: int, online: bool, now: float) -> np.ndarray:
        t = self._start_check(now)
        node = int(node)
        if not 0 <= node < self.N:
            raise UnknownNameError("node", f"no node with index {node}")
        self._start_event(t)
        self.online[node] = bool(online)
        return self._pass([])

    def add_node(self, name: str, capacity: Sequence[int], gpus: Sequence[int], now: float,
                 offload_memory: int = -1) -> tuple[int, np.ndarray]:
        """Appends an online node (its bins after every existing bin, its GPUs after every
        existing device); returns its index and the pass's decisions."""
        t = self._start_check(now)
        if not name:
            raise ValidationError("node.name", "a node needs a name")
        if name in self.node_names:
            raise ValidationError("node.name", f"duplicate node {name!r}")
        capacity, gpus = [int(v) for v in capacity], [int(m) for m in gpus]
        self._check_node("node", capacity, gpus, int(offload_memory))
        self._start_event(t)
        n = self._append_node(name, int(offload_memory))
        for p, caps in enumerate(self._node_bins(capacity)):
            for cap in caps:
                self._append_bin(n, p, cap)
        for g, m in enumerate(gpus):
            self.dev_node.append(n)
            self.dev_local.append(g)
            self.dev_total.append(m)
            self.dev_free.append(m)
            self.dev_ops_end.append(0)
            self.dev_offline.append(False)
            self.dev_fenced.append(0)
        return n, self._pass([])

    def _append_node(self, name: str, offload: int = -1) -> int:
        self.node_names.append(name)
        self.online.append(True)
        self.offload_cap.append(offload)
        self.offload_used.append(0)
        return len(self.node_names) - 1

    def _device_online(self, d: int) -> bool:
        return self.online[self.dev_node[d]] and not self.dev_offline[d]

    def _give_back(self, d: int, amount: int) -> None:
        """Memory back to device d: free, or fenced off while the device is offline."""
        if self.dev_offline[d]:
            self.dev_fenced[d] += amount
        else:
            self.dev_free[d] += amount

    def set_device_online(self, node: int, device: int, online: bool, now: float) -> np.ndarray:
        t = self._start_check(now)
        d = self._global_device(node, device)
        self._start_event(t)
        if self.dev_offline[d] == (not online):
            return self._pass([])
        self.dev_offline[d] = not online
        if online:
            self.dev_free[d], self.dev_fenced[d] = self.dev_free[d] + self.dev_fenced[d], 0
        else:
            self.dev_fenced[d], self.dev_free[d] = self.dev_fenced[d] + self.dev_free[d], 0
        return self._pass([])

    def device_online(self, node: int, device: int) -> bool:
        return not self.dev_offline[self._global_device(node, device)]

    def _global_device(self, node: int, device: int) -> int:
        """The global index of GPU `device` of `node` (as the core checks it)."""
        if not 0 <= node < self.N:
            raise UnknownNameError("node", f"no node with index {node}")
        devices = self._devices_of(node)
        if not 0 <= device < len(devices):
            raise UnknownNameError("device", f"node {node} has no GPU {device}")
        return devices[device]

    def _release_offloaded_state(self, svc: _Service) -> None:
        """Its offloaded state leaves host memory (restored, or given up)."""
        if svc.host_node >= 0:
            self.offload_used[svc.host_node] -= svc.host
            svc.host_node = -1

    def _offload_fits(self, node: int, extra: int) -> bool:
        cap = self.offload_cap[node]
        return cap < 0 or self.offload_used[node] + extra <= cap

    def node_online(self, node: int) -> bool:
        if not 0 <= node < self.N:
            raise UnknownNameError("node", f"no node with index {node}")
        return self.online[node]

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
        if self.rules.resize == "malleable":
            self.freed_bins.add(a.bin)
        free = self.bins[a.bin].free
        for k in range(self.K):
            free[k] += a.demand[k]
        if a.elastic_kind >= 0:
            free[a.elastic_kind] += a.grant - a.minimum
        if a.device >= 0 and a.gpu_memory > 0:
            self._give_back(a.device, a.gpu_memory)

    # ------------------------------------------------------------ validation
    def _decode(self, r: np.void, f: str) -> _Action:
        model = int(r["model"])
        if model > MODEL_CALLBACK:
            raise ValidationError(f"{f}.model", f"unknown model kind {model}")
        ek = int(r["elastic_kind"])
        demand = tuple(_checked_milli(float(v), f"{f}.demand.{k}") for v, k in zip(r["demand"], self.kinds))
        a = _Action(
            id=int(r["id"]), trajectory=int(r["trajectory"]), task=int(r["task"]), demand=demand,
            gpu_memory=_checked_milli(float(r["gpu_memory"]), f"{f}.gpu_memory"), elastic_kind=ek,
            elastic_max=_checked_milli(float(r["elastic_max"]), f"{f}.elastic_max") if ek >= 0 else 0,
            model=(model, float(r["seconds"]), float(r["parallel_fraction"]), int(r["table"])),
            affinity=int(r["affinity"]), service=int(r["service"]), quota=int(r["quota"]), tokens=int(r["tokens"]),
            priority=int(r["priority"]), any_replica=int(r["any_replica"]) != 0,
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
            if a.any_replica and self.services[a.service].replica_of != -1:
                bad("service", "with any_replica, must name the first copy of its replicated service")
        elif a.any_replica:
            bad("any_replica", "needs a service")
        if a.quota != -1 and not 0 <= a.quota < len(self.quotas):
            raise UnknownNameError(f"{f}.quota", f"no quota with index {a.quota}")
        if not 0 <= a.tokens <= 10**12:
            bad("tokens", "must be in [0, 1e12]")
        if a.tokens > 0 and a.quota == -1:
            bad("tokens", "tokens need a quota to draw from")
        if self.rules.bins == "task_pools" and a.task not in self.pool_partition:
            raise UnknownNameError(f"{f}.task", f"no task pool {a.task} among the policy's task pools")
        t = self._seconds(a, a.minimum)
        if not math.isfinite(t) or not 0 <= t <= MAX_SECONDS:
            bad("model", "run time at the minimum grant is not a finite number in [0, 1e9] s")

    def _holds(self, b: int, demand: tuple, gpu_memory: int) -> bool:
        """Could bin b ever hold the demand (by capacity; gpu_memory on one of its node's GPUs)?"""
        bin_ = self.bins[b]
        return _covers(bin_.capacity, demand) and self._node_max_gpu(bin_.node, self.dev_total) >= gpu_memory

    def _infeasible(self, a: _Action) -> str:
        """Why no bin, device or quota could ever hold `a`, in the core's words; "" if one could."""
        if a.quota >= 0 and self.quotas[a.quota].tpm and a.tokens > self.quotas[a.quota].tpm:
            return f"needs {a.tokens} tokens, more than quota '{self.quotas[a.quota].name}' grants per minute"
        if a.service >= 0:
            svc = self.services[a.service]
            for d in self._service_devices(a.service):
                if self.dev_total[d] >= svc.memory + a.gpu_memory and any(
                        self._holds(b, a.demand, 0) for b in self._node_leaves(a.partition, self.dev_node[d])):
                    return ""
            return (f"service '{svc.name}' needs {_units(svc.memory + a.gpu_memory)} MiB of GPU memory with the "
                    f"action's demand on the same node, and no {'home device' if svc.home >= 0 else 'device'} has that")
        if a.affinity >= 0:
            scope, where = self._node_leaves(a.partition, a.affinity), "on its affinity node"
            if not scope:
                return "its affinity node has no bin in this policy"
        else:
            scope, where = self._leaves(a.partition), "on any node"
        if any(self._holds(b, a.demand, a.gpu_memory) for b in scope):
            return ""
        # What falls short: each kind against its largest capacity among those bins.
        names = self.kinds + (["gpu_memory"] if self.has_gpus else [])
        need = list(a.demand) + ([a.gpu_memory] if self.has_gpus else [])
        best = [0] * len(names)
        for b in scope:
            have = self.bins[b].capacity + [self._node_max_gpu(self.bins[b].node, self.dev_total)]
            best = [max(x, y) for x, y in zip(best, have)]
        short = [f" {name} needs {_units(n)}, largest is {_units(h)}" for name, n, h in zip(names, need, best) if n > h]
        return f"demand does not fit {where}:" + ";".join(short)

    # ------------------------------------------------------------ the pass
    def _pass(self, out: list, resized: Iterable[int] = ()) -> np.ndarray:
        p = _Pass()
        self.spared_fresh = False
        self.drained_before = self.draining  # the previous pass's (a drain's run goes on)
        self.draining = set()  # services drained for a starving one (_drain): none yet this pass
        self.drain_wakeups: list[int] = []  # ends of residencies that kept a service from a drain
        p.resized.update(resized)  # limited by this event: not resized again in its pass
        if self.rules.order == "estimate" and self.services:
            self._order_service_tails()
        if self.services:
            self._rebind_replicas()
        for s, svc in enumerate(self.services):  # resident on an offline node, idle: offloaded
            if svc.device >= 0 and not self._device_online(svc.device) and self._running(service=s) == 0:
                self._evict(s, out, discard=True)  # its state there is gone
        if self.rules.restore == "queues_first":
            self._restore_queues(out)
        for a in sorted((a for a in self.actions.values() if not a.running), key=lambda a: a.order):
            if a.cls in p.blocked_classes:
                continue
            outcome = self._try(a, p, out)
            if outcome == STARTED:
                continue
            if outcome == HALT:  # every action behind it is held back: no spare units there
                p.contend(p.contended_partitions, a.partition, [_NO_SPARE] * self.K)
                break
            p.blocked_classes.add(a.cls)
            if outcome == WAITS:  # for a quota or a service: no claim on spare units
                continue
            scope = self._scope_node(a)
            if scope < 0:
                p.contend(p.contended_partitions, a.partition, a.demand)
            else:
                p.contend(p.contended_nodes, scope, a.demand)
        if self.rules.spare != "none" and (p.started or self.freed_bins):
            self._grant_spare(p, out)
        self.freed_bins = set()
        times = [s.ready_ns for s in self.services if s.device >= 0 and s.ready_ns > self.now_ns]
        times += self.drain_wakeups
        # A plan fell short sparing a service ready only since the last pass: the next may evict it.
        if self.spared_fresh and any(not a.running for a in self.actions.values()):
            times.append(self.now_ns + 1)
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
        """The one node the action is confined to (its trajectory's slot, its service's, or
        its affinity), or -1."""
        if a.in_slot and a.trajectory in self.slot_of:
            return self.bins[self.slot_of[a.trajectory]].node
        if a.service >= 0:
            d = self.services[a.service].device
            return -1 if d < 0 else self.dev_node[d]
        return a.affinity

    def _eligible(self, a: _Action) -> list[int] | None:
        """The bins of its partition it may use, in order (its service's resident), or None
        when its scope node has no bin of its partition."""
        node = a.affinity if a.service < 0 else self.dev_node[self.services[a.service].device]
        if node < 0:
            return self._leaves(a.partition)
        return self._node_leaves(a.partition, node) or None

    def _running(self, **match) -> int:
        return sum(1 for a in self.actions.values() if a.running and all(getattr(a, k) == v for k, v in match.items()))

    def _try(self, a: _Action, p: _Pass, out: list) -> str:
        if a.quota >= 0 and a.quota in p.blocked_quotas:
            return WAITS
        device = -1
        if a.service >= 0:
            device = self._service_device(a, p, out)
            if device < 0:
                return WAITS
        if a.in_slot and a.trajectory in self.slot_of:
            self._give_up_slot_never_holding(a)
        own_slot = a.in_slot and a.trajectory in self.slot_of
        bins = [self.slot_of[a.trajectory]] if own_slot else self._eligible(a)
        # A trajectory's own slot is nobody else's: no starving action holds it back.
        masked = not own_slot and a.partition in p.held_partitions
        cands, borrowed = self._candidates(a, bins, own_slot, masked, device, p)
        if not cands:
            return self._no_candidate(a, bins, own_slot, masked, device, p, out)
        if not self._admit_quota(a, p):
            return WAITS

        def score(b: int) -> int:
            free, cap = self.bins[b].free, self.bins[b].capacity
            return sum(((free[k] - a.demand[k]) * 1024) // cap[k] for k in range(self.K) if cap[k] > 0)

        return self._start(a, min(cands, key=score), device, p, out, borrowed)  # best fit, first on ties

    def _service_device(self, a: _Action, p: _Pass, out: list) -> int:
        """The device of a's service, ready with room in its batch, restored (or moved) for a
        if it is not resident; -1 when a waits for its service."""
        svc = self.services[a.service]
        if svc.device >= 0 and not self._device_online(svc.device):
            return -1  # evicted once its actions there have ended
        if svc.device >= 0 and svc.ready_ns <= self.now_ns and not self._could_serve(a, svc.device):
            # Moved once its batch is done and no other waiting action of it could run
            # where it is, for an action its quota admits now.
            if self._running(service=a.service) > 0 or any(
                    not b.running and b.service == a.service and b is not a and self._could_serve(b, svc.device)
                    for b in self.actions.values()):
                return -1
            if a.quota >= 0 and not self._quota_would_admit(a, p):
                return -1
            self._evict(a.service, out, discard=not self._offload_fits(self.dev_node[svc.device], svc.host))
        # A restore is made for an action its quota would admit now.
        if svc.device < 0 and a.quota >= 0 and not self._quota_would_admit(a, p):
            return -1
        if svc.device < 0 and not self._restore(a, out):
            return -1
        drained = a.service in self.draining and self.drain_starts[a.service] == 0  # its drain's starts are spent
        if svc.ready_ns > self.now_ns or drained or self._running(service=a.service) >= svc.max_batch:
            return -1
        return svc.device

    def _give_up_slot_never_holding(self, a: _Action) -> None:
        """A slot that can never hold a is given up once nothing of its trajectory runs there."""
        slot = self.slot_of[a.trajectory]
        if self._slot_never_holds(a, slot) and not any(
                x.running and x.bin == slot and x.trajectory == a.trajectory and x.in_slot and not x.borrowed
                for x in self.actions.values()):
            self._free_slot(self.slot_of.pop(a.trajectory))

    def _candidates(self, a: _Action, bins: list[int] | None, own_slot: bool, masked: bool, device: int,
                    p: _Pass) -> tuple[list[int], bool]:
        """The first bins (up to `candidates`) where a fits now, and whether they are slots
        lent to it."""
        cands: list[int] = []
        # Trajectory slots: a service action runs in its own trajectory's held slot on its
        # service's node first, else in a free slot there, else in another held one (held
        # slots are never held back).
        service_in_slots = a.service >= 0 and self.rules.bins == "trajectory_slots"
        own = self.slot_of.get(a.trajectory, -1) if service_in_slots else -1

        def held_fits(b: int) -> bool:
            return self._bound(b) and self.online[self.bins[b].node] and _covers(self.bins[b].free, a.demand)

        if bins is not None and own in bins and held_fits(own):
            cands = [own]
        for b in bins if bins is not None and not masked and not cands else []:
            if len(cands) == self.candidates:
                break
            bin_ = self.bins[b]
            if not _covers(bin_.free, a.demand) or not self.online[bin_.node]:
                continue
            if not own_slot and (self._bound(b) or bin_.node in p.held_nodes):
                continue
            if device < 0 and self._node_max_gpu(bin_.node, self.dev_free) < a.gpu_memory:
                continue
            cands.append(b)
        if service_in_slots and bins is not None and not cands:
            cands = [b for b in bins if b != own and held_fits(b)][:self.candidates]
        borrowed = False
        if a.in_slot and not own_slot and bins is not None and not masked and not cands:
            # Held slots lent to a trajectory that holds none, on nodes where no holder has
            # anything live (no work in progress could free a slot for it there).
            cands = [b for b in bins
                     if self._bound(b) and self.online[self.bins[b].node] and self.bins[b].node not in p.held_nodes
                     and self._lends(self.bins[b].node) and _covers(self.bins[b].free, a.demand)
                     and self._node_max_gpu(self.bins[b].node, self.dev_free) >= a.gpu_memory][:self.candidates]
            borrowed = bool(cands)
        if device >= 0 and self.dev_free[device] < a.gpu_memory:
            cands = []
        return cands, borrowed

    def _no_candidate(self, a: _Action, bins: list[int] | None, own_slot: bool, masked: bool, device: int,
                      p: _Pass, out: list) -> str:
        """a fits no bin now: GPU memory made by evictions, or room by shrinks, else it is
        blocked (a starving one first claims its bins)."""
        if a.gpu_memory > 0 and bins is not None and not masked:
            # No eviction for an action its quota refuses now (as no restore).
            if a.quota >= 0 and not self._quota_would_admit(a, p):
                return WAITS
            if self._make_gpu_room(a, bins, own_slot, device, p, out):
                return self._try(a, p, out)
        if self.rules.resize == "malleable" and bins is not None and not masked:
            plan = self._plan_shrink(a, bins, own_slot, device, p)
            if plan is not None:
                if not self._admit_quota(a, p):
                    return WAITS
                b, shrunk = plan
                for x, grant, work in shrunk:
                    self.bins[b].free[x.elastic_kind] += x.grant - grant
                    x.grant = grant
                    self._resized(x, work, p, out)
                return self._start(a, b, device, p, out)
        starving = self.now_ns - a.submit_ns >= self.starvation_ns
        # While a node is offline, only an action that some online bin could hold claims bins.
        claims = all(self.online) or (bins is not None and self._fits_online_capacity(a, bins, device))
        if starving and not own_slot and claims:  # first claim on its bins
            scope = self._scope_node(a)
            if scope >= 0:
                p.held_nodes.add(scope)
            elif self.rules.bins == "trajectory_slots" and bins is not None:
                # only the nodes whose slots could ever hold it (see the core's no_room)
                p.held_nodes.update(self.bins[b].node for b in bins if not self._slot_never_holds(a, b))
            else:
                p.held_partitions.add(a.partition)
                if self.n_partitions == 1 and self.rules.bins != "trajectory_slots":
                    return HALT
        return BLOCKED

    def _quota_would_admit(self, a: _Action, p: _Pass) -> bool:
        """Whether a's quota admits it now (nothing taken); if not, the quota is blocked for the
        rest of the pass."""
        if self.quotas[a.quota].admits(self.now_ns, a.tokens, self._running(quota=a.quota)):
            return True
        p.blocked_quotas.add(a.quota)
        return False

    def _admit_quota(self, a: _Action, p: _Pass) -> bool:
        """Takes a's request from its quota, or blocks the quota for the rest of the pass."""
        if a.quota < 0:
            return True
        q = self.quotas[a.quota]
        if not q.admits(self.now_ns, a.tokens, self._running(quota=a.quota)):
            p.blocked_quotas.add(a.quota)
            return False
        q.take(self.now_ns, a.tokens)
        return True

    def _start(self, a: _Action, b: int, device: int, p: _Pass, out: list, borrowed: bool = False) -> str:
        now = self.now_ns
        bin_ = self.bins[b]
        if self.rules.order == "progress":
            self.progress[a.trajectory] = min(self.progress.get(a.trajectory, 0) + 1, PROGRESS_CAP)
        if device < 0 and a.gpu_memory > 0:
            fitting = [d for d in self._devices_of(bin_.node) if self.dev_free[d] >= a.gpu_memory]
            device = min(fitting, key=lambda d: self.dev_free[d] - a.gpu_memory)
        for k in range(self.K):
            bin_.free[k] -= a.demand[k]
        a.grant = a.minimum if a.elastic_kind >= 0 else 0
        if a.elastic_kind >= 0 and a.in_slot:  # the slot is all its trajectory's: take it
            extra = min(bin_.free[a.elastic_kind], a.elastic_max - a.grant)
            a.grant += extra
            bin_.free[a.elastic_kind] -= extra
        elif a.elastic_kind >= 0 and self.rules.resize == "malleable" and self.rules.spare != "none":
            self._top_up_start(a, b)
        if a.gpu_memory > 0:
            self.dev_free[device] -= a.gpu_memory
        a.borrowed = borrowed
        if a.in_slot and not borrowed:
            self.slot_of[a.trajectory] = b
            bin_.bound_to = a.trajectory
        a.running, a.bin, a.device = True, b, device
        a.work_left, a.since = 1.0, now
        if a.service in self.draining:
            self.drain_starts[a.service] -= 1
        p.started.append((a, len(out)))
        out.append(self._decision(START, action=a.id, node=bin_.node,
                                  device=self.dev_local[device] if device >= 0 else -1, service=a.service,
                                  elastic_kind=a.elastic_kind, grant=a.grant, time=now))
        return STARTED

    def _order_units(self, a: _Action) -> int:
        """The grant `a` is ordered by: its minimum, under resize "malleable" rounded up to
        a whole unit for an elastic action."""
        if self.rules.resize != "malleable" or a.elastic_kind < 0 or a.minimum % ELASTIC_STEP == 0:
            return a.minimum
        return a.minimum + _grow_step(a, a.minimum)

    def _top_up_start(self, a: _Action, b: int) -> None:
        """A start on bin b topped up to a whole unit: from a fractional minimum, the step to
        the next whole unit when the bin's free room holds it and the gain rule passes it."""
        if a.grant % ELASTIC_STEP == 0:
            return
        others = sum(1 for x in self.actions.values() if x.running and x.bin == b)  # a is not running yet
        if not self._step_cut(a, b, 1.0, others) > 0:
            return
        step = _grow_step(a, a.grant)
        a.grant += step
        self.bins[b].free[a.elastic_kind] -= step

    def _step_cut(self, a: _Action, b: int, work: float, others: int, keep: list[int] | None = None) -> float:
        """The cut work x (t(g) - t(g + step)) of a's next grow step on bin b when its free
        room holds the step and leaves `keep` (per kind) free, the cut is positive and the
        gain rule passes it; else 0."""
        step = _grow_step(a, a.grant)
        k = a.elastic_kind
        free, capacity_k = self.bins[b].free, self.bins[b].capacity[k]
        if step <= 0 or free[k] < step or (keep is not None and free[k] - step < keep[k]):
            return 0.0
        now_s = self._seconds(a, a.grant)
        next_s = self._seconds(a, a.grant + step)
        remaining = work * now_s
        cut = work * (now_s - next_s)
        if not remaining > 0 or not cut > 0:
            return 0.0
        if self.rules.gain == "relative":
            return cut if cut >= self.min_relative_gain * remaining else 0.0
        capacity = float(capacity_k)
        in_use = float(capacity_k - free[k]) / capacity
        added = work * (float(a.grant + step) * next_s - float(a.grant) * now_s)
        return cut if cut > float(others) * in_use * added / capacity else 0.0

    def _fits_online_capacity(self, a: _Action, bins: list[int], device: int) -> bool:
        """Could one of these bins on an online node ever hold `a` (by capacity)?"""
        gpu = a.gpu_memory if device < 0 else 0
        return any(self.online[self.bins[b].node] and self._holds(b, a.demand, gpu) for b in bins)

    def _restore_queues(self, out: list) -> None:
        """Offloaded services with waiting actions are restored before the walk, in queue
        order: starving first (their first waiting action in policy order has waited
        starvation_ns), then minimum copies before surplus ones, surplus ones by the sum of
        est_ns of the live actions at all copies of the service // max_batch, larger first;
        then most waiting actions per
        (restore_ns + queued est_ns // max_batch) (cross-multiplied integers), then index; each with its first waiting
        action in policy order as the one it is restored for."""
        waiting = sorted((a for a in self.actions.values() if not a.running), key=lambda a: a.order)
        class_heads: dict[tuple, _Action] = {}
        for a in waiting:
            class_heads.setdefault(a.cls, a)
        if any(a.service < 0 and a.gpu_memory > 0 and self.now_ns - a.submit_ns >= self.starvation_ns
               for a in class_heads.values()):
            return  # a starving GPU action gets its memory in the walk, in policy order
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

        def group_work(s: int) -> int:  # its service's waiting and running work per batch slot
            first = self.services[s].replica_of if self.services[s].replica_of >= 0 else s
            group = self._group(first)
            return sum(a.est_ns for a in self.actions.values() if a.service in group) // self.services[s].max_batch

        def rank(x: int, y: int) -> int:
            if starving[x] != starving[y]:
                return -1 if starving[x] else 1
            if self.services[x].surplus != self.services[y].surplus:
                return 1 if self.services[x].surplus else -1  # minimum copies first
            if self.services[x].surplus and group_work(x) != group_work(y):
                return -1 if group_work(x) > group_work(y) else 1
            lhs, rhs = n[x] * span[y], n[y] * span[x]
            if lhs != rhs:
                return -1 if lhs > rhs else 1
            return -1 if x < y else (1 if x > y else 0)

        for s in sorted(heads, key=functools.cmp_to_key(rank)):
            a = heads[s]
            if a.quota >= 0 and not self.quotas[a.quota].admits(self.now_ns, a.tokens, self._running(quota=a.quota)):
                continue  # its quota would refuse it now: the walk says why
            if self.services[s].device < 0:
                self._restore(a, out)

    def _promised_on(self, d: int, keep: int) -> int:
        """GPU memory on device d promised to the heads of services restored there and not
        used yet (restoring, or ready only since the last pass, nothing running): the
        gpu_memory of each one's first waiting action in policy order (but `keep`'s). Plans
        leave it free (see the core's promised_on)."""
        promised = 0
        for o, svc in enumerate(self.services):
            if o == keep or svc.device != d or svc.ready_ns <= self.prev_pass_ns or self._running(service=o):
                continue
            first = min((a for a in self.actions.values() if not a.running and a.service == o),
                        key=lambda a: a.order, default=None)
            if first is not None:
                promised += first.gpu_memory
        return promised

    def _plan_room(self, d: int, need: int, keep: int, starving: bool = False) -> tuple[bool, int, int, float, list[int]]:
        """Greedy victims on device d for `need`: (enough, busy victims, their queued ns, the
        restores the idle victims will likely need, victims). The last is the sum, in victim
        order, of float(restore_ns) / float(expected gap) over the victims with nothing
        waiting that were asked for before."""
        waiting = [b for b in self.actions.values() if not b.running]
        n_waiting = {o: sum(1 for b in waiting if b.service == o) for o in range(len(self.services))}
        queued = {o: sum(b.est_ns for b in waiting if b.service == o) for o in range(len(self.services))}

        def expected_gap(o: int) -> int:  # until it is asked for again: -1 if never asked for
            svc = self.services[o]
            if svc.last_request_ns < 0:
                return -1
            return max(svc.mean_gap_ns, self.now_ns - svc.last_request_ns, 1)

        def rank(x: int, y: int) -> int:
            # Idle first; among idle ones surplus replicas first, then the least restore time per
            # expected gap until the next request (never asked for: first); then least queued
            # work per restore ns.
            if (n_waiting[x] == 0) != (n_waiting[y] == 0):
                return -1 if n_waiting[x] == 0 else 1
            if n_waiting[x] == 0 and self.services[x].surplus != self.services[y].surplus:
                return -1 if self.services[x].surplus else 1  # idle surplus replicas first
            if n_waiting[x] == 0:
                gx, gy = expected_gap(x), expected_gap(y)
                if (gx < 0) != (gy < 0):
                    return -1 if gx < 0 else 1
                if gx >= 0:
                    cx, cy = self.services[x].restore_ns * gy, self.services[y].restore_ns * gx
                    if cx != cy:
                        return -1 if cx < cy else 1
            lhs = queued[x] * max(self.services[y].restore_ns, 1)
            rhs = queued[y] * max(self.services[x].restore_ns, 1)
            if lhs != rhs:
                return -1 if lhs < rhs else 1
            return -1 if x < y else (1 if x > y else 0)

        room, victims = self.dev_free[d] - self._promised_on(d, keep), []
        idle = sorted((o for o, svc in enumerate(self.services) if o != keep and svc.device == d
                       and self._running(service=o) == 0 and svc.ready_ns <= self.prev_pass_ns),
                      key=functools.cmp_to_key(rank))
        # The victims' host memory must fit the node's offload memory, less what `keep`
        # gives back there when this plan is for its restore.
        kept = self.services[keep] if keep >= 0 else None
        host = -kept.host if kept is not None and kept.device < 0 and kept.host_node == self.dev_node[d] else 0
        discard = []  # per victim: its state given up (no room for it in the node's offload memory)
        for o in idle:
            if room >= need:
                break
            kept_state = self._offload_fits(self.dev_node[d], host + self.services[o].host)
            if kept_state:
                host += self.services[o].host
            room += self.services[o].memory - (self.services[o].asleep if kept_state else 0)
            victims.append(o)
            discard.append(not kept_state)
        for i, o in enumerate(victims):  # still short: unmovable victims give their processes up
            if room >= need:
                break
            if not discard[i] and self.services[o].asleep > 0:
                room += self.services[o].asleep
                discard[i] = True
        likely = 0.0
        for o in victims:
            gap = expected_gap(o)
            if n_waiting[o] == 0 and gap > 0:
                likely += float(self.services[o].restore_ns) / float(gap)
        busy, queued_ns = sum(1 for o in victims if n_waiting[o] > 0), sum(queued[o] for o in victims)
        for o, svc in enumerate(self.services):  # idle unmovable ones asleep on d give their processes up
            if room >= need:
                break
            # (for a starving action also those with waiting actions: see the core's plan_room)
            if o != keep and svc.device < 0 and svc.pinned == d and (n_waiting[o] == 0 or starving) and svc.asleep > 0:
                room += svc.asleep
                victims.append(o)
                discard.append(True)
        if room < need and any(o != keep and svc.device == d and self._running(service=o) == 0
                               and self.prev_pass_ns < svc.ready_ns <= self.now_ns for o, svc in enumerate(self.services)):
            self.spared_fresh = True
        return room >= need, busy, queued_ns, likely, victims, discard

    def _evict(self, s: int, out: list, discard: bool = False) -> None:
        """Evicts resident s: its state offloaded (kept in host memory), or discarded."""
        svc = self.services[s]
        d = svc.device
        svc.device = -1
        if discard:
            self._give_back(d, svc.memory)
            svc.pinned = -1
        else:
            self._give_back(d, svc.memory - svc.asleep)
            if svc.host > 0:
                self.offload_used[self.dev_node[d]] += svc.host
                svc.host_node = self.dev_node[d]
        self.dev_ops_end[d] = max(self.now_ns, self.dev_ops_end[d]) + svc.offload_ns
        out.append(self._decision(EVICT, node=self.dev_node[d], device=self.dev_local[d], service=s, time=self.now_ns,
                                  reason=DISCARD if discard else -1))

    def _discard_asleep(self, s: int, out: list) -> None:
        """An unmovable s asleep on its pinned device gives its process up."""
        svc = self.services[s]
        d = svc.pinned
        self._give_back(d, svc.asleep)
        svc.pinned = -1
        self._release_offloaded_state(svc)
        self.dev_ops_end[d] = max(self.now_ns, self.dev_ops_end[d])
        out.append(self._decision(EVICT, node=self.dev_node[d], device=self.dev_local[d], service=s, time=self.now_ns,
                                  reason=DISCARD))

    def _evict_plan(self, victims: list[int], discard: list[bool], out: list) -> None:
        for v, gone in zip(victims, discard):
            if self.services[v].device < 0:
                self._discard_asleep(v, out)
            else:
                self._evict(v, out, gone)

    def _could_serve(self, a: _Action, d: int) -> bool:
        """Whether device d could ever serve service action a: big enough for its service
        beside a's GPU memory, on a node with a bin of a's partition whose capacity covers
        a's demand."""
        return (self.dev_total[d] >= self.services[a.service].memory + a.gpu_memory
                and any(_covers(self.bins[b].capacity, a.demand) for b in self._node_leaves(a.partition, self.dev_node[d])))

    def _restore(self, a: _Action, out: list) -> bool:
        """Make a's service resident somewhere it may live, evicting greedily if needed."""
        s = a.service
        svc = self.services[s]

        def need_on(d: int) -> int:  # where it is pinned it keeps its asleep memory
            return svc.memory - (svc.asleep if d == svc.pinned else 0)

        def room_on(d: int) -> int:  # the head beside the service (see the core's restore())
            return need_on(d) + a.gpu_memory

        # A surplus copy beside another copy of its group only where no other device will ever do.
        sibling_free = svc.surplus and any(self._device_online(d) and self._could_serve(a, d)
                                           and not self._sibling_on(s, d) for d in self._service_devices(s))

        def usable(d: int) -> bool:
            return self._device_online(d) and self._could_serve(a, d) and not (sibling_free and self._sibling_on(s, d))

        def busy_node(d: int) -> int:  # 1 when no free bin of the node holds the action's demand now
            leaves = self._node_leaves(a.partition, self.dev_node[d])
            return 0 if any(not self._bound(b) and _covers(self.bins[b].free, a.demand) for b in leaves) else 1

        def begins(d: int) -> int:  # after the device's earlier restores and offloads
            return max(self.now_ns, self.dev_ops_end[d])

        devices = [svc.pinned] if svc.pinned >= 0 and usable(svc.pinned) else [
            d for d in self._service_devices(s) if usable(d)]

        def actions_on(d: int) -> int:  # actions running or waiting at the services resident on d
            here = {o for o, other in enumerate(self.services) if other.device == d}
            return sum(1 for b in self.actions.values() if b.service in here)

        room_now = [(busy_node(d), actions_on(d), begins(d), self.dev_free[d] - room_on(d), d) for d in devices
                    if self.dev_free[d] - self._promised_on(d, s) >= room_on(d)]
        if room_now:
            target = min(room_now)[-1]
        else:
            plans = []
            for d in devices:
                ok, busy, queued, likely, victims, discard = self._plan_room(d, room_on(d), s)
                if ok:
                    ready = begins(d) + sum(self.services[v].offload_ns for v in victims)
                    plans.append(((busy_node(d), busy, queued, ready, likely, len(victims), d), victims, discard))
            if not plans:
                if self.now_ns - a.submit_ns >= self.starvation_ns:
                    self._drain(s, devices, room_on)
                return False
            (*_, target), victims, discard = min(plans)
            self._evict_plan(victims, discard, out)
        self.dev_free[target] -= need_on(target)
        if svc.pinned >= 0 and svc.pinned != target:  # its old process is given up
            self._discard_asleep(s, out)
        self._release_offloaded_state(svc)  # its offloaded state goes back to the device
        if svc.pinned >= 0 and svc.pinned != target:  # its old process is given up
            self._give_back(svc.pinned, svc.asleep)
        if not svc.movable:
            svc.pinned = target
        svc.device, svc.ready_ns = target, begins(target) + svc.restore_ns
        self.dev_ops_end[target] = svc.ready_ns
        out.append(self._decision(RESTORE, node=self.dev_node[target], device=self.dev_local[target], service=s,
                                  time=svc.ready_ns))
        return True

    def _drain(self, s: int, devices: list[int], room_on: Callable[[int], int]) -> None:
        """Service s starves for a device: the services in its way on the device where they
        run the fewest actions start nothing for the rest of this pass. Services ready there
        for less than starvation_ns are not in its way (their ready + starvation_ns is a
        wakeup of this pass)."""
        least, victims = -1, []
        for d in devices:
            near = [o for o, other in enumerate(self.services) if o != s and other.device == d
                    and other.ready_ns <= self.prev_pass_ns]
            kept = [o for o in near if self.services[o].ready_ns + self.starvation_ns > self.now_ns]
            self.drain_wakeups += [self.services[o].ready_ns + self.starvation_ns for o in kept]
            in_way = sorted((o for o in near if o not in kept), key=lambda o: (self._running(service=o), o))
            room, running, k = self.dev_free[d], 0, 0
            while k < len(in_way) and room < room_on(d):
                o = in_way[k]
                room += self.services[o].memory - self.services[o].asleep
                running += self._running(service=o)
                k += 1
            if room < room_on(d) or (least >= 0 and running >= least):
                continue
            least, victims = running, in_way[:k]
        for v in victims:
            if v not in self.draining and v not in self.drained_before:
                self.drain_starts[v] = sum(1 for b in self.actions.values() if not b.running and b.service == v)
        self.draining.update(victims)

    def _make_gpu_room(self, a: _Action, bins: list[int], own_slot: bool, device: int, p: _Pass, out: list) -> bool:
        """Evict services (greedy plan) for the GPU memory `a` needs: on its service's device, or
        on the device with the cheapest plan among the nodes of its bins (online, not held
        back) whose free vector holds the rest of its demand now."""
        if device >= 0:
            if self.dev_free[device] >= a.gpu_memory:
                return False  # it waits for something else
            # Its trajectory's own held slot is nobody else's: not held back by a starving action.
            own = self.slot_of.get(a.trajectory, -1) if self.rules.bins == "trajectory_slots" else -1
            if not any(self.online[self.bins[b].node] and (b == own or self.bins[b].node not in p.held_nodes)
                       and _covers(self.bins[b].free, a.demand) for b in bins):
                return False  # the memory freed would go unused: the rest of its demand does not fit now
            ok, _, _, _, victims, discard = self._plan_room(device, a.gpu_memory, a.service,
                                                            self.now_ns - a.submit_ns >= self.starvation_ns)
            if not ok:
                return False
        else:
            plans = []
            for b in bins:
                n = self.bins[b].node
                if (not own_slot and self._bound(b) and not self._lent_to(a, b)) or not self.online[n]:
                    continue
                if n in p.held_nodes and not own_slot:  # its own slot: nobody's to hold back
                    continue
                if not _covers(self.bins[b].free, a.demand):
                    continue
                for d in self._devices_of(n):
                    if self.dev_total[d] >= a.gpu_memory and not self.dev_offline[d]:
                        ok, busy, queued, likely, victims, discard = self._plan_room(
                            d, a.gpu_memory, -1, self.now_ns - a.submit_ns >= self.starvation_ns)
                        if ok and victims:
                            plans.append(((busy, queued, likely, len(victims), d), victims, discard))
            if not plans:
                return False
            _, victims, discard = min(plans)
        self._evict_plan(victims, discard, out)
        return True

    def _grant_spare(self, p: _Pass, out: list) -> None:
        """Spare elastic units, bin by bin, one unit at a time, largest cut first: on every
        bin ("every_bin"), or only where neither node nor partition is contended. The
        candidates are this pass's starts (in start order) and, under resize "malleable",
        the running actions (by id) on online bins a complete or cancel freed room on since
        the last pass, not started or resized in this pass. Each running one that grew gets
        a RESIZE decision."""
        def reserve(b: int) -> list[int]:  # what spare units leave free on b, per kind
            if self.rules.spare != "uncontended":
                return [0] * self.K
            bin_ = self.bins[b]
            needs = [p.contended_partitions.get(bin_.partition, [0] * self.K), p.contended_nodes.get(bin_.node, [0] * self.K)]
            return [max(n[k] for n in needs) for k in range(self.K)]

        by_bin: dict[int, list] = {}  # bin -> [action, decision index or None, work left, grant before]
        for a, i in p.started:
            if a.elastic_kind < 0 or a.grant >= a.elastic_max:
                continue
            by_bin.setdefault(a.bin, []).append((a, i, 1.0, a.grant))
        started = {a.id for a, _ in p.started}
        for b in sorted(self.freed_bins):
            if not self.online[self.bins[b].node]:
                continue
            running = sorted((x for x in self.actions.values() if x.running and x.bin == b and x.elastic_kind >= 0
                              and x.grant < x.elastic_max and x.id not in started and x.id not in p.resized),
                             key=lambda x: x.id)
            if running:
                by_bin.setdefault(b, []).extend((x, None, self._work_now(x), x.grant) for x in running)
        for b in sorted(by_bin):
            members, free, keep = by_bin[b], self.bins[b].free, reserve(b)
            others = sum(1 for x in self.actions.values() if x.running and x.bin == b) - 1
            while True:
                best, best_cut = None, 0.0
                for m in members:
                    a, work = m[0], m[2]
                    cut = self._step_cut(a, b, work, others, keep)
                    if not cut > 0:
                        continue
                    if best is None or cut > best_cut:
                        best, best_cut = m, cut
                if best is None:
                    break
                a, i = best[0], best[1]
                step = _grow_step(a, a.grant)
                a.grant += step
                free[a.elastic_kind] -= step
                if i is not None:
                    out[i]["grant"] = a.grant
            for a, i, work, was in members:
                if i is None and a.grant != was:
                    self._resized(a, work, p, out)

    # ------------------------------------------------------------ resize "malleable"
    def _work_now(self, a: _Action) -> float:
        """The share of its work a running action has left now: what it had at `since`, less
        the time since over its run time at its grant (none left if that is not positive)."""
        if a.since >= self.now_ns:
            return a.work_left
        t = self._seconds(a, a.grant)
        if not t > 0:
            return 0.0
        left = a.work_left - float(self.now_ns - a.since) / 1e9 / t
        return left if left > 0 else 0.0

    def _estimated_finish(self, a: _Action) -> float:
        """When it should finish at its grant, in seconds: since + work_left x its run time
        (since alone without a positive run time or work)."""
        since = a.since / 1e9
        t = self._seconds(a, a.grant)
        return since + a.work_left * t if t > 0 and a.work_left > 0 else since

    def _resized(self, a: _Action, work: float, p: _Pass, out: list) -> None:
        """a's grant changed now (`work`: its share of work left now, at the old grant)."""
        a.work_left, a.since = work, self.now_ns
        p.resized.add(a.id)
        out.append(self._decision(RESIZE, action=a.id, node=self.bins[a.bin].node, elastic_kind=a.elastic_kind,
                                  grant=a.grant, time=self.now_ns))

    def _plan_shrink(self, a: _Action, bins: list[int], own_slot: bool, device: int,
                     p: _Pass) -> tuple[int, list] | None:
        """The first of a's bins (in order; those placement may use now, but for room) where
        units taken back from running actions let it start and the loss is less than the
        gain: (bin, [(action, new grant, work left now), ...] by id), or None."""
        if device >= 0 and self.dev_free[device] < a.gpu_memory:
            return None
        started = {x.id for x, _ in p.started}
        for b in bins:
            bin_ = self.bins[b]
            if not self.online[bin_.node]:
                continue
            if not own_slot and (self._bound(b) or bin_.node in p.held_nodes):
                continue
            if device < 0 and self._node_max_gpu(bin_.node, self.dev_free) < a.gpu_memory:
                continue
            running = [x for x in self.actions.values() if x.running and x.bin == b]
            back = [0] * self.K  # units above their minimum, per kind, of the actions running there
            for x in running:
                if x.elastic_kind >= 0:
                    back[x.elastic_kind] += x.grant - x.minimum
            if not any(back) or not all(bin_.free[k] + back[k] >= a.demand[k] for k in range(self.K)):
                continue
            plan = self._plan_shrink_on(a, bin_, running, started, p)
            if plan is not None:
                return b, plan
        return None

    def _plan_shrink_on(self, a: _Action, bin_: _Bin, running: list, started: set, p: _Pass) -> list | None:
        """Units taken back one step at a time, each from the action (of a kind a is short
        of, above its minimum, not started or resized in this pass) that loses least by it:
        loss = work left now x (t(g - step) - t(g)), ties by id; it pays when the total loss
        is less than the gain, the earliest estimated finish among the actions there."""
        short = [max(0, a.demand[k] - bin_.free[k]) for k in range(self.K)]
        donors = [[x, x.grant, self._work_now(x)] for x in running
                  if x.elastic_kind >= 0 and short[x.elastic_kind] > 0 and x.grant > x.minimum
                  and x.id not in started and x.id not in p.resized]
        if not donors:
            return None
        gain = max(0.0, min(self._estimated_finish(x) for x in running) - self.now_ns / 1e9)
        loss = 0.0
        while any(s > 0 for s in short):
            best, best_loss = None, 0.0
            for d in donors:
                x, grant, work = d
                if short[x.elastic_kind] == 0 or grant <= x.minimum:
                    continue
                step = _shrink_step(x, grant)
                cut = work * (self._seconds(x, grant - step) - self._seconds(x, grant))
                if cut != cut:  # NaN
                    continue
                if best is None or cut < best_loss or (cut == best_loss and x.id < best[0].id):
                    best, best_loss = d, cut
            if best is None:
                return None
            x = best[0]
            step = _shrink_step(x, best[1])
            best[1] -= step
            short[x.elastic_kind] = max(0, short[x.elastic_kind] - step)
            loss += best_loss
        if not loss < gain:
            return None
        return [(x, grant, work) for x, grant, work in sorted(donors, key=lambda d: d[0].id) if grant != x.grant]

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
        return f"running on node {self.bins[a.bin].node}" if a.running else "waiting"

    def free_milli(self, node: int, kind: int) -> int:
        """Free amount of `kind` on `node`, summed over the node's bins."""
        return sum(b.free[kind] for b in self.bins if b.node == node)

    def gpu_free(self, node: int, device: int) -> int:
        return self.dev_free[self._devices_of(node)[device]]

    def trajectory_slot_node(self, trajectory: int) -> int:
        b = self.slot_of.get(trajectory)
        return -1 if b is None else self.bins[b].node

    def service_location(self, service: int) -> tuple[int, int]:
        d = self.services[service].device
        return (-1, -1) if d < 0 else (self.dev_node[d], self.dev_local[d])
