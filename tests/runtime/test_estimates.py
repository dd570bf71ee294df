"""Run times learned for calls that declare none (tangram.estimates): the keys,
the cold start, the robust median, the elasticity fit, persistence in SQLite, export and
import, and the orchestrator planning with them (records, explain, the core's order)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sqlite3
from pathlib import Path

import pytest

import tangram
from tangram import Amdahl, Call, Inventory, MockManager, Orchestrator
from tangram.runtime.config import RuntimeConfig
from tangram.estimates import (
    MAX_ESTIMATE,
    MIN_ESTIMATE,
    MIN_FIT,
    PRIOR_PARALLEL,
    PRIOR_SECONDS,
    RunTimeEstimates,
    cli_main,
    key_of,
)


def solve() -> None:
    pass


def amdahl(unit_seconds: float, p: float, grant: float) -> float:
    return unit_seconds * ((1 - p) + p / grant)


# ------------------------------------------------------------------ keys


def test_keys_name_what_a_call_runs() -> None:
    assert key_of(Call(fn=solve, kind="env")) == f"env:{__name__}.solve"
    assert key_of(Call(fn=solve, kind="reward")) == f"reward:{__name__}.solve"
    assert key_of(Call(command="pytest -x tests/test_a.py", kind="env")) == "env:pytest -x"
    assert key_of(Call(command=["python", "solve.py", "--fast"])) == "env:python solve.py"
    assert key_of(Call(command="make")) == "env:make"
    assert key_of(Call(fn=solve, key="unit-tests")) == "unit-tests"
    with pytest.raises(tangram.ValidationError, match=r"call\.key"):
        tangram.runtime.call.validate_call(Call(fn=solve, key=3))  # type: ignore[arg-type]


# ------------------------------------------------------------------ learning


def test_cold_start_then_the_kind_then_the_key() -> None:
    est = RunTimeEstimates()
    first = est.estimate(Call(fn=solve))
    assert first.source == "prior" and first.model == PRIOR_SECONDS and "unknown" in first.describe()
    est.observe(Call(command="ls", kind="env"), 0.2, None)
    est.observe(Call(command="ls", kind="env"), 0.4, None)
    by_kind = est.estimate(Call(fn=solve))
    # The geometric mean of the kind's runs (the earlier one weighs a little less).
    assert by_kind.source == "kind" and by_kind.model == pytest.approx(math.sqrt(0.2 * 0.4), rel=0.005)
    assert by_kind.runs == 2
    assert est.estimate(Call(fn=solve, kind="reward")).source == "prior"  # another kind learned nothing
    est.observe(Call(fn=solve), 0.05, None)
    learned = est.estimate(Call(fn=solve))
    assert learned.source == "learned" and learned.model == pytest.approx(0.05, rel=0.005) and learned.runs == 1
    assert "learned from 1 runs" in learned.describe()
    declared = est.estimate(Call(fn=solve, runtime=7.0))
    assert declared.source == "declared" and declared.model == 7.0


def test_one_stuck_run_barely_moves_an_estimate_and_a_lasting_change_is_followed() -> None:
    est = RunTimeEstimates()
    call = Call(fn=solve)
    for i in range(20):
        est.observe(call, 0.09 if i % 2 else 0.11, None)
    before = est.estimate(call).model
    assert before == pytest.approx(0.1, rel=0.01)
    est.observe(call, 1000.0, None)  # stuck: counts as 2x (the clip's floor; 3 sd are less here)
    assert est.estimate(call).model == pytest.approx(before * 2 ** (1 / 21), rel=0.01)  # in 1% steps
    for bad in (math.nan, -1.0, math.inf):  # not a run time: ignored
        est.observe(call, bad, None)
    assert est.estimate(call).runs == 21
    for i in range(1000):  # the inputs changed for good: 20x longer
        est.observe(call, 1.8 if i % 2 else 2.2, None)
    assert est.estimate(call).model == pytest.approx(2.0, rel=0.1)


def test_an_estimate_stays_within_what_the_core_takes() -> None:
    est = RunTimeEstimates()
    est.observe(Call(fn=solve, key="endless"), 1e12, None)
    est.observe(Call(fn=solve, key="instant"), 0.0, None)
    assert est.estimate(Call(fn=solve, key="endless")).model == pytest.approx(MAX_ESTIMATE, rel=0.01)
    assert est.estimate(Call(fn=solve, key="instant")).model == pytest.approx(MIN_ESTIMATE, rel=0.01)
    # An elastic one at a quarter core, 0.8 parallel: 3.4x its estimate at one unit, still
    # a run time the core takes.
    elastic = Call(fn=solve, key="endless", resources={"cpu": 0.25}, elastic="cpu", max_units=1)
    est.observe(elastic, 1e12, 0.25)
    quarter = est.estimate(elastic)
    assert quarter.source == "learned" and quarter.model.seconds == pytest.approx(3.4 * MAX_ESTIMATE, rel=0.01)
    scheduler = tangram.Scheduler(Inventory.uniform(1, {"cpu": 1}), "tangram")
    scheduler.submit([tangram.Action(1, {"cpu": 0.25}, quarter.model, elastic="cpu", max_units=1)], 0.0)


def test_a_resized_run_is_learned_from_each_grant_it_held() -> None:
    """Runs that grew or shrank while running, given as (seconds, grant) segments: under
    Amdahl's law each segment did its seconds over (1 - p) + p / g of the work, so exact
    runs fit exactly. Their time-averaged grant would not: the speed is concave in the
    grant, so a run that grew would look less parallel than it is."""
    est = RunTimeEstimates()
    call = Call(fn=solve, resources={"cpu": 1.0}, elastic="cpu", max_units=8)
    p, unit = 0.6, 10.0
    for a, b, share in ((1.0, 8.0, 0.2), (2.0, 4.0, 0.5), (8.0, 1.0, 0.3), (1.0, 2.0, 0.7), (4.0, 8.0, 0.4),
                        (3.0, 6.0, 0.5)):
        # `share` of the work at grant a, the rest at b
        first, second = share * amdahl(unit, p, a), (1 - share) * amdahl(unit, p, b)
        est.observe(call, first + second, [(first, a), (second, b)])
    got = est.estimate(call)
    assert got.fitted and got.parallel == pytest.approx(p) and got.model.seconds == pytest.approx(unit, rel=0.01)
    for bad in ([], [(1.0, 0.0)], [(-1.0, 2.0)], [(1.0, math.nan)], [("x", 1.0)], [(1.0,)]):
        est.observe(call, 1.0, bad)  # not learned
    assert est.estimate(call).runs == got.runs


def _burst(seed: int, report: bool, runs: int = 300, ended: float = 0.33) -> tangram.estimates.Estimate:
    """A burst of one key's runs, all started at 0 at grants of 1 to 8 cores, inputs of
    lognormal sizes, p = 0.6: the estimate when the first third have ended. `report`:
    the runs are reported as they start and end (as the orchestrator does), else only
    the ended ones are learned."""
    rng = random.Random(seed)
    burst = []
    for i in range(runs):
        g = float(rng.choice((1, 2, 4, 8)))
        burst.append((amdahl(10.0 * rng.lognormvariate(0, 0.8), 0.6, g), g, i))
    est = RunTimeEstimates()
    if report:
        for _, g, i in burst:
            est.started(i, "k", "env", True, g, 0.0)
    for t, g, i in sorted(burst)[:int(runs * ended)]:
        if report:
            est.finished(i, t)
        else:
            est.learn("k", "env", True, t, g)
    return est.plan("k", "env", True, 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runs_still_going_count_as_censored(seed: int) -> None:
    """Early in a burst the runs that ended are the short ones, and a run at a small grant
    ends early only when its input is small: from the ended runs alone a larger grant
    looks nearly useless (p fitted at 0.3 or less here). The runs still going, counted as
    longer than what they have done so far, put p back near the truth."""
    reported, ended_only = _burst(seed, True), _burst(seed, False)
    assert reported.fitted and reported.parallel == pytest.approx(0.6, abs=0.1)
    assert ended_only.parallel <= 0.3
    # The censored fit chooses p; the run time is the ended runs' geometric mean under it.
    assert reported.model.seconds < 10.0


def test_runs_grown_because_they_ran_long_do_not_bias_the_fit() -> None:
    """Runs start at 1 or 2 cores and those still going at 8 s are grown to 8 cores: the
    long ones hold the large grants. The least-variance fit reads that as no gain from
    cores at all (p = 0 here); the likelihood, with the Jacobian of each run's scaling
    (its speed at its last grant), finds p."""
    rng = random.Random(4)
    est = RunTimeEstimates()
    for i in range(300):
        unit, g = 10.0 * rng.lognormvariate(0, 0.8), float(rng.choice((1, 2)))
        est.started(i, "k", "env", True, g, 0.0)
        end = amdahl(unit, 0.6, g)
        if end > 8.0:  # grown at 8 s; the work left runs at 8 cores
            est.resized(i, 8.0, 8.0)
            end = 8.0 + (unit - 8.0 / amdahl(1.0, 0.6, g)) * amdahl(1.0, 0.6, 8.0)
        est.finished(i, end)
    got = est.plan("k", "env", True, 1.0)
    assert got.fitted and got.parallel == pytest.approx(0.6, abs=0.1)
    history = est._histories[("k", True)]
    variances = [history.squares[i] / history.weight - (history.sums[i] / history.weight) ** 2
                 for i in range(len(history.grid))]
    assert history.grid[variances.index(min(variances))] <= 0.2  # what the least variance would choose


def test_runs_reported_as_they_go() -> None:
    """started / resized / finished: a run that succeeds is learned with each grant it held;
    one that failed, was cancelled or requeued (ok=False) is not; an id not going is
    ignored, and an id started again starts afresh."""
    est = RunTimeEstimates()
    p, unit = 0.6, 10.0
    for i, (a, b) in enumerate(((1.0, 8.0), (2.0, 4.0), (8.0, 1.0), (1.0, 2.0), (4.0, 8.0))):
        first, second = 0.5 * amdahl(unit, p, a), 0.5 * amdahl(unit, p, b)
        est.started(i, "k", "env", True, a, 100.0)
        est.resized(i, b, 100.0 + first)
        est.finished(i, 100.0 + first + second)
    got = est.plan("k", "env", True, 1.0)
    assert got.runs == 5 and got.fitted and got.parallel == pytest.approx(p)
    assert got.model.seconds == pytest.approx(unit, rel=0.01)
    est.started("x", "k", "env", True, 2.0, 0.0)
    est.finished("x", 50.0, ok=False)
    est.finished("x", 60.0)  # not going any more
    est.finished("never", 1.0)
    est.resized("never", 2.0, 1.0)
    est.started("y", "k", "env", True, 2.0, 0.0)
    est.started("y", "k", "env", True, 2.0, 200.0)  # started again (a requeue)
    est.finished("y", 200.0 + amdahl(unit, p, 2.0))
    again = est.plan("k", "env", True, 1.0)
    assert again.runs == 6 and again.model.seconds == pytest.approx(unit, rel=0.01)
    est.started("z", "f", "env", False, 0.0, 0.0)  # a fixed call: its grant does not matter
    est.finished("z", 3.0)
    assert est.plan("f", "env", False, 0.0).model == pytest.approx(3.0, rel=0.01)


def test_a_known_parallel_fraction_plans_the_run_time_learned_under_it() -> None:
    """plan(parallel=p) (the simulator's learned-runtimes diagnosis): the run time at one
    unit learned under that p, whatever p the fit chose."""
    est = RunTimeEstimates()
    for g in (1.0, 2.0, 4.0, 8.0):
        est.learn("k", "env", True, amdahl(10.0, 0.6, g), g)
    told = est.plan("k", "env", True, 1.0, parallel=0.6)
    assert told.parallel == 0.6 and told.model.seconds == pytest.approx(10.0, rel=0.01)
    other = est.plan("k", "env", True, 1.0, parallel=0.9)
    assert other.parallel == 0.9 and other.model.parallel_fraction == 0.9
    assert other.model.seconds != pytest.approx(10.0, rel=0.05)  # the same runs, read under another p
    assert est.plan("new", "other", True, 2.0, parallel=0.6).model == Amdahl.from_one_unit(1.0, 0.6, 2.0)  # prior


def test_elasticity_is_assumed_until_grants_vary_then_fitted() -> None:
    rng = random.Random(7)
    est = RunTimeEstimates()
    call = Call(fn=solve, resources={"cpu": 1.0}, elastic="cpu", max_units=8)
    for _ in range(MIN_FIT + 2):
        est.observe(call, amdahl(10.0, 0.6, 2.0), 2.0)
    same = est.estimate(call)
    assert not same.fitted and same.parallel == PRIOR_PARALLEL
    assert "assumed" in same.describe()
    # All runs at 2 cores: under the assumed p, 10 s at one unit is read back exactly.
    assert same.model == Amdahl(pytest.approx(amdahl(10.0, 0.6, 2.0) / amdahl(1.0, PRIOR_PARALLEL, 2.0), rel=0.01),
                                PRIOR_PARALLEL)  # (estimates move in steps of 1%)
    # Runs of different sizes (lognormal, as one key's inputs are) at grants 1 to 8: the
    # fit finds p although the sizes vary more than the grants' effect.
    for _ in range(400):
        g = float(rng.randint(1, 8))
        est.observe(call, amdahl(10.0 * rng.lognormvariate(0, 0.8), 0.6, g), g)
    fitted = est.estimate(call)
    assert fitted.fitted and fitted.parallel == pytest.approx(0.6, abs=0.1)
    assert isinstance(fitted.model, Amdahl) and fitted.model.seconds == pytest.approx(10.0, rel=0.25)
    # Exact runs fit exactly; seconds at the call's own minimum: 10 ((1 - p) + p / 0.5).
    exact = RunTimeEstimates()
    for g in (1.0, 2.0, 4.0, 8.0, 3.0, 6.0):
        exact.observe(call, amdahl(10.0, 0.6, g), g)
    got = exact.estimate(call)
    assert got.fitted and got.parallel == pytest.approx(0.6) and got.model.seconds == pytest.approx(10.0, rel=0.01)
    half = exact.estimate(Call(fn=solve, resources={"cpu": 0.5}, elastic="cpu", max_units=8))
    assert half.model.seconds == pytest.approx(amdahl(10.0, 0.6, 0.5), rel=0.01)
    # ... the same curve: 4 s serial and 6 s parallel at one unit are 4 and 12 at half of one.
    assert half.model.parallel_fraction == pytest.approx(12.0 / 16.0)
    # A call that gets slower with more cores fits p = 0; one with no serial part p = 1.
    for p_true, name in ((-0.5, "slower"), (1.0, "perfect")):
        c = Call(fn=solve, key=name, resources={"cpu": 1.0}, elastic="cpu", max_units=8)
        for g in (1.0, 2.0, 4.0, 8.0):
            exact.observe(c, 4.0 * (1 - p_true) + 4.0 * p_true / g, g)
        assert exact.estimate(c).parallel == (0.0 if p_true < 0 else pytest.approx(1.0))
    # A fixed call of the same key learns apart from the elastic one.
    assert exact.estimate(Call(fn=solve)).source == "kind"


# ------------------------------------------------------------------ persistence


def test_a_database_keeps_estimates_across_runs(tmp_path: Path) -> None:
    db = tmp_path / "estimates.db"
    first = RunTimeEstimates(db)
    call = Call(fn=solve, resources={"cpu": 1.0}, elastic="cpu", max_units=8)
    for g in (1.0, 2.0, 4.0, 8.0):
        first.observe(call, amdahl(3.0, 0.9, g), g)
    first.observe(Call(command="make -j"), 12.0, None)
    assert first.save() == 2 and first.save() == 0  # only what changed is written
    first.close()
    first.close()  # idempotent
    second = RunTimeEstimates(db)
    got = second.estimate(call)
    assert got.source == "learned" and got.runs == 4 and got.parallel == pytest.approx(0.9)
    assert got.model.seconds == pytest.approx(3.0, rel=0.01)
    assert got.model == first.estimate(call).model  # exactly what the first one planned
    assert second.estimate(Call(command="make -j")).model == pytest.approx(12.0, rel=0.01)
    second.close()


def test_export_and_import_move_estimates_and_check_the_file(tmp_path: Path) -> None:
    est = RunTimeEstimates()
    for t in (1.0, 2.0, 4.0):
        est.observe(Call(command="pytest -q"), t, None)
    assert est.export(tmp_path / "e.json") == 1
    other = RunTimeEstimates()
    other.observe(Call(command="pytest -q"), 8.0, None)
    assert other.import_file(tmp_path / "e.json") == 1
    got = other.estimate(Call(command="pytest -q"))
    assert got.runs == 4 and got.model == pytest.approx((8.0 * 1.0 * 2.0 * 4.0) ** 0.25, rel=0.01)

    def bad(payload: object, match: str) -> None:
        path = tmp_path / "bad.json"
        path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
        with pytest.raises(tangram.ValidationError, match=match):
            RunTimeEstimates().import_file(path)

    head = json.loads((tmp_path / "e.json").read_text())
    good = head["estimates"][0]
    file = {k: v for k, v in head.items() if k != "estimates"}
    bad("{", "not JSON")
    bad({"estimates": []}, "not a tangram estimates file")
    bad(file | {"parallel_grid": [0, 1]}, "another grid")
    bad(file | {"estimates": {}}, r"estimates\.estimates")
    bad(file | {"estimates": [good | {"key": 5}]}, r"estimates\[0\]\.key")
    bad(file | {"estimates": [good | {"runs": -1}]}, r"estimates\[0\]\.runs")
    bad(file | {"estimates": [good, good | {"statistics": [1.0]}]}, r"estimates\[1\]\.statistics.*6 finite.*5 in a version-1")
    bad(file | {"estimates": [good | {"elastic": True}]}, r"estimates\[0\]\.statistics.*66 finite.*elastic")
    bad(file | {"estimates": [good | {"runs": 1}]}, r"estimates\[0\]\.statistics.*weight")


def test_a_version_1_file_still_loads(tmp_path: Path) -> None:
    """Version 1 kept no Jacobian sums; for runs never resized they are the sums of log t
    (the p = 0 sums), which is what loading one assumes."""
    est = RunTimeEstimates()
    for g in (1.0, 2.0, 4.0, 8.0):
        est.learn("k", "env", True, amdahl(3.0, 0.9, g), g)
    est.learn("f", "env", False, 2.0, None)
    est.export(tmp_path / "v2.json")
    data = json.loads((tmp_path / "v2.json").read_text())
    data["tangram_estimates"] = 1
    for entry in data["estimates"]:
        n = (len(entry["statistics"]) - 3) // 3
        entry["statistics"] = entry["statistics"][:3 + 2 * n]
    (tmp_path / "v1.json").write_text(json.dumps(data))
    old = RunTimeEstimates()
    assert old.import_file(tmp_path / "v1.json") == 2
    for got, want in zip(old.entries(), est.entries()):
        assert got["statistics"] == pytest.approx(want["statistics"], rel=1e-12)
        assert {k: v for k, v in got.items() if k != "statistics"} == {k: v for k, v in want.items() if k != "statistics"}


def test_a_file_that_is_not_a_database_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(tangram.ValidationError, match="config.estimates"):
        RunTimeEstimates(path)
    with pytest.raises(tangram.ValidationError, match="config.estimates"):
        RuntimeConfig(estimates=5)  # type: ignore[arg-type]
    assert RuntimeConfig.from_mapping({"estimates": str(path)}).estimates == str(path)


def test_the_command_shows_imports_and_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    est = RunTimeEstimates(tmp_path / "a.db")
    for g in (1.0, 2.0, 4.0, 8.0):
        est.observe(Call(command="make -j", elastic="cpu", max_units=8), amdahl(6.0, 0.5, g), g)
    est.close()
    assert cli_main([str(tmp_path / "a.db"), "--export", str(tmp_path / "a.json")]) == 0
    assert cli_main([str(tmp_path / "b.db"), "--import", str(tmp_path / "a.json")]) == 0
    assert cli_main([str(tmp_path / "b.db")]) == 0
    out = capsys.readouterr().out
    assert "exported 1 keys" in out and "imported 1 keys" in out
    assert "env:make -j | elastic | 4 | 5.99" in out and "| 0.50\n" in out
    (tmp_path / "c.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        cli_main([str(tmp_path / "b.db"), "--import", str(tmp_path / "c.json")])
    assert e.value.code == 2
    assert "not a tangram estimates file" in capsys.readouterr().err
    assert sqlite3.connect(tmp_path / "b.db").execute("SELECT COUNT(*) FROM estimates").fetchone() == (1,)


# ------------------------------------------------------------------ the orchestrator


def orchestrator(cpu: float = 1, **config: object) -> Orchestrator:
    mock = MockManager()
    inventory = Inventory.uniform(1, {"cpu": cpu, "memory": 8192})
    return Orchestrator(RuntimeConfig(**config), inventory=inventory,  # type: ignore[arg-type]
                        default_managers=False, managers={"cpu": mock, "api": mock})


async def sleep_for(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


def test_the_orchestrator_learns_records_and_explains(tmp_path: Path) -> None:
    async def main() -> None:
        async with orchestrator(estimates=str(tmp_path / "e.db")) as orch:
            for _ in range(3):
                await orch.run(Call(fn=sleep_for, args=(0.05,), key="nap"))
            records = list(orch.records)
            assert "unknown" in records[0].estimate and "learned from 2 runs of 'nap'" in records[2].estimate
            learned = orch.estimates.estimate(Call(fn=sleep_for, key="nap"))
            assert 0.05 <= learned.model < 0.5
            blocker = orch.submit(Call(fn=sleep_for, args=(0.2,), key="block", runtime=0.2))
            await asyncio.sleep(0.02)  # started
            waiting = orch.submit(Call(fn=sleep_for, args=(0.01,), key="nap"))
            await asyncio.sleep(0.01)
            assert "run time declared" in await orch.explain(blocker.id)
            assert "learned from 3 runs of 'nap'" in await orch.explain(waiting.id)
            await asyncio.gather(blocker, waiting)
            assert [r.estimate for r in orch.records][-2] == "declared"
        # Saved at close: a new orchestrator plans with them from its first call.
        async with orchestrator(estimates=str(tmp_path / "e.db")) as orch:
            assert orch.estimates.estimate(Call(fn=sleep_for, key="nap")).source == "learned"
            assert "learned from 4 runs" in orch.explain_now(orch.submit(Call(fn=sleep_for, args=(0.0,), key="nap")).id)

    asyncio.run(main())


def test_learned_run_times_order_the_queue_shortest_first() -> None:
    """Two keys learned as 0.3 s and 0.01 s: behind a blocker on one core, the short one
    submitted last starts first. Without estimates both would be planned alike (1 s) and
    start in submit order."""
    async def main() -> None:
        async with orchestrator(cpu=1) as orch:
            for _ in range(2):
                await orch.run(Call(fn=sleep_for, args=(0.3,), key="long"))
                await orch.run(Call(fn=sleep_for, args=(0.01,), key="short"))
            blocker = orch.submit(Call(fn=sleep_for, args=(0.05,), runtime=0.05))
            long = orch.submit(Call(fn=sleep_for, args=(0.3,), key="long"))
            await asyncio.sleep(0.01)
            short = orch.submit(Call(fn=sleep_for, args=(0.01,), key="short"))
            await asyncio.gather(blocker, long, short)
            starts = {r.id: r.start for r in orch.records}
            assert starts[short.id] < starts[long.id]

    asyncio.run(main())


def test_an_elastic_call_learns_from_each_grant_it_held_across_resizes() -> None:
    """A suite starts alone on 4 cores and, a third of the way through, limits itself to
    one (as a worker pool with one task left does): the core resizes it. What is learned
    is the run over both grants, each for as long as it was held: its effective grant
    lies between the start grant and the final one."""
    async def main() -> None:
        async with orchestrator(cpu=4) as orch:
            call = Call(fn=sleep_for, args=(0.3,), key="suite", resources={"cpu": 1.0}, elastic="cpu", max_units=4)
            suite = orch.submit(call)
            await asyncio.sleep(0.1)
            assert orch.limit_grant(suite.id, 1.0)
            await suite
            (rec,) = list(orch.records)
            starts = [p.grant for e, i, p in orch.managers["cpu"].events if e == "execute" and i == suite.id]
            assert starts == [4.0] and rec.grant == 1.0
            got = orch.estimates.estimate(call)
            assert got.source == "learned" and isinstance(got.model, Amdahl)
            # T1 = run / (1 - p + p / g): the g it was learned at.
            p = PRIOR_PARALLEL
            effective_grant = p / ((rec.end - rec.start) / got.model.seconds - (1 - p))
            assert 1.0 + 0.3 < effective_grant < 4.0 - 0.5  # 4 for 0.1 s, then 1 for 0.2 s

    asyncio.run(main())


def test_a_threaded_orchestrator_saves_its_estimates(tmp_path: Path) -> None:
    """SyncOrchestrator builds the orchestrator (and opens the database) in the caller's
    thread and runs it, saves included, in a thread of its own."""
    db = tmp_path / "e.db"
    inventory = Inventory.uniform(1, {"cpu": 2, "memory": 1024})
    with tangram.SyncOrchestrator(RuntimeConfig(estimates=str(db)), inventory=inventory, default_managers=False,
                                  managers={"cpu": MockManager()}) as orch:
        for _ in range(2):
            orch.run(Call(fn=solve, key="threaded"))
    assert RunTimeEstimates(db).estimate(Call(fn=solve, key="threaded")).runs == 2
