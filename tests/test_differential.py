"""Differential tests: the C++ core against the naive Python reference (tangram/reference.py).

Both are fed the same random inventories and event streams; after every event their
decisions must be identical field by field (reject rows: kind and action only), and so
must next_wakeup, the free pools and where each service lives. Along the way the harness
checks, from the decisions alone, the invariants every user relies on.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram import (
    DuplicateIdError, Gpu, InvalidStateError, Inventory, Node, Policy, Quota, Service, UnknownActionError,
    UnknownNameError, ValidationError, _core,
)
from tangram._records import (
    DECISION_DTYPE, EVICT, MODEL_AMDAHL, MODEL_CONSTANT, MODEL_TABLE, REJECT, RESTORE, START, empty_actions,
)
from tangram.reference import ReferenceScheduler, to_milli
from tangram.scheduler import core_arguments

FIELDS = ("kind", "action", "node", "device", "service", "elastic_kind", "grant_milli", "grant", "time")
TABLES = [[(1.0, 10.0), (2.0, 6.0), (4.0, 4.0)], [(0.5, 3.0), (3.0, 1.0)], [(1.0, 5.0)]]


def rows(decisions: np.ndarray) -> list[tuple]:
    out = []
    for d in decisions:
        if d["kind"] == REJECT:
            out.append((REJECT, int(d["action"])))
        else:
            out.append(tuple(d[f].item() for f in FIELDS))
    return out


def describe(args: tuple) -> str:
    parts = []
    for a in args:
        if isinstance(a, np.ndarray) and a.dtype.names and "demand" in a.dtype.names:
            keep = [n for n in a.dtype.names if n not in ("callback",)]
            parts.append(repr([dict(zip(keep, r)) for r in a[keep].tolist()]))
        elif isinstance(a, np.ndarray):
            parts.append(repr(a.tolist()))
        else:
            parts.append(repr(a))
    return ", ".join(parts)


class Harness:
    """Drives the core and the reference with the same events and checks both."""

    def __init__(self, inventory: Inventory, policy: Policy) -> None:
        args = core_arguments(inventory, policy)
        self.core = _core.Scheduler(**args, decision_dtype=DECISION_DTYPE)
        self.ref = ReferenceScheduler(**args)
        for points in TABLES:
            assert self.core.add_table(points) == self.ref.add_table(points)
        self.capacity = args["capacity"]
        self.gpus = args["gpus"]
        self.service_memory = [s[1] for s in args["services"]]
        self.K = len(args["kinds"])
        self.now = 0.0
        self.next_id = 1
        self.state: dict[int, str] = {}  # every id ever submitted: waiting/running/terminal
        self.spec: dict[int, dict] = {}  # id -> demand (milli), trajectory
        self.placed: dict[int, tuple[int, int, int]] = {}  # running id -> (node, elastic_kind, grant)
        self.service_at: dict[int, tuple[int, int]] = {}
        self.trajectories: set[int] = set()
        self.log: list[tuple] = []  # (method, args, core decisions) of every accepted event

    def history(self) -> str:
        return "\n".join(f"{m}({describe(args)}) -> {rows(out)}" for m, args, out in self.log)

    # ---------------------------------------------------------------- events
    def both(self, method: str, *args) -> np.ndarray:
        """Calls `method` on both, insisting on the same decisions (or the same error)."""
        errors = []
        results = []
        for sched in (self.core, self.ref):
            try:
                results.append(getattr(sched, method)(*args))
            except (ValidationError, UnknownActionError, InvalidStateError) as e:
                errors.append(type(e))
        if errors:
            assert len(errors) == 2 and errors[0] is errors[1], (method, errors)
            self.check()
            return None
        core_out, ref_out = results
        self.log.append((method, args, core_out))
        assert rows(core_out) == rows(ref_out), f"reference: {rows(ref_out)}\n{self.history()}"
        self.core.check_invariants()
        return core_out

    def submit(self, records: np.ndarray) -> np.ndarray | None:
        out = self.both("submit", records, self.now)
        if out is None:
            return None
        ids = [int(i) for i in records["id"]]
        rejected = {int(d["action"]) for d in out if d["kind"] == REJECT}
        assert rejected <= set(ids)
        assert [int(d["action"]) for d in out[: len(rejected)]] == [i for i in ids if i in rejected], \
            "rejects come first, in submit order"
        for r in records:
            i = int(r["id"])
            assert i not in self.state or self.state[i] in ("done", "cancelled", "rejected")
            self.state[i] = "rejected" if i in rejected else "waiting"
            self.spec[i] = dict(demand=[to_milli(float(v)) for v in r["demand"]], trajectory=int(r["trajectory"]))
            self.trajectories.add(int(r["trajectory"]))
        self.apply(out, skip=len(rejected))
        return out

    def complete(self, ids: list[int]) -> None:
        out = self.both("complete", np.array(ids, dtype=np.uint64), self.now)
        if out is not None:
            for i in ids:
                assert self.state[i] == "running"
                self.state[i] = "done"
                del self.placed[i]
            self.apply(out)

    def cancel(self, ids: list[int]) -> None:
        out = self.both("cancel", np.array(ids, dtype=np.uint64), self.now)
        if out is not None:
            for i in ids:
                assert self.state[i] in ("waiting", "running")
                self.state[i] = "cancelled"
                self.placed.pop(i, None)
            self.apply(out)

    def tick(self) -> None:
        out = self.both("tick", self.now)
        if out is not None:
            self.apply(out)

    def end_trajectories(self, ids: list[int]) -> None:
        out = self.both("end_trajectories", np.array(ids, dtype=np.uint64), self.now)
        if out is not None:
            self.apply(out)

    def apply(self, out: np.ndarray, skip: int = 0) -> None:
        for d in out[skip:]:
            kind = int(d["kind"])
            assert kind != REJECT, "rejects only at submit, before the pass"
            if kind == START:
                i = int(d["action"])
                assert self.state[i] == "waiting", f"start of a {self.state[i]} action"
                self.state[i] = "running"
                self.placed[i] = (int(d["node"]), int(d["elastic_kind"]), int(d["grant_milli"]))
                if d["service"] >= 0:
                    assert self.service_at[int(d["service"])] == (int(d["node"]), int(d["device"]))
            elif kind == RESTORE:
                assert int(d["service"]) not in self.service_at
                self.service_at[int(d["service"])] = (int(d["node"]), int(d["device"]))
                assert d["time"] >= self.core.now
            elif kind == EVICT:
                assert self.service_at.pop(int(d["service"])) == (int(d["node"]), int(d["device"]))
        self.check()

    # ---------------------------------------------------------------- invariants
    def check(self) -> None:
        self.core.check_invariants()
        assert self.core.next_wakeup == self.ref.next_wakeup
        assert self.core.waiting_count == self.ref.waiting_count == self.count("waiting")
        assert self.core.running_count == self.ref.running_count == self.count("running")
        used = np.zeros_like(self.capacity)
        for i, (node, ek, grant) in self.placed.items():
            used[node] += self.spec[i]["demand"]
            if ek >= 0:
                assert grant >= self.spec[i]["demand"][ek]
                used[node, ek] += grant - self.spec[i]["demand"][ek]
        assert (used <= self.capacity).all(), "capacity exceeded"
        for n in range(len(self.capacity)):
            for k in range(self.K):
                assert self.core.free(n, k) == self.ref.free_milli(n, k) == self.capacity[n, k] - used[n, k]
        for s in range(len(self.service_memory)):
            where = self.service_at.get(s, (-1, -1))
            assert tuple(self.core.service_location(s)) == self.ref.service_location(s) == where

    def count(self, state: str) -> int:
        return sum(1 for s in self.state.values() if s == state)

    def live(self, state: str | None = None) -> list[int]:
        return [i for i, s in self.state.items() if s == state or (state is None and s in ("waiting", "running"))]

    def drain(self) -> None:
        """Ends everything; the pools must be exactly full again."""
        self.cancel(self.live("waiting"))
        while self.live("running"):
            self.complete(self.live("running"))
            self.cancel(self.live("waiting"))
        self.end_trajectories(sorted(self.trajectories))
        assert all(s in ("done", "cancelled", "rejected") for s in self.state.values()), "each action ends once"
        for n in range(len(self.capacity)):
            for k in range(self.K):
                assert self.core.free(n, k) == self.capacity[n, k]
            resident = [self.service_memory[s] for s, (node, _) in self.service_at.items() if node == n]
            dev_used = {d: 0 for d in range(len(self.gpus[n]))}
            for s, (node, dev) in self.service_at.items():
                if node == n:
                    dev_used[dev] += self.service_memory[s]
            assert sum(dev_used.values()) == sum(resident)
            for d, total in enumerate(self.gpus[n]):
                assert self.core.gpu_free(n, d) == self.ref.gpu_free(n, d) == total - dev_used[d]


# -------------------------------------------------------------------- random streams

def inventories(draw, gpu_heavy: bool) -> Inventory:
    """1-4 nodes, cpu + memory (+ disk), 0-2 GPUs each, 0-3 services, 0-2 quotas. GPU-heavy:
    1-2 small GPUs on every node and 2-3 services competing for them."""
    custom = draw(st.booleans())
    nodes = []
    for n in range(draw(st.integers(1, 4))):
        res = {"cpu": draw(st.sampled_from([0, 1, 2, 2.5, 4, 8])), "memory": draw(st.sampled_from([0, 1024, 4096, 16384]))}
        if custom:
            res["disk"] = draw(st.sampled_from([0, 1, 3]))
        sizes = [1000, 2000, 4000] if gpu_heavy else [1000, 4000, 4000, 8000]
        gpus = [Gpu(draw(st.sampled_from(sizes))) for _ in range(draw(st.integers(1 if gpu_heavy else 0, 2)))]
        nodes.append(Node(f"n{n}", res, gpus))
    any_gpu = any(n.gpus for n in nodes)
    memories = [500, 1000, 1500, 2500] if gpu_heavy else [0, 1000, 2000, 2500, 3000, 5000]
    count = draw(st.integers(2, 3)) if gpu_heavy else draw(st.integers(0, 3)) if any_gpu else 0
    services = [Service(f"s{i}", draw(st.sampled_from(memories)), draw(st.sampled_from([0.0, 0.0, 0.5, 2.0])),
                        draw(st.integers(1, 3)))
                for i in range(count)]
    quotas = [Quota(f"q{i}", rate=draw(st.sampled_from([0.0, 0.5, 2.0, 10.0])), burst=draw(st.integers(1, 3)),
                    max_concurrency=draw(st.integers(0, 3)), tokens_per_minute=draw(st.sampled_from([0, 60, 1000])))
              for i in range(draw(st.integers(0, 2)))]
    return Inventory(nodes, quotas, services)


def policies(draw, starvation: list[float]) -> Policy:
    return Policy(
        name=draw(st.sampled_from(["tangram", "tangram", "tangram", "fifo"])),
        aging=draw(st.sampled_from([0.0, 0.5, 1.0, 4.0])),
        candidates=draw(st.sampled_from([1, 2, 4])),
        min_relative_gain=draw(st.sampled_from([0.0, 0.05, 0.3])),
        starvation_seconds=draw(st.sampled_from(starvation)),
    )


def draw_actions(draw, h: Harness, inv: Inventory) -> np.ndarray:
    kinds = inv.kinds
    n = draw(st.integers(1, 6))
    rec = empty_actions(len(kinds), n)
    has_gpu = any(node.gpus for node in inv.nodes)
    for r in rec:
        r["id"] = h.next_id
        h.next_id += 1
        r["trajectory"] = draw(st.integers(1, 5))
        r["priority"] = draw(st.sampled_from([0, 0, 0, 1, -1]))
        choices = {"cpu": [0, 0.5, 1, 1, 2, 3, 5, 100], "memory": [0, 0, 256, 1024, 4096], "disk": [0, 0, 1, 2]}
        demand = [draw(st.sampled_from(choices[k])) for k in kinds]
        service = draw(st.sampled_from([-1, -1] + list(range(len(inv.services))) * 2))
        if service < 0 and draw(st.integers(0, 4)) == 0:
            r["affinity"] = draw(st.integers(0, len(inv.nodes) - 1))
        r["service"] = service
        if has_gpu:
            r["gpu_memory"] = draw(st.sampled_from([0, 0, 200, 1000, 1500] if service >= 0 else [0, 0, 500, 1500, 3000]))
        elastic = [k for k in range(len(kinds)) if kinds[k] != "memory"]
        if draw(st.integers(0, 2)) == 0:
            k = draw(st.sampled_from(elastic))
            demand[k] = max(demand[k], draw(st.sampled_from([0.5, 1, 2])))
            r["elastic_kind"] = k
            r["elastic_max"] = demand[k] + draw(st.sampled_from([0, 1, 2, 3, 5.5]))
        r["demand"] = demand
        model = draw(st.sampled_from([MODEL_CONSTANT, MODEL_AMDAHL, MODEL_AMDAHL, MODEL_TABLE]))
        r["model"] = model
        r["seconds"] = draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0, 0.1 + 0.2]))
        r["parallel_fraction"] = draw(st.sampled_from([0.0, 0.3, 0.9, 0.9, 1.0]))
        r["table"] = draw(st.integers(0, len(TABLES) - 1)) if model == MODEL_TABLE else -1
        if inv.quotas and draw(st.booleans()):
            q = draw(st.integers(0, len(inv.quotas) - 1))
            r["quota"] = q
            r["tokens"] = draw(st.sampled_from([0, 1, 10, 50, 100, 2000]))
    return rec


def run_stream(data, starvation: list[float], gpu_heavy: bool = False) -> None:
    draw = data.draw
    inv = inventories(draw, gpu_heavy)
    policy = policies(draw, starvation)
    h = Harness(inv, policy)
    try:
        events(draw, h, inv)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{inv!r}\n{policy!r}\n{h.history()}") from None


def events(draw, h: Harness, inv: Inventory) -> None:
    for _ in range(draw(st.integers(1, 25))):
        step = draw(st.sampled_from([0, 0, 0.001, 0.1, 0.5, 1, 2.5, 10, 61]))
        wake = h.core.next_wakeup
        if wake is not None and draw(st.integers(0, 3)) == 0:
            h.now = max(h.now, wake)
        else:
            h.now += step
        event = draw(st.sampled_from(["submit"] * 4 + ["complete"] * 3 + ["complete_all", "cancel", "tick", "end",
                                                                            "invalid"]))
        if event == "submit":
            h.submit(draw_actions(draw, h, inv))
        elif event == "complete" and h.live("running"):
            running = h.live("running")
            h.complete(draw(st.lists(st.sampled_from(running), min_size=1, max_size=len(running), unique=True)))
        elif event == "complete_all" and h.live("running"):
            h.complete(h.live("running"))
        elif event == "cancel" and h.live():
            live = h.live()
            h.cancel(draw(st.lists(st.sampled_from(live), min_size=1, max_size=min(3, len(live)), unique=True)))
        elif event == "end":
            busy = {h.spec[i]["trajectory"] for i in h.live()}
            idle = sorted(h.trajectories - busy)
            if idle:
                h.end_trajectories(draw(st.lists(st.sampled_from(idle), min_size=1, unique=True)))
        elif event == "invalid":
            invalid_event(draw, h, inv)
        else:
            h.tick()
    h.drain()


def invalid_event(draw, h: Harness, inv: Inventory) -> None:
    """A refused event: both refuse it with the same error type and nothing changes."""
    what = draw(st.sampled_from(["complete_waiting", "unknown", "duplicate", "bad_affinity", "busy_trajectory"]))
    before = (h.core.waiting_count, h.core.running_count)
    if what == "complete_waiting" and h.live("waiting"):
        h.both("complete", np.array(h.live("waiting")[:1], dtype=np.uint64), h.now)
    elif what == "unknown":
        h.both("cancel", np.array([10**9], dtype=np.uint64), h.now)
    elif what == "duplicate" and h.live():
        rec = draw_actions(draw, h, inv)
        rec["id"][-1] = h.live()[0]
        h.both("submit", rec, h.now)
    elif what == "bad_affinity":
        rec = draw_actions(draw, h, inv)
        rec["service"], rec["affinity"] = -1, len(inv.nodes)
        h.both("submit", rec, h.now)
    elif what == "busy_trajectory" and h.live():
        h.both("end_trajectories", np.array([h.spec[h.live()[0]]["trajectory"]], dtype=np.uint64), h.now)
    assert (h.core.waiting_count, h.core.running_count) == before


# TANGRAM_DIFFERENTIAL_EXAMPLES raises the number of examples for a deeper check after a
# change to the core (2,500 take about five minutes here).
SETTINGS = settings(deadline=None, max_examples=int(os.environ.get("TANGRAM_DIFFERENTIAL_EXAMPLES", "250")),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Random inventories and event streams, starvation out of reach (the streams span minutes).
@SETTINGS
@given(st.data())
def test_random_streams_match_reference(data) -> None:
    run_stream(data, starvation=[1e6])


# Services competing for small GPUs: restores, evictions, moves, GPU room for actions.
@SETTINGS
@given(st.data())
def test_random_gpu_streams_match_reference(data) -> None:
    run_stream(data, starvation=[1e6, 2.0], gpu_heavy=True)


# The same with starvation in play: held-back nodes and halted passes.
@SETTINGS
@given(st.data())
def test_random_streams_with_starvation_match_reference(data) -> None:
    run_stream(data, starvation=[0.5, 2.0, 30.0])


# -------------------------------------------------------------------- deterministic cases

def actions(K: int, *specs: dict) -> np.ndarray:
    rec = empty_actions(K, len(specs))
    for r, s in zip(rec, specs):
        for key, value in s.items():
            r[key] = value
    return rec


# Spare elastic units go, one at a time, to the started action with the largest marginal
# gain, and only once nobody waits for the node.
def test_burst_with_spare_elastic_units() -> None:
    h = Harness(Inventory([Node("n0", {"cpu": 8, "memory": 4096}), Node("n1", {"cpu": 2, "memory": 4096})]), Policy())
    burst = actions(2, *[dict(id=i, demand=[1, 256], elastic_kind=0, elastic_max=6, model=MODEL_AMDAHL,
                              seconds=float(i), parallel_fraction=0.9) for i in (1, 2, 3)])
    out = h.submit(burst)
    grants = {int(d["action"]): int(d["grant_milli"]) for d in out if d["kind"] == START}
    assert len(grants) == 3 and sum(grants.values()) > 3000
    # Another wave while the node is contended: minimum grants only.
    h.now = 1.0
    out = h.submit(actions(2, *[dict(id=10 + i, demand=[3, 256], elastic_kind=0, elastic_max=8, model=MODEL_AMDAHL,
                                     seconds=5.0, parallel_fraction=0.9) for i in range(4)]))
    h.now = 2.0
    h.complete(h.live("running"))
    h.drain()


# An offloaded service is restored by evicting the idle one that costs least to bring back;
# its action starts once the restore is done.
def test_service_eviction() -> None:
    inv = Inventory([Node("n0", {"cpu": 4}, [Gpu(4000)])],
                    services=[Service("a", 3000, 1.0), Service("b", 2500, 2.0), Service("c", 1000, 0.5)])
    h = Harness(inv, Policy())
    out = h.submit(actions(1, dict(id=1, demand=[1], seconds=1, service=0)))
    assert [int(d["kind"]) for d in out] == [RESTORE]
    h.now = 1.0
    h.tick()
    assert h.state[1] == "running"
    h.complete([1])
    out = h.submit(actions(1, dict(id=2, demand=[1], seconds=1, service=1, gpu_memory=100),
                           dict(id=3, demand=[1], seconds=1, service=2)))
    # tangram restores whole queues before the walk, the most waiting per second of restore
    # plus queued work first: c (1 / 1.5 s) fits beside a at once, then b (1 / 3 s) evicts a.
    assert [(int(d["kind"]), int(d["service"])) for d in out][:3] == [(RESTORE, 2), (EVICT, 0), (RESTORE, 1)]
    h.now = h.core.next_wakeup
    h.tick()
    h.now += 5
    h.tick()
    h.drain()


# An action short of GPU memory that idle cached services hold evicts them; a service
# whose device is too small for an action beside it moves to a larger one.
def test_gpu_room_and_service_move() -> None:
    inv = Inventory([Node("n0", {"cpu": 4}, [Gpu(1000), Gpu(4000)])],
                    services=[Service("small", 1000), Service("big", 3000)])
    h = Harness(inv, Policy())
    h.submit(actions(1, dict(id=1, demand=[1], seconds=1, service=0), dict(id=2, demand=[1], seconds=1, service=1)))
    assert h.service_at == {0: (0, 0), 1: (0, 1)}
    h.now = 1.0
    h.complete([1, 2])
    out = h.submit(actions(1, dict(id=3, demand=[1], seconds=1, gpu_memory=2000)))
    assert [int(d["kind"]) for d in out] == [EVICT, START] and h.placed[3][0] == 0
    h.now = 2.0
    out = h.submit(actions(1, dict(id=4, demand=[1], seconds=1, service=0, gpu_memory=500)))
    assert [int(d["kind"]) for d in out] == [EVICT, RESTORE, START]
    assert h.service_at[0] == (0, 1)
    h.drain()


# Rate (GCRA with burst), concurrency and token budget: admissions and wakeups agree.
def test_quota_admission() -> None:
    inv = Inventory([Node("n0", {"cpu": 16})],
                    quotas=[Quota("api", rate=2.0, burst=2, max_concurrency=3, tokens_per_minute=600)])
    h = Harness(inv, Policy())
    h.submit(actions(1, *[dict(id=i, demand=[1], seconds=1, quota=0, tokens=150) for i in range(1, 7)]))
    assert h.count("running") == 2 and h.core.next_wakeup is not None
    for _ in range(12):
        h.now = h.core.next_wakeup if h.core.next_wakeup is not None else h.now + 1
        h.tick()
        if h.count("running") == 3:
            h.complete(h.live("running")[:1])
    h.drain()


# A starving action that fits nowhere halts the pass: nothing behind it starts.
def test_starvation_halts_the_pass() -> None:
    h = Harness(Inventory([Node("n0", {"cpu": 4})]), Policy(starvation_seconds=10))
    h.submit(actions(1, dict(id=1, demand=[3], seconds=1)))
    h.now = 20.0
    h.submit(actions(1, dict(id=2, demand=[2], seconds=1)))  # fails in its first pass
    h.now = 31.0
    h.submit(actions(1, dict(id=3, demand=[1], seconds=1)))
    assert h.state[3] == "waiting", "held back by the starving action 2"
    h.complete([1])
    assert h.state[2] == "running"
    h.drain()


# Refused calls raise the same error type in both and apply nothing.
@pytest.mark.parametrize("case", ["unknown_kind", "nan_demand", "negative", "elastic_below", "no_quota_tokens",
                                  "unknown_service", "unknown_table", "bad_fraction", "duplicate", "backwards"])
def test_validation_errors_match(case: str) -> None:
    inv = Inventory([Node("n0", {"cpu": 4}, [Gpu(1000)])], quotas=[Quota("q", rate=1)], services=[Service("s", 100)])
    h = Harness(inv, Policy())
    h.now = 5.0
    h.submit(actions(1, dict(id=1, demand=[1], seconds=1)))
    good = dict(id=2, demand=[1], seconds=1)
    bad = {
        "unknown_kind": dict(elastic_kind=3, elastic_max=2), "nan_demand": dict(demand=[math.nan]),
        "negative": dict(gpu_memory=-1), "elastic_below": dict(elastic_kind=0, elastic_max=0.5),
        "no_quota_tokens": dict(tokens=5), "unknown_service": dict(service=4), "unknown_table": dict(model=MODEL_TABLE),
        "bad_fraction": dict(model=MODEL_AMDAHL, parallel_fraction=1.5), "duplicate": dict(id=1), "backwards": {},
    }[case]
    now = 1.0 if case == "backwards" else h.now
    errors = []
    for sched in (h.core, h.ref):
        with pytest.raises((ValidationError, UnknownNameError, DuplicateIdError)) as e:
            sched.submit(actions(1, {**good, **bad}), now)
        errors.append(e.type)
    assert errors[0] is errors[1]
    h.check()
    with pytest.raises(InvalidStateError):
        h.ref.end_trajectories([0], h.now)
    h.drain()


# -------------------------------------------------------------------- regressions
# Each was once a divergence between the core and the reference (fixed in the core).


# A class that failed before (and was parked) still starves: at t=61 action 2 holds the
# node back, so action 3 does not take the core it is waiting for.
def test_parked_class_starves() -> None:
    h = Harness(Inventory([Node("n0", {"cpu": 4})]), Policy(starvation_seconds=60))
    h.submit(actions(1, dict(id=1, demand=[3], seconds=1)))
    h.submit(actions(1, dict(id=2, demand=[2], seconds=1)))
    h.now = 61.0
    h.submit(actions(1, dict(id=3, demand=[1], seconds=1)))
    assert h.state[3] == "waiting"
    h.drain()


# A request that can never fit is rejected at once, a service action over its quota's
# token budget included.
def test_service_action_over_token_budget_is_rejected() -> None:
    inv = Inventory([Node("n0", {"cpu": 4}, [Gpu(1000)])], quotas=[Quota("q", tokens_per_minute=10)],
                    services=[Service("s", 100)])
    h = Harness(inv, Policy())
    out = h.submit(actions(1, dict(id=1, demand=[1], seconds=1, service=0, quota=0, tokens=20)))
    assert [int(d["kind"]) for d in out] == [REJECT]


# A refused batch applies nothing, the clock included.
def test_refused_submit_leaves_the_clock() -> None:
    h = Harness(Inventory([Node("n0", {"cpu": 4})]), Policy())
    h.now = 5.0
    h.both("submit", actions(1, dict(id=1, demand=[1], seconds=1, affinity=7)), h.now)
    assert h.core.now == h.ref.now == 0.0
    h.now = 1.0
    h.tick()


# Spare elastic units go only where nobody waits. Action 3 (4 cores, any node) waits; at
# t=2 the eviction made for action 4 releases GPU memory (waking parked classes) before
# action 5 starts: action 3 still waits for cores, so action 5 gets no spare one.
def test_class_woken_mid_pass_still_contends() -> None:
    inv = Inventory([Node("n0", {"cpu": 4}, [Gpu(4000)])], services=[Service("a", 3000), Service("b", 3000)])
    h = Harness(inv, Policy())
    h.submit(actions(1, dict(id=1, demand=[1], seconds=1, service=0), dict(id=2, demand=[2], seconds=100)))
    h.now = 1.0
    h.complete([1])
    h.submit(actions(1, dict(id=3, demand=[4], seconds=1)))
    h.now = 2.0
    h.submit(actions(1, dict(id=4, demand=[0], seconds=1, service=1),
                     dict(id=5, demand=[1], elastic_kind=0, elastic_max=2, model=MODEL_AMDAHL, seconds=1,
                          parallel_fraction=1.0)))
    assert h.placed[5][2] == 1000
    h.drain()
