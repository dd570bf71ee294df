"""Workloads the simulator's tests share (tests/test_sim*.py)."""

from __future__ import annotations

import tangram.sim as sim


def tiny(**over):  # type: ignore[no-untyped-def]
    """A workload small enough to compute by hand: fixed times, no noise, no think time."""
    w = {
        "name": "tiny",
        "batch": 2,
        "turns": {"dist": "fixed", "value": 2},
        "think": 0,
        "noise_sigma": 0,
        "actions": [{"name": "cmd", "cpu": 1, "memory": 100, "seconds": 2.0}],
        "inventory": {"cpu_nodes": 1, "cpu_node": {"cpu": 1, "memory": 1000}},
    }
    w.update(over)
    return sim.Workload.from_dict(w)


def small_coding(batch: int = 96) -> sim.Workload:
    return sim.builtin("coding").with_batch(batch)
