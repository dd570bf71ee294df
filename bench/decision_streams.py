"""Fingerprints of the core's decisions, for refactors that must not change them.

Hashes the decision streams of the burst and churn benchmarks (tangram.bench) at 64 and
1,024 nodes under every built-in policy, and the per-action outputs of `tangram sim` for
every policy on every built-in workload (seeds 0 and 3). Run it with one build, then the
other, and diff the two files:

    python bench/decision_streams.py before.json   # (build A installed)
    python bench/decision_streams.py after.json    # (build B installed)
    diff before.json after.json

About 20 s. A stream that cannot finish records its error text.
"""
from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Callable

import numpy as np

from tangram import bench
from tangram.scheduler import Policy
from tangram.sim import engine
from tangram.sim.workloads import builtin, builtin_names

POLICIES = {
    "tangram": Policy(),
    "fifo": Policy(name="fifo"),
    "optimus": Policy(name="optimus"),
    "trajectory": Policy(name="trajectory", trajectory_slot_cpu=4.0),
    "isolated": Policy(name="isolated", pools={0: 1.0}),
}


class Hashing:
    """A scheduler that hashes every decision record it gives."""

    def __init__(self, sched: Any, digest: Any) -> None:
        self.sched, self.digest = sched, digest

    def submit(self, records: np.ndarray, now: float) -> np.ndarray:
        return self._seen(self.sched.submit(records, now))

    def complete(self, ids: np.ndarray, now: float) -> np.ndarray:
        return self._seen(self.sched.complete(ids, now))

    def _seen(self, out: np.ndarray) -> np.ndarray:
        self.digest.update(out.tobytes())
        return out

    def __getattr__(self, name: str) -> Any:  # check_invariants, free: as the scheduler's
        return getattr(self.sched, name)


def fits_slots(make_actions: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """The benchmark's actions cut to fit 4-core trajectory slots (4 cores, 1 net unit)."""
    def make(*args: Any, **kwargs: Any) -> np.ndarray:
        rec = make_actions(*args, **kwargs)
        demand = rec["demand"].copy()
        demand[:, 0] = np.minimum(demand[:, 0], 4.0)
        demand[:, 3] = np.minimum(demand[:, 3], 1.0)
        rec["demand"] = demand
        rec["elastic_max"] = np.minimum(rec["elastic_max"], 4.0)
        return rec
    return make


def stream_hash(name: str, scenario: str, nodes: int) -> str:
    """The benchmark scenario run under policy `name`, its decisions hashed. The benchmark
    makes its own schedulers and actions; both are swapped here for the run."""
    digest = hashlib.sha256()
    make_scheduler, make_actions = bench.make_scheduler, bench.make_actions
    bench.make_scheduler = lambda impl, inv, policy=None: Hashing(make_scheduler(impl, inv, POLICIES[name]), digest)
    if name == "trajectory":
        bench.make_actions = fits_slots(make_actions)
    try:
        if scenario == "burst":
            bench.run_burst("core", nodes, 4000 if nodes > 64 else 600)
        else:
            bench.run_churn("core", nodes, 2000 if nodes > 64 else 300, 300)
    except RuntimeError as e:  # a stream that cannot finish: its error is its fingerprint
        return f"error {type(e).__name__}: {e}"[:120]
    finally:
        bench.make_scheduler, bench.make_actions = make_scheduler, make_actions
    return digest.hexdigest()[:16]


def sim_hash(workload: str, policy: str, seed: int) -> str:
    """`tangram sim`'s per-action arrays and totals for one step, hashed."""
    result = engine.simulate(builtin(workload), policy, seed=seed)
    digest = hashlib.sha256()
    for key, value in sorted(vars(result).items()):
        if isinstance(value, np.ndarray):
            digest.update(key.encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, (int, float, str, dict, list, tuple)):
            digest.update(f"{key}={plain(value)!r}".encode())
    return digest.hexdigest()[:16]


def plain(value: Any) -> Any:
    """`value` with its ints as plain ints, in lists, tuples and dicts: an IntEnum member
    (a DecisionKind in the service log) prints as its name, but fingerprints as the number
    it is, so that the fingerprint follows the decisions, not how their kinds print."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


def main(path: str) -> None:
    hashes = {}
    for name in POLICIES:
        for scenario in ("burst", "churn"):
            for nodes in (64, 1024):
                hashes[f"{name}/{scenario}/{nodes}"] = stream_hash(name, scenario, nodes)
    for workload in builtin_names():
        for policy in engine.POLICY_NAMES:
            for seed in (0, 3):
                hashes[f"sim/{workload}/{policy}/{seed}"] = sim_hash(workload, policy, seed)
    with open(path, "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    print(f"{len(hashes)} fingerprints written to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
