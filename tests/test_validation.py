"""Typed errors through the Python face: the exception class and the field it names.

Every refused call applies nothing: the scheduler's state after it is as before.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import tangram
from tangram import (
    Action,
    DuplicateIdError,
    Gpu,
    InvalidStateError,
    Inventory,
    Node,
    Quota,
    Scheduler,
    Service,
    Table,
    TangramError,
    UnknownActionError,
    UnknownNameError,
    ValidationError,
)


def inventory() -> Inventory:
    return Inventory(
        nodes=[Node("a", {"cpu": 8, "memory": 4096}, [Gpu(8000)]), Node("b", {"cpu": 8, "memory": 4096})],
        quotas=[Quota("api", rate=1.0)],
        services=[Service("rm", 1000)],
    )


@pytest.fixture
def s() -> Scheduler:
    return Scheduler(inventory())


def refused(s: Scheduler, call, cls: type, field: str) -> TangramError:
    """`call()` raises exactly `cls` naming `field`, and changes nothing."""
    before = (s.waiting, s.running, s.now)
    with pytest.raises(cls) as info:
        call()
    e = info.value
    assert type(e) is cls, f"{type(e).__name__}: {e}"
    assert e.field == field, str(e)
    assert e.reason and str(e) == f"{field}: {e.reason}"
    s.check_invariants()
    assert (s.waiting, s.running) == before[:2]
    return e


def test_error_hierarchy():
    assert issubclass(ValidationError, ValueError) and issubclass(ValidationError, TangramError)
    assert issubclass(UnknownNameError, ValidationError)
    assert issubclass(DuplicateIdError, ValidationError)
    assert issubclass(UnknownActionError, LookupError)
    assert issubclass(InvalidStateError, RuntimeError)
    for cls in (ValidationError, UnknownNameError, DuplicateIdError, UnknownActionError, InvalidStateError):
        assert issubclass(cls, TangramError)


# ------------------------------------------------------------------ action values

@pytest.mark.parametrize(
    "value, words",
    [(math.nan, "finite"), (math.inf, "finite"), (-math.inf, "finite"), (-1.0, "negative"), (-0.001, "negative"),
     (1e13, "absurdly large")],
)
def test_bad_demand(s, value, words):
    e = refused(s, lambda: s.submit([Action(1, {"cpu": 1}), Action(2, {"memory": value})], 0),
                ValidationError, "actions[1].demand.memory")
    assert words in e.reason
    assert s.state(1) == "unknown"  # nothing of the batch applied


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 1e13])
def test_bad_gpu_memory(s, value):
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, gpu_memory=value), 0), ValidationError, "actions[0].gpu_memory")


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 2e9])
def test_bad_runtime_seconds(s, value):
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, value), 0), ValidationError, "actions[0].runtime.seconds")


def test_bad_runtime_type(s):
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, "slow"), 0), ValidationError, "actions[0].runtime")
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, tangram.Amdahl(10, 1.5), elastic="cpu", max_units=2), 0),
            ValidationError, "actions[0].runtime.parallel_fraction")


def test_bad_demand_type_and_ids(s):
    refused(s, lambda: s.submit(Action(1, {"cpu": "two"}), 0), ValidationError, "actions[0].demand.cpu")
    refused(s, lambda: s.submit(Action(-1, {"cpu": 1}), 0), ValidationError, "actions[0].id")
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, tokens=-5), 0), ValidationError, "actions[0].tokens")
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, priority=2**40), 0), ValidationError, "actions[0].priority")
    refused(s, lambda: s.submit(["not an action"], 0), ValidationError, "actions[0]")
    refused(s, lambda: s.complete([-1], 0), ValidationError, "ids")


# ------------------------------------------------------------------ names

def test_unknown_kind_in_demand(s):
    e = refused(s, lambda: s.submit(Action(1, {"cpu": 1, "tpu": 1}), 0), UnknownNameError, "actions[0].demand")
    assert "'tpu'" in e.reason and "cpu, memory" in e.reason
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, elastic="tpu", max_units=2), 0),
            UnknownNameError, "actions[0].elastic")


def test_unknown_service_quota_node(s):
    e = refused(s, lambda: s.submit(Action(1, {"cpu": 1}, service="judge"), 0), UnknownNameError, "actions[0].service")
    assert "'judge'" in e.reason and "rm" in e.reason
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, quota="openai"), 0), UnknownNameError, "actions[0].quota")
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, affinity="c"), 0), UnknownNameError, "actions[0].affinity")


def test_unknown_indices_in_bulk_records(s):
    for name, field in (("service", "actions[0].service"), ("quota", "actions[0].quota"),
                        ("affinity", "actions[0].affinity_node")):
        rec = s.new_actions(1)
        rec["id"], rec["demand"][0, 0] = 1, 1
        rec[name] = 7
        refused(s, lambda: s.submit(rec, 0), UnknownNameError, field)
    rec = s.new_actions(1)
    rec["id"], rec["model"], rec["table"] = 1, 2, 3
    refused(s, lambda: s.submit(rec, 0), ValidationError, "actions[0].model.table")
    rec = s.new_actions(1)
    rec["id"], rec["model"] = 1, 9
    refused(s, lambda: s.submit(rec, 0), ValidationError, "actions[0].model")
    refused(s, lambda: s.submit(np.zeros(1, tangram.action_dtype(3)), 0), ValidationError, "actions")


def test_unknown_names_in_queries(s):
    refused(s, lambda: s.free(0, "tpu"), UnknownNameError, "kind")
    refused(s, lambda: s.free(5, "cpu"), UnknownNameError, "node")
    refused(s, lambda: s.gpu_free(1, 0), UnknownNameError, "device")
    refused(s, lambda: s.service_location("judge"), UnknownNameError, "service")
    refused(s, lambda: s.runtime(1, 1), UnknownActionError, "id")


def test_bad_policy_name():
    with pytest.raises(UnknownNameError) as e:
        Scheduler(inventory(), "lifo")
    assert e.value.field == "policy" and "tangram, fifo, trajectory, isolated" in e.value.reason


def test_isolated_task_without_a_pool():
    s = Scheduler(inventory(), "isolated", pools={0: 1.0, 2: 1.0})
    refused(s, lambda: s.submit([Action(1, {"cpu": 1}, task=0), Action(2, {"cpu": 1}, task=1)], 0),
            UnknownNameError, "actions[1].task")
    with pytest.raises(ValidationError) as e:
        Scheduler(inventory(), "isolated", pools={})
    assert e.value.field == "policy(isolated).pools"


# ------------------------------------------------------------------ elasticity bounds

def test_elastic_bound_below_minimum_in_records(s):
    rec = s.new_actions(1)
    rec["id"], rec["elastic_kind"], rec["elastic_max"], rec["seconds"] = 1, 0, 1.5, 10
    rec["demand"][0, 0] = 2
    refused(s, lambda: s.submit(rec, 0), ValidationError, "actions[0].elastic_max")


def test_elastic_bound_below_minimum(s):
    e = refused(s, lambda: s.submit(Action(1, {"cpu": 2}, 10.0, elastic="cpu", max_units=1), 0),
                ValidationError, "actions[0].max_units")
    assert "below the minimum" in e.reason


@pytest.mark.parametrize("action, field", [
    (Action(1, {"cpu": 2}, 10.0, elastic="cpu", max_units=1), "actions[0].max_units"),
    (Action(1, {"cpu": 1}, 10.0, affinity=9), "actions[0].affinity"),
])
def test_field_names_match_action_attributes(s, action, field):
    with pytest.raises(ValidationError) as e:
        s.submit(action, 0)
    assert e.value.field == field


def test_max_units_without_elastic_and_elastic_without_bound(s):
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, max_units=4), 0), ValidationError, "actions[0].max_units")
    e = refused(s, lambda: s.submit(Action(1, {"cpu": 1}, elastic="cpu"), 0), ValidationError, "actions[0].max_units")
    assert "upper bound" in e.reason
    refused(s, lambda: s.submit(Action(1, {"cpu": 0}, 1.0, elastic="cpu", max_units=4), 0),
            ValidationError, "actions[0].demand.cpu")
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, 1.0, elastic="cpu", max_units=math.nan), 0),
            ValidationError, "actions[0].max_units")


@pytest.mark.parametrize("bound", [0.5, -5.0, math.nan])
def test_callable_with_bound_below_minimum(s, bound):
    with pytest.raises(ValidationError) as e:
        s.submit(Action(1, {"cpu": 1}, lambda u: 10.0 / u, elastic="cpu", max_units=bound), 0)
    assert e.value.field == "actions[0].max_units"


def test_callable_with_zero_elastic_minimum(s):
    with pytest.raises(ValidationError) as e:
        s.submit(Action(1, {"cpu": 0}, lambda u: 10.0 / u, elastic="cpu", max_units=3), 0)
    assert e.value.field == "actions[0].demand.cpu"


def test_callable_with_a_bad_result(s):
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, lambda u: -1.0), 0), ValidationError, "actions[0].runtime")
    refused(s, lambda: s.submit(Action(1, {"cpu": 1}, lambda u: 1.0, elastic="cpu", max_units=1e6), 0),
            ValidationError, "actions[0].runtime")


def test_bad_tables(s):
    for points, field in (([], "table"), ([(1, 5), (1, 4)], "table[1].units"), ([(1, -5)], "table[0].seconds"),
                          ([(0, 5)], "table[0].units"), ([(1, math.nan)], "table[0].seconds")):
        refused(s, lambda: s.submit(Action(1, {"cpu": 1}, Table(points), elastic="cpu", max_units=2), 0),
                ValidationError, field)


# ------------------------------------------------------------------ ids and states

def test_duplicate_ids(s):
    e = refused(s, lambda: s.submit([Action(1, {"cpu": 1}), Action(2, {"cpu": 1}), Action(1, {"cpu": 1})], 0),
                DuplicateIdError, "actions[2].id")
    assert "twice" in e.reason
    s.submit(Action(1, {"cpu": 1}), 0)
    e = refused(s, lambda: s.submit([Action(3, {"cpu": 1}), Action(1, {"cpu": 1})], 0), DuplicateIdError,
                "actions[1].id")
    assert "already live" in e.reason
    assert s.state(3) == "unknown"
    refused(s, lambda: s.complete([1, 1], 1), DuplicateIdError, "ids[1]")
    assert s.state(1) == "running"


def test_complete_unknown_and_not_started(s):
    s.submit([Action(1, {"cpu": 8}, 10.0, affinity="a"), Action(2, {"cpu": 8}, 10.0, affinity="a")], 0)
    running, waiting = 1, 2
    assert (s.state(1), s.state(2)) == ("running", "waiting")
    e = refused(s, lambda: s.complete([running, 99], 1), UnknownActionError, "ids[1]")
    assert "not live" in e.reason
    assert s.state(running) == "running"  # the good id of the refused batch was not applied
    e = refused(s, lambda: s.complete(waiting, 1), InvalidStateError, "ids[0]")
    assert "has not started" in e.reason
    refused(s, lambda: s.cancel(99, 1), UnknownActionError, "ids[0]")
    s.complete(running, 2)
    refused(s, lambda: s.complete(running, 3), UnknownActionError, "ids[0]")


@pytest.mark.parametrize("event", ["submit", "complete", "cancel", "tick", "end_trajectories"])
def test_time_going_backwards(s, event):
    s.submit(Action(1, {"cpu": 1}, 10.0), 5)
    calls = {
        "submit": lambda: s.submit(Action(2, {"cpu": 1}), 4.999),
        "complete": lambda: s.complete(1, 4),
        "cancel": lambda: s.cancel(1, 4),
        "tick": lambda: s.tick(0),
        "end_trajectories": lambda: s.end_trajectories([], 4),
    }
    e = refused(s, calls[event], ValidationError, "now")
    assert "backwards" in e.reason
    assert s.now == 5.0 and s.state(1) == "running"


@pytest.mark.parametrize("now", [math.nan, math.inf, -1.0, 2e9])
def test_bad_time(s, now):
    refused(s, lambda: s.tick(now), ValidationError, "now")


def test_refused_submit_leaves_the_clock_alone(s):
    s.submit(Action(1, {"cpu": 1}), 1)
    with pytest.raises(ValidationError):
        s.submit(Action(2, {"cpu": 2}, elastic="cpu", max_units=1), 10)
    assert s.now == 1.0
    s.submit(Action(2, {"cpu": 1}), 2)  # "time went backwards (2 s < 10 s)"


# ------------------------------------------------------------------ inventory

@pytest.mark.parametrize("make, cls, field", [
    (lambda: Inventory.uniform(1, {"cpu": -1}), ValidationError, "inventory.nodes[0].resources.cpu"),
    (lambda: Inventory.uniform(1, {"cpu": math.nan}), ValidationError, "inventory.nodes[0].resources.cpu"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, gpus=[math.inf]), ValidationError, "inventory.nodes[0].gpus[0].memory"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, gpus=[0]), ValidationError, "inventory.nodes[0].gpus[0].memory"),
    (lambda: Inventory([]), ValidationError, "inventory.nodes"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, quotas=[Quota("q", rate=-1)]), ValidationError,
     "inventory.quotas[0].rate"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, quotas=[Quota("q", burst=0)]), ValidationError,
     "inventory.quotas[0].burst"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, quotas=[Quota("q"), Quota("q")]), ValidationError,
     "inventory.quotas[1].name"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, gpus=[100], services=[Service("s", 10), Service("s", 10)]),
     ValidationError, "inventory.services[1].name"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, services=[Service("s", 10)]), ValidationError, "inventory.services[0]"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, gpus=[100], services=[Service("s", 10, restore_seconds=math.nan)]),
     ValidationError, "inventory.services[0].restore_seconds"),
])
def test_bad_inventory(make, cls, field):
    with pytest.raises(cls) as e:
        Scheduler(make())
    assert type(e.value) is cls and e.value.field == field


@pytest.mark.parametrize("options, field", [
    (dict(aging=math.nan), "policy(tangram).aging"),
    (dict(candidates=0), "policy(tangram).candidates"),
    (dict(min_relative_gain=2.0), "policy(tangram).min_relative_gain"),
    (dict(starvation_seconds=0), "policy(tangram).starvation_seconds"),
])
def test_bad_policy_options(options, field):
    with pytest.raises(ValidationError) as e:
        Scheduler(inventory(), **options)
    assert e.value.field == field


def test_bad_trajectory_slot():
    with pytest.raises(ValidationError) as e:
        Scheduler(inventory(), "trajectory", trajectory_slot_cpu=0)
    assert e.value.field == "policy(trajectory).trajectory_slot_cpu"
    with pytest.raises(ValidationError) as e:
        Scheduler(inventory(), "trajectory", trajectory_slot_cpu=-2)
    assert e.value.field == "policy.trajectory_slot_cpu"
