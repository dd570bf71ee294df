"""Decision-latency microbenchmarks (pytest-benchmark).

Under the default `--benchmark-disable` each runs once as a correctness test; time them
with `pytest bench --benchmark-enable`. `tangram bench` (tangram/bench/__init__.py) is the fuller
report: more sizes, the churn scenario, machine info and core/reference ratios.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tangram
from tangram import bench
from tangram.bench.numpy_placement import NumpyPlacement
from tangram.scheduler import Policy, core_arguments

from bench.replica_queue import Queue

NODES = 1024
BURST = 10_000
REFERENCE_BURST = 300  # the pure-Python reference on a smaller burst of the same workload


@pytest.fixture(scope="module")
def inventory() -> tangram.Inventory:
    return bench.make_inventory(NODES)


@pytest.fixture(scope="module")
def records() -> np.ndarray:
    return bench.make_actions(BURST, NODES)


def _burst(benchmark, impl: str, inventory: tangram.Inventory, records: np.ndarray) -> object:
    # Timed: only the scheduler calls of the burst, replayed from a recording (the driver's
    # finish-time bookkeeping is not in the measurement). Each round gets a fresh scheduler.
    events = bench.record_burst(impl, inventory, records)
    schedulers = []

    def setup():  # type: ignore[no-untyped-def]
        schedulers.append(bench.make_scheduler(impl, inventory))
        return (schedulers[-1], events), {}

    starts = benchmark.pedantic(bench.replay, setup=setup, rounds=3)
    assert starts == len(records), f"{starts} of {len(records)} actions started"
    sched = schedulers[-1]
    assert sched.waiting_count == 0
    # Complete everything still running: every pool must come back to exactly its capacity.
    running = np.setdiff1d(records["id"], np.concatenate([ids for kind, ids, _ in events if kind == "complete"]))
    sched.complete(running, events[-1][2] + 1e3)
    capacity = np.asarray(core_arguments(inventory, Policy())["capacity"])
    assert bench._pools_full(sched, capacity) is True
    bench._check(sched)
    benchmark.extra_info.update(actions=len(records), calls=len(events))
    return sched


# Invariant: every action of a 10,000-action burst on 1,024 nodes starts exactly once with
# no rejection, the burst queues (it does not all fit at t=0), and once everything has
# completed every pool is back to exactly its capacity.
def test_burst_core(benchmark, inventory, records):
    sched = _burst(benchmark, "core", inventory, records)
    assert sched.running_count == 0
    first = bench.make_scheduler("core", inventory).submit(records, 0.0)
    assert (first["kind"] == tangram._records.START).sum() < len(records)
    assert not (first["kind"] == tangram._records.REJECT).any()


# Invariant: the reference starts every action of its (smaller) burst of the same workload
# and returns every pool to capacity.
def test_burst_reference(benchmark, inventory):
    pytest.importorskip("tangram.bench.reference")
    sched = _burst(benchmark, "reference", inventory, bench.make_actions(REFERENCE_BURST, NODES))
    assert sched.running_count == 0


# Invariant: the NumPy placement scan starts every action, never exceeds a node's capacity
# in any kind at any point (checked after every call), and returns every pool to capacity.
def test_burst_numpy_placements_valid(benchmark, inventory, records):
    capacity = np.asarray(core_arguments(inventory, Policy())["capacity"])

    # Within a call free room only shrinks after the releases, so checking after every
    # call catches any placement that overcommits a node.
    class Checked(NumpyPlacement):
        calls = 0

        def _checked(self, out):  # type: ignore[no-untyped-def]
            assert (self.free_matrix >= 0).all(), "capacity exceeded"
            assert (self.free_matrix <= capacity).all(), "free above capacity"
            Checked.calls += 1
            if Checked.calls % 50 == 0:
                self.check_invariants()  # free + used == capacity, O(live actions)
            return out

        def submit(self, recs, now):  # type: ignore[no-untyped-def]
            return self._checked(super().submit(recs, now))

        def complete(self, ids, now):  # type: ignore[no-untyped-def]
            return self._checked(super().complete(ids, now))

    def once() -> tuple[bench._Sim, Checked]:
        sched = Checked(**core_arguments(inventory, Policy()))
        sim = bench._Sim(sched, records)
        sim.submit(0, len(records), 0.0)
        while sim.starts < len(records):
            sim.complete_next(32)
        sim.drain()
        return sim, sched

    sim, sched = benchmark.pedantic(once, rounds=1, iterations=1)
    sched.check_invariants()
    assert sim.starts == BURST
    assert sched.waiting_count == 0 and sched.running_count == 0
    assert np.array_equal(sched.free_matrix, capacity)


# Invariant: the timed NumPy burst (no per-call checks) also starts everything and leaves
# every pool full.
def test_burst_numpy(benchmark, inventory, records):
    sched = _burst(benchmark, "numpy", inventory, records)
    assert sched.running_count == 0


SINGLE_ROUNDS, SINGLE_ITERATIONS = 200, 50


def _single_submit(benchmark, raw: bool) -> tuple[tangram.Scheduler, np.ndarray]:
    # Capacity for every call pytest-benchmark makes: each action starts at once, so every
    # call does the same work (one start decision); the records are built beforehand.
    inventory = tangram.Inventory.uniform(64, {"cpu": 1e6, "memory": 1e9, "disk": 1e6, "net": 1e6})
    sched = tangram.Scheduler(inventory)
    count = SINGLE_ROUNDS * SINGLE_ITERATIONS + 1
    rec = sched.new_actions(count)
    rec["id"] = np.arange(count, dtype=np.uint64)
    rec["demand"] = (1.0, 512.0, 0.0, 0.0)
    rec["seconds"] = 1.0
    singles = iter([rec[i:i + 1] for i in range(count)])
    submit = sched._core.submit if raw else sched.submit

    def submit_one():  # type: ignore[no-untyped-def]
        return submit(next(singles), 0.0)

    out = benchmark.pedantic(submit_one, rounds=SINGLE_ROUNDS, iterations=SINGLE_ITERATIONS)
    return sched, out


# Invariant: one action submitted alone through the public Scheduler starts at once, and
# every call so far started its action (nothing waits).
def test_single_submit_scheduler(benchmark):
    sched, out = _single_submit(benchmark, raw=False)
    assert len(out) == 1 and out[0].kind == "start"
    assert sched.waiting == 0 and sched.running >= 1
    sched.check_invariants()


# Invariant: the same through the raw binding: one start decision record per call.
def test_single_submit_raw_core(benchmark):
    sched, out = _single_submit(benchmark, raw=True)
    assert len(out) == 1 and out["kind"][0] == tangram._records.START
    assert sched.waiting == 0 and sched.running >= 1
    sched.check_invariants()


# Invariant: `tangram bench` writes a header with the machine's description and one row per
# (impl, scenario, size) with the fields the report promises; the core/reference speedup
# compares rows of the same workload.
def test_bench_main_json(tmp_path, capsys):
    pytest.importorskip("tangram.bench.reference")
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--sizes", "64", "--burst", "300", "--repeats", "1", "--reference-budget", "0.5",
                       "-q", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    header, rows = data["header"], data["rows"]
    for key in ("platform", "cpu_model", "python"):
        assert header[key]
    for row in rows:
        for key in ("impl", "nodes", "kinds", "scenario", "us_per_decision", "actions"):
            assert key in row
        assert row["us_per_decision"] > 0 and row["kinds"] == 4
    seen = {(r["impl"], r["scenario"]) for r in rows}
    assert {("core", "burst"), ("core", "churn"), ("numpy", "burst"), ("reference", "burst"),
            ("core", "single_submit")} <= seen
    assert {r["api"] for r in rows if r["scenario"] == "single_submit"} == {"Scheduler.submit", "_core.Scheduler.submit"}
    assert "core vs reference" in capsys.readouterr().out


# Invariant: a replicated service (4 copies, max_batch 8) with 10,000 calls queued, or one
# copy of it, completes 500 calls one event at a time: each call starts once, none is
# rejected, the queue keeps every copy busy (4 copies: all used), and what is left is
# exactly what was submitted less what ended. Timed, the events (`python
# bench/replica_queue.py` compares the two and longer queues).
@pytest.mark.parametrize("copies", [1, 4])
def test_replica_queue_completions(benchmark, copies):
    queue = Queue(10_000, copies)

    def events():  # type: ignore[no-untyped-def]
        for _ in range(500):
            queue.complete_first()

    benchmark.pedantic(events, rounds=1, iterations=1)
    queue.sched.check_invariants()
    assert queue.completed == 500 and len(queue.started) == 8 * copies
    assert queue.sched.waiting + queue.sched.running == queue.submitted - queue.completed
    assert queue.copies_used == ({f"rm#{i}" for i in range(copies)} if copies > 1 else {"rm"})
