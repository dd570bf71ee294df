"""The capacity-aware lower bound on average ACT (tangram/sim/bounds.py): its pieces against
hand-worked schedules and against random feasible schedules, and the whole bound against
every policy the simulator runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tangram import sim
from tangram.sim.bounds import (capacity_bound, chain_token_bound, machine_bound, srpt_completions, token_bound,
                                wspt_mean_busy)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a package at the repository's root
    sys.path.insert(0, str(ROOT))
from bench.exact_optima import best_chained_bucket_schedule, take_token  # noqa: E402

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
            tokens, clock, start = burst, 0.0, np.zeros(n)
            for j in order:
                clock, tokens = take_token(tokens, clock, release[j], rate, burst)
                start[j] = clock
            assert float(np.dot(weight, start + best)) >= bound - 1e-7


def test_token_bound_keeps_no_tokens_beyond_the_burst() -> None:
    # Three requests at 10 s under 1 request/s, burst 1: the bucket holds one token however
    # long it was idle, so they start at 10, 11 and 12 (not all at 10).
    release, best, weight = np.full(3, 10.0), np.ones(3), np.ones(3)
    assert token_bound(release, best, weight, rate=1.0, burst=1.0) == pytest.approx(3 * 11 + 3)
    # burst 2: two at once, the third a second later
    assert token_bound(release, best, weight, rate=1.0, burst=2.0) == pytest.approx(10 + 10 + 11 + 3)


def _chained_bucket_schedule(gaps: list[np.ndarray], runs: list[np.ndarray], rate: float, burst: float,
                             rng: np.random.Generator, delay: float) -> list[np.ndarray]:
    """Start times of chains of requests under a token bucket, in a closed loop: a chain's
    next request is submitted `gaps` after its previous one ends (plus up to `delay` more,
    as other waits on the way would add), and the bucket hands its next token to a
    submitted request chosen at random. Returns each chain's start times."""
    chains = len(gaps)
    nxt = [0] * chains
    submitted = [float(g[0] + rng.uniform(0, delay)) if len(g) else math.inf for g in gaps]
    starts: list[list[float]] = [[] for _ in range(chains)]
    tokens, clock = burst, 0.0
    while any(nxt[c] < len(gaps[c]) for c in range(chains)):
        live = [c for c in range(chains) if nxt[c] < len(gaps[c])]
        first = min(submitted[c] for c in live)
        ready = [c for c in live if submitted[c] <= max(clock, first) + 1e-12]
        c = ready[int(rng.integers(len(ready)))]
        t, tokens = take_token(tokens, clock, submitted[c], rate, burst)
        clock = t
        starts[c].append(t)
        i = nxt[c] = nxt[c] + 1
        if i < len(gaps[c]):
            submitted[c] = t + runs[c][i - 1] + gaps[c][i] + rng.uniform(0, delay)
    return [np.array(s) for s in starts]


def test_chain_token_bound_is_below_closed_loop_bucket_schedules() -> None:
    rng = np.random.default_rng(11)
    gained = 0
    for _ in range(150):
        chains = int(rng.integers(1, 7))
        rate, burst = float(rng.choice([0.5, 1.0, 3.0])), float(rng.integers(1, 4))
        gaps = [rng.uniform(0, 2, int(rng.integers(0, 5))) for _ in range(chains)]
        runs = [rng.uniform(0.1, 2, len(g)) for g in gaps]
        # zero-wait releases: each request right after the previous one's run and its gap
        zero_wait = [np.cumsum(g + np.r_[0.0, r[:-1]]) for g, r in zip(gaps, runs)]
        chain = np.concatenate([np.full(len(g), c) for c, g in enumerate(gaps)]).astype(np.int64)
        release, best = np.concatenate(zero_wait), np.concatenate(runs)
        for weight in (rng.uniform(0, 2, len(release)),
                       np.concatenate([np.eye(len(g))[-1] if len(g) else [] for g in gaps])):
            bound = chain_token_bound(chain, release, best, weight, rate, burst)
            assert bound >= float(np.dot(weight, release + best)) - 1e-9
            gained += bound > float(np.dot(weight, release + best)) + 1e-6
            for delay in (0.0, 1.0):
                starts = np.concatenate(_chained_bucket_schedule(gaps, runs, rate, burst, rng, delay))
                assert float(np.dot(weight, starts + best)) >= bound - 1e-7
    assert gained > 20  # it sees backlogs that carry, not only the zero-wait releases


def test_chain_token_bound_is_below_the_optimum_of_small_instances() -> None:
    rng = np.random.default_rng(5)
    gains = 0
    for _ in range(120):
        rate, burst = float(rng.choice([0.5, 1.0, 2.0])), float(rng.integers(1, 3))
        gaps = [rng.uniform(0, 1, int(rng.integers(1, 4))) for _ in range(int(rng.integers(2, 4)))]
        runs = [rng.uniform(0.1, 1, len(g)) for g in gaps]
        weight = [np.eye(len(g))[-1] if rng.random() < 0.5 else rng.uniform(0, 1, len(g)) for g in gaps]
        chain = np.concatenate([np.full(len(g), c) for c, g in enumerate(gaps)]).astype(np.int64)
        release = np.concatenate([np.cumsum(g + np.r_[0.0, r[:-1]]) for g, r in zip(gaps, runs)])
        bound = chain_token_bound(chain, release, np.concatenate(runs), np.concatenate(weight), rate, burst)
        optimum = best_chained_bucket_schedule(gaps, runs, weight, rate, burst)
        assert bound <= optimum + 1e-9
        gains += bound > float(np.dot(np.concatenate(weight), release + np.concatenate(runs))) + 1e-6
    # it sees a backlog in most of them (100 of the 120 have one, though it captures only
    # part of its cost)
    assert gains > 60


def test_chain_token_bound_counts_a_backlog_that_carries() -> None:
    # Two trajectories, each a request at 0 (1 s) then another 1 s after the first ends;
    # 1 request/s, burst 1. Tokens come at 0, 1, 2, 3, so one first request starts at 1 and
    # its trajectory's second at 3: the last requests end at 3 and 4 or later, 1 s past
    # zero wait (2 and 3). The bound sees part of that second from the moments it prices.
    chain, release = np.array([0, 0, 1, 1]), np.array([0.0, 2.0, 0.0, 2.0])
    best, last = np.ones(4), np.array([0.0, 1.0, 0.0, 1.0])
    zero_wait = float(np.dot(last, release + best))
    bound = chain_token_bound(chain, release, best, last, rate=1.0, burst=1.0)
    assert zero_wait + 0.3 < bound <= zero_wait + 1.0 + 1e-9
    # token_bound keeps each release at its zero-wait value, so it sees no backlog here
    assert token_bound(release, best, last, rate=1.0, burst=1.0) <= zero_wait


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
    # multireward with each service one copy (its services may scale to 4; not here): the
    # most popular one's rewards queue on one device, which the zero-wait bound cannot see
    # and this one does.
    from dataclasses import replace
    w = sim.builtin("multireward").with_batch(512)
    assert w.reward is not None
    w = replace(w, reward=replace(w.reward, services=tuple(replace(s, max_replicas=None) for s in w.reward.services)))
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
