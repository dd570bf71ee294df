"""A discrete-event simulator of one RL rollout step, driving one `tangram.Scheduler` in
virtual time through the same events a live runtime sends (submit, complete,
end_trajectories, tick).

The step: every trajectory of the batch starts at t = 0. Each alternates LLM generation (a
think time that uses no external resource) and actions, one at a time: an action is
submitted once the previous action of its trajectory has ended plus a think time. After
its last environment action (and one more think time) comes its reward action on a GPU
reward service. The trajectory ends when its reward ends (`end_trajectories` is sent
then); the step ends when every trajectory has ended.

Executors only wait: an action started with grant g runs its true model's time at g (the
workload's seconds and parallel fraction) times a per-action noise factor, so the core's
estimates are imperfect. What the core is told (`estimates`):
  oracle        the true model (without the noise), as every call declared its run time;
  noisy:SIGMA   the true model's seconds times a seeded lognormal factor of mean 1 and
                log-sd SIGMA per action (a user's declared run times, that far off);
  learned       nothing declared: each action is planned with what
                tangram.runtime.estimates has learned from the step's earlier runs of its
                action kind (a reward from those of its service), as the live orchestrator
                plans a call without a runtime; it starts cold (a prior of 1 s) at t = 0.
A resize decision (policies with malleable grants) moves a running action's completion:
the share of its work done since its last grant change is that time over its run time at
the old grant, and the rest runs at the new one. An action
the core rejects (it can never fit) ends at once as failed; its trajectory carries on.

GPU compute (docs/workloads.md, "GPU compute"): the reward actions running on one GPU
device, of whichever services are resident there, share its compute as a processor-sharing
queue with a batching gain. With n of them running there, each progresses at
1 / (1 + (n - 1) / S) of its speed alone (its run time alone is its sampled seconds times
its noise), S being the reward section's `gpu_batch_gain`; the device's throughput,
n / (1 + (n - 1) / S), rises from 1 towards S. Whenever n changes on a device (a reward
starts or ends there), every reward running there is re-timed as a resize is: the share of
its work done since it was last timed, at the pace it had, is banked, and the rest runs at
the new pace. The core is not told: it plans each reward with its run time alone, as it
would a declared runtime. S = infinity turns the model off (every reward runs at its speed
alone, whatever else runs on its device).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._errors import ValidationError
from .._model import Action, Amdahl, Constant, Gpu, Inventory, Node, Quota, Service
from .._records import EVICT, RESIZE, RESTORE, START
from ..runtime.estimates import RunTimeEstimates
from ..scheduler import POLICIES, Policy, Scheduler
from .bounds import capacity_bound, zero_wait_walk
from .workloads import Step, Workload

POLICY_NAMES = POLICIES  # every built-in policy, in the core's order
ENV, REWARD = 0, 1
KIND_LABELS = ("env", "reward")

_FINISH, _SUBMIT = 0, 1


# ------------------------------------------------------------------ setup


def build_inventory(w: Workload) -> Inventory:
    """CPU nodes node0.. (the sandboxes), then GPU nodes gpu0.. holding the reward services;
    the workload's API quotas."""
    inv = w.inventory
    nodes = [Node(f"node{i}", {"cpu": inv.cpu_node.cpu, "memory": inv.cpu_node.memory},
                  [Gpu(m) for m in inv.cpu_node.gpus]) for i in range(inv.cpu_nodes)]
    if inv.gpu_nodes and inv.gpu_node is not None:
        nodes += [Node(f"gpu{i}", {"cpu": inv.gpu_node.cpu, "memory": inv.gpu_node.memory},
                       [Gpu(m) for m in inv.gpu_node.gpus]) for i in range(inv.gpu_nodes)]
    services = []
    if w.reward is not None:
        r = w.reward
        services = [Service(sv.name, memory=sv.gpu_memory, restore_seconds=sv.restore_seconds,
                            max_batch=sv.max_batch, offload_seconds=sv.offload_seconds, replicas=sv.replicas,
                            max_replicas=sv.max_replicas) for sv in r.services]
    quotas = [Quota(q.name, rate=q.rate, burst=q.burst, max_concurrency=q.max_concurrency,
                    tokens_per_minute=q.tokens_per_minute) for q in w.quotas]
    return Inventory(nodes=nodes, quotas=quotas, services=services)


def trajectory_slot_cpu(w: Workload) -> float:
    """The `trajectory` baseline as a careful user configures it: the cores of each sandbox
    node divided evenly among the trajectories that live there at once (every trajectory of
    the step is concurrent; they are spread round robin over the CPU nodes), in whole cores,
    but never less than the largest minimum core demand of an action (else it could never
    run), and large enough that a slot's share of node memory holds the largest memory
    demand. When the node has fewer such slots than trajectories, the rest wait for a slot:
    the baseline is then short of sandboxes, not misconfigured."""
    inv = w.inventory
    per_node = math.ceil(w.batch / inv.cpu_nodes)
    need_cpu = max(k.cpu for k in w.actions)
    need_mem = max(k.memory for k in w.actions)
    slot = max(float(math.floor(inv.cpu_node.cpu / per_node)), float(math.ceil(need_cpu)), 1.0)
    while slot < inv.cpu_node.cpu:
        slots = math.floor(inv.cpu_node.cpu / slot)
        if inv.cpu_node.memory / slots >= need_mem:
            break
        slot += 1.0
    return slot


def make_policy(w: Workload, name: str, objective: str = "step") -> Policy:
    """The policy `name` as the simulator runs it on `w`; `objective` as tangram.Policy's."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICY_NAMES)})")
    if objective != "step":
        return replace(make_policy(w, name), objective=objective)
    if name == "trajectory":
        return Policy(name="trajectory", trajectory_slot_cpu=trajectory_slot_cpu(w))
    if name == "isolated":
        # One task in these workloads: one pool holding every node; each reward replica
        # gets its own home GPU (round robin), as a dedicated deployment would.
        return Policy(name="isolated", pools={0: 1.0})
    return Policy(name=name)


# ------------------------------------------------------------------ the bound's own schedule


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


# The bounds of the last step simulated. They are properties of the step, not of the
# policy, and every comparison runs each policy on one sampled step in turn, so the next
# policy's run of the same step (the same objects) takes them from here.
_last_bounds: tuple[Workload, Step, dict[str, Any]] | None = None


def step_bounds(w: Workload, st: Step) -> dict[str, Any]:
    """`bound_schedule` and `bounds.capacity_bound` of one step."""
    global _last_bounds
    if _last_bounds is None or _last_bounds[0] is not w or _last_bounds[1] is not st:
        _last_bounds = (w, st, {**bound_schedule(w, st), **capacity_bound(w, st)})
    return dict(_last_bounds[2])


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
    cpu_ev: list[tuple[float, int, int, float]] = []
    quota_ev: list[tuple[float, int, int, float]] = []
    quota_index = {q.name: i for i, q in enumerate(w.quotas)}
    rew: list[tuple[float, float, int]] = []
    longest = 0.0  # the longest trajectory, zero-wait
    node_area = [0.0] * inv.cpu_nodes  # core-seconds at the minimum grant per sandbox node
    quota_calls = [0] * len(w.quotas)
    tail = math.inf  # the shortest reward's think and run time
    for x in zero_wait_walk(w, st):
        end = x.release + x.best
        longest = max(longest, end)
        k = x.kind
        if k is None:
            tail = min(tail, x.think + x.best)
            rew.append((x.release, end, x.service))
            continue
        node = x.traj % inv.cpu_nodes
        cores = k.max_units if k.elastic else k.cpu
        cpu_ev += [(x.release, 1, node, cores), (end, -1, node, cores)]
        node_area[node] += x.least_work
        if k.quota:
            q = quota_index[k.quota]
            quota_ev += [(x.release, 1, q, 1.0), (end, -1, q, 1.0)]
            quota_calls[q] += 1
    tail = 0.0 if math.isinf(tail) else tail
    drained = [area / inv.cpu_node.cpu + tail for area in node_area if area > 0]
    drained += [max(0.0, calls - q.burst) / q.rate + tail for q, calls in zip(w.quotas, quota_calls) if q.rate > 0]
    peak_cpu, cpu_over = _peak(cpu_ev, inv.cpu_nodes, [inv.cpu_node.cpu] * inv.cpu_nodes)
    out = {"bound_peak_cpu": peak_cpu, "bound_cpu_over": cpu_over}
    if quota_ev and any(q.max_concurrency > 0 for q in w.quotas):
        caps = [float(q.max_concurrency) if q.max_concurrency > 0 else math.inf for q in w.quotas]
        out["bound_peak_quota"], out["bound_quota_over"] = _peak(quota_ev, len(caps), caps)
    if w.reward is not None and inv.gpu_node is not None and inv.gpu_nodes:
        svcs = w.reward.services
        total = float(sum(inv.gpu_node.gpus)) * inv.gpu_nodes
        ev = sorted([(a, 1, s) for a, _, s in rew] + [(b, -1, s) for _, b, s in rew], key=lambda e: (e[0], e[1]))
        running = [0] * len(svcs)
        need, peak, over, starts = 0.0, 0.0, 0, 0
        for _, sign, s in ev:
            before = math.ceil(running[s] / svcs[s].max_batch)
            running[s] += sign
            need += (math.ceil(running[s] / svcs[s].max_batch) - before) * svcs[s].gpu_memory
            if sign > 0:
                starts += 1
                peak = max(peak, need / total)
                over += need > total
        out["bound_peak_gpu"] = peak
        out["bound_gpu_over"] = over / starts if starts else 0.0
        drained.append(sum(svcs[s].gpu_memory * (b - a) / svcs[s].max_batch for a, b, s in rew) / total)
        gain = w.reward.gpu_batch_gain
        if math.isfinite(gain):
            work = [0.0] * len(svcs)  # alone-seconds per service
            for a, b, s in rew:
                work[s] += b - a
            drained.append(sum(work) / (gain * len(inv.gpu_node.gpus) * inv.gpu_nodes))
            drained += [x * (1 + (sv.max_batch - 1) / gain) / (sv.max_batch * sv.copies)
                        for x, sv in zip(work, svcs) if x > 0]
    out["step_bound"] = max([longest, *drained])
    return out


# ------------------------------------------------------------------ result


@dataclass
class SimResult:
    workload: str
    policy: str
    seed: int
    load: int  # trajectories in the step
    label: np.ndarray  # ENV or REWARD per action (index = action id)
    trajectory: np.ndarray
    submit: np.ndarray
    start: np.ndarray  # NaN for rejected actions
    finish: np.ndarray
    grant: np.ndarray  # elastic units granted at start (cores); the minimum for non-elastic actions
    run: np.ndarray  # finish - start (after any resizes)
    best: np.ndarray  # run time at the best grant (elastic max), same noise
    rejected: np.ndarray  # bool
    step_duration: float
    utilisation: dict[str, float]
    resource_seconds: dict[str, float]  # granted resource-seconds per kind
    cpu_held_seconds: float  # what the policy holds: granted, or whole slots under trajectory
    restores: int
    evictions: int
    action_kind: np.ndarray  # index into workload.actions per environment action; -1 for rewards
    service: np.ndarray  # index into workload.reward.services per reward action; -1 otherwise
    copy: np.ndarray  # the core service it ran on (a copy of a replicated one: service_log's index); -1 otherwise
    kind_names: tuple[str, ...]  # the workload's action kind names
    # (time, RESTORE or EVICT (tangram._records), service index, node, device), in decision order
    service_log: list[tuple[float, int, int, int, int]] = field(default_factory=list, repr=False)
    scheduler: Scheduler | None = field(default=None, repr=False, compare=False)
    bound: dict[str, Any] = field(default_factory=dict)  # bound_schedule() and bounds.capacity_bound()
    cores: int = 0  # cores per CPU (sandbox) node of the inventory it ran on
    gpus: int = 0  # GPUs per GPU node (the built-ins have one GPU node: the total)
    estimates: str = "oracle"  # what the core was told of run times (see the module docstring)
    gpu_batch_gain: float = math.inf  # S of the GPU compute model it ran under; inf: no contention

    @property
    def wait(self) -> np.ndarray:
        return self.start - self.submit

    @property
    def act(self) -> np.ndarray:
        return self.finish - self.submit

    def row(self) -> dict[str, Any]:
        ok = ~self.rejected
        act = self.act[ok]
        lab = self.label[ok]

        def mean(a: np.ndarray) -> float:
            return float(a.mean()) if len(a) else float("nan")

        lb = mean(self.best[ok])
        avg = mean(act)
        ak = self.action_kind[ok]
        by_kind = {name: mean(act[ak == i]) for i, name in enumerate(self.kind_names) if (ak == i).any()}
        if (lab == REWARD).any():
            by_kind["reward"] = mean(act[lab == REWARD])
        return {
            "workload": self.workload,
            "policy": self.policy,
            "seed": self.seed,
            "load": self.load,
            "cores": self.cores,
            "gpus": self.gpus,
            "estimates": self.estimates,
            # S of the GPU compute model; None (null): no contention modelled
            "gpu_batch_gain": self.gpu_batch_gain if math.isfinite(self.gpu_batch_gain) else None,
            "actions": int(ok.sum()),
            "rejected": int(self.rejected.sum()),
            "avg_act": avg,
            "p99_act": float(np.percentile(act, 99)) if len(act) else float("nan"),
            "lower_bound_act": lb,
            "act_ratio_to_bound": avg / lb if lb > 0 else float("nan"),
            # the capacity bound counts every action: no ratio when some were rejected
            "act_ratio_to_capacity_bound": (avg / self.bound["capacity_bound_act"]
                                            if self.bound.get("capacity_bound_act", 0) > 0 and not self.rejected.any()
                                            else float("nan")),
            "step_ratio_to_bound": (self.step_duration / self.bound["step_bound"]
                                    if self.bound.get("step_bound", 0) > 0 else float("nan")),
            **self.bound,
            "act_env": mean(act[lab == ENV]),
            "act_reward": mean(act[lab == REWARD]),
            "act_by_kind": by_kind,
            "avg_wait": mean(self.wait[ok]),
            "step_duration": self.step_duration,
            "utilisation": dict(self.utilisation),
            "resource_seconds": dict(self.resource_seconds),
            "cpu_held_seconds": self.cpu_held_seconds,
            "restores": self.restores,
            "evictions": self.evictions,
            # GPU compute: how much slower than alone rewards ran, and co-location
            "reward_slowdown": mean(np.divide(self.run, self.best, out=np.ones_like(self.run),
                                              where=self.best > 0)[ok & (self.label == REWARD)]),
            "peak_services_per_device": self.peak_services_per_device(),
        }

    def peak_services_per_device(self) -> int:
        """The most services resident (or restoring) on one GPU device at once, from the
        restore and eviction decisions."""
        resident: dict[tuple[int, int], set[int]] = {}
        peak = 0
        for _, kind, svc, node, device in self.service_log:
            here = resident.setdefault((node, device), set())
            if kind == RESTORE:
                here.add(svc)
                peak = max(peak, len(here))
            else:
                here.discard(svc)
        return peak


# ------------------------------------------------------------------ simulation


def parse_estimates(text: str) -> tuple[str, float]:
    """`oracle`, `learned`, `learned-runtimes` or `noisy:SIGMA` (SIGMA a finite number >= 0)
    -> (mode, sigma). `learned-runtimes` learns run times as `learned` does but plans each
    elastic action with its kind's true parallel fraction: what the learned elasticity
    costs, apart from the learned run times."""
    if text in ("oracle", "learned", "learned-runtimes"):
        return text, 0.0
    if isinstance(text, str) and text.startswith("noisy:"):
        try:
            sigma = float(text[len("noisy:"):])
        except ValueError:
            sigma = math.nan
        if math.isfinite(sigma) and sigma >= 0:
            return "noisy", sigma
        raise ValidationError("estimates", f"noisy:SIGMA needs a finite SIGMA >= 0, got {text!r}")
    raise ValidationError("estimates", f"must be oracle, learned, learned-runtimes or noisy:SIGMA, got {text!r}")


def simulate(workload: Workload, policy: str | Policy, seed: int = 0,
             step: Step | None = None, check: bool = True, estimates: str = "oracle") -> SimResult:
    """Simulates one RL step of `workload` under `policy`. Deterministic for a seed.
    `estimates`: what the core is told of run times (see the module docstring)."""
    mode, sigma = parse_estimates(estimates)
    w = workload
    gain = w.reward.gpu_batch_gain if w.reward is not None else math.inf
    contention = math.isfinite(gain)  # the GPU compute model (module docstring) is on
    pol = make_policy(w, policy) if isinstance(policy, str) else policy
    inventory = build_inventory(w)
    sched = Scheduler(inventory, pol)
    st = step if step is not None else w.sample(seed)
    n = w.batch
    offsets = st.offsets
    n_env = int(offsets[-1])
    has_reward = w.reward is not None
    total = n_env + (n if has_reward else 0)
    kinds = sched.kinds
    cpu_nodes = w.inventory.cpu_nodes

    label = np.zeros(total, dtype=np.int8)
    traj_of = np.zeros(total, dtype=np.int64)
    traj_of[:n_env] = np.repeat(np.arange(n), st.turns)
    action_kind = np.full(total, -1, dtype=np.int64)
    action_kind[:n_env] = st.kind
    service_of = np.full(total, -1, dtype=np.int64)
    copy_of = np.full(total, -1, dtype=np.int64)  # the core service (copy) a reward ran on
    if has_reward:
        label[n_env:] = REWARD
        traj_of[n_env:] = np.arange(n)
        service_of[n_env:] = st.reward_service
    submit = np.full(total, np.nan)
    start = np.full(total, np.nan)
    finish = np.full(total, np.nan)
    grant = np.zeros(total)
    run = np.zeros(total)
    best = np.zeros(total)
    rejected = np.zeros(total, dtype=bool)
    demand = np.zeros((total, len(kinds)))  # held per kind (elastic kind = grant), now
    elastic = np.zeros(total, dtype=bool)
    max_units = np.zeros(total)
    # Moving a running action's completion (a resize, or a reward's GPU compute share
    # changing): since when it runs at its current grant and pace, the share of its work
    # left then, what it held before (resource-seconds per kind), and the heap entry (its
    # seq) of its pending completion; earlier entries of a moved action are stale.
    since = np.zeros(total)
    work_left = np.ones(total)
    held_before = np.zeros((total, len(kinds)))
    moved = np.zeros(total, dtype=bool)
    finish_seq = np.full(total, -1, dtype=np.int64)
    # GPU compute: each action's slowdown now (1 + (n - 1) / S for a reward sharing its
    # device with n - 1 others; 1 otherwise), the rewards running on each (node, device) in
    # start order, and the devices whose count changed at this instant.
    pace = np.ones(total)
    noise_at = np.ones(total)  # each started action's noise factor (noise_of), kept
    on_device: dict[tuple[int, int], dict[int, None]] = {}
    device_of: dict[int, tuple[int, int]] = {}
    changed: dict[tuple[int, int], None] = {}
    # The truth an executor runs: seconds at the minimum, Amdahl's parallel fraction (0 for
    # a fixed action) and the minimum, per action.
    true_seconds = np.zeros(total)
    true_parallel = np.zeros(total)
    true_minimum = np.ones(total)
    planned_factor = np.ones(total)  # noisy: the error of the run time the core is told
    if mode == "noisy":
        planned_factor = np.random.default_rng([seed, 0x6E6F697379]).lognormal(-sigma * sigma / 2, sigma, total)
    learner = RunTimeEstimates() if mode in ("learned", "learned-runtimes") else None
    learn_key: dict[int, tuple[str, str, bool]] = {}  # action id -> its key, kind and elasticity

    def true_runtime(aid: int, g: float) -> float:
        p = true_parallel[aid]
        return float(true_seconds[aid] * ((1 - p) + p * true_minimum[aid] / g)) if p > 0 else float(true_seconds[aid])

    def planned(aid: int, key: str, kind: str, secs: float, p: float | None, minimum: float) -> Any:
        """The model the core is told for an action whose truth is (secs, p)."""
        true_seconds[aid] = secs
        if p is not None:
            true_parallel[aid], true_minimum[aid] = p, minimum
        if learner is not None:
            learn_key[aid] = (key, kind, p is not None)
            declared = p if mode == "learned-runtimes" else None  # the true fraction, for the diagnosis
            return learner.plan(key, kind, p is not None, minimum, parallel=declared).model
        secs = secs * float(planned_factor[aid])
        return Constant(secs) if p is None else Amdahl(secs, p)

    # noise/think index: per trajectory, one entry per env action then one for the reward
    def side_index(t: int, j: int) -> int:
        return int(offsets[t]) + t + j

    def make_action(t: int, j: int) -> tuple[int, Action]:
        """The j-th action of trajectory t (j == turns[t]: its reward)."""
        if j < st.turns[t]:
            aid = int(offsets[t]) + j
            k = w.actions[int(st.kind[aid])]
            secs = float(st.seconds[aid])
            extra = {"quota": k.quota, "tokens": int(st.tokens[aid])} if k.quota else {}
            if k.elastic:
                elastic[aid] = True
                max_units[aid] = k.max_units
                model = planned(aid, k.name, KIND_LABELS[ENV], secs, k.parallel_fraction, k.cpu)
                a = Action(aid, {"cpu": k.cpu, "memory": k.memory}, model,
                           elastic="cpu", max_units=k.max_units, trajectory=t, affinity=t % cpu_nodes,
                           **extra)  # type: ignore[arg-type]
            else:
                model = planned(aid, k.name, KIND_LABELS[ENV], secs, None, k.cpu)
                a = Action(aid, {"cpu": k.cpu, "memory": k.memory}, model,
                           trajectory=t, affinity=t % cpu_nodes, **extra)  # type: ignore[arg-type]
            return aid, a
        r = w.reward
        assert r is not None
        aid = n_env + t
        service = r.services[int(st.reward_service[t])].name
        model = planned(aid, service, KIND_LABELS[REWARD], float(st.reward_seconds[t]), None, 0.0)
        a = Action(aid, {"cpu": r.cpu, "memory": r.memory}, model, trajectory=t, service=service)
        return aid, a

    base_demand = {}  # action id -> minimum demand vector, filled at submit

    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    next_j = np.zeros(n, dtype=np.int64)  # next action index per trajectory
    traj_end = np.full(n, np.nan)
    traj_first_start = np.full(n, np.nan)  # under "trajectory": when it bound its slot
    slots = pol.name == "trajectory"
    lent: set[int] = set()  # trajectories that ran in a slot lent to them, holding none
    restores = evictions = 0
    rejected_now: list[int] = []
    service_log: list[tuple[float, int, int, int, int]] = []

    def push(time: float, kind: int, x: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (time, seq, kind, x))
        if kind == _FINISH:
            finish_seq[x] = seq
        seq += 1

    def noise_of(aid: int) -> float:
        return float(st.noise[side_index(int(traj_of[aid]), _j_of(aid))])

    def bank(aid: int, now: float) -> None:
        """Before a running action's grant or pace changes: the share of its work done since
        it was last timed (at the grant and pace it had) comes off its work left."""
        before = true_runtime(aid, float(demand[aid, 0])) * noise_at[aid] * pace[aid]
        left = work_left[aid] - (now - since[aid]) / before if before > 0 else 0.0
        work_left[aid] = max(left, 0.0)
        held_before[aid] += demand[aid] * (now - since[aid])
        since[aid] = now
        moved[aid] = True

    def retime(aid: int, now: float) -> None:
        """After bank() and the change: its completion moves to when its work left ends at
        its grant and pace now (earlier heap entries go stale)."""
        end = now + work_left[aid] * true_runtime(aid, float(demand[aid, 0])) * noise_at[aid] * pace[aid]
        run[aid] = end - start[aid]
        push(end, _FINISH, aid)

    def share_compute(now: float) -> None:
        """Every reward running on a device whose count changed at `now` runs on at its new
        share of the device's compute."""
        for key in changed:
            running = on_device[key]
            p = 1.0 + (len(running) - 1) / gain if running else 1.0
            for aid in running:
                if finish_seq[aid] >= 0 and pace[aid] == p:
                    continue  # timed, and its pace is the same
                bank(aid, now)
                pace[aid] = p
                retime(aid, now)
        changed.clear()

    def apply(decisions, now: float) -> None:  # type: ignore[no-untyped-def]
        nonlocal restores, evictions
        arr = decisions.array
        for r in arr:
            kind = int(r["kind"])
            if kind == START:
                aid = int(r["action"])
                g = float(r["grant"])
                noise = noise_at[aid] = noise_of(aid)
                if elastic[aid]:
                    t_run = true_runtime(aid, g) * noise
                    best[aid] = true_runtime(aid, float(max_units[aid])) * noise
                    grant[aid] = g
                else:
                    t_run = true_runtime(aid, 1.0) * noise
                    best[aid] = t_run
                    grant[aid] = base_demand[aid][0]
                start[aid] = now
                run[aid] = t_run
                copy_of[aid] = int(r["service"])
                d = base_demand[aid]
                if elastic[aid]:
                    d = d.copy()
                    d[0] = g
                demand[aid] = d
                t = int(traj_of[aid])
                # Under "trajectory" it holds its slot from the start that binds one (a start
                # in a slot lent to it binds none).
                if slots and label[aid] == ENV and math.isnan(traj_first_start[t]):
                    if sched.trajectory_slot(t) is not None:
                        traj_first_start[t] = now
                    else:
                        lent.add(t)
                since[aid] = now
                if learner is not None:  # as the live orchestrator reports a run as it goes
                    key, kind_name, is_elastic = learn_key[aid]
                    learner.started(aid, key, kind_name, is_elastic, g, now)
                if contention and label[aid] == REWARD:  # timed by share_compute() below
                    device = (int(r["node"]), int(r["device"]))
                    on_device.setdefault(device, {})[aid] = None
                    device_of[aid] = device
                    changed[device] = None
                else:
                    push(now + t_run, _FINISH, aid)
            elif kind == RESTORE:
                restores += 1
                service_log.append((now, RESTORE, int(r["service"]), int(r["node"]), int(r["device"])))
            elif kind == EVICT:
                evictions += 1
                service_log.append((now, EVICT, int(r["service"]), int(r["node"]), int(r["device"])))
            elif kind == RESIZE:  # the work left runs on at the new grant
                aid = int(r["action"])
                g = float(r["grant"])
                bank(aid, now)
                if learner is not None:
                    learner.resized(aid, g, now)
                demand[aid, 0] = g
                retime(aid, now)
            else:
                rejected_now.append(int(r["action"]))
        if changed:
            share_compute(now)

    def _j_of(aid: int) -> int:
        if aid >= n_env:
            return int(st.turns[aid - n_env])
        return aid - int(offsets[int(traj_of[aid])])

    def n_actions(t: int) -> int:
        return int(st.turns[t]) + (1 if has_reward else 0)

    def queue_next(t: int, now: float, immediate: list[int], ended: list[int]) -> None:
        j = int(next_j[t])
        if j >= n_actions(t):
            traj_end[t] = now
            ended.append(t)
            return
        think = float(st.think[side_index(t, j)])
        if think > 0:
            push(now + think, _SUBMIT, t)
        else:
            immediate.append(t)

    now = 0.0
    immediate: list[int] = []
    ended: list[int] = []
    for t in range(n):
        queue_next(t, 0.0, immediate, ended)

    def advance(aid: int, now: float, to_submit: list[int], ended: list[int]) -> None:
        t = int(traj_of[aid])
        next_j[t] += 1
        queue_next(t, now, to_submit, ended)

    def handle(now: float, finished: list[int], to_submit: list[int], ended: list[int]) -> None:
        """Events at `now`, in a fixed order: completions, then trajectories that ended,
        then submissions (and again while rejections or zero think times chain on)."""
        if finished:
            for aid in finished:
                finish[aid] = now
                if learner is not None:  # what the live orchestrator learns as an action ends
                    learner.finished(aid, now)
                device = device_of.pop(aid, None)
                if device is not None:  # the others there speed up (share_compute, in apply)
                    del on_device[device][aid]
                    changed[device] = None
            apply(sched.complete(finished, now), now)
            for aid in finished:
                advance(aid, now, to_submit, ended)
        while ended or to_submit:
            if ended:
                apply(sched.end_trajectories(ended, now), now)
                ended = []
                # A slot let go with a lent action in it is taken over by that action's
                # trajectory, which holds it from now on.
                for t in list(lent):
                    if sched.trajectory_slot(t) is not None or not math.isnan(traj_end[t]):
                        lent.discard(t)
                        if math.isnan(traj_first_start[t]) and math.isnan(traj_end[t]):
                            traj_first_start[t] = now
            if to_submit:
                batch = []
                for t in to_submit:
                    aid, a = make_action(t, int(next_j[t]))
                    submit[aid] = now
                    vec = np.zeros(len(kinds))
                    for kname, v in a.demand.items():
                        vec[kinds.index(kname)] = v
                    base_demand[aid] = vec
                    batch.append(a)
                to_submit = []
                apply(sched.submit(batch, now), now)
                refused = list(rejected_now)
                rejected_now.clear()
                for aid in refused:  # can never run: ends now, failed; its trajectory goes on
                    rejected[aid] = True
                    finish[aid] = now
                    advance(aid, now, to_submit, ended)

    assert kinds[0] == "cpu"
    handle(0.0, [], immediate, ended)
    while True:
        while heap and heap[0][2] == _FINISH and heap[0][1] != finish_seq[heap[0][3]]:
            heapq.heappop(heap)  # a completion a resize or the GPU compute model moved
        wake = sched.next_wakeup
        nxt = heap[0][0] if heap else math.inf
        if wake is not None and now < wake < nxt:
            now = wake
            apply(sched.tick(now), now)
            handle(now, [], [], [])
            continue
        if not heap:
            break
        now = nxt
        finished: list[int] = []
        subs: list[int] = []
        while heap and heap[0][0] == now:
            _, entry, kind, x = heapq.heappop(heap)
            if kind == _FINISH and entry != finish_seq[x]:
                continue  # moved by a resize or a change of its GPU compute share
            (finished if kind == _FINISH else subs).append(x)
        handle(now, finished, subs, [])

    if sched.waiting or sched.running:
        stuck = [i for i in range(total) if np.isnan(finish[i]) and not np.isnan(submit[i])][:3]
        why = "; ".join(f"{i}: {sched.explain(i)}" for i in stuck)
        raise RuntimeError(f"simulation stalled at t={now:g} with {sched.waiting} waiting, "
                           f"{sched.running} running ({why})")
    if check:
        sched.check_invariants()

    step_duration = float(np.nanmax(traj_end)) if n else 0.0
    ok = ~rejected
    if moved.any():  # each grant for as long as it was held
        rows = demand * run[:, None]
        r = np.flatnonzero(moved & ok)
        rows[r] = held_before[r] + demand[r] * (finish[r] - since[r])[:, None]
        held = rows[ok].sum(axis=0)
    else:
        held = (demand[ok] * run[ok, None]).sum(axis=0)
    capacity = np.zeros(len(kinds))
    for node in inventory.nodes:
        for k, kname in enumerate(kinds):
            capacity[k] += node.resources.get(kname, 0.0)
    span = step_duration if step_duration > 0 else 1.0
    utilisation = {kname: float(held[k] / (capacity[k] * span)) if capacity[k] > 0 else 0.0
                   for k, kname in enumerate(kinds)}
    resource_seconds = {kname: float(held[k]) for k, kname in enumerate(kinds)}
    cpu_held = float(held[0])
    if pol.name == "trajectory":
        # Each trajectory holds its whole slot from the start that binds it until it ends;
        # reward actions and actions in lent slots bind none (a lent slot is its holder's).
        slot = pol.trajectory_slot_cpu
        bound = ~np.isnan(traj_first_start)
        reward_cpu = float((demand[ok & (label == REWARD), 0] * run[ok & (label == REWARD)]).sum())
        cpu_held = float((slot * (traj_end[bound] - traj_first_start[bound])).sum()) + reward_cpu
    return SimResult(
        workload=w.name, policy=pol.name, seed=seed, load=n, label=label, trajectory=traj_of,
        submit=submit, start=start, finish=finish, grant=grant, run=run, best=best,
        rejected=rejected, step_duration=step_duration, utilisation=utilisation,
        resource_seconds=resource_seconds, cpu_held_seconds=cpu_held, restores=restores,
        evictions=evictions, action_kind=action_kind, service=service_of, copy=copy_of,
        kind_names=tuple(k.name for k in w.actions), service_log=service_log, scheduler=sched,
        cores=w.value("cores"), gpus=w.value("gpus"), estimates=estimates,
        bound=step_bounds(w, st),
        gpu_batch_gain=gain,
    )
