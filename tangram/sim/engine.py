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
                tangram.estimates has learned from the step's earlier runs of its
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

from .._errors import InvalidStateError, ValidationError
from .._model import Action, Amdahl, Constant, Gpu, Inventory, Model, Node, Quota, Service
from .._records import EVICT, RESIZE, RESTORE, START, Decision, decisions
from ..estimates import RunTimeEstimates
from ..scheduler import POLICIES, Decisions, Policy, Scheduler
from .bounds import step_bounds
from .result import ENV, KIND_LABELS, REWARD, SimResult
from .workloads import Step, Workload

POLICY_NAMES = POLICIES  # every built-in policy, in the core's order


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


# ------------------------------------------------------------------ the simulation's state

_FINISH, _SUBMIT = 0, 1  # event kinds: an action's completion, a trajectory's next submission


class _EventQueue:
    """The step's pending events in time order, ties in the order they were pushed:
    completions (_FINISH, action id) and submissions (_SUBMIT, trajectory). Moving an
    action's completion (a resize, a change of its GPU compute share) pushes it again; its
    earlier entries go stale and are skipped."""

    def __init__(self, actions: int) -> None:
        self.heap: list[tuple[float, int, int, int]] = []  # (time, push order, event kind, action or trajectory)
        self.pushed = 0
        # Each action's live completion entry (its push order); -1 until it is timed.
        self.live_finish = np.full(actions, -1, dtype=np.int64)

    def push(self, time: float, kind: int, x: int) -> None:
        """Queues an event; a completion replaces the action's earlier one."""
        heapq.heappush(self.heap, (time, self.pushed, kind, x))
        if kind == _FINISH:
            self.live_finish[x] = self.pushed
        self.pushed += 1

    def next_time(self) -> float | None:
        """When the next live event is due; None when nothing is pending."""
        heap, live = self.heap, self.live_finish
        while heap and heap[0][2] == _FINISH and heap[0][1] != live[heap[0][3]]:
            heapq.heappop(heap)  # a completion that was moved
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> tuple[list[int], list[int]]:
        """The live events due at `now`: (actions that complete, trajectories that submit)."""
        heap, live = self.heap, self.live_finish
        finished: list[int] = []
        submits: list[int] = []
        while heap and heap[0][0] == now:
            _, pushed, kind, x = heapq.heappop(heap)
            if kind == _SUBMIT:
                submits.append(x)
            elif pushed == live[x]:
                finished.append(x)
        return finished, submits


@dataclass
class _ActionLog:
    """What happened to each action of the step (index = action id), as SimResult reports
    it: environment actions first, in trajectory order, then one reward per trajectory."""

    label: np.ndarray  # ENV or REWARD
    trajectory: np.ndarray
    action_kind: np.ndarray  # index into workload.actions; -1 for rewards
    service: np.ndarray  # index into workload.reward.services; -1 otherwise
    copy: np.ndarray  # the core service (copy) a reward ran on; -1 otherwise
    submit: np.ndarray
    start: np.ndarray  # NaN until it starts (for ever when rejected)
    finish: np.ndarray
    grant: np.ndarray  # elastic units granted at start; the minimum for non-elastic actions
    run: np.ndarray  # finish - start, as resizes and GPU compute shares moved it
    best: np.ndarray  # run time at the best grant (elastic max), same noise
    rejected: np.ndarray  # bool

    @classmethod
    def of_step(cls, st: Step, trajectories: int, n_env: int, has_reward: bool) -> _ActionLog:
        """Every action of the step, none submitted yet."""
        total = n_env + (trajectories if has_reward else 0)
        log = cls(label=np.zeros(total, dtype=np.int8), trajectory=np.zeros(total, dtype=np.int64),
                  action_kind=np.full(total, -1, dtype=np.int64), service=np.full(total, -1, dtype=np.int64),
                  copy=np.full(total, -1, dtype=np.int64), submit=np.full(total, np.nan),
                  start=np.full(total, np.nan), finish=np.full(total, np.nan), grant=np.zeros(total),
                  run=np.zeros(total), best=np.zeros(total), rejected=np.zeros(total, dtype=bool))
        log.trajectory[:n_env] = np.repeat(np.arange(trajectories), st.turns)
        log.action_kind[:n_env] = st.kind
        if has_reward:
            log.label[n_env:] = REWARD
            log.trajectory[n_env:] = np.arange(trajectories)
            log.service[n_env:] = st.reward_service
        return log


@dataclass
class _Truth:
    """What each action's executor really runs (index = action id): its seconds at the
    minimum grant, Amdahl's parallel fraction (0: a fixed action) and that minimum, whether
    it is elastic (up to max_units cores), and its noise factor."""

    seconds: np.ndarray
    parallel: np.ndarray
    minimum: np.ndarray
    elastic: np.ndarray  # bool
    max_units: np.ndarray
    noise: np.ndarray

    @classmethod
    def of_step(cls, st: Step, log: _ActionLog, n_env: int) -> _Truth:
        """Nothing recorded yet but each action's noise: the step's entry for it (an
        environment action's index offsets[t] + t + j, a reward's offsets[t + 1] + t)."""
        total = len(log.label)
        side = np.arange(total) + log.trajectory
        side[n_env:] = st.offsets[1:][log.trajectory[n_env:]] + log.trajectory[n_env:]
        return cls(seconds=np.zeros(total), parallel=np.zeros(total), minimum=np.ones(total),
                   elastic=np.zeros(total, dtype=bool), max_units=np.zeros(total), noise=st.noise[side])

    def record(self, aid: int, seconds: float, parallel: float | None, minimum: float, max_units: float) -> None:
        """An action's truth as it is submitted; `parallel` None: it is not elastic."""
        self.seconds[aid] = seconds
        if parallel is not None:
            self.parallel[aid], self.minimum[aid] = parallel, minimum
            self.elastic[aid] = True
            self.max_units[aid] = max_units

    def runtime(self, aid: int, grant: float) -> float:
        """Its run time at `grant` cores, without noise."""
        p = self.parallel[aid]
        if p > 0:
            return float(self.seconds[aid] * ((1 - p) + p * self.minimum[aid] / grant))
        return float(self.seconds[aid])


@dataclass
class _Holding:
    """Each action's hold on resources and its progress while it runs (index = action id).
    A resize, or a change of a reward's GPU compute share, moves a running action's
    completion: the share of its work done since it was last timed is banked and the rest
    runs at its new grant and pace."""

    # (actions, kinds): its minimum per kind from submission; of the elastic kind, its grant once started
    demand: np.ndarray
    pace: np.ndarray  # its slowdown: 1 + (n - 1) / S for a reward sharing its device with n - 1 others; else 1
    since: np.ndarray  # since when it runs at its current grant and pace
    work_left: np.ndarray  # the share of its work left then
    held_before: np.ndarray  # (actions, kinds): the resource-seconds it held before then
    moved: np.ndarray  # bool: its grant or pace changed while it ran

    @classmethod
    def empty(cls, actions: int, kinds: int) -> _Holding:
        """Nothing held yet."""
        return cls(demand=np.zeros((actions, kinds)), pace=np.ones(actions), since=np.zeros(actions),
                   work_left=np.ones(actions), held_before=np.zeros((actions, kinds)),
                   moved=np.zeros(actions, dtype=bool))

    def held_seconds(self, ok: np.ndarray, finish: np.ndarray, run: np.ndarray) -> np.ndarray:
        """The resource-seconds per kind the actions `ok` held, each grant for as long as it
        was held."""
        if not self.moved.any():
            return (self.demand[ok] * run[ok, None]).sum(axis=0)
        rows = self.demand * run[:, None]
        r = np.flatnonzero(self.moved & ok)
        rows[r] = self.held_before[r] + self.demand[r] * (finish[r] - self.since[r])[:, None]
        return rows[ok].sum(axis=0)


class _GpuSharing:
    """The GPU compute model's state (module docstring): the rewards running on each
    (node, device), in start order, and the devices whose count changed at this instant."""

    def __init__(self, gain: float) -> None:
        self.gain = gain
        self.running: dict[tuple[int, int], dict[int, None]] = {}
        self.device_of: dict[int, tuple[int, int]] = {}
        self.changed: dict[tuple[int, int], None] = {}

    def add(self, aid: int, device: tuple[int, int]) -> None:
        """Reward `aid` started on `device`."""
        self.running.setdefault(device, {})[aid] = None
        self.device_of[aid] = device
        self.changed[device] = None

    def remove(self, aid: int) -> None:
        """Action `aid` ended; if it ran on a device, the others there speed up."""
        device = self.device_of.pop(aid, None)
        if device is not None:
            del self.running[device][aid]
            self.changed[device] = None

    def repaced(self) -> list[tuple[float, list[int]]]:
        """For each device whose count changed since last asked: the pace its rewards run
        at now and those rewards."""
        out = []
        for device in self.changed:
            running = self.running[device]
            out.append((1.0 + (len(running) - 1) / self.gain if running else 1.0, list(running)))
        self.changed.clear()
        return out


class _Declarations:
    """What the core is told of each action's run time (`estimates`, module docstring)
    and, under learned estimates, the learner that watches the step's runs as the live
    orchestrator's does."""

    def __init__(self, mode: str, sigma: float, seed: int, actions: int) -> None:
        self.mode = mode
        self.error = np.ones(actions)  # noisy: the factor each declared run time is off by
        if mode == "noisy":
            self.error = np.random.default_rng([seed, 0x6E6F697379]).lognormal(-sigma * sigma / 2, sigma, actions)
        self.learner = RunTimeEstimates() if mode in ("learned", "learned-runtimes") else None
        self.keys: dict[int, tuple[str, str, bool]] = {}  # action id -> its key, kind and elasticity

    def model(self, aid: int, key: str, kind: str, seconds: float, parallel: float | None, minimum: float) -> Model:
        """The model the core is told for an action whose truth is (seconds, parallel)."""
        if self.learner is not None:
            elastic = parallel is not None
            self.keys[aid] = (key, kind, elastic)
            declared = parallel if self.mode == "learned-runtimes" else None  # the true fraction, for the diagnosis
            return self.learner.plan(key, kind, elastic, minimum, parallel=declared).model
        seconds = seconds * float(self.error[aid])
        return Constant(seconds) if parallel is None else Amdahl(seconds, parallel)

    def started(self, aid: int, grant: float, now: float) -> None:
        """Action `aid` started at `grant`."""
        if self.learner is not None:
            key, kind, elastic = self.keys[aid]
            self.learner.started(aid, key, kind, elastic, grant, now)

    def resized(self, aid: int, grant: float, now: float) -> None:
        """Running action `aid` runs on at `grant`."""
        if self.learner is not None:
            self.learner.resized(aid, grant, now)

    def finished(self, aid: int, now: float) -> None:
        """Action `aid` ended."""
        if self.learner is not None:
            self.learner.finished(aid, now)


@dataclass
class _Trajectories:
    """Each trajectory's progress (index = trajectory) and, under the `trajectory` policy,
    its sandbox slot: when it bound one, and which trajectories run in a slot lent to them
    (holding none)."""

    next_action: np.ndarray  # j of its next action (its reward's is its turns)
    end: np.ndarray  # when it ended; NaN until then
    slot_from: np.ndarray  # under `trajectory`: when it bound its slot; NaN until then
    lent: set[int] = field(default_factory=set)

    @classmethod
    def starting(cls, trajectories: int) -> _Trajectories:
        """None has run an action."""
        return cls(next_action=np.zeros(trajectories, dtype=np.int64), end=np.full(trajectories, np.nan),
                   slot_from=np.full(trajectories, np.nan))

    def started_in_slot(self, t: int, scheduler: Scheduler, now: float) -> None:
        """An environment action of t started under `trajectory`: t holds its slot from the
        start that binds one (a start in a slot lent to it binds none)."""
        if math.isnan(self.slot_from[t]):
            if scheduler.trajectory_slot(t) is not None:
                self.slot_from[t] = now
            else:
                self.lent.add(t)

    def take_over_lent(self, scheduler: Scheduler, now: float) -> None:
        """A slot let go with a lent action in it is taken over by that action's
        trajectory, which holds it from now on."""
        for t in list(self.lent):
            if scheduler.trajectory_slot(t) is not None or not math.isnan(self.end[t]):
                self.lent.discard(t)
                if math.isnan(self.slot_from[t]) and math.isnan(self.end[t]):
                    self.slot_from[t] = now


# ------------------------------------------------------------------ the simulation


class StepSimulation:
    """One RL step of `workload` under `policy` (module docstring): the sampled `step`
    driven through a `tangram.Scheduler` in virtual time. `estimates`: what the core is told
    of run times; `bounds`: the step's (bounds.step_bounds), computed at the end when not
    given: they do not depend on the policy, so a comparison of policies on one step
    computes them once. `run` it once."""

    def __init__(self, workload: Workload, policy: str | Policy, step: Step, seed: int = 0,
                 estimates: str = "oracle", bounds: dict[str, Any] | None = None) -> None:
        mode, sigma = parse_estimates(estimates)
        self.workload, self.step, self.seed, self.estimates, self.bounds = workload, step, seed, estimates, bounds
        self.policy = make_policy(workload, policy) if isinstance(policy, str) else policy
        self.inventory = build_inventory(workload)
        self.scheduler = Scheduler(self.inventory, self.policy)
        self.kinds = self.scheduler.kinds
        self.kind_column = {kind: i for i, kind in enumerate(self.kinds)}
        self.cpu = self.kind_column["cpu"]  # the elastic kind's column
        self.slots = self.policy.name == "trajectory"  # trajectories hold sandbox slots
        reward = workload.reward
        self.gain = reward.gpu_batch_gain if reward is not None else math.inf
        self.contention = math.isfinite(self.gain)  # the GPU compute model is on
        self.reward_services = tuple(sv.name for sv in reward.services) if reward is not None else ()
        self.reward_demand = {"cpu": reward.cpu, "memory": reward.memory} if reward is not None else {}
        self.batch = workload.batch
        offsets = step.offsets
        self.n_env = int(offsets[-1])
        self.first_action = offsets.tolist()  # each trajectory's first environment action id
        self.actions_of = (step.turns + (1 if reward is not None else 0)).tolist()  # per trajectory
        self.log = _ActionLog.of_step(step, self.batch, self.n_env, reward is not None)
        total = len(self.log.label)
        self.truth = _Truth.of_step(step, self.log, self.n_env)
        self.holding = _Holding.empty(total, len(self.kinds))
        self.told = _Declarations(mode, sigma, seed, total)
        self.queue = _EventQueue(total)
        self.gpu = _GpuSharing(self.gain)
        self.trajectories = _Trajectories.starting(self.batch)
        # The work of the instant being handled: trajectories whose next action is
        # submitted now, trajectories that ended (for the core to hear of), rejections.
        self.submitting: list[int] = []
        self.ending: list[int] = []
        self.rejected_now: list[int] = []
        self.restores = self.evictions = 0
        self.service_log: list[tuple[float, int, int, int, int]] = []
        self.ran = False

    def run(self, check: bool = True) -> SimResult:
        """Runs the step until every trajectory has ended; `check`: the core then checks its
        invariants. Raises RuntimeError when the core stalls with actions left, and
        InvalidStateError when run a second time (its state is the step's end)."""
        if self.ran:
            raise InvalidStateError("StepSimulation.run", "a simulation runs once: make another to run again")
        self.ran = True
        for t in range(self.batch):
            self._queue_next(t, 0.0)
        now = 0.0
        self._handle(now, [], [])
        while True:
            due = self.queue.next_time()
            wake = self.scheduler.next_wakeup
            if wake is not None and now < wake < (math.inf if due is None else due):
                now = wake
                self._apply(self.scheduler.tick(now), now)
                self._handle(now, [], [])
            elif due is None:
                break
            else:
                now = due
                self._handle(now, *self.queue.pop_due(now))
        self._check_finished(now, check)
        return self._result()

    # ---------------------------------------------------------------- events

    def _handle(self, now: float, finished: list[int], submits: list[int]) -> None:
        """Events at `now`, in a fixed order: completions, then trajectories that ended,
        then submissions (and again while rejections or zero think times chain on)."""
        self.submitting += submits
        if finished:
            self._complete(finished, now)
        while self.ending or self.submitting:
            if self.ending:
                self._end_trajectories(now)
            if self.submitting:
                self._submit(now)

    def _complete(self, finished: list[int], now: float) -> None:
        """Actions that end at `now`: the core hears of them, their trajectories go on."""
        log, told, gpu = self.log, self.told, self.gpu
        for aid in finished:
            log.finish[aid] = now
            told.finished(aid, now)
            gpu.remove(aid)
        self._apply(self.scheduler.complete(finished, now), now)
        for aid in finished:
            self._advance(aid, now)

    def _end_trajectories(self, now: float) -> None:
        """Tells the core of the trajectories that ended at `now`."""
        ended, self.ending = self.ending, []
        self._apply(self.scheduler.end_trajectories(ended, now), now)
        self.trajectories.take_over_lent(self.scheduler, now)

    def _submit(self, now: float) -> None:
        """Submits the next action of each trajectory due to submit at `now`; one the core
        rejects (it can never run) ends at once, failed, and its trajectory goes on."""
        batch = [self._next_action(t, now) for t in self.submitting]
        self.submitting = []
        self._apply(self.scheduler.submit(batch, now), now)
        refused, self.rejected_now = self.rejected_now, []
        for aid in refused:
            self.log.rejected[aid] = True
            self.log.finish[aid] = now
            self._advance(aid, now)

    def _advance(self, aid: int, now: float) -> None:
        """Action `aid` ended at `now`: its trajectory moves on to its next action."""
        t = int(self.log.trajectory[aid])
        self.trajectories.next_action[t] += 1
        self._queue_next(t, now)

    def _queue_next(self, t: int, now: float) -> None:
        """Trajectory t's next action is submitted after its think time; with none left,
        t ends."""
        j = int(self.trajectories.next_action[t])
        if j >= self.actions_of[t]:
            self.trajectories.end[t] = now
            self.ending.append(t)
            return
        think = float(self.step.think[self.first_action[t] + t + j])
        if think > 0:
            self.queue.push(now + think, _SUBMIT, t)
        else:
            self.submitting.append(t)

    # ---------------------------------------------------------------- actions

    def _next_action(self, t: int, now: float) -> Action:
        """Trajectory t's next action, submitted at `now`: its truth recorded, its minimum
        demand held from here on."""
        j = int(self.trajectories.next_action[t])
        first = self.first_action[t]
        a = self._environment_action(t, first + j) if first + j < self.first_action[t + 1] else self._reward_action(t)
        self.log.submit[a.id] = now
        demand = self.holding.demand[a.id]
        for kind, amount in a.demand.items():
            demand[self.kind_column[kind]] = amount
        return a

    def _environment_action(self, t: int, aid: int) -> Action:
        """Environment action `aid` of trajectory t, on t's sandbox node (round robin)."""
        st = self.step
        k = self.workload.actions[int(st.kind[aid])]
        seconds = float(st.seconds[aid])
        parallel = k.parallel_fraction if k.elastic else None
        self.truth.record(aid, seconds, parallel, k.cpu, k.max_units)
        model = self.told.model(aid, k.name, KIND_LABELS[ENV], seconds, parallel, k.cpu)
        return Action(aid, {"cpu": k.cpu, "memory": k.memory}, model,
                      elastic="cpu" if k.elastic else None, max_units=k.max_units if k.elastic else None,
                      trajectory=t, affinity=t % self.workload.inventory.cpu_nodes,
                      quota=k.quota or None, tokens=int(st.tokens[aid]) if k.quota else 0)

    def _reward_action(self, t: int) -> Action:
        """Trajectory t's reward action, on its reward service."""
        aid = self.n_env + t
        service = self.reward_services[int(self.step.reward_service[t])]
        seconds = float(self.step.reward_seconds[t])
        self.truth.record(aid, seconds, None, 0.0, 0.0)
        model = self.told.model(aid, service, KIND_LABELS[REWARD], seconds, None, 0.0)
        return Action(aid, self.reward_demand, model, trajectory=t, service=service)

    # ---------------------------------------------------------------- decisions

    def _apply(self, made: Decisions, now: float) -> None:
        """Carries out the core's decisions at `now` (rejections are ended by `_submit`);
        then the rewards on each device whose count changed run on at their new pace."""
        for d in decisions(made.array):
            if d.kind == START:
                self._start(d, now)
            elif d.kind == RESIZE:
                self._resize(d.action, d.grant, now)
            elif d.kind == RESTORE or d.kind == EVICT:
                if d.kind == RESTORE:
                    self.restores += 1
                else:
                    self.evictions += 1
                self.service_log.append((now, d.kind, d.service, d.node, d.device))
            else:
                self.rejected_now.append(d.action)
        if self.gpu.changed:
            self._share_compute(now)

    def _start(self, d: Decision, now: float) -> None:
        """The core started action `d.action` at `d.grant` (a reward: on service copy
        `d.service`, on `d.device` of `d.node`): it runs its true time at that grant times
        its noise."""
        log, truth, aid = self.log, self.truth, d.action
        noise = float(truth.noise[aid])
        if truth.elastic[aid]:
            run = truth.runtime(aid, d.grant) * noise
            log.best[aid] = truth.runtime(aid, float(truth.max_units[aid])) * noise
            log.grant[aid] = d.grant
            self.holding.demand[aid, self.cpu] = d.grant
        else:
            run = truth.runtime(aid, 1.0) * noise
            log.best[aid] = run
            log.grant[aid] = self.holding.demand[aid, self.cpu]
        log.start[aid] = now
        log.run[aid] = run
        log.copy[aid] = d.service
        self.holding.since[aid] = now
        if self.slots and log.label[aid] == ENV:
            self.trajectories.started_in_slot(int(log.trajectory[aid]), self.scheduler, now)
        self.told.started(aid, d.grant, now)
        if self.contention and log.label[aid] == REWARD:
            self.gpu.add(aid, (d.node, d.device))  # timed by _share_compute, once every start is in
        else:
            self.queue.push(now + run, _FINISH, aid)

    def _resize(self, aid: int, grant: float, now: float) -> None:
        """Running action `aid` runs the work it has left at `grant`."""
        self._bank(aid, now)
        self.told.resized(aid, grant, now)
        self.holding.demand[aid, self.cpu] = grant
        self._retime(aid, now)

    def _share_compute(self, now: float) -> None:
        """Every reward running on a device whose count changed at `now` runs on at its new
        share of the device's compute."""
        pace, live = self.holding.pace, self.queue.live_finish
        for device_pace, running in self.gpu.repaced():
            for aid in running:
                if live[aid] >= 0 and pace[aid] == device_pace:
                    continue  # timed, and its pace is the same
                self._bank(aid, now)
                pace[aid] = device_pace
                self._retime(aid, now)

    def _bank(self, aid: int, now: float) -> None:
        """Before a running action's grant or pace changes: the share of its work done since
        it was last timed (at the grant and pace it had) comes off its work left."""
        h, truth = self.holding, self.truth
        grant = float(h.demand[aid, self.cpu])
        before = truth.runtime(aid, grant) * truth.noise[aid] * h.pace[aid]
        left = h.work_left[aid] - (now - h.since[aid]) / before if before > 0 else 0.0
        h.work_left[aid] = max(left, 0.0)
        h.held_before[aid] += h.demand[aid] * (now - h.since[aid])
        h.since[aid] = now
        h.moved[aid] = True

    def _retime(self, aid: int, now: float) -> None:
        """After _bank and the change: its completion moves to when its work left ends at
        its grant and pace now."""
        h, truth = self.holding, self.truth
        grant = float(h.demand[aid, self.cpu])
        end = now + h.work_left[aid] * truth.runtime(aid, grant) * truth.noise[aid] * h.pace[aid]
        self.log.run[aid] = end - self.log.start[aid]
        self.queue.push(end, _FINISH, aid)

    # ---------------------------------------------------------------- the end

    def _check_finished(self, now: float, check: bool) -> None:
        """Raises RuntimeError when the core still holds actions at the end (it stalled);
        with `check`, has the core check its invariants."""
        sched, log = self.scheduler, self.log
        if sched.waiting or sched.running:
            stuck = np.flatnonzero(np.isnan(log.finish) & ~np.isnan(log.submit))[:3]
            why = "; ".join(f"{i}: {sched.explain(int(i))}" for i in stuck)
            raise RuntimeError(f"simulation stalled at t={now:g} with {sched.waiting} waiting, "
                               f"{sched.running} running ({why})")
        if check:
            sched.check_invariants()

    def _cpu_held(self, held: np.ndarray, ok: np.ndarray) -> float:
        """The CPU core-seconds the policy holds: what it granted or, under `trajectory`,
        each trajectory's whole slot from the start that binds it until it ends, plus its
        reward's grant (a lent slot is its holder's)."""
        if not self.slots:
            return float(held[self.cpu])
        log, trajectories = self.log, self.trajectories
        bound = ~np.isnan(trajectories.slot_from)
        rewards = ok & (log.label == REWARD)
        reward_cpu = float((self.holding.demand[rewards, self.cpu] * log.run[rewards]).sum())
        held_slots = trajectories.end[bound] - trajectories.slot_from[bound]
        return float((self.policy.trajectory_slot_cpu * held_slots).sum()) + reward_cpu

    def _result(self) -> SimResult:
        """The step's outcome."""
        w, log = self.workload, self.log
        step_duration = float(np.nanmax(self.trajectories.end)) if self.batch else 0.0
        ok = ~log.rejected
        held = self.holding.held_seconds(ok, log.finish, log.run)
        capacity = np.zeros(len(self.kinds))
        for node in self.inventory.nodes:
            for k, kind in enumerate(self.kinds):
                capacity[k] += node.resources.get(kind, 0.0)
        span = step_duration if step_duration > 0 else 1.0
        return SimResult(
            workload=w.name, policy=self.policy.name, seed=self.seed, load=self.batch, step_duration=step_duration,
            utilisation={kind: float(held[k] / (capacity[k] * span)) if capacity[k] > 0 else 0.0
                         for k, kind in enumerate(self.kinds)},
            resource_seconds={kind: float(held[k]) for k, kind in enumerate(self.kinds)},
            cpu_held_seconds=self._cpu_held(held, ok), restores=self.restores, evictions=self.evictions,
            kind_names=tuple(k.name for k in w.actions), service_log=self.service_log, scheduler=self.scheduler,
            cores=w.value("cores"), gpus=w.value("gpus"), estimates=self.estimates,
            bound=dict(self.bounds) if self.bounds is not None else step_bounds(w, self.step),
            gpu_batch_gain=self.gain, restore_scale=w.reward.restore_scale if w.reward is not None else 1.0,
            **vars(log))


def simulate(workload: Workload, policy: str | Policy, seed: int = 0,
             step: Step | None = None, check: bool = True, estimates: str = "oracle") -> SimResult:
    """Simulates one RL step of `workload` under `policy`. Deterministic for a seed.
    `step`: the sampled step (default: `workload.sample(seed)`); `estimates`: what the
    core is told of run times (see the module docstring). Computes the step's bounds: to
    run several policies on one step, compute them once and pass them to StepSimulation."""
    st = step if step is not None else workload.sample(seed)
    return StepSimulation(workload, policy, st, seed, estimates).run(check)
