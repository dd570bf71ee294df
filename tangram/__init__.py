"""tangram: action-level orchestration of CPUs, GPUs and API quotas for agentic RL."""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it from here)

from ._compiled import import_core as _import_core

_import_core(__path__, __version__)  # before anything below imports tangram._core
del _import_core

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
from .server import Client
from .runtime import (
    ActionCancelled,
    ActionCrashed,
    ActionError,
    ActionFailed,
    ActionInfeasible,
    ActionRecord,
    ActionTimeout,
    Call,
    CommandResult,
    ManagerError,
    MockManager,
    Orchestrator,
    ResourceLimitExceeded,
    ResourceManager,
    RuntimeConfig,
    SyncOrchestrator,
    register_manager,
)

__all__ = [
    "Action",
    "ActionCancelled",
    "ActionCrashed",
    "ActionError",
    "ActionFailed",
    "ActionInfeasible",
    "ActionRecord",
    "ActionTimeout",
    "Call",
    "Client",
    "CommandResult",
    "ManagerError",
    "MockManager",
    "Orchestrator",
    "ResourceLimitExceeded",
    "ResourceManager",
    "RuntimeConfig",
    "SyncOrchestrator",
    "register_manager",
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
