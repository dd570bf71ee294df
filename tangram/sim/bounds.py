"""A lower bound on a step's average ACT that counts capacity.

The zero-wait bound (every action at its best grant, no wait) ignores capacity. This one
does not, and it stays valid for any policy although the steps are closed loops (an action
is submitted when its trajectory's previous one ends, so a policy that delays a trajectory
also moves its later demand). The argument runs on completion times, which a delay cannot
move earlier:

1. A trajectory's actions' ACTs sum to its end E_t minus its think time (it starts at 0 and
   alternates think and actions), so the average ACT is (sum of E_t - all think) / actions.
2. For any action j of trajectory t, E_t >= C_j + tail_j, where C_j is j's completion and
   tail_j the zero-wait time from there to the trajectory's end (the rest of its think and
   its later actions at their best). So for any weights lambda over a trajectory's actions
   summing to 1, E_t >= sum_j lambda_j (C_j + tail_j).
3. No action is released before its zero-wait release r_j (everything before it took at
   least its best time), and none finishes sooner than its best run time b_j after it
   starts. Group the actions by the resource that limits them and bound each group's
   sum_j lambda_j C_j with a relaxation of that resource (below); the groups' bounds add.

Each resource is relaxed to one fluid machine of rate `mu` on which action j needs work
q_j, no sooner than r_j and at most q_j / b_j per second:

- a sandbox node: rate its cores, work the least core-seconds of the action (its minimum
  grant times its run time there: under Amdahl's law g x t(g) grows with g);
- a reward service: each of its copies (up to max_replicas) runs on one device, at most
  `max_batch` at once, so rate copies x max_batch / (1 + (max_batch - 1) / S) seconds of
  work alone per second under the GPU compute model (S the batch gain), work the reward's
  time alone, and nothing starts before its first restore is done (services start
  offloaded);
- all devices together (the sandbox nodes' GPUs too): rate S per device (the most a device
  does at any batch);
- an API quota: in flight at most max_concurrency (rate, work the request's run time); and
  its token bucket, which lets the k-th start (in time order) happen no sooner than
  (k - burst) / rate, nor than (k - j + 1 - burst) / rate after the j-th release for any
  j <= k (tokens unused before the requests come are not kept beyond the burst). The
  releases stay at zero wait there, so a third bound (`chain_token_bound`) counts how a
  backlog carries along the trajectories: a request's lateness (start minus zero-wait
  release) never decreases along its trajectory, so each of a trajectory's requests
  starts within its last one's lateness of its zero-wait release, and no more than
  burst + rate x tau requests start by any tau; Lagrange multipliers on those counts, at
  every moment at once, bound the least total lateness that fits.

For weighted completion times on such a machine with release dates the bound is Goemans's
mean busy time relaxation (M. X. Goemans, "Improved approximation algorithms for
scheduling with release dates", SODA 1997): every schedule's mean busy times M_j satisfy
inequalities whose linear minimum is the preemptive schedule that always runs the released
action of largest weight / work (WSPT), and C_j >= M_j + b_j / 2 because j runs at most at
its best pace. With equal weights, shortest remaining work first (SRPT) is the exact
minimum on the machine and bounds it too. Each group keeps the largest of its bounds and
of sum lambda_j (r_j + b_j), so this bound is never below the zero-wait one.

The bound is the largest over a few weightings lambda (all weight on the reward, on the
last environment action, on the last quota request, spread evenly, or evenly over the
environment actions): each is valid, so their maximum is. What it cannot see is what no
single-machine relaxation sees: GPU memory (services that do not fit together and must be swapped), a device's
restores in series, the per-device split of compute, and elastic actions paying more
core-seconds at larger grants for their speed.

The zero-wait schedule also says what a step asks of its inventory, and how long the step
lasts at least (`bound_schedule`). `step_bounds` gives every bound of a step: the same
under every policy, so a comparison of policies on one step computes them once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .workloads import ActionKind, NodeShape, Reward, RewardService, Step, Workload


# ------------------------------------------------------------------ one machine


def _preemptive(release: np.ndarray, proc: np.ndarray,
                weight: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Completion and mean busy times of a preemptive schedule on one unit-speed machine: at
    every moment the released job of the largest weight / processing time runs (WSPT), or
    with `weight` None the one of the shortest remaining time (SRPT); ties: earlier release,
    then index. A job with no processing time ends, and is busy, at its release."""
    n = len(release)
    done = np.array(release, dtype=float)
    busy = np.array(release, dtype=float)
    order = np.argsort(release, kind="stable")
    left = np.array(proc, dtype=float)
    acc = np.zeros(n)  # sum over its pieces of length x mid-time
    heap: list[tuple[float, float, int]] = []
    now, i = 0.0, 0
    while i < n or heap:
        if not heap:
            now = max(now, float(release[order[i]]))
        while i < n and release[order[i]] <= now:
            j = int(order[i])
            i += 1
            if proc[j] > 0:
                key = float(proc[j]) if weight is None else -weight[j] / proc[j]
                heapq.heappush(heap, (key, float(release[j]), j))
        if not heap:
            continue
        _, r, j = heap[0]
        until = float(release[order[i]]) if i < n else math.inf
        run = min(left[j], until - now)
        acc[j] += run * (now + run / 2)
        left[j] -= run
        now += run
        if left[j] <= 1e-12 * max(1.0, proc[j]):
            heapq.heappop(heap)
            done[j], busy[j] = now, acc[j] / proc[j]
        elif weight is None:  # its remaining time is its key
            heapq.heapreplace(heap, (float(left[j]), r, j))
    return done, busy


def wspt_mean_busy(release: np.ndarray, proc: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Mean busy times of the preemptive WSPT schedule (largest weight / processing time
    first): the minimum of sum weight x mean busy time over every preemptive schedule."""
    return _preemptive(release, proc, weight)[1]


def srpt_completions(release: np.ndarray, proc: np.ndarray) -> np.ndarray:
    """Completion times of shortest remaining processing time first: the minimum of their
    sum over every preemptive schedule."""
    return _preemptive(release, proc, None)[0]


def machine_bound(release: np.ndarray, best: np.ndarray, work: np.ndarray, rate: float,
                  weight: np.ndarray) -> float:
    """A lower bound on sum_j weight_j C_j over the jobs of one fluid machine of `rate`
    (module docstring): each job needs `work`, no sooner than `release`, and takes at least
    `best`."""
    if len(release) == 0:
        return 0.0
    trivial = float(np.dot(weight, release + best))
    proc = work / rate
    m = wspt_mean_busy(release, proc, weight)
    bounds = [trivial, float(np.dot(weight, m + np.maximum(best, proc) / 2))]
    if np.all(weight == weight[0]):
        bounds.append(float(weight[0] * srpt_completions(release, proc).sum()))
    return max(bounds)


def token_bound(release: np.ndarray, best: np.ndarray, weight: np.ndarray, rate: float,
                burst: float) -> float:
    """A lower bound on sum_j weight_j C_j for requests under a token bucket (GCRA: `burst`
    tokens at 0, one more every 1 / rate, at most `burst` kept). Between the j-th and the k-th
    start in time order (j <= k) the bucket lets k - j + 1 starts through no faster than
    burst at once and `rate` after, so the k-th start is no sooner than (k - burst) / rate
    (from 0) nor r_(j) + (k - j + 1 - burst) / rate, r_(j) the j-th release (the j-th
    start cannot precede it), nor the k-th release. A request ends at least `best` after its
    start; the largest weights take the earliest starts."""
    if len(release) == 0 or rate <= 0:
        return float(np.dot(weight, release + best)) if len(release) else 0.0
    k = np.arange(1, len(release) + 1)
    r = np.sort(release)
    burst = max(float(burst), 1.0)  # the core's GCRA takes burst >= 1
    # max over j <= k of r_(j) + (k - j + 1 - burst) / rate; j = 1 covers (k - burst) / rate
    after_release = np.maximum.accumulate(r - k / rate) + (k + 1 - burst) / rate
    earliest = np.maximum(r, after_release)
    return float(np.dot(np.sort(weight)[::-1], earliest) + np.dot(weight, best))


CHAIN_PAIRS = 8_000_000  # (candidate, request) pairs chain_token_bound may hold at once


def chain_token_bound(chain: np.ndarray, release: np.ndarray, best: np.ndarray, weight: np.ndarray,
                      rate: float, burst: float, moments: int = 64, rounds: int = 100) -> float:
    """A lower bound on sum_j weight_j C_j for requests under a token bucket (as
    `token_bound`) that come in chains: `chain` names each request's trajectory, and a
    request is submitted only after the previous action of its trajectory has ended.

    Call a request's lateness its start minus its zero-wait release z_j. Lateness never
    decreases along a trajectory (between two of its requests come the earlier one's run,
    think times and other actions, none shorter than at zero wait), so with L_t the
    lateness of trajectory t's last request, every request of t starts by z_j + L_t. No
    more than burst + rate x tau requests start by any time tau (the k-th start is no
    sooner than (k - burst) / rate), hence at every tau

        sum_t #{j of t: z_j + L_t <= tau} <= burst + rate x tau,

    and sum_j w_j C_j >= sum_j w_j (z_j + best_j) + sum_t w_t L_t, w_t the weight of t's
    last request (earlier ones are late by at least 0). The least sum_t w_t L_t under those
    constraints is bounded below by its Lagrangian dual: for multipliers mu_k >= 0 on a
    grid of moments tau_k, each trajectory alone minimises w_t L_t plus the prices of the
    requests its L_t leaves counted, less sum_k mu_k (burst + rate tau_k). Every choice of
    the multipliers gives a valid bound; a projected subgradient ascent chooses them.
    `token_bound` keeps each release at its zero-wait value and sees only where those
    bunch; this one sees a backlog carry along the trajectories, at every moment at once."""
    base = float(np.dot(weight, release + best))
    n = len(release)
    if n == 0 or rate <= 0:
        return base
    burst = max(float(burst), 1.0)  # the core's GCRA takes burst >= 1
    order = np.lexsort((release, chain))
    chain, z, w = chain[order], release[order], weight[order]
    heads = np.flatnonzero(np.r_[True, chain[1:] != chain[:-1]])
    lengths = np.diff(np.r_[heads, n])
    w_last = w[heads + lengths - 1]  # per trajectory, in the order of `heads`
    # the moments: from the first release to when the bucket could have let every request through
    end = (n - burst) / rate
    if not np.any(w_last > 0) or end <= z[0]:
        return base
    # The dual's (candidate, request) pairs number about moments x sum_t n_t^2: keep them
    # within memory (fewer moments only loosen the bound).
    moments = min(moments, CHAIN_PAIRS // max(1, int(np.dot(lengths, lengths))))
    if moments < 8:
        return base
    taus = np.linspace(z[0], end, moments)
    dual = _ChainDual.of(z, heads, lengths, w_last, taus, burst + rate * taus)
    first_step = 0.3 * float(w_last.max())  # converges in 100 rounds on deepsearch
    return float(base + dual.ascend(first_step, rounds))


@dataclass
class _ChainDual:
    """chain_token_bound's Lagrangian dual: every candidate lateness L of each trajectory
    (0, and each tau_k - z_j > 0 of its requests: just past it, the request is no longer
    counted at tau_k; between them a trajectory's cost only grows), grouped by trajectory,
    and every (candidate, request of its trajectory) pair with the first moment the
    request is still counted at (the first tau_k > z_j + L)."""

    z: np.ndarray  # zero-wait releases, by trajectory
    traj_of: np.ndarray  # each request's trajectory (the order of `heads`)
    taus: np.ndarray  # the moments
    capacity: np.ndarray  # the bucket's starts by each moment
    own: np.ndarray  # per candidate: its trajectory's last weight x L
    cand_late: np.ndarray  # per candidate: L
    cand_heads: np.ndarray  # each trajectory's first candidate
    cand_count: np.ndarray  # candidates per trajectory
    pair_heads: np.ndarray  # each candidate's first pair
    first_counted: np.ndarray  # per pair: the first moment its request is counted at

    @classmethod
    def of(cls, z: np.ndarray, heads: np.ndarray, lengths: np.ndarray, w_last: np.ndarray, taus: np.ndarray,
           capacity: np.ndarray) -> _ChainDual:
        """The dual of requests released at `z`, sorted by trajectory (trajectory t's are
        heads[t] .. heads[t] + lengths[t] - 1, its last of weight w_last[t])."""
        traj_of = np.repeat(np.arange(len(heads)), lengths)
        k, j = np.nonzero(taus[:, None] > z[None, :])
        cand_traj = np.r_[np.arange(len(heads)), traj_of[j]]
        cand_late = np.r_[np.zeros(len(heads)), taus[k] - z[j]]
        by_traj = np.argsort(cand_traj, kind="stable")
        cand_traj, cand_late = cand_traj[by_traj], cand_late[by_traj]
        cand_heads = np.flatnonzero(np.r_[True, cand_traj[1:] != cand_traj[:-1]])
        per_cand = lengths[cand_traj]
        pair_heads = np.cumsum(per_cand) - per_cand
        pair_cand = np.repeat(np.arange(len(cand_traj)), per_cand)
        pair_req = np.repeat(heads[cand_traj] - pair_heads, per_cand) + np.arange(len(pair_cand))
        return cls(z=z, traj_of=traj_of, taus=taus, capacity=capacity, own=w_last[cand_traj] * cand_late,
                   cand_late=cand_late, cand_heads=cand_heads,
                   cand_count=np.diff(np.r_[cand_heads, len(cand_traj)]), pair_heads=pair_heads,
                   first_counted=np.searchsorted(taus, z[pair_req] + cand_late[pair_cand], side="right"))

    def value(self, mu: np.ndarray) -> tuple[float, np.ndarray]:
        """The dual's value at multipliers `mu`, and its subgradient: the requests counted
        at each moment under the minimisers, over capacity."""
        counted_from = np.r_[np.cumsum(mu[::-1])[::-1], 0.0]  # price of a request counted from moment k on
        cost = self.own + np.add.reduceat(counted_from[self.first_counted], self.pair_heads)
        cheapest = np.minimum.reduceat(cost, self.cand_heads)
        at_min = np.flatnonzero(cost <= np.repeat(cheapest, self.cand_count))
        pick = at_min[np.searchsorted(at_min, self.cand_heads)]  # each trajectory's first cheapest candidate
        starts_by = np.sort(self.z + self.cand_late[pick][self.traj_of])
        over = np.searchsorted(starts_by, self.taus, side="left") - self.capacity
        return float(cost[pick].sum() - np.dot(mu, self.capacity)), over

    def ascend(self, step: float, rounds: int) -> float:
        """The best value a projected subgradient ascent from mu = 0 finds in `rounds`,
        starting with `step`."""
        mu = np.zeros(len(self.taus))
        gain = 0.0
        for r in range(rounds):
            value, over = self.value(mu)
            gain = max(gain, value)
            if not np.any(over > 0) and not np.any(mu > 0):
                break  # no moment is over the bucket: nothing to price
            mu = np.maximum(0.0, mu + step / np.sqrt(1 + r) * over / max(1.0, float(np.abs(over).max())))
        return gain


# ------------------------------------------------------------------ a step


@dataclass(frozen=True)
class ZeroWaitAction:
    """One action of a step's zero-wait schedule (every action at its best grant, no wait)."""

    traj: int
    kind: ActionKind | None  # None: the trajectory's reward
    think: float  # the think time just before it
    release: float
    best: float  # run time at its best grant (elastic maximum), noise included
    least_work: float  # core-seconds at its minimum grant; a reward: its time alone
    service: int  # a reward's service index; -1 otherwise


def zero_wait_walk(w: Workload, st: Step) -> Iterator[ZeroWaitAction]:
    """The step's actions in trajectory order (each trajectory's environment actions, then
    its reward), each trajectory starting at 0 and running its actions back to back after
    their think times."""
    offsets = st.offsets
    for t in range(w.batch):
        now = 0.0
        for j in range(int(st.turns[t])):
            aid = int(offsets[t]) + j
            k = w.actions[int(st.kind[aid])]
            noise = float(st.noise[aid + t])
            secs = float(st.seconds[aid])
            run = secs * ((1 - k.parallel_fraction) + k.parallel_fraction * k.cpu / k.max_units) if k.elastic else secs
            think = float(st.think[aid + t])
            now += think
            yield ZeroWaitAction(t, k, think, now, run * noise, k.cpu * secs * noise, -1)
            now += run * noise
        if w.reward is not None:
            i = int(offsets[t + 1]) + t
            run = float(st.reward_seconds[t]) * float(st.noise[i])
            think = float(st.think[i])
            now += think
            yield ZeroWaitAction(t, None, think, now, run, run, int(st.reward_service[t]))
            now += run


# One relaxation of a set of actions: given the weights of all actions, a lower bound on
# the weighted sum of the set's completion times.
Relaxation = Callable[[np.ndarray], float]


@dataclass
class _Actions:
    """A step's actions at zero wait, in trajectory order (each trajectory's environment
    actions, then its reward), and the relaxations that bound them."""

    traj: np.ndarray
    release: np.ndarray  # zero-wait release (a reward: not before its service's first restore)
    best: np.ndarray  # run time at the best grant (noise included)
    tail: np.ndarray  # zero-wait time from its completion to its trajectory's end
    is_reward: np.ndarray
    quota: np.ndarray  # the API quota an environment action is a request against; -1: none
    think: float  # all think time of the step
    # Disjoint sets of actions, each with its alternative relaxations (the largest counts).
    sets: list[tuple[np.ndarray, list[Relaxation]]]


def _machine(a_release: np.ndarray, a_best: np.ndarray, ids: np.ndarray, work: np.ndarray,
             rate: float) -> Relaxation:
    if not math.isfinite(rate):
        return lambda lam: float(np.dot(lam[ids], a_release[ids] + a_best[ids]))
    return lambda lam: machine_bound(a_release[ids], a_best[ids], work, rate, lam[ids])


def _actions(w: Workload, st: Step) -> _Actions:
    inv = w.inventory
    walk = list(zero_wait_walk(w, st))
    quota_index = {q.name: i for i, q in enumerate(w.quotas)}
    traj_a = np.array([x.traj for x in walk], dtype=np.int64)
    rel = np.array([x.release for x in walk])
    best_a = np.array([x.best for x in walk])
    work_a = np.array([x.least_work for x in walk])
    is_reward = np.array([x.kind is None for x in walk])
    node_a = np.where(is_reward, -1, traj_a % inv.cpu_nodes)
    quota_a = np.array([quota_index[x.kind.quota] if x.kind is not None and x.kind.quota else -1 for x in walk])
    service_a = np.array([x.service for x in walk])
    ends = np.zeros(w.batch)
    np.maximum.at(ends, traj_a, rel + best_a)
    tail = ends[traj_a] - (rel + best_a)
    think = float(sum(x.think for x in walk))
    sets: list[tuple[np.ndarray, list[Relaxation]]] = []
    # Quota requests under their quota (its concurrency, its token bucket), other
    # environment actions under their sandbox node, rewards under their services or all the
    # devices together.
    for q, spec in enumerate(w.quotas):
        ids = np.flatnonzero(quota_a == q)
        alternatives = [_machine(rel, best_a, ids, best_a[ids],
                                 float(spec.max_concurrency) if spec.max_concurrency > 0 else math.inf)]
        if spec.rate > 0:
            alternatives.append(lambda lam, ids=ids, spec=spec: token_bound(
                rel[ids], best_a[ids], lam[ids], float(spec.rate), float(spec.burst)))
            alternatives.append(lambda lam, ids=ids, spec=spec: chain_token_bound(
                traj_a[ids], rel[ids], best_a[ids], lam[ids], float(spec.rate), float(spec.burst)))
        sets.append((ids, alternatives))
    for c in range(inv.cpu_nodes):
        ids = np.flatnonzero((node_a == c) & (quota_a < 0))
        sets.append((ids, [_machine(rel, best_a, ids, work_a[ids], float(inv.cpu_node.cpu))]))
    if w.reward is not None:
        gain = w.reward.gpu_batch_gain
        per_service: list[Relaxation] = []
        for s, sv in enumerate(w.reward.services):
            ids = np.flatnonzero(service_a == s)
            # nothing of a service starts before its first restore is done (services start offloaded)
            rel[ids] = np.maximum(rel[ids], sv.restore_seconds)
            rate = sv.copies * sv.max_batch / (1 + (sv.max_batch - 1) / gain)  # max_batch per copy when S is inf
            per_service.append(_machine(rel, best_a, ids, work_a[ids], rate))
        ids = np.flatnonzero(service_a >= 0)
        alternatives = [lambda lam: sum(f(lam) for f in per_service)]
        # every device a service can be restored on: sandbox nodes may have GPUs too
        devices = len(inv.cpu_node.gpus) * inv.cpu_nodes
        devices += len(inv.gpu_node.gpus) * inv.gpu_nodes if inv.gpu_node is not None else 0
        if math.isfinite(gain) and devices:
            alternatives.append(_machine(rel, best_a, ids, best_a[ids], gain * devices))
        sets.append((ids, alternatives))
    return _Actions(traj_a, rel, best_a, tail, is_reward, quota_a, think, sets)


def _weightings(a: _Actions) -> dict[str, np.ndarray]:
    n_traj = int(a.traj.max()) + 1 if len(a.traj) else 0
    count = np.bincount(a.traj, minlength=n_traj).astype(float)
    last = np.ones(len(a.traj), dtype=bool)
    last[:-1] = a.traj[1:] != a.traj[:-1]
    env = ~a.is_reward
    env_count = np.bincount(a.traj[env], minlength=n_traj).astype(float)
    last_env = env & np.append(~env[1:] | (a.traj[1:] != a.traj[:-1]), True)
    out = {"last": last.astype(float), "even": 1.0 / count[a.traj]}
    if env.any() and a.is_reward.any():
        out["last environment"] = np.where(env_count[a.traj] > 0, last_env, last).astype(float)
        out["even environment"] = np.where(env_count[a.traj] > 0, env / np.maximum(env_count[a.traj], 1), last)
    requests = a.quota >= 0
    if requests.any():
        # each trajectory's last quota request (its last action if it makes none): the
        # weighting under which a quota's backlog carries to the trajectory's end
        later = np.zeros(len(a.traj), dtype=bool)  # another request of its trajectory follows
        seen = np.zeros(n_traj, dtype=bool)
        for j in np.flatnonzero(requests)[::-1]:
            later[j] = seen[a.traj[j]]
            seen[a.traj[j]] = True
        out["last quota request"] = np.where(seen[a.traj], requests & ~later, last).astype(float)
    return out


def _bound_for(a: _Actions, lam: np.ndarray) -> float:
    """A lower bound on the sum of trajectory ends, for weights `lam`."""
    total = float(np.dot(lam, a.tail))
    covered = np.zeros(len(lam), dtype=bool)
    for ids, alternatives in a.sets:
        total += max(f(lam) for f in alternatives)
        covered[ids] = True
    rest = ~covered  # in no set: bounded by their zero-wait completion alone
    return total + float(np.dot(lam[rest], a.release[rest] + a.best[rest]))


def capacity_bound(w: Workload, st: Step) -> dict[str, float | str]:
    """`capacity_bound_act`: a lower bound on the step's average ACT under any policy that
    counts each resource's capacity (module docstring); `capacity_bound_weighting` names the
    weighting that gave it."""
    a = _actions(w, st)
    if len(a.traj) == 0:
        return {}
    best_name, best_sum = "", -math.inf
    for name, lam in _weightings(a).items():
        value = _bound_for(a, lam)
        if value > best_sum:
            best_name, best_sum = name, value
    return {"capacity_bound_act": (best_sum - a.think) / len(a.traj), "capacity_bound_weighting": best_name}


# ------------------------------------------------------------------ the zero-wait schedule against the inventory


def _peak(events: list[tuple[float, int, int, float]], scopes: int, capacity: list[float]) -> tuple[float, float]:
    """Events (time, +1 start / -1 end, scope, amount); ends before starts at one instant.
    Returns (peak of the largest demand / capacity over scopes, share of starts made while
    their scope's demand exceeds its capacity)."""
    events.sort(key=lambda e: (e[0], e[1]))
    level = [0.0] * scopes
    peak, over, starts = 0.0, 0, 0
    for _, sign, scope, amount in events:
        level[scope] += sign * amount
        if sign > 0:
            starts += 1
            r = level[scope] / capacity[scope] if capacity[scope] > 0 else math.inf
            peak = max(peak, r)
            over += r > 1 + 1e-9
    return peak, (over / starts if starts else 0.0)


@dataclass
class _ZeroWaitDemand:
    """What a step's zero-wait schedule asks of each resource (bound_schedule)."""

    longest: float  # the longest trajectory's end
    tail: float  # the shortest reward's think and run time; 0 without rewards
    cpu_events: list[tuple[float, int, int, float]]  # (time, +1 / -1, sandbox node, best-grant cores)
    quota_events: list[tuple[float, int, int, float]]  # (time, +1 / -1, quota, 1 request)
    node_area: list[float]  # core-seconds at the minimum grant per sandbox node
    quota_calls: list[int]  # requests per quota
    rewards: list[tuple[float, float, int]]  # (release, end, service) per reward


def _zero_wait_demand(w: Workload, st: Step) -> _ZeroWaitDemand:
    """The zero-wait schedule's demand: each trajectory on its sandbox node (round robin)."""
    inv = w.inventory
    quota_index = {q.name: i for i, q in enumerate(w.quotas)}
    d = _ZeroWaitDemand(0.0, math.inf, [], [], [0.0] * inv.cpu_nodes, [0] * len(w.quotas), [])
    for x in zero_wait_walk(w, st):
        end = x.release + x.best
        d.longest = max(d.longest, end)
        k = x.kind
        if k is None:
            d.tail = min(d.tail, x.think + x.best)
            d.rewards.append((x.release, end, x.service))
            continue
        node = x.traj % inv.cpu_nodes
        cores = k.max_units if k.elastic else k.cpu
        d.cpu_events += [(x.release, 1, node, cores), (end, -1, node, cores)]
        d.node_area[node] += x.least_work
        if k.quota:
            q = quota_index[k.quota]
            d.quota_events += [(x.release, 1, q, 1.0), (end, -1, q, 1.0)]
            d.quota_calls[q] += 1
    d.tail = 0.0 if math.isinf(d.tail) else d.tail
    return d


def _gpu_memory_peak(services: Sequence[RewardService], rewards: list[tuple[float, float, int]],
                     total: float) -> tuple[float, float]:
    """(the most GPU memory the rewards' services need at once over `total`, the share of
    rewards started while that need is over it): each service with rewards running needs
    ceil(running / max_batch) resident copies."""
    ev = sorted([(a, 1, s) for a, _, s in rewards] + [(b, -1, s) for _, b, s in rewards], key=lambda e: (e[0], e[1]))
    running = [0] * len(services)
    need, peak, over, starts = 0.0, 0.0, 0, 0
    for _, sign, s in ev:
        before = math.ceil(running[s] / services[s].max_batch)
        running[s] += sign
        need += (math.ceil(running[s] / services[s].max_batch) - before) * services[s].gpu_memory
        if sign > 0:
            starts += 1
            peak = max(peak, need / total)
            over += need > total
    return peak, (over / starts if starts else 0.0)


def _gpu_drained(reward: Reward, rewards: list[tuple[float, float, int]], total: float, gpu_node: NodeShape,
                 gpu_nodes: int) -> list[float]:
    """Lower bounds on when the GPUs have served the rewards: their share of GPU memory over
    all of it (`total`) and, under the GPU compute model, the devices' and each service's
    copies' throughput (bound_schedule)."""
    svcs = reward.services
    drained = [sum(svcs[s].gpu_memory * (b - a) / svcs[s].max_batch for a, b, s in rewards) / total]
    gain = reward.gpu_batch_gain
    if math.isfinite(gain):
        work = [0.0] * len(svcs)  # alone-seconds per service
        for a, b, s in rewards:
            work[s] += b - a
        drained.append(sum(work) / (gain * len(gpu_node.gpus) * gpu_nodes))
        drained += [x * (1 + (sv.max_batch - 1) / gain) / (sv.max_batch * sv.copies)
                    for x, sv in zip(work, svcs) if x > 0]
    return drained


def bound_schedule(w: Workload, st: Step) -> dict[str, float]:
    """What the lower bound asks of the inventory. The bound runs every action at its best
    grant with zero wait, so its schedule does not depend on any policy: each trajectory
    thinks, runs its actions back to back at their best grants (times the same noise), then
    its reward. Over that schedule: `bound_peak_cpu` is the largest best-grant core demand
    of the actions running at once on one sandbox node, over that node's cores;
    `bound_cpu_over` the share of environment actions that start while their node is over
    its cores; `bound_peak_gpu` the largest GPU memory the reward services would need at
    once (each service with actions running needs ceil(running / max_batch) resident copies)
    over the inventory's GPU memory; `bound_gpu_over` the share of reward actions that start
    while that need is over the inventory; `bound_peak_quota` and `bound_quota_over` the same
    for the in-flight requests of API quotas against their max_concurrency (their rate
    limit is not counted). A value above 1 means the bound cannot be met on
    this inventory by any policy.

    `step_bound` is a lower bound on the step's duration that counts capacity: the step
    lasts at least as long as its longest trajectory's zero-wait schedule, and at least
    until each resource has served the step's demand for it: a sandbox node's actions at
    their least core-seconds (the minimum grant: under Amdahl's law g x t(g) grows with g)
    over its cores; a quota's requests after its burst at its rate; the rewards' share of
    GPU memory (memory x run time / max_batch) over all of it; after a node or quota is
    done, the shortest reward (think and run) still follows. With the GPU compute model on
    (a finite `gpu_batch_gain` S), two more: a device serves at most S alone-seconds of
    reward work per second, so all of it takes at least its total over S x the devices; and
    each copy of a service runs on one device at most `max_batch` at once, so its work alone
    takes at least its total over copies x max_batch / (1 + (max_batch - 1) / S)."""
    inv = w.inventory
    d = _zero_wait_demand(w, st)
    drained = [area / inv.cpu_node.cpu + d.tail for area in d.node_area if area > 0]
    drained += [max(0.0, calls - q.burst) / q.rate + d.tail for q, calls in zip(w.quotas, d.quota_calls) if q.rate > 0]
    peak_cpu, cpu_over = _peak(d.cpu_events, inv.cpu_nodes, [inv.cpu_node.cpu] * inv.cpu_nodes)
    out = {"bound_peak_cpu": peak_cpu, "bound_cpu_over": cpu_over}
    if d.quota_events and any(q.max_concurrency > 0 for q in w.quotas):
        caps = [float(q.max_concurrency) if q.max_concurrency > 0 else math.inf for q in w.quotas]
        out["bound_peak_quota"], out["bound_quota_over"] = _peak(d.quota_events, len(caps), caps)
    if w.reward is not None and inv.gpu_node is not None and inv.gpu_nodes:
        total = float(sum(inv.gpu_node.gpus)) * inv.gpu_nodes
        out["bound_peak_gpu"], out["bound_gpu_over"] = _gpu_memory_peak(w.reward.services, d.rewards, total)
        drained += _gpu_drained(w.reward, d.rewards, total, inv.gpu_node, inv.gpu_nodes)
    out["step_bound"] = max([d.longest, *drained])
    return out


def step_bounds(w: Workload, st: Step) -> dict[str, Any]:
    """Every bound of one step (`bound_schedule` and `capacity_bound`): properties of the
    step and its inventory, the same under every policy, so a comparison of policies on one
    step computes them once and hands them to each run (engine.StepSimulation)."""
    return {**bound_schedule(w, st), **capacity_bound(w, st)}
