"""bench/sim_grid.py: the paired win/tie/loss counts and the cells that hold."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tangram.sim.engine import POLICY_NAMES

_PATH = Path(__file__).resolve().parents[1] / "bench" / "sim_grid.py"
_spec = importlib.util.spec_from_file_location("sim_grid", _PATH)
assert _spec is not None and _spec.loader is not None
sim_grid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_grid)


def _row(policy: str, seed: int, act: float, step: float = 10.0) -> dict:
    return {"workload": "w", "load": 8, "seed": seed, "policy": policy, "avg_act": act, "p99_act": act,
            "step_duration": step, "lower_bound_act": 1.0, "capacity_bound_act": 1.5, "step_bound": 5.0,
            "rejected": 0}


def test_paired_margins_count_wins_ties_and_losses() -> None:
    rows = []
    # tangram 2.0 on both seeds; fifo 2.5 (a win), 2.005 (a tie: 0.25% < 0.5%); the others
    # 1.9 on seed 0 (a loss of 5.3%) and 2.0 on seed 1 (a tie).
    for seed, fifo in ((0, 2.5), (1, 2.005)):
        rows.append(_row("tangram", seed, 2.0))
        rows.append(_row("fifo", seed, fifo))
        for other in POLICY_NAMES:
            if other not in ("tangram", "fifo"):
                rows.append(_row(other, seed, 1.9 if seed == 0 else 2.0))
    cells = sim_grid.summarise(rows, tie=0.5)
    cell = cells[("w", 8)]
    fifo = cell["avg_act"]["policies"]["fifo"]
    assert (fifo["win"], fifo["tie"], fifo["loss"]) == (1, 1, 0)
    assert fifo["mean"] == pytest.approx((20.0 + (0.005 / 2.005) * 100) / 2)
    optimus = cell["avg_act"]["policies"]["optimus"]
    assert (optimus["win"], optimus["tie"], optimus["loss"]) == (0, 1, 1)
    assert optimus["worst"] == pytest.approx(-0.1 / 1.9 * 100)
    assert not cell["avg_act"]["holds"]  # -2.6% on average against optimus
    assert cell["step_duration"]["holds"]  # equal steps everywhere: all ties
    assert cell["act_to_bound"] == pytest.approx(2.0) and cell["step_to_bound"] == pytest.approx(2.0)
    assert cell["act_to_capacity_bound"] == pytest.approx(2.0 / 1.5)


def test_a_lower_mean_act_is_a_trade_off_only_with_a_step_or_p99_longer_by_5_percent() -> None:
    rows = []
    for seed in (0, 1):
        rows.append(_row("tangram", seed, 2.0))
        rows.append(_row("fifo", seed, 1.9, step=11.0))  # -5.3% ACT, step +9.1%: a trade-off
        rows.append(_row("optimus", seed, 1.9, step=10.2))  # -5.3% ACT, step +2.0%: a loss
        rows.append(_row("trajectory", seed, 2.0, step=9.0))  # a shorter step (-11.1%): a loss
        rows.append(_row("isolated", seed, 2.0))  # all ties: not listed
    found = {f["policy"]: f for f in sim_grid.better_elsewhere(sim_grid.summarise(rows, tie=0.5), tie=0.5)}
    assert set(found) == {"fifo", "optimus", "trajectory"}
    assert found["fifo"]["trade_off"] and found["fifo"]["step"] == pytest.approx(1.0 / 11.0 * 100)
    assert not found["optimus"]["trade_off"] and not found["trajectory"]["trade_off"]
    page = sim_grid.markdown(sim_grid.summarise(rows, tie=0.5), 0.5, 2, "cmd", [])
    assert "Losses: 2; trade-offs: 1." in page


def test_a_small_grid_runs_every_policy_and_writes_its_files(tmp_path: Path) -> None:
    rows_file, page = tmp_path / "grid.json", tmp_path / "grid.md"
    assert sim_grid.main(["--workloads", "multireward", "--loads", "16", "--seeds", "2",
                          "--json", str(rows_file), "--markdown", str(page)]) == 0
    data = json.loads(rows_file.read_text())
    assert {(r["policy"], r["seed"]) for r in data["rows"]} == {(p, s) for p in POLICY_NAMES for s in (0, 1)}
    for cell in data["cells"]:
        for metric in ("avg_act", "step_duration", "p99_act"):
            for counts in cell[metric]["policies"].values():
                assert counts["win"] + counts["tie"] + counts["loss"] == 2
    text = page.read_text()
    assert "| multireward | 16 |" in text and "Cells that hold" in text
