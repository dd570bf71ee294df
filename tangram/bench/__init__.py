"""`tangram bench`: decision-latency benchmarks of the scheduler core.

Implementations, all driven by one driver through the same event methods (records in,
DECISION_DTYPE arrays out):

  core       the compiled core, `tangram._core.Scheduler` (the raw binding: the time is
             the core's plus one crossing per call)
  reference  the pure-Python reference, `tangram.bench.reference.ReferenceScheduler`, on the
             largest workload of a ladder (1,000 / 3,000 / 10,000 actions) that fits a
             time budget; `burst` says which, and the core also runs that size so that
             the speedup compares like with like
  numpy      `tangram.bench.numpy_placement.NumpyPlacement`: one vectorised first-fit/best-fit
             scan over a (nodes x kinds) free matrix per action, minimum grants, strict
             arrival order: what a straightforward vectorised Python scheduler costs

Scenarios:

  burst          `burst` actions arrive at t=0 in one submit call; the driver then completes
                 running actions in batches, in order of their modelled finish times
                 (start + the model's seconds at the granted units), until every action has
                 started. us_per_decision = wall time of all scheduler calls / start
                 decisions (the driver's own bookkeeping is outside the timed calls).
  churn          a steady state with about burst/2 actions waiting: each step completes the
                 `churn_step` earliest finishers (one call) and submits as many new actions
                 (one call). Time per start decision over the steps.
  single_submit  one action per call, from a prebuilt 1-record array, through
                 `tangram.Scheduler.submit` and through the raw `_core.Scheduler.submit`:
                 the per-call cost including its one start decision.

Each measurement is repeated; a row reports the fastest repeat (timeit's convention: the
one least disturbed by other work on the machine) with the median and slowest beside it,
and the header records the load average. `cpu us` (cpu_us_per_decision) is the same
measurement in this thread's CPU time, which time slices lost to other processes do not
inflate: when it is well below the wall-clock figure, the machine was busy.

The workload is deterministic (seeded NumPy RNG): four kinds (cpu, memory, disk, net),
nodes of 4 or 8 cores; mixed minimum demands, about half elastic in cpu with an Amdahl
model, a fifth pinned to their trajectory's node. The burst does not fit at once at any
size, so queueing, parking and the starvation rule are all exercised.

Usage: `tangram bench [--quick] [--json PATH]` or `python -m tangram.bench ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import heapq
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .. import _core
from .._errors import TangramError
from .._model import Inventory, Node
from .numpy_placement import NumpyPlacement
from .._records import DECISION_DTYPE, MODEL_AMDAHL, MODEL_CONSTANT, REJECT, START, empty_actions
from .._arguments import ArgumentParser, name_list, non_negative_int, non_negative_seconds, positive_int, writable_file
from ..scheduler import Policy, Scheduler, core_arguments

__all__ = ["Config", "KINDS", "make_actions", "make_inventory", "make_scheduler", "record_burst", "replay",
           "run_burst", "run_churn", "run_single_submit", "run", "format_table", "main"]

KINDS = ("cpu", "memory", "disk", "net")
IMPLS = ("core", "reference", "numpy")
CPU = 0  # index of "cpu" in KINDS (and in Inventory.kinds, which puts cpu and memory first)


# ====================================================================== workload


def make_inventory(nodes: int, seed: int = 0) -> Inventory:
    """`nodes` nodes of 4 or 8 cores, 4 GiB per core, 2 or 4 disk and net units."""
    rng = np.random.default_rng([seed, nodes, 1])
    cpu = rng.choice([4, 8], size=nodes)
    disk = rng.choice([2, 4], size=nodes)
    net = rng.choice([2, 4], size=nodes)
    return Inventory(nodes=[
        Node(f"node{i}", {"cpu": int(cpu[i]), "memory": int(cpu[i]) * 4096, "disk": int(disk[i]), "net": int(net[i])})
        for i in range(nodes)
    ])


def make_actions(count: int, nodes: int, seed: int = 0, first_id: int = 0, actions_per_trajectory: int = 8) -> np.ndarray:
    """`count` bulk action records (ids first_id...), deterministic in (count, nodes, seed).

    Minimum demands: cpu 1/2/4/8 cores, memory 0.5-8 GiB, disk 0/1, net 0/1/2. About half
    are elastic in cpu (Amdahl, parallel fraction 0.5-0.95, up to 2x or 4x the minimum,
    at most 8 cores); the others take a constant time. Run times are log-normal (median
    1 s). A fifth are pinned to their trajectory's node (8 actions per trajectory, nodes
    drawn at random) and ask for at most 4 cores, so every action fits some node.
    """
    rng = np.random.default_rng([seed, nodes, 2])
    rec = empty_actions(len(KINDS), count)
    idx = np.arange(count, dtype=np.uint64)
    rec["id"] = first_id + idx
    traj = (first_id + idx) // actions_per_trajectory
    rec["trajectory"] = traj
    cpu = rng.choice([1.0, 2.0, 4.0, 8.0], size=count, p=[0.35, 0.30, 0.20, 0.15])
    mem = rng.choice([512.0, 1024.0, 2048.0, 4096.0, 8192.0], size=count, p=[0.2, 0.3, 0.25, 0.15, 0.1])
    disk = rng.choice([0.0, 1.0], size=count, p=[0.6, 0.4])
    net = rng.choice([0.0, 1.0, 2.0], size=count, p=[0.5, 0.35, 0.15])
    pinned = rng.random(count) < 0.2
    # The node of each trajectory: a fixed hash of the trajectory id, so it does not depend
    # on how the stream is cut into calls.
    home = (traj.astype(np.uint64) * np.uint64(2654435761) + np.uint64(seed)) % np.uint64(nodes)
    cpu = np.where(pinned, np.minimum(cpu, 4.0), cpu)
    rec["affinity"] = np.where(pinned, home.astype(np.int64), -1)
    rec["demand"] = np.stack([cpu, mem, disk, net], axis=1)
    elastic = rng.random(count) < 0.5
    rec["elastic_kind"] = np.where(elastic, CPU, -1)
    rec["elastic_max"] = np.where(elastic, np.maximum(cpu, np.minimum(8.0, cpu * rng.choice([2.0, 4.0], size=count))), 0.0)
    rec["model"] = np.where(elastic, MODEL_AMDAHL, MODEL_CONSTANT)
    rec["parallel_fraction"] = np.where(elastic, rng.uniform(0.5, 0.95, size=count), 0.0)
    rec["seconds"] = np.round(rng.lognormal(mean=0.0, sigma=0.8, size=count), 3) + 0.01
    return rec


def model_seconds(records: np.ndarray, grant: np.ndarray) -> np.ndarray:
    """Run time of each record at its granted units (base units of its elastic kind)."""
    seconds = records["seconds"]
    ek = records["elastic_kind"]
    amdahl = (records["model"] == MODEL_AMDAHL) & (ek >= 0)
    if not amdahl.any():
        return seconds.astype(np.float64)
    minimum = records["demand"][np.arange(len(records)), np.maximum(ek, 0)]
    p = records["parallel_fraction"]
    units = np.where(amdahl & (grant > 0), grant, np.where(minimum > 0, minimum, 1.0))
    ratio = np.divide(minimum, units, out=np.ones_like(units), where=units > 0)
    return np.where(amdahl, seconds * ((1.0 - p) + p * ratio), seconds)


# ====================================================================== implementations


def _reference_class() -> Any:
    from .reference import ReferenceScheduler  # written separately; optional here

    return ReferenceScheduler


def reference_available() -> tuple[bool, str]:
    try:
        _reference_class()
    except Exception as e:  # noqa: BLE001 - report any import failure in the header
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def make_scheduler(impl: str, inventory: Inventory, policy: Policy | None = None) -> Any:
    """A fresh scheduler of `impl` with the submit/complete/tick record interface."""
    args = core_arguments(inventory, policy or Policy())
    if impl == "core":
        return _core.Scheduler(**args, decision_dtype=DECISION_DTYPE)
    if impl == "reference":
        return _reference_class()(**args)
    if impl == "numpy":
        return NumpyPlacement(**args)
    raise ValueError(f"unknown impl {impl!r} (one of {', '.join(IMPLS)})")


# ====================================================================== driver


@dataclass
class Result:
    impl: str
    scenario: str
    nodes: int
    kinds: int
    burst: int  # actions submitted at t=0 (burst) or the waiting target x 2 (churn)
    actions: int  # start decisions timed
    calls: int
    seconds: float  # wall time inside the scheduler calls
    us_per_decision: float
    started_at_t0: int = 0
    rejected: int = 0
    virtual_seconds: float = 0.0  # the simulated clock at the end
    pools_full: bool | None = None  # every pool back to its capacity after the drain
    extra: dict[str, Any] = field(default_factory=dict)


class _Sim:
    """Running actions by modelled finish time; times every scheduler call."""

    def __init__(self, sched: Any, records: np.ndarray) -> None:
        self.sched = sched
        self.records = records
        self.first_id = int(records["id"][0]) if len(records) else 0
        self.heap: list[tuple[float, int]] = []
        self.ns = 0  # wall time inside the scheduler calls
        self.cpu_ns = 0  # this thread's CPU time inside them (not inflated by preemption)
        self.calls = 0
        self.starts = 0
        self.rejects = 0
        self.submitted = 0

    def _take(self, out: np.ndarray) -> None:
        kind = out["kind"]
        if (kind == REJECT).any():
            self.rejects += int((kind == REJECT).sum())
            raise RuntimeError(f"the workload produced {int((kind == REJECT).sum())} rejected action(s)")
        starts = out[kind == START]
        if not len(starts):
            return
        self.starts += len(starts)
        idx = starts["action"].astype(np.int64) - self.first_id
        finish = starts["time"] + model_seconds(self.records[idx], starts["grant"])
        push = heapq.heappush
        for f, a in zip(finish.tolist(), starts["action"].tolist()):
            push(self.heap, (f, a))

    def submit(self, lo: int, hi: int, now: float) -> None:
        self._timed(self.sched.submit, self.records[lo:hi], now)
        self.submitted += hi - lo

    def complete_next(self, count: int) -> float:
        """Completes the `count` earliest finishers at the last one's finish time."""
        if not self.heap:
            raise RuntimeError("actions wait but none runs: the workload cannot make progress")
        pop = heapq.heappop
        items = [pop(self.heap) for _ in range(min(count, len(self.heap)))]
        now = items[-1][0]
        self._timed(self.sched.complete, np.fromiter((a for _, a in items), dtype=np.uint64, count=len(items)), now)
        return now

    def _timed(self, event: Callable[[np.ndarray, float], np.ndarray], records: np.ndarray, now: float) -> None:
        """One event into the scheduler, its wall and CPU time counted, its decisions taken."""
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = event(records, now)
        self.ns += time.perf_counter_ns() - t0
        self.cpu_ns += time.thread_time_ns() - c0
        self.calls += 1
        self._take(out)

    def drain(self) -> float:
        """Completes everything still running (untimed); returns the final time."""
        now = 0.0
        while self.heap:
            items, self.heap = self.heap, []
            now = max(f for f, _ in items)
            ids = np.array([a for _, a in items], dtype=np.uint64)
            self._take(self.sched.complete(ids, now))
        return now

    @property
    def waiting(self) -> int:
        return self.submitted - self.starts - self.rejects


def _pools_full(sched: Any, capacity: np.ndarray) -> bool | None:
    """True when every node's free vector equals its capacity (None: cannot tell)."""
    free = getattr(sched, "free", None)
    if not callable(free):
        free = getattr(sched, "free_milli", None)  # the reference's name for it
    if not callable(free):
        return None
    try:
        nodes, kinds = capacity.shape
        got = np.array([[free(n, k) for k in range(kinds)] for n in range(nodes)], dtype=np.int64)
    except Exception:  # noqa: BLE001 - an implementation without this query
        return None
    return bool(np.array_equal(got, capacity))


def _check(sched: Any) -> None:
    check = getattr(sched, "check_invariants", None)
    if callable(check):
        check()


def run_burst(impl: str, nodes: int, burst: int, *, batch: int = 32, seed: int = 0, check: bool = True,
              inventory: Inventory | None = None, records: np.ndarray | None = None) -> Result:
    """One burst: `burst` actions at t=0, then completions in finish order until all started."""
    inventory = inventory or make_inventory(nodes, seed)
    records = make_actions(burst, nodes, seed) if records is None else records
    sched = make_scheduler(impl, inventory)
    sim = _Sim(sched, records)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        sim.submit(0, len(records), 0.0)
        at_t0 = sim.starts
        now = 0.0
        while sim.starts < len(records):
            now = sim.complete_next(batch)
    finally:
        if gc_was:
            gc.enable()
    timed_starts, timed_ns, cpu_ns, calls = sim.starts, sim.ns, sim.cpu_ns, sim.calls
    full = None
    if check:
        _check(sched)
        sim.drain()
        _check(sched)
        capacity = np.asarray(core_arguments(inventory, Policy())["capacity"])
        full = _pools_full(sched, capacity)
        if full is False:
            raise AssertionError(f"{impl}: pools not back to capacity after the burst drained")
    return Result(impl=impl, scenario="burst", nodes=nodes, kinds=len(inventory.kinds), burst=len(records),
                  actions=timed_starts, calls=calls, seconds=timed_ns / 1e9,
                  us_per_decision=timed_ns / 1e3 / max(timed_starts, 1), started_at_t0=at_t0,
                  virtual_seconds=now, pools_full=full,
                  extra={"batch": batch, "cpu_us_per_decision": round(cpu_ns / 1e3 / max(timed_starts, 1), 4)})


def record_burst(impl: str, inventory: Inventory, records: np.ndarray, batch: int = 32) -> list[tuple[str, np.ndarray, float]]:
    """The burst's event sequence as ("submit" | "complete", records | ids, now), recorded
    from one run of `impl`. The schedulers are deterministic, so `replay` on a fresh one of
    the same impl repeats it decision for decision, with no driver work in between."""
    events: list[tuple[str, np.ndarray, float]] = []
    sched = make_scheduler(impl, inventory)

    class Recorder:
        def submit(self, recs: np.ndarray, now: float) -> np.ndarray:
            events.append(("submit", recs, now))
            return sched.submit(recs, now)

        def complete(self, ids: np.ndarray, now: float) -> np.ndarray:
            events.append(("complete", ids, now))
            return sched.complete(ids, now)

    sim = _Sim(Recorder(), records)
    sim.submit(0, len(records), 0.0)
    while sim.starts < len(records):
        sim.complete_next(batch)
    return events


def replay(sched: Any, events: Sequence[tuple[str, np.ndarray, float]]) -> int:
    """Feeds recorded events to `sched`; returns the number of start decisions."""
    starts = 0
    for kind, arg, now in events:
        out = sched.submit(arg, now) if kind == "submit" else sched.complete(arg, now)
        starts += int(np.count_nonzero(out["kind"] == START))
    return starts


def run_churn(impl: str, nodes: int, waiting: int, steps: int, *, step: int = 8, seed: int = 0,
              check: bool = True, inventory: Inventory | None = None) -> Result:
    """Steady state: about `waiting` actions wait; each step completes `step` and submits `step`."""
    inventory = inventory or make_inventory(nodes, seed)
    chunk = max(1, waiting // 4)
    # Enough records for the warm-up (the running set plus `waiting`, in chunks) and the steps.
    capacity_guess = sum(int(n.resources["cpu"]) for n in inventory.nodes)
    stream = make_actions(capacity_guess + 2 * waiting + 2 * chunk + steps * step, nodes, seed + 1)
    sched = make_scheduler(impl, inventory)
    sim = _Sim(sched, stream)
    pos = 0
    while sim.waiting < waiting:  # warm-up at t=0, untimed
        if pos + chunk > len(stream):
            raise RuntimeError("churn warm-up ran out of records")
        sim.submit(pos, pos + chunk, 0.0)
        pos += chunk
    sim.ns = sim.cpu_ns = sim.calls = 0
    starts0 = sim.starts
    waiting_seen: list[int] = []
    now = 0.0
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(steps):
            now = sim.complete_next(step)
            if pos + step > len(stream):
                break
            sim.submit(pos, pos + step, now)
            pos += step
            waiting_seen.append(sim.waiting)
    finally:
        if gc_was:
            gc.enable()
    timed_starts = sim.starts - starts0
    if check:
        _check(sched)
    return Result(impl=impl, scenario="churn", nodes=nodes, kinds=len(inventory.kinds), burst=2 * waiting,
                  actions=timed_starts, calls=sim.calls, seconds=sim.ns / 1e9,
                  us_per_decision=sim.ns / 1e3 / max(timed_starts, 1), virtual_seconds=now,
                  extra={"cpu_us_per_decision": round(sim.cpu_ns / 1e3 / max(timed_starts, 1), 4),
                         "step": step, "steps": steps, "waiting_target": waiting,
                         "waiting_mean": round(statistics.fmean(waiting_seen), 1) if waiting_seen else 0})


def run_single_submit(nodes: int = 1024, calls: int = 2000, rounds: int = 5, seed: int = 0) -> list[Result]:
    """Submits one action per call (a prebuilt 1-record array), through the public
    `tangram.Scheduler.submit` and through the raw `_core.Scheduler.submit`. Each action is
    1 cpu, 512 MiB and starts at once; after each round the actions complete (untimed)."""
    inventory = make_inventory(nodes, seed)
    results = []
    for api in ("Scheduler.submit", "_core.Scheduler.submit"):
        sched = Scheduler(inventory)
        target = sched.submit if api == "Scheduler.submit" else sched.core.submit
        complete = sched.core.complete
        per_call: list[float] = []
        cpu: list[float] = []
        next_id = 0
        for _ in range(rounds + 1):  # the first round warms up
            rec = sched.new_actions(calls)
            rec["id"] = np.arange(next_id, next_id + calls, dtype=np.uint64)
            next_id += calls
            rec["demand"] = (1.0, 512.0, 0.0, 0.0)
            rec["seconds"] = 1.0
            singles = [rec[i:i + 1] for i in range(calls)]
            now = float(len(per_call))
            gc_was = gc.isenabled()
            gc.disable()
            try:
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                for r in singles:
                    target(r, now)
                ns = time.perf_counter_ns() - t0
                cpu.append((time.thread_time_ns() - c0) / 1e3 / calls)
            finally:
                if gc_was:
                    gc.enable()
            if sched.running != calls:
                raise AssertionError(f"{api}: {sched.running} of {calls} single submits started")
            complete(rec["id"], now)
            per_call.append(ns / 1e3 / calls)
        per_call, cpu = per_call[1:], cpu[1:]
        sched.check_invariants()
        best, med = min(per_call), statistics.median(per_call)
        results.append(Result(impl="core", scenario="single_submit", nodes=nodes, kinds=len(inventory.kinds), burst=1,
                              actions=calls, calls=calls, seconds=best * calls / 1e6, us_per_decision=best,
                              extra={"api": api, "us_per_call": round(best, 4), "cpu_us_per_decision": round(min(cpu), 4),
                                     "repeats": rounds,
                                     "us_per_decision_median": round(med, 4), "us_per_decision_max": round(max(per_call), 4)}))
    return results


# ====================================================================== the run


@dataclass
class Config:
    sizes: Sequence[int] = (64, 1024, 4096)
    burst: int = 10_000
    batch: int = 32  # completions per complete() call in the burst
    repeats: int = 5  # core burst and churn repeats (the fastest is reported, the median beside it)
    numpy_repeats: int = 2
    churn_steps: int = 1000
    churn_step: int = 8
    # The reference runs a ladder of workload sizes and keeps the largest that fits its
    # time budget per (scenario, size); the core also runs that size for the speedup. The
    # first rung always runs to the end, so it is small: the reference's malleable-grant
    # search grows steeply with the number waiting (churn on 1,024 nodes: minutes at 1,000).
    reference_ladder: Sequence[int] = (100, 300, 1000, 3000, 10_000)
    reference_budget_s: float = 25.0
    single_calls: int = 2000
    single_rounds: int = 5
    seed: int = 0
    impls: Sequence[str] = IMPLS

    @staticmethod
    def quick() -> "Config":
        return Config(sizes=(64, 1024, 4096), burst=2000, repeats=2, numpy_repeats=1, churn_steps=200,
                      reference_ladder=(300, 1000), reference_budget_s=3.0, single_calls=1000, single_rounds=3)


def _best_result(results: list[Result]) -> Result:
    """The fastest of the repeats (timeit's convention: the least disturbed by other work on
    the machine), with the median and the slowest alongside."""
    ordered = sorted(results, key=lambda r: r.us_per_decision)
    best = ordered[0]
    best.pools_full = next((r.pools_full for r in results if r.pools_full is not None), None)
    cpu = [r.extra["cpu_us_per_decision"] for r in results if "cpu_us_per_decision" in r.extra]
    best.extra = dict(best.extra, repeats=len(results), cpu_us_per_decision_min=min(cpu) if cpu else None,
                      us_per_decision_median=round(statistics.median(r.us_per_decision for r in results), 4),
                      us_per_decision_max=round(ordered[-1].us_per_decision, 4))
    return best


def _repeat(fn: Callable[[bool], Result], repeats: int) -> Result:
    # The first run checks correctness (invariants, pools back to full); the rest only time.
    return _best_result([fn(i == 0) for i in range(max(1, repeats))])


class _OverBudget(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raises _OverBudget in the main thread after `seconds` (no limit elsewhere)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _OverBudget()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _reference_ladder(fn: Callable[[int], Result], ladder: Sequence[int], budget_s: float) -> Result | None:
    """Runs fn(size) up the ladder while the predicted time (quadratic growth) fits the
    budget; a step that overruns what is left of the budget is abandoned. The first step
    always runs to completion."""
    best = None
    spent = 0.0
    last_size, last_s = 0, 0.0
    for size in ladder:
        t0 = time.perf_counter()
        if best is None:
            best = fn(size)
        else:
            predicted = last_s * (size / last_size) ** 2
            if spent + predicted > budget_s:
                break
            try:
                with _time_limit(budget_s - spent):
                    best = fn(size)
            except _OverBudget:
                break
        last_s = time.perf_counter() - t0
        last_size = size
        spent += last_s
    return best


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    commit = dirty = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
        if commit:
            dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                        capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    from .. import __version__

    return {
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "tangram": __version__,
        "git_commit": commit,
        "git_dirty": dirty,  # tracked files modified since that commit
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Other work on the machine skews wall-clock timings: the 1-minute load average at
        # the start (compare with cpu_count).
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def run(config: Config, log: Callable[[str], None] = lambda s: None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs every benchmark of `config`; returns (header, rows)."""
    has_ref, ref_error = reference_available()
    impls = [i for i in config.impls if i != "reference" or has_ref]
    header = machine_info()
    header["config"] = asdict(config)
    header["reference"] = "available" if has_ref else f"unavailable ({ref_error})"
    header["kinds"] = list(KINDS)
    rows: list[Result] = []

    def add(r: Result | None) -> None:
        if r is None:
            return
        rows.append(r)
        log(f"  {r.scenario:<13} {r.impl:<9} nodes={r.nodes:<5} actions={r.actions:<6} "
            f"{r.us_per_decision:10.3f} us/decision")

    for nodes in config.sizes:
        inventory = make_inventory(nodes, config.seed)
        records = make_actions(config.burst, nodes, config.seed)
        log(f"{nodes} nodes")
        for impl, repeats in (("core", config.repeats), ("numpy", config.numpy_repeats)):
            if impl not in impls:
                continue
            add(_repeat(lambda chk, impl=impl: run_burst(impl, nodes, config.burst, batch=config.batch,
                                                         seed=config.seed, check=chk, inventory=inventory,
                                                         records=records), repeats))
            add(_repeat(lambda chk, impl=impl: run_churn(impl, nodes, config.burst // 2, config.churn_steps,
                                                         step=config.churn_step, seed=config.seed, check=chk,
                                                         inventory=inventory), repeats))
        if "reference" in impls:
            def ref_burst(size: int) -> Result:
                return run_burst("reference", nodes, size, batch=config.batch, seed=config.seed, inventory=inventory)

            def ref_churn(size: int) -> Result:
                steps = max(20, config.churn_steps * size // config.burst)
                return run_churn("reference", nodes, size // 2, steps, step=config.churn_step, seed=config.seed,
                                 inventory=inventory)

            ladder = [size for size in config.reference_ladder if size < config.burst] + [config.burst]
            rb = _reference_ladder(ref_burst, ladder, config.reference_budget_s)
            rc = _reference_ladder(ref_churn, ladder, config.reference_budget_s)
            for r in (rb, rc):
                if r is not None and r.burst < config.burst:
                    r.extra["note"] = f"smaller workload ({r.burst} actions) than the core's {config.burst}"
            add(rb)
            add(rc)
            # The core on the reference's workload, for a like-for-like speedup.
            if "core" in impls and rb is not None and rb.burst != config.burst:
                r = _repeat(lambda chk: run_burst("core", nodes, rb.burst, batch=config.batch, seed=config.seed,
                                                  check=chk, inventory=inventory), config.repeats)
                r.extra["note"] = "the reference's burst size, for the speedup"
                add(r)
            if "core" in impls and rc is not None and rc.burst != config.burst:
                steps = rc.extra["steps"]
                r = _repeat(lambda chk: run_churn("core", nodes, rc.burst // 2, steps, step=config.churn_step,
                                                  seed=config.seed, check=chk, inventory=inventory), config.repeats)
                r.extra["note"] = "the reference's churn size, for the speedup"
                add(r)
    if "core" in impls:
        log("single submit")
        for r in run_single_submit(nodes=1024, calls=config.single_calls, rounds=config.single_rounds, seed=config.seed):
            add(r)
    return header, [_row(r) for r in rows]


def _row(r: Result) -> dict[str, Any]:
    d = asdict(r)
    extra = d.pop("extra")
    d["seconds"] = round(d["seconds"], 6)
    d["us_per_decision"] = round(d["us_per_decision"], 4)
    d["virtual_seconds"] = round(d["virtual_seconds"], 3)
    d.update(extra)
    return d


# ====================================================================== report


def _speedups(rows: list[dict[str, Any]]) -> list[tuple[str, int, int, float, float, float]]:
    """(scenario, nodes, burst, core us, reference us, speedup) on identical workloads."""
    out = []
    for ref in rows:
        if ref["impl"] != "reference":
            continue
        for core in rows:
            if (core["impl"], core["scenario"], core["nodes"], core["burst"]) == (
                    "core", ref["scenario"], ref["nodes"], ref["burst"]) and core["us_per_decision"] > 0:
                out.append((ref["scenario"], ref["nodes"], ref["burst"], core["us_per_decision"],
                            ref["us_per_decision"], ref["us_per_decision"] / core["us_per_decision"]))
    return out


def format_table(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"tangram bench  ({header.get('cpu_model')}, {header.get('cpu_count')} cpus, Python {header.get('python')}, "
        f"numpy {header.get('numpy')}, {header.get('platform')}, load {header.get('load_average_1m')})",
        f"reference: {header.get('reference')}",
        "",
        f"{'scenario':<14}{'nodes':>6}{'kinds':>6}  {'impl':<10}{'burst':>7}{'decisions':>10}{'calls':>7}"
        f"{'us/decision':>13}{'cpu us':>9}{'at t=0':>8}  notes",
    ]
    order = {"burst": 0, "churn": 1, "single_submit": 2}
    impl_order = {"core": 0, "numpy": 1, "reference": 2}
    for r in sorted(rows, key=lambda r: (order.get(r["scenario"], 9), r["nodes"], -r["burst"],
                                         impl_order.get(r["impl"], 9), r.get("api", ""))):
        notes = []
        if r["scenario"] == "single_submit":
            notes.append(r.get("api", ""))
        if r.get("note"):
            notes.append(r["note"])
        if r["scenario"] == "churn":
            notes.append(f"mean waiting {r.get('waiting_mean')}")
        if r.get("repeats", 1) > 1:
            notes.append(f"best of {r['repeats']}, median {r['us_per_decision_median']:.3f}")
        at0 = str(r["started_at_t0"]) if r["scenario"] == "burst" else ""
        cpu = r.get("cpu_us_per_decision")
        cpu_s = f"{cpu:9.3f}" if cpu is not None else f"{'':9}"
        lines.append(f"{r['scenario']:<14}{r['nodes']:>6}{r['kinds']:>6}  {r['impl']:<10}{r['burst']:>7}"
                     f"{r['actions']:>10}{r['calls']:>7}{r['us_per_decision']:>13.3f}{cpu_s}{at0:>8}  {'; '.join(notes)}")
    sp = _speedups(rows)
    if sp:
        lines += ["", "core vs reference (same workload):"]
        for scen, nodes, burst, c, ref, x in sorted(sp):
            lines.append(f"  {scen:<6} {nodes:>5} nodes, {burst:>6} actions: core {c:8.3f} us, "
                         f"reference {ref:10.1f} us  ->  {x:8.0f}x")
    np_rows = {(r["scenario"], r["nodes"]): r for r in rows if r["impl"] == "numpy"}
    lines += ["", "core vs numpy placement scan (same workload):"]
    for r in rows:
        n = np_rows.get((r["scenario"], r["nodes"]))
        if r["impl"] == "core" and n and n["burst"] == r["burst"] and r["us_per_decision"] > 0:
            lines.append(f"  {r['scenario']:<6} {r['nodes']:>5} nodes, {r['burst']:>6} actions: core "
                         f"{r['us_per_decision']:8.3f} us, numpy {n['us_per_decision']:8.1f} us  ->  "
                         f"{n['us_per_decision'] / r['us_per_decision']:6.0f}x")
    lines += ["", "targets:"]
    burst1k = [r for r in rows if r["impl"] == "core" and r["scenario"] == "burst" and r["nodes"] == 1024
               and r["burst"] >= 10_000]
    for r in burst1k:
        ok = "met" if r["us_per_decision"] < 1.0 else "MISSED"
        lines.append(f"  1024-node burst of {r['burst']}: {r['us_per_decision']:.3f} us/decision (target < 1 us): {ok}")
    if not burst1k:
        lines.append("  1024-node burst of 10,000: not run (--quick, --sizes or --burst)")
    churn4k = [r for r in rows if r["impl"] == "core" and r["scenario"] == "churn" and r["nodes"] == 4096
               and r["burst"] >= 10_000]
    for r in churn4k:
        ok = "met" if r["us_per_decision"] <= 2.0 else "MISSED"
        lines.append(f"  4096-node churn ({r['burst'] // 2} waiting): {r['us_per_decision']:.3f} us/decision "
                     f"(target <= 2 us): {ok}")
    if not churn4k:
        lines.append("  4096-node churn of 5,000 waiting: not run (--quick, --sizes or --burst)")
    for scen, nodes, burst, c, ref, x in sp:
        if nodes == 1024:
            lines.append(f"  1024-node {scen} speedup vs reference: {x:.0f}x (target >= 50x): "
                         f"{'met' if x >= 50 else 'MISSED'}")
    for r in rows:
        if r["scenario"] == "single_submit":
            lines.append(f"  single submit via {r['api']}: {r['us_per_call']:.3f} us/call (target < 2 us): "
                         f"{'met' if r['us_per_call'] < 2.0 else 'MISSED'}")
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(positive_int(x) for x in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive node counts, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="tangram bench", description="Decision-latency benchmarks of the scheduler.")
    parser.add_argument("--json", metavar="PATH", help="write the header and rows as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (under a minute)")
    parser.add_argument("--sizes", type=_sizes, help="comma-separated node counts (default 64,1024,4096)")
    parser.add_argument("--impls", type=lambda s: name_list(s, IMPLS, "impl"),
                        help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--burst", type=positive_int, help="actions in the burst (default 10000; --quick 2000)")
    parser.add_argument("--repeats", type=positive_int, help="repeats of each core measurement (median reported)")
    parser.add_argument("--reference-budget", type=non_negative_seconds, metavar="SECONDS",
                        help="time budget of the reference per scenario and size")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        if args.json:
            writable_file(args.json, "--json")  # before the run, not after it
    except TangramError as e:
        parser.error(str(e))

    config = Config.quick() if args.quick else Config()
    if args.sizes:
        config.sizes = args.sizes
    if args.impls:
        config.impls = args.impls
    if args.burst is not None:
        config.burst = args.burst
    if args.repeats is not None:
        config.repeats = args.repeats
    if args.reference_budget is not None:
        config.reference_budget_s = args.reference_budget
    config.seed = args.seed

    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    header, rows = run(config, log)
    header["wall_seconds"] = round(time.perf_counter() - t0, 1)
    if hasattr(os, "getloadavg"):
        header["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(format_table(header, rows))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"header": header, "rows": rows}, f, indent=2)
                f.write("\n")
        except OSError as e:
            parser.error(f"--json: cannot write {args.json!r}: {e.strerror or e}")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
