"""The exact optima of small instances (bench/exact_optima.py): the list scheme against a
hand-worked case and against a brute force over every start time, and every policy's
schedule never below the optimum where the optimum covers what the policy can do."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a package at the repository's root
    sys.path.insert(0, str(ROOT))
from bench import exact_optima as eo  # noqa: E402


def test_the_optimum_idles_a_core_for_an_action_that_comes_later() -> None:
    # 4 cores. Chain 0: an action at 0 needing 1 core for 4 s; chain 1: one at 0.5 needing
    # all 4 for 1 s. Online, the long one starts at 0 and the short one waits until 4 (ACTs
    # 4 and 4.5, the step ends at 5). The optimum knows the short one is coming: it keeps
    # the node free for it (0.5 to 1.5) and starts the long one after (ACTs 1 and 5.5). The
    # least step is the online order's.
    inst = eo.Instance("rigid", ((eo.Job(0.0, 4.0, 1),), (eo.Job(0.5, 1.0, 4),)), cores=4)
    assert eo.optimum(inst) == pytest.approx((3.25, 5.0))
    for policy in eo.POLICIES:
        assert eo.policy_schedule(inst, policy) == pytest.approx((4.25, 5.0))


def _brute_force(inst: eo.Instance) -> tuple[float, float]:
    """Integer data only: every start time 0..horizon of every action, kept when the chains
    and the node allow it (the optimum has integer starts when every time is an integer)."""
    jobs = [j for c in inst.chains for j in c]
    chain_of = [c for c, ch in enumerate(inst.chains) for _ in ch]
    horizon = int(sum(j.think + j.seconds for j in jobs))
    best_sum = best_step = math.inf
    for starts in itertools.product(range(horizon + 1), repeat=len(jobs)):
        ends = [s + j.seconds for s, j in zip(starts, jobs)]
        ok = all(starts[i] >= (ends[i - 1] if i and chain_of[i - 1] == chain_of[i] else 0) + jobs[i].think
                 for i in range(len(jobs)))
        ok = ok and all(sum(j.cores for s, e, j in zip(starts, ends, jobs) if s <= t < e) <= inst.cores
                        for t in range(horizon + 1))
        if ok:
            best_sum = min(best_sum, sum(e for i, e in enumerate(ends)
                                         if i + 1 == len(jobs) or chain_of[i + 1] != chain_of[i]))
            best_step = min(best_step, max(ends))
    return (best_sum - inst.think_total) / inst.actions, best_step


def test_the_list_scheme_matches_a_brute_force_over_start_times() -> None:
    rng = np.random.default_rng(2)
    for _ in range(25):
        lengths = [int(rng.integers(1, 3)) for _ in range(2)]
        chains = tuple(tuple(eo.Job(float(rng.integers(0, 2)), float(rng.integers(1, 3)), int(rng.integers(1, 4)))
                             for _ in range(n)) for n in lengths)
        inst = eo.Instance("rigid", chains, cores=3)
        assert eo.optimum(inst) == pytest.approx(_brute_force(inst))


@pytest.mark.parametrize("family", ["rigid", "quota"])
def test_no_policy_beats_the_optimum_of_what_it_can_do(family: str) -> None:
    # rigid actions on a node and requests under a bucket: the optimum covers every
    # schedule a policy can make, so no policy goes below it, and on some instances
    # (drawn so that the optimum waits) a policy is above it.
    rows = eo.run(15, seed=4, families=[family])
    assert all(r["act_ratio"] >= 1 - 1e-6 and r["step_ratio"] >= 1 - 1e-6 for r in rows)
    assert any(r["act_ratio"] > 1.01 for r in rows)


def test_moldable_optimum_fixes_grants_and_tangram_resizes_below_it() -> None:
    # The moldable optimum is over grants fixed at start: fifo fixes them, so it never goes
    # below; tangram changes running grants (malleable resizes), and on some instances that
    # beats every fixed choice.
    rows = eo.run(40, seed=1, families=["moldable"])
    assert all(r["act_ratio"] >= 1 - 1e-6 and r["step_ratio"] >= 1 - 1e-6 for r in rows if r["policy"] == "fifo")
    assert min(r["act_ratio"] for r in rows if r["policy"] == "tangram") < 1 - 1e-3


def test_every_family_and_policy_is_summarised() -> None:
    rows = eo.run(5, seed=0)
    for family in eo.FAMILIES:
        mine = [r for r in rows if r["family"] == family]
        assert len(mine) == 5 * len(eo.POLICIES)
        assert all(r["actions"] <= 7 for r in mine)
    entries = eo.summary(rows)
    assert [(e["family"], e["policy"]) for e in entries] == [(f, p) for f in eo.FAMILIES for p in eo.POLICIES]
    assert all(e["instances"] == 5 for e in entries)
