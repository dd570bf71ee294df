"""Exact optima of small instances, and each policy's ratio to them.

    python bench/exact_optima.py [--instances 60] [--seed 0] [--json rows.json] [--markdown out.md]

The lower bounds of tangram.sim.bounds hold for any instance but are not reached; on small
instances the optimum itself can be found by enumeration, so a policy's distance from it
is exact. Each instance is a handful of trajectories (chains of actions, each submitted a
think time after the previous one of its chain ended), in three families:

  rigid    one node of C cores; every action needs a fixed number of cores for a fixed
           time. The optimum is over every schedule: a serial schedule generation scheme
           (each action, in list order, at the earliest time its chain and the node allow)
           over every list the chains permit yields every active schedule, and an active
           schedule is optimal for both objectives here (both are regular: see below).
  moldable the same with some actions elastic (Amdahl: their time shrinks with the cores
           granted, up to max_units). The optimum is over schedules that fix each action's
           whole-core grant at its start (the list scheme over every list and every grant):
           the choice tangram's start decision makes. tangram may change a running grant
           (malleable resizes) or grant a fraction of a core, so it can go below this
           "optimum" (a ratio under 1).
  quota    requests under a token bucket (rate, burst) with no other limit: the optimum is
           over every order in which the requests take the bucket's tokens, each as soon as
           its chain and the bucket allow (starting later never leaves more tokens).

Objectives: the mean ACT (an action's end minus its submission) and the step (the last
end). A chain's ACTs sum to its last end minus its think times, so the mean ACT is a
regular objective (non-decreasing in every end time) and so is the step; each is
minimised separately. Every policy runs each instance through tangram.Scheduler in an
event loop of its own below, with its true run times declared (no noise): the numbers
are the scheduling rule's alone. Reports per family and policy the mean, 90th percentile
and worst ratio over the instances, for both objectives.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from tangram import Action, Amdahl, Constant, Inventory, Node, Quota, Scheduler
from tangram.scheduler import Policy

POLICIES = ("tangram", "fifo", "optimus")
FAMILIES = ("rigid", "moldable", "quota")


@dataclass(frozen=True)
class Job:
    think: float  # after the previous action of its chain ends (the first: after t = 0)
    seconds: float  # its run time at `cores` (rigid: its run time)
    cores: int  # its minimum grant
    parallel: float = 0.0  # Amdahl parallel fraction; 0: rigid
    max_units: int = 0  # elastic upper bound (with parallel > 0)

    def run_time(self, grant: float) -> float:
        if self.parallel <= 0:
            return self.seconds
        return self.seconds * ((1 - self.parallel) + self.parallel * self.cores / grant)

    def grants(self) -> range:
        return range(self.cores, (self.max_units if self.parallel > 0 else self.cores) + 1)


@dataclass(frozen=True)
class Instance:
    family: str
    chains: tuple[tuple[Job, ...], ...]
    cores: int = 0  # rigid and moldable: the node's cores
    rate: float = 0.0  # quota: requests per second
    burst: int = 1

    @property
    def think_total(self) -> float:
        return sum(j.think for c in self.chains for j in c)

    @property
    def actions(self) -> int:
        return sum(len(c) for c in self.chains)


# ---------------------------------------------------------------- exact optima

def _interleavings(lengths: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every sequence of chain indices that takes chain c's actions lengths[c] times."""
    left = list(lengths)
    seq: list[int] = []
    total = sum(lengths)

    def go() -> Iterator[tuple[int, ...]]:
        if len(seq) == total:
            yield tuple(seq)
            return
        for c in range(len(left)):
            if left[c]:
                left[c] -= 1
                seq.append(c)
                yield from go()
                seq.pop()
                left[c] += 1
    return go()


def _earliest(placed: list[tuple[float, float, int]], ready: float, run: float, need: int, cores: int) -> float:
    """The earliest t >= ready at which `need` cores stay free over [t, t + run), given the
    placed (start, end, cores). A feasible start is `ready` or some placed action's end."""
    for t in sorted({ready} | {e for _, e, _ in placed if e > ready}):
        points = [t] + [s for s, _, _ in placed if t < s < t + run]
        if all(sum(c for s, e, c in placed if s <= p < e) + need <= cores for p in points):
            return t
    raise AssertionError("no start found: an action needs more than the node")


def node_optimum(inst: Instance) -> tuple[float, float]:
    """(least mean ACT, least step) over the list scheme's schedules: every list the chains
    allow, every whole-core grant of each elastic action."""
    jobs = [j for c in inst.chains for j in c]
    first = np.cumsum([0] + [len(c) for c in inst.chains])
    best_sum, best_step = math.inf, math.inf
    for grants in itertools.product(*(j.grants() for j in jobs)):
        runs = [j.run_time(g) for j, g in zip(jobs, grants)]
        for order in _interleavings([len(c) for c in inst.chains]):
            placed: list[tuple[float, float, int]] = []
            nxt = [0] * len(inst.chains)
            ends = [0.0] * len(inst.chains)
            for c in order:
                i = int(first[c]) + nxt[c]
                t = _earliest(placed, ends[c] + jobs[i].think, runs[i], grants[i], inst.cores)
                ends[c] = t + runs[i]
                placed.append((t, ends[c], grants[i]))
                nxt[c] += 1
            best_sum = min(best_sum, sum(ends))
            best_step = max(0.0, min(best_step, max(ends)))
    return (best_sum - inst.think_total) / inst.actions, best_step


def take_token(tokens: float, clock: float, ready: float, rate: float, burst: float) -> tuple[float, float]:
    """A token bucket (`burst` tokens at 0, one more every 1 / rate, up to `burst` kept) that
    last handed out a token at `clock` holding `tokens`: when a request ready at `ready`
    (>= clock) gets the next one, and the tokens left."""
    t = max(clock, ready)
    tokens = min(burst, tokens + (t - clock) * rate)
    if tokens < 1:
        t += (1 - tokens) / rate
        tokens = 1.0
    return t, tokens - 1


def best_chained_bucket_schedule(gaps: list[np.ndarray], runs: list[np.ndarray], weight: list[np.ndarray],
                                 rate: float, burst: float,
                                 objective: Callable[[float, float], float] = lambda total, end: total) -> float:
    """The least objective over every order in which the chains' requests may take the
    bucket's tokens (each as soon as the bucket and its chain allow: starting later never
    leaves more tokens for the next). Chain c's request i is ready gaps[c][i] after its
    previous one ends (the first at gaps[c][0]) and runs runs[c][i]. The objective of a
    schedule is objective(sum of weight x end, last end): by default the weighted sum."""
    best = math.inf

    def go(nxt: tuple[int, ...], ready: tuple[float, ...], tokens: float, clock: float, total: float,
           last: float) -> None:
        nonlocal best
        live = [c for c in range(len(gaps)) if nxt[c] < len(gaps[c])]
        if not live:
            best = min(best, objective(total, last))
            return
        for c in live:
            t, left = take_token(tokens, clock, ready[c], rate, burst)
            i = nxt[c]
            end = t + runs[c][i]
            after = end + gaps[c][i + 1] if i + 1 < len(gaps[c]) else math.inf
            go(nxt[:c] + (i + 1,) + nxt[c + 1:], ready[:c] + (after,) + ready[c + 1:], left, t,
               total + weight[c][i] * end, max(last, end))

    go(tuple(0 for _ in gaps), tuple(float(g[0]) if len(g) else math.inf for g in gaps), burst, 0.0, 0.0, 0.0)
    return best


def quota_optimum(inst: Instance) -> tuple[float, float]:
    gaps = [np.array([j.think for j in c]) for c in inst.chains]
    runs = [np.array([j.seconds for j in c]) for c in inst.chains]
    last = [np.eye(len(c))[-1] for c in inst.chains]  # a chain's ACTs sum to its last end less its thinks
    total = best_chained_bucket_schedule(gaps, runs, last, inst.rate, inst.burst)
    step = best_chained_bucket_schedule(gaps, runs, last, inst.rate, inst.burst, lambda total, end: end)
    return (total - inst.think_total) / inst.actions, step


def optimum(inst: Instance) -> tuple[float, float]:
    return quota_optimum(inst) if inst.family == "quota" else node_optimum(inst)


# ---------------------------------------------------------------- a policy's schedule

def policy_schedule(inst: Instance, policy: str) -> tuple[float, float]:
    """(mean ACT, step) of the instance run by the core under `policy`: submissions,
    completions and wake-ups in virtual time, each action's true run time declared; a
    resize runs the work left at the new grant."""
    quotas = [Quota("api", rate=inst.rate, burst=inst.burst)] if inst.family == "quota" else []
    cores = inst.cores if inst.family != "quota" else 1024
    sched = Scheduler(Inventory(nodes=[Node("node", {"cpu": cores, "memory": 1 << 20})], quotas=quotas),
                      Policy(name=policy))
    jobs = [j for c in inst.chains for j in c]
    chain_of = [c for c, ch in enumerate(inst.chains) for _ in ch]
    first = [int(x) for x in np.cumsum([0] + [len(c) for c in inst.chains])]
    submitted = [0.0] * len(jobs)
    ended = [math.nan] * len(jobs)
    work_left = [1.0] * len(jobs)  # the share of its work still to run
    timed = [0.0] * len(jobs)  # when work_left was last set
    grant = [0.0] * len(jobs)
    version = [0] * len(jobs)
    heap: list[tuple[float, int, int, int]] = []  # (time, 0 finish / 1 submit, seq, action)
    seq = itertools.count()

    def action(i: int) -> Action:
        j = jobs[i]
        if inst.family == "quota":
            return Action(i, {"cpu": 0.05}, Constant(j.seconds), trajectory=chain_of[i], quota="api")
        if j.parallel > 0:
            return Action(i, {"cpu": j.cores}, Amdahl(j.seconds, j.parallel), elastic="cpu",
                          max_units=j.max_units, trajectory=chain_of[i])
        return Action(i, {"cpu": j.cores}, Constant(j.seconds), trajectory=chain_of[i])

    def retime(i: int, now: float) -> None:
        version[i] += 1
        heapq.heappush(heap, (now + work_left[i] * jobs[i].run_time(grant[i]), 0, version[i], i))

    def apply(decisions, now: float) -> None:  # type: ignore[no-untyped-def]
        for d in decisions:
            if d.kind == "start":
                i = d.action
                grant[i] = d.grant if jobs[i].parallel > 0 else jobs[i].cores
                timed[i] = now
                retime(i, now)
            elif d.kind == "resize":
                i = d.action
                work_left[i] -= (now - timed[i]) / jobs[i].run_time(grant[i])
                grant[i], timed[i] = d.grant, now
                retime(i, now)
            else:
                raise AssertionError(f"unexpected decision {d}")

    for c, ch in enumerate(inst.chains):
        heapq.heappush(heap, (ch[0].think, 1, next(seq), first[c]))
    while True:
        wake = sched.next_wakeup
        if heap and (wake is None or heap[0][0] <= wake + 1e-12):
            now = heap[0][0]
        elif wake is not None and not math.isinf(wake):
            apply(sched.tick(wake), wake)
            continue
        else:
            break
        finished, submit = [], []
        while heap and heap[0][0] <= now + 1e-12:
            _, what, tag, i = heapq.heappop(heap)
            if what == 1:
                submit.append(i)
            elif tag == version[i] and math.isnan(ended[i]):
                finished.append(i)
        for i in finished:
            ended[i] = now
        if finished:
            apply(sched.complete(finished, now), now)
            for i in finished:
                if i + 1 < len(jobs) and chain_of[i + 1] == chain_of[i]:
                    heapq.heappush(heap, (now + jobs[i + 1].think, 1, next(seq), i + 1))
        if submit:
            for i in submit:
                submitted[i] = now
            apply(sched.submit([action(i) for i in submit], now), now)
    if any(math.isnan(e) for e in ended) or sched.running or sched.waiting:
        raise AssertionError(f"{policy}: the instance did not finish: {inst}")
    return float(np.mean(np.subtract(ended, submitted))), max(ended)


# ---------------------------------------------------------------- instances

def zero_wait_act(inst: Instance) -> float:
    """The mean ACT with no wait: every action at its largest grant."""
    return float(np.mean([j.run_time(max(j.grants())) for c in inst.chains for j in c]))


def make_instance(family: str, rng: np.random.Generator) -> Instance:
    """A random instance of 2 to 4 chains of 1 to 3 actions, at most 7 actions in all (6
    for moldable, whose grants multiply the schedules), drawn until the optimum waits
    somewhere (its mean ACT above the zero-wait one): every policy solves the others."""
    while True:
        inst = _draw(family, rng)
        if optimum(inst)[0] > zero_wait_act(inst) * (1 + 1e-6):
            return inst


def _draw(family: str, rng: np.random.Generator) -> Instance:
    limit = 6 if family == "moldable" else 7
    while True:
        lengths = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(2, 5)))]
        if sum(lengths) <= limit:
            break
    if family == "quota":
        chains = tuple(tuple(Job(float(rng.uniform(0, 1)), float(rng.uniform(0.1, 1.5)), 0) for _ in range(n))
                       for n in lengths)
        return Instance(family, chains, rate=float(rng.choice([0.5, 1.0, 2.0])), burst=int(rng.integers(1, 3)))
    cores = int(rng.choice([4, 8]))
    chains_list = []
    for n in lengths:
        chain = []
        for _ in range(n):
            need = int(rng.integers(1, cores + 1))
            think, seconds = float(rng.uniform(0, 1)), float(rng.uniform(0.5, 4))
            if family == "moldable" and rng.random() < 0.5 and need < cores:
                top = min(cores, need + int(rng.integers(1, 4)))
                chain.append(Job(think, seconds, need, float(rng.choice([0.6, 0.9])), top))
            else:
                chain.append(Job(think, seconds, need))
        chains_list.append(tuple(chain))
    return Instance(family, tuple(chains_list), cores=cores)


def run(instances: int, seed: int, families: Sequence[str] = FAMILIES) -> list[dict]:
    rows = []
    for family in families:
        rng = np.random.default_rng([seed, FAMILIES.index(family)])
        for k in range(instances):
            inst = make_instance(family, rng)
            best_act, best_step = optimum(inst)
            for policy in POLICIES:
                act, step = policy_schedule(inst, policy)
                rows.append({"family": family, "instance": k, "actions": inst.actions, "policy": policy,
                             "avg_act": act, "step": step, "optimum_act": best_act, "optimum_step": best_step,
                             "act_ratio": act / best_act, "step_ratio": step / best_step})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        for policy in POLICIES:
            mine = [r for r in rows if r["family"] == family and r["policy"] == policy]
            entry = {"family": family, "policy": policy, "instances": len(mine)}
            for key in ("act_ratio", "step_ratio"):
                x = np.array([r[key] for r in mine])
                entry[key] = {"mean": float(x.mean()), "p90": float(np.percentile(x, 90)), "max": float(x.max()),
                              "min": float(x.min()), "optimal": int(np.sum(x <= 1 + 1e-6))}
            out.append(entry)
    return out


def markdown(entries: list[dict]) -> list[str]:
    out = ["| family | policy | instances | mean ACT / optimum: mean | p90 | worst | optimal | "
           "step / optimum: mean | p90 | worst | optimal |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in entries:
        a, s = e["act_ratio"], e["step_ratio"]
        out.append(f"| {e['family']} | {e['policy']} | {e['instances']} | {a['mean']:.3f} | {a['p90']:.3f} "
                   f"| {a['max']:.3f} | {a['optimal']} | {s['mean']:.3f} | {s['p90']:.3f} | {s['max']:.3f} "
                   f"| {s['optimal']} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=60, help="instances per family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows and the summary here")
    p.add_argument("--markdown", help="write the summary table here")
    args = p.parse_args(argv)
    rows = run(args.instances, args.seed)
    entries = summary(rows)
    table = markdown(entries)
    print("\n".join(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": entries, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
