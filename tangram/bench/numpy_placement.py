"""A NumPy-vectorised placement scan: the `numpy` implementation of `tangram bench`.

It answers "what would a straightforward vectorised Python scheduler cost?". It keeps a
(nodes x kinds) matrix of free milli-units and places each waiting action with one
vectorised scan over every node: `np.all(free >= demand, axis=1)` for feasibility and the
argmin of a best-fit score (the normalised room left over, as the core scores it but in
floating point) among the nodes that fit. Affinity confines an action to its node (a
K-wide check).

Deliberately simple, and so a lower bound on what a real Python scheduler would spend per
decision: actions start in arrival order with their minimum grants, and an unpinned action
that does not fit blocks the unpinned ones behind it until resources come back (strict
FIFO, no backfill). Actions pinned to a node wait in that node's own FIFO queue, checked
(first) when the node gets resources back, so they never block the shared queue. No
elasticity, quotas, services, GPUs, priorities or starvation handling; records are assumed
valid except that an action no node could ever hold is rejected at submit.

It takes the same constructor arguments as the core (`core_arguments(inventory, policy)`,
the policy fields ignored) and offers the same event methods, returning DECISION_DTYPE
arrays, so the benchmark drives all implementations with one driver.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from .._records import DECISION_DTYPE, REJECT, START

__all__ = ["NumpyPlacement"]


def _milli(values: np.ndarray) -> np.ndarray:
    """Base units to the core's milli-units: round half up, as the core does."""
    return np.floor(np.asarray(values, dtype=np.float64) * 1000.0 + 0.5).astype(np.int64)


class NumpyPlacement:
    """First-fit feasibility + best-fit choice by one vectorised scan per action."""

    def __init__(self, *, kinds: Sequence[str], capacity: np.ndarray, **_ignored: object) -> None:
        self.kinds = list(kinds)
        self.capacity = np.array(capacity, dtype=np.int64, copy=True)
        if self.capacity.ndim != 2 or self.capacity.shape[1] != len(self.kinds):
            raise ValueError("capacity must be a nodes x kinds array")
        # Column-major, so the per-node reductions over kinds run down contiguous columns
        # (NumPy's reduction over a short contiguous last axis is several times slower).
        self.free_matrix = np.asfortranarray(self.capacity)
        cap = self.capacity.astype(np.float64)
        # Best-fit weights: room left over in kind k on node n counts (left / capacity).
        self._weight = np.asfortranarray(np.divide(1.0, cap, out=np.zeros_like(cap), where=cap > 0))
        self._queue: deque[int] = deque()  # slots of waiting unpinned actions, in arrival order
        self._pinned: dict[int, deque[int]] = {}  # node -> slots of actions pinned to it, in order
        self._dirty: set[int] = set()  # nodes whose pinned queue may be able to start now
        self._waiting = 0
        self._by_id: dict[int, int] = {}  # live action id -> slot
        # per slot
        self._id: list[int] = []
        self._demand: list[np.ndarray] = []  # (K,) int64 milli
        self._affinity: list[int] = []
        self._elastic: list[int] = []
        self._node: list[int] = []  # -1 while waiting
        self._free_slots: list[int] = []
        self.now = 0.0

    # ------------------------------------------------------------------ events
    def submit(self, records: np.ndarray, now: float) -> np.ndarray:
        self.now = now
        n = len(records)
        demand = _milli(records["demand"])
        affinity = records["affinity"].astype(np.int64)
        ids = records["id"]
        # An action no node could ever hold is rejected: one vectorised capacity check per
        # distinct demand (affinity actions: against their own node, all at once).
        feasible = np.ones(n, dtype=bool)
        pinned = affinity >= 0
        if pinned.any():
            feasible[pinned] = np.all(self.capacity[affinity[pinned]] >= demand[pinned], axis=1)
        if (~pinned).any():
            shapes, inverse = np.unique(demand[~pinned], axis=0, return_inverse=True)
            ok = np.array([np.any(np.all(self.capacity >= s, axis=1)) for s in shapes], dtype=bool)
            feasible[~pinned] = ok[inverse.reshape(-1)]
        rejected: list[int] = []
        elastic = records["elastic_kind"].tolist()
        aff = affinity.tolist()
        for i, aid in enumerate(ids.tolist()):
            if not feasible[i]:
                rejected.append(aid)
                continue
            if aid in self._by_id:
                raise ValueError(f"action {aid} is already live")
            slot = self._new_slot()
            self._id[slot] = aid
            self._demand[slot] = demand[i]
            self._affinity[slot] = aff[i]
            self._elastic[slot] = elastic[i]
            self._node[slot] = -1
            self._by_id[aid] = slot
            self._waiting += 1
            if aff[i] >= 0:
                self._pinned.setdefault(aff[i], deque()).append(slot)
                self._dirty.add(aff[i])
            else:
                self._queue.append(slot)
        return self._decisions(self._pass(), rejected)

    def complete(self, ids: np.ndarray, now: float) -> np.ndarray:
        self.now = now
        free = self.free_matrix
        for aid in np.asarray(ids).tolist():
            slot = self._by_id.pop(aid)
            node = self._node[slot]
            if node < 0:
                raise ValueError(f"action {aid} has not started")
            free[node] += self._demand[slot]
            self._node[slot] = -1
            if node in self._pinned:
                self._dirty.add(node)
            self._free_slots.append(slot)
        return self._decisions(self._pass(), [])

    def tick(self, now: float) -> np.ndarray:
        self.now = now
        return self._decisions(self._pass(), [])

    # ------------------------------------------------------------------ queries
    @property
    def waiting_count(self) -> int:
        return self._waiting

    @property
    def running_count(self) -> int:
        return len(self._by_id) - self._waiting

    def free(self, node: int, kind: int) -> int:
        """Free milli-units of `kind` on `node`, like the core's `free`."""
        return int(self.free_matrix[node, kind])

    def check_invariants(self) -> None:
        """Capacity never exceeded, and free + used == capacity on every node and kind."""
        used = np.zeros_like(self.capacity)
        for aid, slot in self._by_id.items():
            node = self._node[slot]
            if node >= 0:
                used[node] += self._demand[slot]
        if (self.free_matrix < 0).any():
            raise AssertionError("capacity exceeded on node(s) "
                                 f"{np.flatnonzero((self.free_matrix < 0).any(axis=1)).tolist()}")
        if not np.array_equal(self.free_matrix + used, self.capacity):
            raise AssertionError("free + used != capacity")

    # ------------------------------------------------------------------ internals
    def _new_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._id.append(0)
        self._demand.append(np.zeros(len(self.kinds), dtype=np.int64))
        self._affinity.append(-1)
        self._elastic.append(-1)
        self._node.append(-1)
        return len(self._id) - 1

    def _place(self, demand: np.ndarray, affinity: int) -> int:
        """The node for `demand`, or -1 when none has room now."""
        free = self.free_matrix
        if affinity >= 0:
            return affinity if bool(np.all(free[affinity] >= demand)) else -1
        fits = np.all(free >= demand, axis=1)
        # Best fit: the least normalised room left over; the first such node on ties.
        score = np.where(fits, ((free - demand) * self._weight).sum(axis=1), np.inf)
        node = int(score.argmin())
        return node if fits[node] else -1

    def _pass(self) -> list[int]:
        """Starts pinned actions on nodes that got resources back, then unpinned actions in
        arrival order until the first that does not fit."""
        started: list[int] = []
        free = self.free_matrix
        for node in sorted(self._dirty):
            queue = self._pinned[node]
            while queue and self._place(self._demand[queue[0]], node) >= 0:
                slot = queue.popleft()
                free[node] -= self._demand[slot]
                self._node[slot] = node
                started.append(slot)
            if not queue:
                del self._pinned[node]
        self._dirty.clear()
        queue = self._queue
        while queue:
            slot = queue[0]
            node = self._place(self._demand[slot], self._affinity[slot])
            if node < 0:
                break
            queue.popleft()
            free[node] -= self._demand[slot]
            self._node[slot] = node
            started.append(slot)
        self._waiting -= len(started)
        return started

    def _decisions(self, started: list[int], rejected: list[int]) -> np.ndarray:
        out = np.zeros(len(started) + len(rejected), dtype=DECISION_DTYPE)
        if started:
            s = out[: len(started)]
            s["action"] = [self._id[x] for x in started]
            s["node"] = [self._node[x] for x in started]
            ek = np.array([self._elastic[x] for x in started], dtype=np.int32)
            grant = np.array([self._demand[x][e] if e >= 0 else 0 for x, e in zip(started, ek.tolist())],
                             dtype=np.int64)
            s["elastic_kind"] = ek
            s["grant_milli"] = grant
            s["grant"] = grant / 1000.0
            s["kind"] = START
            s["time"] = self.now
            s["reason"] = -1
        if rejected:
            r = out[len(started):]
            r["action"] = rejected
            r["kind"] = REJECT
            r["node"] = -1
            r["elastic_kind"] = -1
            r["time"] = self.now
            r["reason"] = -1  # no message table: the numpy scan does not explain itself
        out["device"] = -1
        out["service"] = -1
        return out
