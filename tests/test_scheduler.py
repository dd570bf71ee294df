"""tangram.Scheduler end to end through the public Python face.

Action objects and bulk NumPy records, Decisions (objects and arrays), explain() for each
wait reason, queries, and each policy by name.
"""

from __future__ import annotations

import numpy as np
import pytest

import tangram
from tangram import Action, Amdahl, Inventory, Node, Gpu, Quota, Service, Scheduler
from tangram._records import DecisionKind, decisions


def cpu_mem(nodes: int = 2, cpu: float = 8, memory: float = 16384, **kw) -> Inventory:
    return Inventory.uniform(nodes, {"cpu": cpu, "memory": memory}, **kw)


# ------------------------------------------------------------------ objects vs records

def workload() -> list[Action]:
    """A mixed burst: constants, elastic Amdahl actions, affinities, priorities, an
    infeasible one, a quota and a service."""
    acts = []
    for i in range(1, 41):
        if i % 4 == 0:
            acts.append(Action(i, {"cpu": 1, "memory": 256 * (i % 5)}, Amdahl(10.0 + i, 0.5 + (i % 5) / 10),
                               elastic="cpu", max_units=1 + i % 6, trajectory=i // 3))
        else:
            acts.append(Action(i, {"cpu": 0.5 * (1 + i % 4), "memory": 512}, float(1 + i % 7),
                               trajectory=i // 3, priority=i % 2,
                               affinity=(i % 2) if i % 5 == 0 else None))
    acts.append(Action(41, {"cpu": 64}, 1.0))  # can never fit
    acts.append(Action(42, {"cpu": 1}, 2.0, quota="api", tokens=10))
    acts.append(Action(43, {"cpu": 1}, 2.0, service="rm", gpu_memory=100))
    return acts


def gpu_inventory() -> Inventory:
    return Inventory(
        nodes=[Node("a", {"cpu": 8, "memory": 16384}, [Gpu(8000)]), Node("b", {"cpu": 8, "memory": 16384})],
        quotas=[Quota("api", rate=2.0, burst=1, tokens_per_minute=600)],
        services=[Service("rm", memory=4000, restore_seconds=1.5, max_batch=2)],
    )


def as_records(s: Scheduler, actions: list[Action]) -> np.ndarray:
    """The same actions written by hand into bulk records."""
    rec = s.new_actions(len(actions))
    kinds = s.kinds
    for r, a in zip(rec, actions):
        r["id"], r["trajectory"], r["task"], r["priority"] = a.id, a.trajectory, a.task, a.priority
        r["demand"] = [a.demand.get(k, 0.0) for k in kinds]
        r["gpu_memory"] = a.gpu_memory
        if isinstance(a.runtime, Amdahl):
            r["model"], r["seconds"], r["parallel_fraction"] = 1, a.runtime.seconds, a.runtime.parallel_fraction
        else:
            r["model"], r["seconds"] = 0, float(a.runtime)
        if a.elastic is not None:
            r["elastic_kind"], r["elastic_max"] = kinds.index(a.elastic), a.max_units
        if a.affinity is not None:
            r["affinity"] = a.affinity
        if a.service is not None:
            r["service"] = [sv.name for sv in s.inventory.services].index(a.service)
        if a.quota is not None:
            r["quota"] = [q.name for q in s.inventory.quotas].index(a.quota)
        r["tokens"] = a.tokens
    return rec


def drive(s: Scheduler, submit) -> list[np.ndarray]:
    """Submits in three batches, then completes whatever runs and ticks until done."""
    out = [submit(s, 0, 15, 0.0).array, submit(s, 15, 30, 1.0).array, submit(s, 30, 43, 2.0).array]
    running: list[int] = []
    for arr in out:
        running += [int(a) for a in arr[arr["kind"] == DecisionKind.START]["action"]]
    t = 3.0
    while running or s.waiting:
        if running:
            d = s.complete(running[:3], t)
            running = running[3:]
        else:
            assert s.next_wakeup is not None, "actions wait but no wakeup is due"
            t = max(t, s.next_wakeup)
            d = s.tick(t)
        s.check_invariants()
        running += [int(a) for a in d.array[d.array["kind"] == DecisionKind.START]["action"]]
        out.append(d.array)
        t += 1.0
    return out


def test_objects_and_bulk_records_give_the_same_decisions():
    acts = workload()
    a = Scheduler(gpu_inventory())
    b = Scheduler(gpu_inventory())
    by_objects = drive(a, lambda s, lo, hi, t: s.submit(acts[lo:hi], t))
    by_records = drive(b, lambda s, lo, hi, t: s.submit(as_records(s, acts[lo:hi]), t))
    assert len(by_objects) == len(by_records)
    for x, y in zip(by_objects, by_records):
        np.testing.assert_array_equal(x, y)
    kinds = np.concatenate(by_objects)["kind"].tolist()
    # Action 41 can never fit and is rejected; every other action starts once; "rm", the
    # only service, is restored once and never evicted.
    assert (kinds.count(0), kinds.count(1), kinds.count(2), kinds.count(3)) == (42, 1, 0, 1)
    assert a.waiting == a.running == 0


def test_action_dtype_and_new_actions():
    s = Scheduler(cpu_mem())
    assert s.action_dtype == tangram.action_dtype(2)
    assert s.action_dtype.itemsize == 104 + 16
    rec = s.new_actions(3)
    assert rec.dtype == s.action_dtype and len(rec) == 3
    for name in ("elastic_kind", "table", "affinity", "service", "quota"):
        assert (rec[name] == -1).all()
    assert (rec["model"] == 0).all() and (rec["demand"] == 0).all()
    rec["id"] = [1, 2, 3]
    rec["demand"][:, 0] = [1, 2, 100]
    rec["seconds"] = 5
    d = s.submit(rec, 0)
    # Rejects come out of the submit itself, before the pass's starts.
    assert [(x.kind, x.action) for x in d] == [("reject", 3), ("start", 1), ("start", 2)]
    # A Table registered for bulk records.
    tid = s.table([(1, 10.0), (4, 4.0)])
    assert s.table([(1.0, 10.0), (4.0, 4.0)]) == tid
    rec = s.new_actions(1)
    rec["id"], rec["model"], rec["table"], rec["elastic_kind"], rec["elastic_max"] = 4, 2, tid, 0, 4
    rec["demand"][0, 0] = 1
    d = s.submit(rec, 1)
    # Best fit on node 0 (beside actions 1 and 2); alone there, each unit cuts 2 s of the
    # table's 10, 8, 6, 4 s, so it gets its bound of 4.
    assert [(x.kind, x.action, x.node, x.grant) for x in d] == [("start", 4, 0, 4.0)]
    assert s.runtime(4, 2.5) == pytest.approx(7.0)


def test_empty_batches():
    s = Scheduler(cpu_mem())
    assert len(s.submit([], 0)) == 0
    assert len(s.submit(s.new_actions(0), 0)) == 0
    assert len(s.complete([], 0)) == 0
    assert len(s.tick(1)) == 0


# ------------------------------------------------------------------ Decisions

def test_decisions_objects_and_arrays():
    s = Scheduler(gpu_inventory())
    d = s.submit([
        Action(1, {"cpu": 1}, Amdahl(100, 0.9), elastic="cpu", max_units=3, affinity="b"),
        Action(2, {"cpu": 100}, 1.0),
        Action(3, {"cpu": 1}, 1.0, service="rm"),
        Action(4, {"cpu": 1}, 1.0, gpu_memory=1000),
    ], 0.5)
    assert isinstance(d, tangram.Decisions)
    # The reject comes out of the submit; the pass restores "rm" before its walk, then walks
    # by estimated run time: 3 and 4 (1 s each, in arrival order; 3 waits for the restore),
    # then 1 (100 s).
    assert [(x.kind, x.action) for x in d] == [("reject", 2), ("restore", None), ("start", 4), ("start", 1)]
    assert d.array.dtype == tangram.DECISION_DTYPE
    assert len(d) == len(d.array) == 4
    objs = list(d)
    assert all(isinstance(x, tangram.Decision) for x in objs)
    assert objs == d[:] == [d[i] for i in range(len(d))]
    assert d[-1] == objs[-1]
    by_kind = {x.kind: x for x in objs if x.kind != "start"}
    starts = {x.action: x for x in objs if x.kind == "start"}
    # The elastic action alone on node b (its affinity), where nobody waits: 3 cores (its
    # bound), a float.
    assert starts[1].grant == 3.0 and isinstance(starts[1].grant, float)
    assert starts[1].node == 1 and starts[1].device is None and starts[1].service is None
    assert starts[1].time == 0.5
    assert starts[4].node == 0 and starts[4].device == 0  # the only GPU
    rej = by_kind["reject"]
    assert rej.action == 2 and rej.node is None
    assert rej.reason.startswith("action 2 can never run: ") and "cpu needs 100, largest is 8" in rej.reason
    res = by_kind["restore"]
    assert res.action is None and res.service == "rm" and (res.node, res.device) == (0, 0)
    assert res.time == pytest.approx(2.0)  # 0.5 + restore_seconds
    assert sorted(d.of_kind("start")["action"].tolist()) == sorted(starts)
    assert d.of_kind("evict").size == 0
    arr = d.of_kind("start")
    row = arr[arr["action"] == 1][0]
    assert row["grant_milli"] == 3000 and row["grant"] == 3.0 and row["elastic_kind"] == 0
    assert "Decision(kind=" in repr(d)


# Invariant: the runtime's view of decision records (tangram._records.decisions) reads every
# field as the array holds it, in order, with plain Python numbers.
def test_decision_records_view_reads_every_field():
    s = Scheduler(gpu_inventory())
    d = s.submit([Action(1, {"cpu": 1}, Amdahl(100, 0.9), elastic="cpu", max_units=3, affinity="b"),
                  Action(2, {"cpu": 100}, 1.0), Action(3, {"cpu": 1}, 1.0, service="rm")], 0.5)
    view = list(decisions(d.array))
    assert [DecisionKind(x.kind) for x in view] == [DecisionKind.REJECT, DecisionKind.RESTORE, DecisionKind.START]
    for x, row in zip(view, d.array):
        assert x._asdict() == {name: row[name].item() for name in d.array.dtype.names}
        assert all(type(v) in (int, float) for v in x)
    assert list(decisions(d.array[:0])) == []
    assert list(decisions(d.array[::2])) == view[::2]  # a strided view


def test_queries_and_states():
    s = Scheduler(cpu_mem(nodes=1, cpu=2), "fifo")
    assert s.now == 0.0 and s.next_wakeup is None
    s.submit([Action(1, {"cpu": 2}, 10.0), Action(2, {"cpu": 1}, 5.0)], 1.25)
    assert s.now == 1.25
    assert (s.state(1), s.state(2), s.state(3)) == ("running", "waiting", "unknown")
    assert (s.waiting, s.running) == (1, 1)
    assert s.free(0, "cpu") == 0.0 and s.free(0, "memory") == 16384.0
    assert s.explain(1) == "running on node 0 (node0)"
    assert s.runtime(1, 1) == 10.0
    d = s.complete(1, 3)
    assert [x.action for x in d] == [2]
    assert s.state(1) == "unknown"
    assert "not live" in s.explain(1)
    s.cancel([2], 4)
    assert s.waiting == s.running == 0 and s.free(0, "cpu") == 2.0


# ------------------------------------------------------------------ explain

def test_explain_resources():
    s = Scheduler(cpu_mem(nodes=1, cpu=4))
    s.submit([Action(1, {"cpu": 3}, 10.0), Action(2, {"cpu": 2, "memory": 100}, 10.0),
              Action(3, {"cpu": 2, "memory": 100}, 10.0)], 0)
    assert s.explain(2) == ("waiting for resources: needs cpu=2 memory=100; "
                            "most free on one bin it may use: cpu=1 memory=16384")
    assert s.explain(3).startswith("waiting behind 1 earlier action of the same shape; for resources")


def test_explain_quota_rate_concurrency_tokens():
    inv = Inventory.uniform(1, {"cpu": 64}, quotas=[
        Quota("rated", rate=2.0), Quota("capped", max_concurrency=1), Quota("budget", tokens_per_minute=60)])
    s = Scheduler(inv, "fifo")
    s.submit([Action(i, {"cpu": 1}, 100.0, quota="rated") for i in (1, 2)]
             + [Action(i, {"cpu": 1}, 100.0, quota="capped") for i in (3, 4)]
             + [Action(i, {"cpu": 1}, 100.0, quota="budget", tokens=40) for i in (5, 6)], 0)
    assert s.explain(2) == "waiting for quota 'rated' rate limit; next admission at 0.500000 s"
    assert s.explain(4) == "waiting for quota 'capped' concurrency limit (1 in flight)"
    # 60 tokens a minute: 40 spent, 20 left; 20 more take 20 s.
    assert s.explain(6) == "waiting for quota 'budget' token budget; enough tokens at 20.000000 s"
    assert s.next_wakeup == 0.5
    assert [x.action for x in s.tick(0.5)] == [2]
    assert s.next_wakeup == 20.0
    assert [x.action for x in s.tick(20.0)] == [6]


def test_explain_service_restoring_and_batch_full():
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(10000)])],
                    services=[Service("rm", 4000, restore_seconds=3.0, max_batch=1)])
    s = Scheduler(inv)
    d = s.submit([Action(1, {"cpu": 1}, 10.0, service="rm"), Action(2, {"cpu": 1}, 10.0, service="rm")], 1)
    assert [x.kind for x in d] == ["restore"]
    assert s.explain(1) == "waiting for service 'rm' to finish restoring at 4.000000 s"
    assert s.service_location("rm") == (0, 0) and s.gpu_free(0, 0) == 6000.0
    assert s.next_wakeup == 4.0
    d = s.tick(4.0)
    assert [(x.kind, x.action, x.service) for x in d] == [("start", 1, "rm")]
    assert s.explain(2) == "waiting for service 'rm': its batch is full (1 running)"
    assert [x.action for x in s.complete(1, 5)] == [2]


def test_explain_held_back_by_a_starving_action():
    s = Scheduler(Inventory.uniform(2, {"cpu": 4}), "fifo", starvation_seconds=10)
    s.submit([Action(i, {"cpu": 1}, 100.0, affinity="node0") for i in (1, 2, 3)], 0)
    s.submit(Action(10, {"cpu": 4}, 1.0, affinity=0), 1)
    assert s.explain(10).startswith("waiting for resources: needs cpu=4 on node 0;")
    s.complete(1, 12)  # the big one has waited 11 s: it claims node 0
    assert len(s.submit(Action(20, {"cpu": 1}, 1.0, affinity=0), 12)) == 0
    assert s.explain(20) == ("waiting held back: an action that has waited over 10 s has first claim "
                             "on the resources it needs")
    assert [x.action for x in s.submit(Action(21, {"cpu": 1}, 1.0, affinity=1), 12)] == [21]
    assert [x.action for x in s.complete([2, 3], 13)] == [10]


def test_explain_held_back_on_the_only_node_with_room():
    """An action that may use any node, whose demand fits only a node a starving action
    holds back, is said to be held back, not short of resources."""
    s = Scheduler(Inventory.uniform(2, {"cpu": 4}), "fifo", starvation_seconds=10)
    s.submit([Action(i, {"cpu": 1}, 100.0, affinity=1) for i in (1, 2, 3, 4)], 0)
    s.submit([Action(i, {"cpu": 1}, 100.0, affinity=0) for i in (5, 6, 7)], 0)
    s.submit(Action(10, {"cpu": 4}, 1.0, affinity=0), 1)
    s.complete(5, 12)  # the big one has waited 11 s: it claims node 0, where 2 cores are free
    assert len(s.submit(Action(20, {"cpu": 1}, 1.0), 12)) == 0
    assert s.explain(20) == ("waiting held back: an action that has waited over 10 s has first claim "
                             "on the resources it needs")


def test_explain_behind_a_starving_action_that_stops_the_pass():
    s = Scheduler(Inventory.uniform(1, {"cpu": 4}), "fifo", starvation_seconds=10)
    s.submit([Action(i, {"cpu": 1}, 100.0) for i in (1, 2, 3)], 0)
    s.submit(Action(10, {"cpu": 4}, 1.0), 1)
    s.complete(1, 11)
    assert len(s.submit(Action(20, {"cpu": 1}, 1.0), 12)) == 0
    assert s.explain(20) == ("waiting held back: an action that has waited over 10 s has first claim "
                             "on the resources it needs")


# ------------------------------------------------------------------ policies

def test_policy_by_name_object_and_overrides():
    assert tangram.POLICIES == ("tangram", "fifo", "trajectory", "isolated", "optimus")
    assert Scheduler(cpu_mem()).policy == tangram.Policy()
    s = Scheduler(cpu_mem(), "fifo", starvation_seconds=5)
    assert s.policy.name == "fifo" and s.policy.starvation_seconds == 5
    s = Scheduler(cpu_mem(), tangram.Policy("isolated", pools={0: 1.0, 1: 3.0}), candidates=2)
    assert s.policy.candidates == 2 and s.policy.pools == {0: 1.0, 1: 3.0}


def test_fifo_and_tangram_order():
    def order(policy: str) -> list[int]:
        s = Scheduler(Inventory.uniform(1, {"cpu": 1}), policy)
        seen = [x.action for x in s.submit([Action(1, {"cpu": 1}, 100.0), Action(2, {"cpu": 1}, 50.0),
                                            Action(3, {"cpu": 1}, 1.0)], 0)]
        t = 1.0
        while len(seen) < 3:
            seen += [x.action for x in s.complete(seen[-1], t)]
            t += 1
        return seen

    assert order("fifo") == [1, 2, 3]
    assert order("tangram") == [3, 2, 1]


def test_spare_units_only_when_nobody_waits():
    s = Scheduler(Inventory.uniform(1, {"cpu": 4}))
    d = s.submit([Action(1, {"cpu": 1}, Amdahl(100, 0.9), elastic="cpu", max_units=4),
                  Action(2, {"cpu": 1}, Amdahl(100, 0.2), elastic="cpu", max_units=4)], 0)
    assert {x.action: x.grant for x in d} == {1: 3.0, 2: 1.0}
    s = Scheduler(Inventory.uniform(1, {"cpu": 4}))
    d = s.submit([Action(1, {"cpu": 1}, Amdahl(10, 0.9), elastic="cpu", max_units=4),
                  Action(2, {"cpu": 4}, 100.0)], 0)
    assert [(x.action, x.grant) for x in d] == [(1, 1.0)]


# tangram starts an elastic action with a fractional minimum topped up to a whole core
# when one is free: single-threaded programs declared from a quarter core run one per core
# rather than four to a core.
def test_fractional_minimum_starts_with_a_whole_core():
    programs = [Action(i, {"cpu": 0.25}, Amdahl(1.0, 1.0), elastic="cpu", max_units=1) for i in range(1, 5)]
    s = Scheduler(Inventory.uniform(1, {"cpu": 2}))
    assert [(x.action, x.grant) for x in s.submit(programs, 0)] == [(1, 1.0), (2, 1.0)]
    assert [(x.action, x.grant) for x in s.complete([1], 0.25)] == [(3, 1.0)]


# tangram's grants are malleable: a running action grows into cores a completion frees, and
# gives cores back for a waiting action when that pays (docs/scheduling.md has the rule and
# tests/cpp/test_resize.cc the arithmetic). Decisions name the resized action and its new
# total grant; fifo's grants stay fixed.
def test_resize_decisions():
    s = Scheduler(Inventory.uniform(1, {"cpu": 8}))
    d = s.submit([Action(1, {"cpu": 1}, Amdahl(10, 0.9), elastic="cpu", max_units=8),
                  Action(2, {"cpu": 1}, Amdahl(10, 0.9), elastic="cpu", max_units=8)], 0)
    assert [(x.kind, x.action, x.grant) for x in d] == [("start", 1, 4.0), ("start", 2, 4.0)]
    d = s.complete([2], 1)
    assert list(d) == [tangram.Decision(kind="resize", action=1, node=0, device=None, service=None, grant=8.0,
                                        time=1.0)]
    assert d.of_kind("resize")["grant_milli"].tolist() == [8000]
    assert "cpu grant 8 (from 4 at 1 s)" in s.explain(1)
    d = s.submit([Action(3, {"cpu": 2}, 1.0)], 2)
    assert [(x.kind, x.action, x.grant) for x in d] == [("resize", 1, 6.0), ("start", 3, 0.0)]
    fixed = Scheduler(Inventory.uniform(1, {"cpu": 8}), "fifo")
    fixed.submit([Action(1, {"cpu": 1}, Amdahl(10, 0.9), elastic="cpu", max_units=8)], 0)
    assert list(fixed.submit([Action(3, {"cpu": 8}, 1.0)], 1)) == []


# A running elastic action limits its own grant (a worker pool with fewer tasks left than
# cores): the cores go at once to what waits; raised again, it grows back into free cores.
def test_limit_gives_cores_back():
    s = Scheduler(Inventory.uniform(1, {"cpu": 2}))
    assert [(x.kind, x.grant) for x in s.submit(Action(1, {"cpu": 1}, Amdahl(10, 1.0), elastic="cpu", max_units=2), 0)] \
        == [("start", 2.0)]
    assert len(s.submit(Action(2, {"cpu": 1}, 1.0), 0)) == 0
    d = s.limit(1, 1, 1)
    assert [(x.kind, x.action, x.grant) for x in d] == [("resize", 1, 1.0), ("start", 2, 0.0)]
    assert s.explain(1).endswith("limited by the action to 1 of 2")
    s.complete(2, 2)
    assert [(x.kind, x.grant) for x in s.limit([1], [2.0], 3)] == [("resize", 2.0)]
    with pytest.raises(tangram.ValidationError) as e:
        s.limit(1, 2.5, 3)
    assert e.value.field == "limits[0]"
    with pytest.raises(tangram.ValidationError) as e:
        s.limit([1], [1.0, 2.0], 3)
    assert e.value.field == "limits"


def test_trajectory_policy_slots():
    s = Scheduler(Inventory.uniform(1, {"cpu": 4}), "trajectory", trajectory_slot_cpu=2)
    d = s.submit([Action(1, {"cpu": 1}, Amdahl(10, 0.9), elastic="cpu", max_units=8, trajectory=1),
                  Action(2, {"cpu": 1}, 10.0, trajectory=2), Action(3, {"cpu": 1}, 10.0, trajectory=3)], 0)
    assert [(x.action, x.grant) for x in d] == [(1, 2.0), (2, 0.0)]
    assert "(no free trajectory slot" in s.explain(3)
    assert len(s.complete(1, 1)) == 0  # trajectory 1 keeps its slot; 2 still works: none lent
    with pytest.raises(tangram.InvalidStateError) as e:
        s.end_trajectories(2, 2)
    assert e.value.field == "trajectories[0]"
    assert [x.action for x in s.end_trajectories([1], 2)] == [3]


def test_isolated_policy_pools():
    s = Scheduler(Inventory.uniform(1, {"cpu": 8}), "isolated", pools={0: 1.0, 1: 1.0})
    d = s.submit([Action(i, {"cpu": 1}, 10.0, task=0) for i in range(1, 6)], 0)
    assert [(x.kind, x.action) for x in d] == [("start", i) for i in range(1, 5)]  # pool 0's half: 4 cores
    assert s.state(5) == "waiting"
    assert [x.action for x in s.submit(Action(6, {"cpu": 4}, 10.0, task=1), 1)] == [6]
    d = s.submit(Action(7, {"cpu": 5}, 10.0, task=1), 2)
    assert [(x.kind, x.action) for x in d] == [("reject", 7)]
    assert d[0].reason == "action 7 can never run: demand does not fit on any node: cpu needs 5, largest is 4"


def test_isolated_equal_pools_split_the_node_exactly():
    s = Scheduler(Inventory.uniform(1, {"cpu": 3}), "isolated", pools={0: 1.0, 1: 1.0, 2: 1.0})
    assert s.free(0, "cpu") == 3.0
    assert s.submit(Action(1, {"cpu": 1}, 10.0, task=2), 0)[0].kind == "start"


# ------------------------------------------------------------------ GPU services

def test_services_restore_and_evict():
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(10000)])],
                    services=[Service("rm0", 6000, restore_seconds=2.0), Service("rm1", 6000, restore_seconds=2.0)])
    s = Scheduler(inv)
    s.submit(Action(1, {"cpu": 1}, 5.0, service="rm0"), 0)
    assert [x.action for x in s.tick(2)] == [1]
    assert len(s.submit(Action(2, {"cpu": 1}, 5.0, service="rm1"), 3)) == 0
    assert s.explain(2) == ("waiting for service 'rm1': no GPU can make room for it now "
                            "(resident services are busy)")
    d = s.complete(1, 7)
    assert [(x.kind, x.service) for x in d] == [("evict", "rm0"), ("restore", "rm1")]
    assert s.service_location("rm0") is None and s.service_location("rm1") == (0, 0)
    # rm1's restore goes into rm0's memory: it begins when rm0's offload ends (as long as
    # its restore unless it says otherwise), so it is ready at 7 + 2 + 2.
    assert d[1].time == pytest.approx(11.0)
    assert [x.action for x in s.tick(9)] == []
    assert [x.action for x in s.tick(11)] == [2]


def test_a_device_runs_its_restores_and_offloads_in_order():
    # Two 4,000 MiB devices, three services restored at once (c first: the shortest span).
    # A restore begins when its device's earlier restores and offloads end, so a goes to
    # the idle device (best fit alone would stack it on c's) and b waits for c's restore.
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(4000), Gpu(4000)])],
                    services=[Service("a", 1000, restore_seconds=2.0), Service("b", 1000, restore_seconds=2.0),
                              Service("c", 1000, restore_seconds=1.0)])
    s = Scheduler(inv)
    d = s.submit([Action(i, {"cpu": 1}, 1.0, service=name) for i, name in enumerate("abc", 1)], 0)
    assert [(x.service, x.device, x.time) for x in d if x.kind == "restore"] == [("c", 0, 1.0), ("a", 1, 2.0),
                                                                                 ("b", 0, 3.0)]
    assert [sorted(x.action for x in s.tick(t)) for t in (1, 2, 3)] == [[3], [1], [2]]


def test_eviction_prefers_the_device_whose_offload_ends_first():
    # Each device holds one idle service; a third needs a whole device. The plans are alike
    # (one idle victim each, asked for as often), so the restore goes where the victim's
    # offload ends first: device 1, though device 0 comes first.
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(4000), Gpu(4000)])],
                    services=[Service("slow", 4000, restore_seconds=1.0, offload_seconds=5.0),
                              Service("fast", 4000, restore_seconds=1.0, offload_seconds=0.5),
                              Service("big", 4000, restore_seconds=1.0)])
    s = Scheduler(inv)
    d = s.submit([Action(1, {"cpu": 1}, 1.0, service="slow"), Action(2, {"cpu": 1}, 1.0, service="fast")], 0)
    assert [(x.service, x.device) for x in d if x.kind == "restore"] == [("slow", 0), ("fast", 1)]
    assert sorted(x.action for x in s.tick(1)) == [1, 2]
    s.complete([1, 2], 2)
    d = s.submit(Action(3, {"cpu": 1}, 1.0, service="big"), 3)
    assert [(x.kind, x.service, x.device) for x in d] == [("evict", "fast", 1), ("restore", "big", 1)]
    assert d[-1].time == pytest.approx(3.0 + 0.5 + 1.0)
    with pytest.raises(tangram.ValidationError) as e:
        Service("x", 1000, offload_seconds="slow")  # type: ignore[arg-type]
    assert e.value.field == "service.offload_seconds"
    with pytest.raises(tangram.ValidationError) as e:
        Scheduler(Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(4000)])], services=[Service("x", 1000, offload_seconds=-1)]))
    assert e.value.field == "inventory.services[0].offload_seconds"


def test_replicated_service_is_one_core_service_per_replica():
    """Service(replicas=2): the core schedules rm#0 and rm#1, each with its own residency; an
    Action naming rm goes to the copy that serves it soonest (the core routes it: the first
    to rm#0, the second to rm#1 since rm#0's one-call batch is taken), one naming a copy to
    that one."""
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(1000), Gpu(1000)])],
                    services=[Service("rm", 800, restore_seconds=1.0, replicas=2)])
    s = Scheduler(inv)
    d = s.submit([Action(1, {"cpu": 1}, 1.0, service="rm"), Action(2, {"cpu": 1}, 1.0, service="rm")], 0.0)
    assert sorted((x.kind, x.service, x.device) for x in d) == [("restore", "rm#0", 0), ("restore", "rm#1", 1)]
    d = s.tick(1.0)
    assert sorted((x.action, x.service) for x in d) == [(1, "rm#0"), (2, "rm#1")]
    d = s.submit([Action(3, {"cpu": 1}, 1.0, service="rm#1")], 1.0)
    assert s.service_location("rm#0") is not None and s.service_location("rm#1") is not None
    with pytest.raises(tangram.UnknownNameError, match="no service named 'rm'"):
        s.service_location("rm")


@pytest.mark.parametrize("replicas, max_replicas, field", [(0, None, "service.replicas"), (1.5, None, "service.replicas"),
                                                           (True, None, "service.replicas"),
                                                           (2, 1, "service.max_replicas"),
                                                           (1, 2.5, "service.max_replicas")])
def test_replicas_validated(replicas, max_replicas, field):  # type: ignore[no-untyped-def]
    with pytest.raises(tangram.ValidationError) as e:
        Service("rm", 1000, replicas=replicas, max_replicas=max_replicas)
    assert e.value.field == field


def test_max_replicas_copies_come_when_a_queue_outlasts_a_restore():
    """Service(replicas=1, max_replicas=3): the core schedules rm#0..rm#2, the two beyond the
    minimum surplus. Calls of 10 s with a 1 s restore: the first goes to rm#0, the second
    (one whole batch of 10 s ahead there) to rm#1, the third to rm#2; short calls later, with
    rm#0 idle and resident, go to rm#0."""
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(1000), Gpu(1000), Gpu(1000)])],
                    services=[Service("rm", 800, restore_seconds=1.0, replicas=1, max_replicas=3)])
    assert inv.services[0].instances == ["rm#0", "rm#1", "rm#2"]
    s = Scheduler(inv)
    d = s.submit([Action(i, {"cpu": 1}, 10.0, service="rm") for i in (1, 2, 3)], 0.0)
    assert sorted((x.kind, x.service) for x in d) == [("restore", "rm#0"), ("restore", "rm#1"), ("restore", "rm#2")]
    d = s.tick(1.0)
    assert sorted((x.action, x.service) for x in d) == [(1, "rm#0"), (2, "rm#1"), (3, "rm#2")]
    s.complete([1, 2, 3], 11.0)
    d = s.submit([Action(4, {"cpu": 1}, 0.5, service="rm")], 12.0)
    assert [(x.kind, x.action, x.service) for x in d] == [("start", 4, "rm#0")]


def test_replica_names_must_not_clash():
    with pytest.raises(tangram.ValidationError) as e:
        Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(1000)])],
                  services=[Service("rm", 100, replicas=2), Service("rm#1", 100)])
    assert e.value.field == "inventory.services[1].name" and "rm#1" in str(e.value)


def test_offloaded_services_host_memory_must_fit_the_nodes_offload_memory():
    """Node(offload_memory=1000), services holding 800 MiB of host memory while offloaded:
    only one of them can be offloaded at a time, so the second one is discarded (its state
    given up: its next restore is a load) rather than offloaded."""
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(4000), Gpu(4000)], offload_memory=1000)],
                    services=[Service("a", 3000, 1.0, host_memory=800), Service("b", 3000, 1.0, host_memory=800)])
    s = Scheduler(inv)
    s.submit([Action(1, {"cpu": 1}, 1.0, service="a"), Action(2, {"cpu": 1}, 1.0, service="b")], 0.0)
    s.tick(1.0)
    s.complete([1, 2], 2.0)
    d = s.submit([Action(3, {"cpu": 1}, 1.0, gpu_memory=3000), Action(4, {"cpu": 1}, 1.0, gpu_memory=3000)], 3.0)
    assert [(x.kind, x.service or x.action, x.reason) for x in d] == [
        ("evict", "a", None), ("start", 3, None), ("evict", "b", "discard"), ("start", 4, None)]
    assert s.service_location("b") is None
    s.check_invariants()


@pytest.mark.parametrize("make, field", [
    (lambda: Node("g", {"cpu": 1}, [Gpu(1000)], offload_memory=-5), "inventory.nodes[0].offload_memory"),
    (lambda: Node("g", {"cpu": 1}, [Gpu(1000)], offload_memory="lots"), "node.offload_memory"),
    (lambda: Service("s", 100, host_memory=-1), "inventory.services[0].host_memory"),
    (lambda: Service("s", 100, host_memory=None), "service.host_memory"),
])
def test_offload_and_host_memory_validated(make, field):  # type: ignore[no-untyped-def]
    with pytest.raises(tangram.ValidationError) as e:
        made = make()
        node = made if isinstance(made, Node) else Node("g", {"cpu": 1}, [Gpu(1000)])
        Scheduler(Inventory(nodes=[node], services=[made] if isinstance(made, Service) else []))
    assert e.value.field == field


def test_service_action_over_token_budget_is_rejected():
    inv = Inventory(nodes=[Node("g", {"cpu": 8}, [Gpu(10000)])], services=[Service("rm", 1000)],
                    quotas=[Quota("llm", tokens_per_minute=100)])
    s = Scheduler(inv)
    d = s.submit(Action(1, {"cpu": 1}, 5.0, service="rm", quota="llm", tokens=1000), 0)
    assert [x.kind for x in d] == ["reject"]


def test_plain_gpu_action_gets_memory_held_by_idle_services():
    inv = Inventory(nodes=[Node("g", {"cpu": 4}, [Gpu(10000)])],
                    services=[Service("A", 6000), Service("B", 4000)])
    s = Scheduler(inv)
    s.submit(Action(1, {"cpu": 1}, 1.0, service="B"), 0)
    s.complete(1, 1)
    s.submit(Action(2, {"cpu": 1}, 1.0, service="A"), 2)
    s.complete(2, 3)
    assert s.gpu_free(0, 0) == 0.0
    # Both idle with no queued work: service order evicts A, which alone makes room.
    d = s.submit(Action(3, {"cpu": 1}, 1.0, gpu_memory=500), 4)
    assert list(d) == [tangram.Decision("evict", None, 0, 0, "A", 0.0, 4.0),
                       tangram.Decision("start", 3, 0, 0, None, 0.0, 4.0)]
    assert s.service_location("A") is None and s.gpu_free(0, 0) == 5500.0


def test_trajectory_service_action_runs_where_its_service_is():
    inv = Inventory(nodes=[Node("a", {"cpu": 4}, [Gpu(1000)]), Node("b", {"cpu": 4}, [Gpu(1000)])],
                    services=[Service("s0", 500), Service("s1", 500)])  # home devices a/0 and b/0
    s = Scheduler(inv, "trajectory", trajectory_slot_cpu=2)
    assert s.submit(Action(1, {"cpu": 1}, 10.0, trajectory=7), 0)[0].node == 0
    # s1's home is node b's GPU: restored there (ready at once), the action starts beside
    # it, not in trajectory 7's slot on node a.
    d = s.submit(Action(2, {"cpu": 1}, 10.0, trajectory=7, service="s1"), 0)
    assert list(d) == [tangram.Decision("restore", None, 1, 0, "s1", 0.0, 0.0),
                       tangram.Decision("start", 2, 1, 0, "s1", 0.0, 0.0)]
    assert s.service_location("s1") == (1, 0)


# ------------------------------------------------------------------ every policy by name alone

def readme_inventory() -> Inventory:
    return Inventory.uniform(4, {"cpu": 16, "memory": 65536}, gpus=[81920],
                             services=[Service("reward-7b", memory=16000, restore_seconds=4, max_batch=64)],
                             quotas=[Quota("search", rate=20, burst=5, max_concurrency=8)])


# Invariant: each policy the README names runs with its defaults, on the README's
# inventory and actions: every action starts and ends, and the pools return to full.
@pytest.mark.parametrize("policy", tangram.POLICIES)
def test_every_policy_runs_by_name_alone(policy: str) -> None:
    s = Scheduler(readme_inventory(), policy)
    actions = [Action(1, {"cpu": 1, "memory": 512}, Amdahl(30, 0.9), elastic="cpu", max_units=8, trajectory=7),
               Action(2, {"cpu": 0.5}, 3.0, service="reward-7b"), Action(3, {"cpu": 0.1}, 0.4, quota="search")]
    started = {x.action for x in s.submit(actions, 0.0) if x.kind == "start"}
    t = 0.0
    while len(started) < 3:
        t = s.next_wakeup if s.next_wakeup is not None else t + 1.0
        started |= {x.action for x in s.tick(t) if x.kind == "start"}
        assert t < 100, s.explain(min({1, 2, 3} - started))
    s.complete([1, 2, 3], t + 60)
    s.end_trajectories([7], t + 60)
    assert s.waiting == 0 and s.running == 0
    s.check_invariants()


# Invariant: the trajectory policy's default slot is one core: a node of 4 cores holds 4
# trajectories at once, each action gets its slot (an elastic one all of it, no more), the
# fifth trajectory waits for a slot, and an action larger than a slot is rejected, not lost.
def test_trajectory_policy_default_slot_is_one_core() -> None:
    s = Scheduler(Inventory.uniform(1, {"cpu": 4, "memory": 4096}), "trajectory")
    assert s.policy.trajectory_slot_cpu == 1.0
    d = s.submit([Action(t, {"cpu": 1}, Amdahl(10, 0.9), elastic="cpu", max_units=8, trajectory=t)
                  for t in range(1, 6)], 0)
    assert [(x.action, x.grant) for x in d] == [(t, 1.0) for t in range(1, 5)]
    assert "(no free trajectory slot" in s.explain(5)
    (reject,) = s.submit(Action(6, {"cpu": 2}, 1.0, trajectory=6), 0)
    assert reject.kind == "reject" and "cpu needs 2, largest is 1" in reject.reason


# Regression: a service asked for once a second (each request runs 2 s, so it always has
# one running) keeps the only GPU; another service that does not fit beside it used to wait
# for as long as the stream lasted (600 s here), since no eviction takes a service with
# running actions. Once it has waited starvation_seconds the busy one is drained: it starts
# nothing new, its running actions end, it is evicted, and the starving one runs.
@pytest.mark.parametrize("policy", tangram.POLICIES)
def test_a_steady_stream_does_not_starve_another_service(policy: str) -> None:
    inv = Inventory(nodes=[Node("n", {"cpu": 16}, gpus=[Gpu(10000)])],
                    services=[Service("a", 6000, restore_seconds=1, max_batch=2),
                              Service("b", 6000, restore_seconds=1, max_batch=2)])
    s = Scheduler(inv, policy, starvation_seconds=10)
    ends: dict[int, float] = {}

    def note(decisions, now: float) -> None:
        ends.update((d.action, now + 2.0) for d in decisions if d.kind == "start")

    note(s.submit(Action(1, {"cpu": 1}, 2.0, service="a"), 0.0), 0.0)
    note(s.tick(1.0), 1.0)
    note(s.submit(Action(2, {"cpu": 1}, 1.0, service="b"), 1.5), 1.5)
    now, explained = 1.5, set()
    for i in range(3, 200):
        now += 0.5
        done = [a for a, end in ends.items() if end <= now]
        for a in done:
            ends.pop(a)
        if done:
            note(s.complete(done, now), now)
        if i % 2:
            note(s.submit(Action(i, {"cpu": 1}, 2.0, service="a"), now), now)
            if i not in ends:  # a's new request waits: why
                explained.add(s.explain(i))
        note(s.tick(now), now)
        if 2 in ends:
            break
    assert 2 in ends and now <= 1.5 + 10 + 5, f"b still waits at {now} s: {s.explain(2)}"
    assert any("starts nothing until it is evicted for service 'b'" in e for e in explained)


# Regression: one machine with a GPU under the trajectory policy (the embedded layout).
# Every slot is held by a trajectory waiting for its reward; the rewards run in those held
# slots (each in its own trajectory's), so the trajectories end and the fifth gets a slot.
# They used to wait for a free slot for ever.
def test_trajectory_policy_rewards_run_when_every_slot_is_held() -> None:
    inv = Inventory(nodes=[Node("n0", {"cpu": 4, "memory": 4096}, gpus=[Gpu(81920)])],
                    services=[Service("rm", memory=16384, restore_seconds=1.0, max_batch=8)])
    s = Scheduler(inv, "trajectory")
    assert [x.action for x in s.submit([Action(t, {"cpu": 1}, 1.0, trajectory=t) for t in range(5)], 0)] == [0, 1, 2, 3]
    assert list(s.complete([0, 1, 2], 1.0)) == []  # trajectory 3 still works: no slot is lent
    d = s.submit([Action(10 + t, {"cpu": 0.1}, 1.0, trajectory=t, service="rm") for t in range(4)], 1.0)
    assert [x.kind for x in d] == ["restore"]
    d = s.tick(2.0)  # the restore is done; trajectory 3's reward runs in another held slot
    assert sorted(x.action for x in d if x.kind == "start") == [10, 11, 12, 13]
    # Every holder idle: trajectory 4, which holds no slot, runs in a lent one.
    assert [x.action for x in s.complete([10, 11, 12, 13, 3], 3.0)] == [4]
    s.check_invariants()


# Invariant: the isolated policy's default is one pool of whole nodes for task 0 (every
# Action's task by default): all of a node is there for it; another task has no pool and
# the error names the field.
def test_isolated_policy_default_is_one_pool_for_task_zero() -> None:
    s = Scheduler(Inventory.uniform(1, {"cpu": 8}), "isolated")
    assert s.policy.pools == {0: 1.0} and s.free(0, "cpu") == 8.0
    assert [x.action for x in s.submit(Action(1, {"cpu": 8}, 1.0), 0)] == [1]
    with pytest.raises(tangram.UnknownNameError) as e:
        s.submit(Action(2, {"cpu": 1}, 1.0, task=1), 0)
    assert e.value.field == "actions[0].task" and "no task pool 1" in e.value.reason


# Invariant: a policy option that does not exist, or pools of the wrong shape, is a typed
# error naming the option, never a TypeError from inside; pool keys given as digit strings
# (how TOML and JSON keys arrive) are the same pools as integers.
def test_policy_options_are_checked_and_named() -> None:
    inv = Inventory.uniform(1, {"cpu": 4})
    for options, error, field in [
        (dict(slot=2), tangram.UnknownNameError, "policy.slot"),
        (dict(pools=[(0, 1.0)]), tangram.ValidationError, "policy.pools"),
        (dict(pools={"a": 1.0}), tangram.ValidationError, "policy.pools['a']"),
        (dict(pools={-1: 1.0}), tangram.ValidationError, "policy.pools[-1]"),
        (dict(pools={0: "heavy"}), tangram.ValidationError, "policy.pools[0]"),
        (dict(pools={0: 1.0, "0": 2.0}), tangram.ValidationError, "policy.pools['0']"),
        (dict(pools={}), tangram.ValidationError, "policy(isolated).pools"),
        (dict(aging="x"), tangram.ValidationError, "policy.aging"),
        (dict(aging=True), tangram.ValidationError, "policy.aging"),
        (dict(starvation_seconds=None), tangram.ValidationError, "policy.starvation_seconds"),
        (dict(min_relative_gain=[0.1]), tangram.ValidationError, "policy.min_relative_gain"),
        (dict(trajectory_slot_cpu="2"), tangram.ValidationError, "policy.trajectory_slot_cpu"),
        (dict(candidates=2.5), tangram.ValidationError, "policy.candidates"),
        (dict(candidates=2**40), tangram.ValidationError, "policy.candidates"),
    ]:
        with pytest.raises(error) as e:
            Scheduler(inv, "isolated", **options)
        assert e.value.field == field, options
    with pytest.raises(tangram.ValidationError, match="policy: expected a policy name"):
        Scheduler(inv, 3)  # type: ignore[arg-type]
    assert Scheduler(inv, "isolated", pools={"0": 1.0, "1": 3.0}).policy.pools == {0: 1.0, 1: 3.0}


async def _trajectories(orch, count: int) -> list[object]:  # type: ignore[no-untyped-def]
    """`count` concurrent trajectories of one action each, each ended once done (under
    `trajectory` a slot is held until then, so later ones wait for a slot)."""
    import asyncio

    from tangram import Call

    async def one(t: int) -> object:
        result = await orch.run(Call(fn=lambda: t, trajectory=t))
        await orch.end_trajectory(t)
        return result

    return list(await asyncio.gather(*(one(t) for t in range(count))))


# Invariant: the live runtime takes the same defaults and options: an Orchestrator with
# `RuntimeConfig(policy=...)` alone runs every action under each policy (under
# `trajectory`, more trajectories than slots), and a config file's [policy_options] reach
# the core.
def test_every_policy_runs_live_by_name_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from tangram import MockManager, Orchestrator, RuntimeConfig

    async def run(config: RuntimeConfig) -> tuple[list[object], tangram.Policy]:
        async with Orchestrator(config, inventory=Inventory.uniform(1, {"cpu": 4, "memory": 4096}),
                                default_managers=False, managers={"cpu": MockManager()}) as orch:
            results = await _trajectories(orch, 6)
            assert orch.scheduler is not None
            return results, orch.scheduler.policy

    for policy in tangram.POLICIES:
        assert asyncio.run(run(RuntimeConfig(policy=policy)))[0] == list(range(6)), policy
    path = tmp_path / "tangram.toml"
    path.write_text('policy = "isolated"\n[policy_options]\npools = { "0" = 1.0, "1" = 3.0 }\n')
    results, policy = asyncio.run(run(RuntimeConfig.from_file(str(path))))
    assert results == list(range(6)) and policy.pools == {0: 1.0, 1: 3.0}


# Invariant: `tangram serve --policy P` starts and serves actions for every policy, with
# no policy option given.
def test_every_policy_is_served_by_name_alone() -> None:
    import asyncio
    import re
    import select
    import signal
    import subprocess
    import sys

    from tangram import Client

    async def use(address: str) -> list[object]:
        async with Client(address) as client:
            return await _trajectories(client, 3)

    for policy in ("trajectory", "isolated"):
        proc = subprocess.Popen([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--policy", policy,
                                 "--manager", "cpu=mock", "--grace", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else ""
            match = re.search(r"listening on (\S+) \(policy (\w+)", line)
            assert match is not None and match.group(2) == policy, (line, proc.stderr and proc.stderr.read())
            assert asyncio.run(use(match.group(1))) == [0, 1, 2]
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
