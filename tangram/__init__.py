"""tangram: action-level orchestration of CPUs, GPUs and API quotas for agentic RL."""

from ._errors import (
    DuplicateIdError,
    InvalidStateError,
    TangramError,
    UnknownActionError,
    UnknownNameError,
    ValidationError,
)
from ._model import (
    Action,
    Amdahl,
    Constant,
    Gpu,
    Inventory,
    Native,
    Node,
    Quota,
    Service,
    Table,
    cost_model,
)
from ._records import DECISION_DTYPE, action_dtype
from .scheduler import POLICIES, Decision, Decisions, Policy, Scheduler

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Amdahl",
    "Constant",
    "DECISION_DTYPE",
    "Decision",
    "Decisions",
    "DuplicateIdError",
    "Gpu",
    "InvalidStateError",
    "Inventory",
    "Native",
    "Node",
    "POLICIES",
    "Policy",
    "Quota",
    "Scheduler",
    "Service",
    "Table",
    "TangramError",
    "UnknownActionError",
    "UnknownNameError",
    "ValidationError",
    "action_dtype",
    "cost_model",
]
