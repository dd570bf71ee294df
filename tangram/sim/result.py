"""What one simulated step gives (tangram.sim.engine): each action's times and grants,
the step's totals, and its bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._records import RESTORE
from ..scheduler import Scheduler

ENV, REWARD = 0, 1  # an action's label: an environment action, or its trajectory's reward
KIND_LABELS = ("env", "reward")


@dataclass
class SimResult:
    """One simulated step: per action (index = action id) its times, grant and fate, and
    the step's totals; `row` sums it up as `tangram sim` reports it."""

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
    bound: dict[str, Any] = field(default_factory=dict)  # bounds.step_bounds()
    cores: int = 0  # cores per CPU (sandbox) node of the inventory it ran on
    gpus: int = 0  # GPUs per GPU node (the built-ins have one GPU node: the total)
    estimates: str = "oracle"  # what the core was told of run times (see the module docstring)
    gpu_batch_gain: float = math.inf  # S of the GPU compute model it ran under; inf: no contention
    restore_scale: float = 1.0  # the factor on the reward services' restore times (Workload.with_restore_scale)

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
            "restore_scale": self.restore_scale,
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
