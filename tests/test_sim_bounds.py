"""The capacity-aware lower bound on average ACT (tangram/sim/bounds.py): its pieces against
hand-worked schedules and against random feasible schedules, and the whole bound against
every policy the simulator runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tangram import sim
from tangram.sim.bounds import capacity_bound, machine_bound, srpt_completions, token_bound, wspt_mean_busy

POLICIES = ("tangram", "fifo", "trajectory", "isolated", "optimus")


def test_srpt_and_wspt_worked_case() -> None:
    # Job 0 (3 s) from 0, job 1 (1 s) from 1: job 1 preempts, ends at 2; job 0 ends at 4.
    release, proc = np.array([0.0, 1.0]), np.array([3.0, 1.0])
    assert srpt_completions(release, proc).tolist() == pytest.approx([4.0, 2.0])
    # WSPT with equal weights runs the same schedule: job 0 on [0, 1] and [2, 4].
    assert wspt_mean_busy(release, proc, np.ones(2)).tolist() == pytest.approx([(0.5 + 2 * 3) / 3, 1.5])
    # A heavy long job keeps the machine: weight / processing 10 / 3 against 1.
    assert wspt_mean_busy(release, proc, np.array([10.0, 1.0])).tolist() == pytest.approx([1.5, 3.5])


def _fluid_schedule(release: np.ndarray, best: np.ndarray, work: np.ndarray, rate: float,
                    priority: np.ndarray) -> np.ndarray:
    """Completion times of a feasible fluid schedule: at every moment the released jobs in
    `priority` order take the machine's rate, each at most work / best per second."""
    n = len(release)
    left = work.astype(float).copy()
    done = np.full(n, math.nan)
    now = 0.0
    while np.isnan(done).any():
        live = [j for j in np.argsort(priority) if release[j] <= now + 1e-12 and np.isnan(done[j])]
        pending = [release[j] for j in range(n) if release[j] > now + 1e-12]
        if not live:
            now = min(pending)
            continue
        pace = np.zeros(n)
        room = rate
        for j in live:
            pace[j] = min(work[j] / best[j], room)
            room -= pace[j]
        step = min([left[j] / pace[j] for j in live if pace[j] > 0] + [p - now for p in pending])
        for j in live:
            left[j] -= pace[j] * step
            if left[j] <= 1e-9 * work[j]:
                done[j] = now + step
        now += step
    return done


def test_machine_bound_is_below_random_feasible_schedules() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        rate = float(rng.choice([1.0, 2.5, 6.0]))
        release = np.round(rng.uniform(0, 4, n), 1)
        best = rng.uniform(0.2, 3.0, n)
        work = best * rng.uniform(0.1, 1.0, n) * min(rate, 4.0)  # a job alone never needs more than the machine
        weight = rng.choice([np.ones(n), rng.uniform(0, 2, n)])
        bound = machine_bound(release, best, work, rate, weight)
        assert bound >= float(np.dot(weight, release + best)) - 1e-9
        for order in (np.arange(n), rng.permutation(n), np.argsort(best), np.argsort(-weight / work)):
            done = _fluid_schedule(release, best, work, rate, order)
            assert float(np.dot(weight, done)) >= bound - 1e-7


def test_token_bound_is_below_bucket_schedules() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        rate, burst = float(rng.choice([0.5, 2.0])), float(rng.integers(1, 4))  # the core's burst >= 1
        release, best, weight = rng.uniform(0, 5, n), rng.uniform(0.1, 2, n), rng.uniform(0, 2, n)
        bound = token_bound(release, best, weight, rate, burst)
        for order in (np.argsort(release), rng.permutation(n), np.argsort(-weight)):
            # a token bucket: `burst` tokens at 0, one more every 1 / rate, up to `burst` kept
            tokens, clock, start = burst, 0.0, np.zeros(n)
            for j in order:
                t = max(clock, release[j])
                tokens = min(max(burst, 1.0), tokens + (t - clock) * rate)
                if tokens < 1:
                    t += (1 - tokens) / rate
                    tokens = 1.0
                start[j], tokens, clock = t, tokens - 1, t
            assert float(np.dot(weight, start + best)) >= bound - 1e-7


def test_token_bound_keeps_no_tokens_beyond_the_burst() -> None:
    # Three requests at 10 s under 1 request/s, burst 1: the bucket holds one token however
    # long it was idle, so they start at 10, 11 and 12 (not all at 10).
    release, best, weight = np.full(3, 10.0), np.ones(3), np.ones(3)
    assert token_bound(release, best, weight, rate=1.0, burst=1.0) == pytest.approx(3 * 11 + 3)
    # burst 2: two at once, the third a second later
    assert token_bound(release, best, weight, rate=1.0, burst=2.0) == pytest.approx(10 + 10 + 11 + 3)


@pytest.mark.parametrize("name", ["coding", "deepsearch", "multireward"])
def test_capacity_bound_is_below_every_policy(name: str) -> None:
    base = sim.builtin(name)
    for batch, seed in ((64, 0), (256, 1)):
        w = base.with_batch(batch)
        st = w.sample(seed)
        rows = [sim.simulate(w, p, seed, step=st).row() for p in POLICIES]
        cap = rows[0]["capacity_bound_act"]
        assert cap >= rows[0]["lower_bound_act"] - 1e-9
        for row in rows:
            assert row["capacity_bound_act"] == cap  # a property of the step, not of the policy
            assert row["avg_act"] >= cap - 1e-9, row["policy"]
            assert row["act_ratio_to_capacity_bound"] == pytest.approx(row["avg_act"] / cap)


def test_capacity_bound_counts_a_saturated_service() -> None:
    # multireward's most popular service is one copy on one device: its rewards queue, which
    # the zero-wait bound cannot see and this one does.
    w = sim.builtin("multireward").with_batch(512)
    st = w.sample(0)
    out = capacity_bound(w, st)
    zero_wait = sim.simulate(w, "fifo", 0, step=st).row()["lower_bound_act"]
    assert out["capacity_bound_act"] > 1.2 * zero_wait
    assert out["capacity_bound_weighting"] == "last"


def test_capacity_bound_counts_gpus_on_sandbox_nodes() -> None:
    # Services may be restored on the sandbox nodes' GPUs too: the devices' rate counts them
    # (with only the GPU node's one device counted, the bound was twice these policies' ACT).
    # `trajectory` runs there too: its rewards take held slots beside their services (it
    # stalled when they waited for a free slot on a node whose slots trajectories all held).
    from dataclasses import replace
    base = sim.builtin("coding").with_batch(128).with_gpus(1).with_gpu_batch_gain(1)
    inv = base.inventory
    w = replace(base, inventory=replace(inv, cpu_node=replace(inv.cpu_node, gpus=(81920.0,))))
    st = w.sample(0)
    for policy in POLICIES:
        row = sim.simulate(w, policy, 0, step=st).row()
        assert row["rejected"] == 0 and row["avg_act"] >= row["capacity_bound_act"], policy
