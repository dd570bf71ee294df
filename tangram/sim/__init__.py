"""The simulator: one RL rollout step of a workload, in virtual time, driving the scheduler
core through the same events a live runtime sends, under each policy."""

from .cli import cli_main
from .engine import POLICY_NAMES, build_inventory, make_policy, simulate, trajectory_slot_cpu
from .experiments import Progress, act_timeline, run_many, savings_search, smallest_meeting
from .result import SimResult
from .workloads import DEFAULT_GPU_BATCH_GAIN, Dist, QuotaSpec, RewardService, Step, Workload, builtin, builtin_names

__all__ = [
    "DEFAULT_GPU_BATCH_GAIN",
    "Dist",
    "POLICY_NAMES",
    "Progress",
    "QuotaSpec",
    "RewardService",
    "SimResult",
    "act_timeline",
    "Step",
    "Workload",
    "build_inventory",
    "builtin",
    "builtin_names",
    "cli_main",
    "make_policy",
    "run_many",
    "savings_search",
    "simulate",
    "smallest_meeting",
    "trajectory_slot_cpu",
]
