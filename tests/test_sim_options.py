"""The simulator's options (tangram/sim): inventory sweeps, savings searches, figures and
the report, and what the core is told of run times (--estimates)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tangram
import tangram.sim as sim
from tangram.estimates import PRIOR_PARALLEL
from tangram.sim.engine import ENV

from sim_cases import small_coding, tiny


# ------------------------------------------------------------------ inventory sweeps, savings, figures


def test_inventory_scaling() -> None:
    w = sim.builtin("multireward")
    assert w.value("gpus") == 4 and w.value("cores") == 64 and w.total("cores") == 16 * 64
    g = w.with_gpus(2)
    assert g.inventory.gpu_node.gpus == (81920.0, 81920.0) and g.total("gpus") == 2
    assert w.with_cores(8).inventory.cpu_node.cpu == 8 and w.with_cores(8).inventory.cpu_nodes == 16
    # the sampled step depends on the batch and the seed only: inventories share it
    np.testing.assert_array_equal(w.with_cores(8).sample(1).seconds, w.sample(1).seconds)
    with pytest.raises(tangram.ValidationError):
        tiny().with_gpus(1)  # no GPU node
    with pytest.raises(tangram.ValidationError):
        w.with_cores(0)


def test_cli_sweep_inventory(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rows.json"
    assert sim.cli_main(["--workload", "multireward", "--batch", "32", "--policies", "tangram,isolated",
                         "--sweep", "gpus=1,2", "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["gpus"], r["policy"]) for r in rows] == [(1, "tangram"), (1, "isolated"), (2, "tangram"), (2, "isolated")]
    assert all(r["load"] == 32 and r["sweep"] == "gpus" and r["cores"] == 64 for r in rows)
    assert "1 GPUs per GPU node" in capsys.readouterr().out
    assert sim.cli_main(["--workload", "coding", "--batch", "16", "--policies", "fifo", "--sweep", "cores=1,4",
                         "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["cores"], r["load"], r["sweep"]) for r in rows] == [(1, 16, "cores"), (4, 16, "cores")]
    # 16 trajectories on 16 one-core nodes never wait for a core: no worse than with 4
    assert rows[0]["avg_act"] >= rows[1]["avg_act"] > 0


def _one_parallel_test() -> sim.Workload:
    # One trajectory, one perfectly parallel 8 s test (1 core minimum, up to 4 cores).
    return tiny(batch=1, turns={"dist": "fixed", "value": 1},
                actions=[{"name": "test", "cpu": 1, "memory": 100, "seconds": 8.0,
                          "parallel_fraction": 1.0, "max_units": 4}],
                inventory={"cpu_nodes": 1, "cpu_node": {"cpu": 4, "memory": 1000}})


def test_savings_search_known_answer() -> None:
    # With c cores: tangram grants min(c, 4) -> ACT 8 / min(c, 4); trajectory's slot is the
    # whole node (one trajectory) -> the same; fifo grants 1 core -> 8 s whatever c. Against
    # trajectory at 4 cores (ACT 2): tangram and trajectory need 4 cores, fifo never gets there.
    w = _one_parallel_test()
    rows = sim.savings_search(w, ["tangram", "fifo", "trajectory"], "trajectory", "cores", [0], cap=8)
    by = {r["policy"]: r for r in rows}
    assert by["tangram"]["baseline_avg_act"] == pytest.approx(2.0)
    assert by["tangram"]["needed"] == 4 and by["tangram"]["fraction_of_baseline"] == pytest.approx(1.0)
    assert by["trajectory"]["needed"] == 4
    assert not by["fifo"]["reached"] and by["fifo"]["needed"] is None
    assert "does not reach" in by["fifo"]["statement"]
    assert [p["avg_act"] for p in by["tangram"]["probes"]] == pytest.approx([8.0, 4.0, 8 / 3, 2.0])
    assert by["tangram"]["method"] == "scan"
    # against fifo at 4 cores (8 s), one core is enough for everybody: 25% of the cores
    rows = sim.savings_search(w, ["tangram", "fifo"], "fifo", "cores", [0, 1], cap=8)
    assert [r["needed"] for r in rows] == [1, 1]
    assert rows[0]["statement"].startswith("tangram needs 25% of the cores of the fifo baseline")


def test_savings_search_gpus_known_answer() -> None:
    # Two reward services of 1,000 MiB on 1,500 MiB GPUs, two trajectories (one reward on
    # each, 1 s, restore 2 s, offload as long). On one GPU the second service waits for the
    # first's eviction and offload: ACTs 3 and 3 + 2 + 2 + 1 = 8; on two GPUs both restore
    # at once: 3 and 3.
    w = tiny(turns={"dist": "fixed", "value": 0},
             reward={"cpu": 0.1, "memory": 10, "seconds": 1.0,
                     "services": [{"name": "a", "gpu_memory": 1000, "restore_seconds": 2.0, "max_batch": 1},
                                  {"name": "b", "gpu_memory": 1000, "restore_seconds": 2.0, "max_batch": 1}]},
             inventory={"cpu_nodes": 1, "cpu_node": {"cpu": 1, "memory": 1000},
                        "gpu_nodes": 1, "gpu_node": {"cpu": 2, "memory": 1000, "gpus": [1500, 1500, 1500]}})
    step = w.sample(0)
    if len(set(step.reward_service.tolist())) < 2:
        pytest.skip("both rewards drew the same service")
    rows = sim.savings_search(w, ["tangram", "isolated"], "isolated", "gpus", [0])
    assert rows[0]["baseline_avg_act"] == pytest.approx(3.0)
    assert [r["needed"] for r in rows] == [2, 2]
    assert [p["avg_act"] for p in rows[0]["probes"]] == pytest.approx([5.5, 3.0])


def test_savings_search_does_not_count_rejected_actions() -> None:
    # multireward at 16 trajectories: under `trajectory` every reward is rejected (it can
    # never run there), and a rejected action ends at once. Its ACT of 0 must not make that
    # inventory meet the baseline's average ACT.
    w = sim.builtin("multireward").with_batch(16)
    rows = sim.savings_search(w, ["tangram", "trajectory"], "isolated", "gpus", [0], cap=6)
    trajectory = rows[1]
    assert all(p["rejected"] > 0 for p in trajectory["probes"])
    assert not trajectory["reached"] and "it rejects actions it can never run" in trajectory["statement"]
    assert rows[0]["reached"] and all(p["rejected"] == 0 for p in rows[0]["probes"])
    with pytest.raises(ValueError, match="rejects"):
        sim.savings_search(w, ["tangram"], "trajectory", "gpus", [0], cap=6)


def test_smallest_meeting_bisection() -> None:
    calls: list[int] = []

    def f(v: int) -> float:
        calls.append(v)
        return 100.0 / v

    assert sim.smallest_meeting(f, 2.0, 1, 1000) == (50, "bisection")
    assert len(calls) < 15  # logarithmic, not a scan
    assert sim.smallest_meeting(f, 0.01, 1, 1000) == (None, "bisection")
    assert sim.smallest_meeting(f, 30.0, 1, 10) == (4, "scan")


def test_cli_savings(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "w.json"
    p.write_text(json.dumps(dict(_one_parallel_test().source)))
    out = tmp_path / "savings.json"
    assert sim.cli_main(["--savings", "--workload", str(p), "--baseline", "trajectory", "--resource", "cores",
                         "--policies", "tangram,fifo", "--seeds", "1", "--cap", "6", "--json", str(out),
                         "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "tangram needs 100% of the cores of the trajectory baseline" in text
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["needed"], r["reached"]) for r in rows] == [("tangram", 4, True), ("fifo", None, False)]
    with pytest.raises(SystemExit):
        sim.cli_main(["--savings", "--workload", str(p)])  # no --resource
    with pytest.raises(SystemExit):
        sim.cli_main(["--savings", "--workload", str(p), "--resource", "gpus"])  # no GPU node


def test_act_timeline() -> None:
    r = sim.simulate(tiny(), "fifo", seed=0)  # finishes 2, 6, 4, 8 with ACTs 2, 4, 4, 4
    t, act, count = sim.act_timeline(r, bin_seconds=5.0)
    np.testing.assert_allclose(t, [0, 5])
    np.testing.assert_allclose(act, [3.0, 4.0])
    assert count.tolist() == [2, 2]


def test_progress_fallback(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    with sim.Progress(3, "demo") as bar:
        for _ in range(3):
            bar.update()
    assert "demo: 3/3 simulations" in capsys.readouterr().err
    with sim.Progress(3, "quiet", enabled=False) as bar:
        bar.update()
    assert capsys.readouterr().err == ""


def test_figures_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    d = tmp_path / "figs"
    assert sim.cli_main(["--workload", "multireward", "--batch", "24", "--policies", "tangram,isolated",
                         "--sweep", "gpus=2,4", "--figures", str(d), "--no-progress"]) == 0
    names = sorted(x.name for x in d.iterdir())
    assert names == ["act_by_kind_multireward.png", "act_over_time_multireward.png", "sweep_multireward_gpus.png"]
    p = tmp_path / "w.json"
    p.write_text(json.dumps(dict(_one_parallel_test().source)))
    assert sim.cli_main(["--savings", "--workload", str(p), "--baseline", "trajectory", "--resource", "cores",
                         "--policies", "tangram,fifo", "--cap", "4", "--figures", str(d), "--no-progress"]) == 0
    assert (d / "savings_tiny_cores.png").stat().st_size > 1000
    for x in d.iterdir():
        assert x.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_small(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tangram.sim.report import write_report

    have_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        have_mpl = False
    md = write_report(tmp_path, seeds=1, progress=False, batch=16,
                      savings=(("multireward", "gpus", "isolated", None, 6),), figures=have_mpl)
    text = md.read_text()
    for name in ("coding", "deepsearch", "multireward"):
        assert f"### {name} (16 trajectories" in text
    assert "Only 1 seed(s)" in text and "## Resource savings" in text and "tangram needs" in text
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == 3 * len(sim.POLICY_NAMES)
    assert len(json.loads((tmp_path / "savings.json").read_text())) == len(sim.POLICY_NAMES)
    if have_mpl:
        assert (tmp_path / "savings_multireward_gpus_isolated4.png").exists()
        assert len(list(tmp_path.glob("*.png"))) == 8  # load_sweep.png included
    assert "## Load sweep" in text and "## Why the zero-wait bound is out of reach" in text
    assert "ACT / capacity bound" in text and "capacity bound |" in text
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sorted({r["load"] for r in sweep}) == [4, 8, 16]
    assert all("bound_peak_cpu" in r for r in rows)


# ------------------------------------------------------------------ what the core is told of run times


def test_estimates_oracle_noisy_and_learned() -> None:
    w = small_coding(64).with_value("cores", 8)  # loaded: what the core is told decides who waits
    oracle = sim.simulate(w, "tangram", seed=2)
    # noisy:0 is the oracle exactly; a run's truth never depends on what the core is told.
    zero = sim.simulate(w, "tangram", seed=2, estimates="noisy:0")
    np.testing.assert_array_equal(zero.finish, oracle.finish)
    noisy = sim.simulate(w, "tangram", seed=2, estimates="noisy:0.5")
    again = sim.simulate(w, "tangram", seed=2, estimates="noisy:0.5")
    np.testing.assert_array_equal(noisy.finish, again.finish)  # seeded
    assert not np.array_equal(noisy.start, oracle.start)
    learned = sim.simulate(w, "tangram", seed=2, estimates="learned")
    np.testing.assert_array_equal(learned.finish, sim.simulate(w, "tangram", seed=2, estimates="learned").finish)
    assert learned.row()["estimates"] == "learned" and oracle.row()["estimates"] == "oracle"
    # The same actions ran, each at its true model: at the same grant the same run time.
    assert learned.row()["actions"] == oracle.row()["actions"]
    same = (learned.grant == oracle.grant) & ~learned.rejected & (learned.label == ENV)
    unresized = same & np.isclose(learned.run, oracle.run)
    assert unresized.sum() > 0.5 * (learned.label == ENV).sum()
    told = sim.simulate(w, "tangram", seed=2, estimates="learned-runtimes")
    assert told.row()["estimates"] == "learned-runtimes" and told.row()["actions"] == oracle.row()["actions"]
    for bad, match in (("exact", "oracle, learned, learned-runtimes or noisy"), ("noisy:-1", "SIGMA >= 0"), ("noisy:x", "SIGMA")):
        with pytest.raises(tangram.ValidationError, match=match):
            sim.simulate(w, "tangram", seed=2, estimates=bad)


def test_learned_estimates_start_cold_and_learn_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-checkable: one kind of 2 s fixed actions, one core, one trajectory of 3 turns.
    The first is planned as the 1 s prior; once one has run, the next is planned as 2 s."""
    import tangram.sim.engine as engine

    planned: list[object] = []

    class Recording(engine.RunTimeEstimates):
        def plan(self, key: str, kind: str, elastic: bool, minimum: float, parallel=None):  # type: ignore[no-untyped-def]
            estimate = super().plan(key, kind, elastic, minimum, parallel)
            planned.append((key, estimate.source, estimate.model))
            return estimate

    monkeypatch.setattr(engine, "RunTimeEstimates", Recording)
    w = tiny(batch=1, turns={"dist": "fixed", "value": 3})
    r = sim.simulate(w, "tangram", seed=0, estimates="learned")
    assert list(r.finish[:3]) == [2.0, 4.0, 6.0]  # the truth, whatever was planned
    assert [(k, s) for k, s, _ in planned] == [("cmd", "prior"), ("cmd", "learned"), ("cmd", "learned")]
    assert [m for _, _, m in planned] == [1.0, pytest.approx(2.0, rel=0.01), pytest.approx(2.0, rel=0.01)]


def test_learned_runtimes_plan_each_elastic_kind_with_its_true_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """learned-runtimes: the run times are learned, but every elastic action is planned with
    its kind's true parallel fraction; under learned the fraction starts at the prior."""
    import tangram.sim.engine as engine

    planned: list[tuple[str, float]] = []

    class Recording(engine.RunTimeEstimates):
        def plan(self, key, kind, elastic, minimum, parallel=None):  # type: ignore[no-untyped-def]
            estimate = super().plan(key, kind, elastic, minimum, parallel)
            if elastic:
                planned.append((key, estimate.model.parallel_fraction))
            return estimate

    monkeypatch.setattr(engine, "RunTimeEstimates", Recording)
    w = small_coding(64).with_value("cores", 8)
    truth = {k.name: k.parallel_fraction for k in w.actions if k.elastic}
    sim.simulate(w, "tangram", seed=2, estimates="learned-runtimes")
    assert planned and {key for key, _ in planned} == set(truth)
    assert all(p == pytest.approx(truth[key]) for key, p in planned)  # minimum 1: the fraction as declared
    planned.clear()
    sim.simulate(w, "tangram", seed=2, estimates="learned")
    assert planned[0][1] == pytest.approx(PRIOR_PARALLEL) and any(p != pytest.approx(truth[k]) for k, p in planned)


def test_cli_estimates(capsys) -> None:  # type: ignore[no-untyped-def]
    assert sim.cli_main(["--policies", "tangram", "--batch", "32", "--estimates", "learned"]) == 0
    assert "run times learned" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        sim.cli_main(["--policies", "tangram", "--batch", "32", "--estimates", "guess"])
    assert e.value.code == 2
    assert "oracle, learned, learned-runtimes or noisy" in capsys.readouterr().err
