"""Elasticity models (Constant, Amdahl, Table, numba native callbacks, plain callables) and
the inventory helpers (Inventory.local, TANGRAM_FAKE_GPUS, kinds)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import tangram
from tangram import Action, Amdahl, Constant, Gpu, Inventory, Native, Node, Scheduler, Table
from tangram._records import DecisionKind


def amdahl(seconds: float, p: float, minimum: float, units: float) -> float:
    """The documented formula, in the core's order of operations."""
    return seconds * ((1.0 - p) + p * (minimum / units))


def one_action(model, demand: float = 1.0, max_units: float | None = 10.0) -> Scheduler:
    s = Scheduler(Inventory.uniform(1, {"cpu": 64}), "fifo")  # fifo: minimum grants only
    elastic = "cpu" if max_units is not None else None
    s.submit(Action(1, {"cpu": demand}, model, elastic=elastic, max_units=max_units), 0)
    assert s.state(1) == "running"
    return s


# ------------------------------------------------------------------ models

def test_constant_and_plain_seconds():
    for model in (7.5, 7, Constant(7.5)):
        s = one_action(model)
        assert s.runtime(1, 1) == s.runtime(1, 9) == float(model if not isinstance(model, Constant) else 7.5)


def test_amdahl():
    s = one_action(Amdahl(60.0, 0.75), demand=2.0)
    assert s.runtime(1, 2) == 60.0  # `seconds` at the minimum grant
    for u in (2.5, 3, 4, 7, 10):
        assert s.runtime(1, u) == amdahl(60.0, 0.75, 2.0, u)
    assert s.runtime(1, 4) == pytest.approx(60 * (0.25 + 0.375))


def test_amdahl_extremes():
    assert one_action(Amdahl(10.0, 0.0)).runtime(1, 8) == 10.0  # serial: no speed-up
    assert one_action(Amdahl(10.0, 1.0)).runtime(1, 8) == 1.25  # perfectly parallel


def test_amdahl_from_one_unit_is_the_same_curve_at_any_minimum():
    # 2 s on one core, 95% parallel: 0.1 s serial, 1.9 s that divides over the cores.
    for minimum in (0.125, 0.25, 1.0, 2.0):  # whole milli-units, as the core keeps grants
        s = one_action(Amdahl.from_one_unit(2.0, 0.95, minimum), demand=minimum, max_units=16.0)
        for u in (minimum, 1.0, 2.0, 16.0):
            if u >= minimum:
                assert s.runtime(1, u) == pytest.approx(2.0 * (0.05 + 0.95 / u), rel=1e-12)
    assert Amdahl.from_one_unit(3.0, 0.6, 1.0) == Amdahl(3.0, 0.6)  # a minimum of one unit changes nothing
    assert Amdahl.from_one_unit(0.0, 0.5, 0.25) == Amdahl(0.0, 0.5)  # nothing to run: the fraction as given


@pytest.mark.parametrize("args, field", [
    (("2", 0.5, 1.0), "amdahl.seconds"), ((2.0, 1.5, 1.0), "amdahl.parallel_fraction"),
    ((2.0, -0.1, 1.0), "amdahl.parallel_fraction"), ((2.0, 0.5, 0.0), "amdahl.minimum"),
    ((2.0, 0.5, math.inf), "amdahl.minimum"), ((2.0, 0.5, None), "amdahl.minimum")])
def test_amdahl_from_one_unit_refuses_bad_figures(args, field):
    with pytest.raises(tangram.ValidationError) as e:
        Amdahl.from_one_unit(*args)
    assert e.value.field == field


def test_table_interpolates_and_is_flat_outside():
    s = one_action(Table([(2, 10.0), (4, 6.0), (8, 5.0)]), demand=1.0)
    expected = {1: 10.0, 1.5: 10.0, 2: 10.0, 2.5: 9.0, 3: 8.0, 4: 6.0, 6: 5.5, 7: 5.25, 8: 5.0, 9: 5.0, 64: 5.0}
    for u, t in expected.items():
        assert s.runtime(1, u) == pytest.approx(t, abs=1e-12), u


def test_table_points_are_normalised_and_shared():
    assert Table([(1, 2), (3, 4)]).points == ((1.0, 2.0), (3.0, 4.0))
    assert Table([(1, 2)]) == Table([(1.0, 2.0)])
    s = Scheduler(Inventory.uniform(1, {"cpu": 8}))
    assert s.table([(1, 2), (3, 4)]) == s.table([(1.0, 2.0), (3.0, 4.0)])  # registered once


def test_non_elastic_models_are_evaluated_at_one_unit():
    s = one_action(Table([(1, 7.0), (2, 3.0)]), demand=4.0, max_units=None)
    assert s.runtime(1, 0) == s.runtime(1, 100) == 7.0
    s = one_action(Amdahl(9.0, 0.5), demand=4.0, max_units=None)
    assert s.runtime(1, 2) == 9.0


def test_cost_model_returns_a_native_callback():
    native = tangram.cost_model(lambda u: 3.0 + 1.0 / u)
    assert isinstance(native, Native) and native.address > 0
    s = one_action(native)
    assert s.runtime(1, 2) == 3.5
    assert s.runtime(1, 4) == 3.25


def test_native_callback_returning_nan_is_refused():
    s = Scheduler(Inventory.uniform(1, {"cpu": 8}))
    with pytest.raises(tangram.ValidationError) as e:
        s.submit(Action(1, {"cpu": 1}, tangram.cost_model(lambda u: math.nan)), 0)
    assert e.value.field == "actions[0].runtime"


def test_plain_callable_is_sampled_at_whole_units():
    calls: list[float] = []

    def f(u: float) -> float:
        calls.append(u)
        return 12.0 / u

    s = one_action(f, demand=1.5, max_units=4.0)
    assert calls == [1.5, 2.5, 3.5, 4.0]  # the grants the core can choose, plus the bound
    assert s.runtime(1, 2.5) == 12.0 / 2.5
    assert s.runtime(1, 3.0) == pytest.approx((12.0 / 2.5 + 12.0 / 3.5) / 2)  # interpolated
    assert s.runtime(1, 9.0) == 3.0  # flat past the bound


# ------------------------------------------------------------------ same decisions

PARAMS = [(40.0, 0.95), (40.0, 0.6), (25.0, 0.85), (60.0, 0.3), (25.0, 0.85), (40.0, 0.95)]


def elastic_run(model_for) -> list[np.ndarray]:
    """Elastic actions arriving in bursts on a small node: the spare-unit split depends on
    the models' marginal gains."""
    s = Scheduler(Inventory.uniform(1, {"cpu": 12}))
    out = []
    ids = iter(range(1, 100))
    running: list[int] = []
    t = 0.0
    for burst in (PARAMS[:2], PARAMS[2:5], PARAMS[5:], PARAMS[:3]):
        acts = [Action(next(ids), {"cpu": 1}, model_for(sec, p), elastic="cpu", max_units=6) for sec, p in burst]
        d = s.submit(acts, t)
        out.append(d.array)
        running += [x.action for x in d if x.kind == "start"]
        t += 1
        d = s.complete(running[:1], t)
        out.append(d.array)
        running = running[1:] + [x.action for x in d if x.kind == "start"]
        t += 1
    while running:
        d = s.complete(running.pop(0), t)
        out.append(d.array)
        running += [x.action for x in d if x.kind == "start"]
        t += 1
    assert s.waiting == s.running == 0
    return out


_native_cache: dict[tuple[float, float], Native] = {}


def native_amdahl(seconds: float, p: float) -> Native:
    if (seconds, p) not in _native_cache:
        _native_cache[(seconds, p)] = tangram.cost_model(lambda u: seconds * ((1.0 - p) + p * (1.0 / u)))
    return _native_cache[(seconds, p)]


def table_amdahl(seconds: float, p: float) -> Table:
    return Table([(u, amdahl(seconds, p, 1.0, u)) for u in range(1, 7)])


def callable_amdahl(seconds: float, p: float):
    return lambda u: amdahl(seconds, p, 1.0, u)


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray]:
    return elastic_run(Amdahl)


def test_reference_run_uses_spare_units(reference):
    starts = np.concatenate(reference)
    starts = starts[starts["kind"] == DecisionKind.START]
    assert len(starts) == 9  # every action starts once
    grants = set(starts["grant"].tolist())
    assert len(grants) >= 3 and min(grants) == 1.0 and max(grants) > 1.0, grants


@pytest.mark.parametrize("model_for", [table_amdahl, native_amdahl, callable_amdahl],
                         ids=["table", "numba", "python-callable"])
def test_equivalent_models_give_the_same_decisions(reference, model_for):
    other = elastic_run(model_for)
    assert len(other) == len(reference)
    for x, y in zip(reference, other):
        np.testing.assert_array_equal(x, y)


def test_native_and_table_agree_on_a_non_amdahl_curve():
    points = [(1, 30.0), (2, 18.0), (3, 14.0), (4, 13.0), (6, 12.5)]
    table = Table(points)

    def curve(u: float) -> float:  # the same piecewise-linear curve, flat outside
        if u <= 1.0:
            return 30.0
        if u >= 6.0:
            return 12.5
        if u < 2.0:
            return 30.0 + (18.0 - 30.0) * ((u - 1.0) / (2.0 - 1.0))
        if u < 3.0:
            return 18.0 + (14.0 - 18.0) * ((u - 2.0) / (3.0 - 2.0))
        if u < 4.0:
            return 14.0 + (13.0 - 14.0) * ((u - 3.0) / (4.0 - 3.0))
        return 13.0 + (12.5 - 13.0) * ((u - 4.0) / (6.0 - 4.0))

    native = tangram.cost_model(curve)
    runs = []
    for model in (table, native, curve):
        s = Scheduler(Inventory.uniform(1, {"cpu": 8}))
        d = s.submit([Action(1, {"cpu": 1}, model, elastic="cpu", max_units=6),
                      Action(2, {"cpu": 1}, Amdahl(30.0, 0.5), elastic="cpu", max_units=6)], 0)
        runs.append(d.array)
        assert [s.runtime(1, u) for u in (1, 2.5, 5, 7)] == pytest.approx([30.0, 16.0, 12.75, 12.5])
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


# ------------------------------------------------------------------ inventory

def test_inventory_local(monkeypatch):
    monkeypatch.delenv("TANGRAM_FAKE_GPUS", raising=False)
    inv = Inventory.local()
    assert len(inv.nodes) == 1
    node = inv.nodes[0]
    assert node.name == os.uname().nodename
    assert node.resources["cpu"] == len(os.sched_getaffinity(0))
    assert node.resources["memory"] == math.floor(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    assert inv.kinds == ["cpu", "memory"]
    s = Scheduler(inv)
    assert s.free(0, "cpu") == node.resources["cpu"]


def test_inventory_local_with_fake_gpus(monkeypatch):
    monkeypatch.setenv("TANGRAM_FAKE_GPUS", "1000,2000")
    inv = Inventory.local(services=[tangram.Service("rm", 1500)])
    assert list(inv.nodes[0].gpus) == [Gpu(1000.0), Gpu(2000.0)]
    s = Scheduler(inv)
    assert (s.gpu_free(0, 0), s.gpu_free(0, 1)) == (1000.0, 2000.0)
    d = s.submit([Action(1, {"cpu": 0.5}, 1.0, gpu_memory=1500), Action(2, {"cpu": 0.5}, 1.0, gpu_memory=2500)], 0)
    assert [(x.kind, x.action, x.device) for x in d] == [("reject", 2, None), ("start", 1, 1)]
    assert "gpu_memory needs 2500, largest is 2000" in d[0].reason
    s.complete(1, 1)
    d = s.submit(Action(3, {"cpu": 0.5}, 1.0, service="rm"), 2)
    assert [(x.kind, x.service, x.device) for x in d] == [("restore", "rm", 1), ("start", "rm", 1)]


def test_fake_gpus_malformed(monkeypatch):
    monkeypatch.setenv("TANGRAM_FAKE_GPUS", "80GB")
    with pytest.raises(tangram.ValidationError) as e:
        Inventory.local()
    assert e.value.field == "TANGRAM_FAKE_GPUS"


def test_inventory_kinds_and_uniform():
    inv = Inventory([Node("x", {"tpu": 1, "memory": 10}), Node("y", {"cpu": 2, "disk": 5})])
    assert inv.kinds == ["cpu", "memory", "tpu", "disk"]
    s = Scheduler(inv)
    assert s.kinds == inv.kinds
    assert s.free(0, "cpu") == 0.0 and s.free(1, "disk") == 5.0
    u = Inventory.uniform(3, {"cpu": 4}, gpus=[100, 200])
    assert [n.name for n in u.nodes] == ["node0", "node1", "node2"]
    assert list(u.nodes[2].gpus) == [Gpu(100), Gpu(200)]
