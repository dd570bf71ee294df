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
    OrchestratorClosed,
    ResourceLimitExceeded,
    ResourceManager,
    RuntimeConfig,
    SyncOrchestrator,
    register_manager,
)
from .runtime.interface import OrchestratorAPI

# Imported on first use, so that `import tangram` does not load the server's client
# (and cloudpickle) or the GPU manager for programs that use neither.
_LAZY = {
    "AuthenticationError": "server.protocol",
    "Client": "server.client",
    "ConnectionLost": "server.protocol",
    "FrameTooLarge": "server.protocol",
    "ProtocolError": "server.protocol",
    "RemoteError": "server.protocol",
    "ServiceHooks": "runtime.gpu",
    "SyncClient": "server.client",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tangram' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "Action",
    "ActionCancelled",
    "ActionCrashed",
    "ActionError",
    "ActionFailed",
    "ActionInfeasible",
    "ActionRecord",
    "ActionTimeout",
    "AuthenticationError",
    "Call",
    "Client",
    "CommandResult",
    "ConnectionLost",
    "FrameTooLarge",
    "ManagerError",
    "MockManager",
    "Orchestrator",
    "OrchestratorAPI",
    "OrchestratorClosed",
    "ProtocolError",
    "RemoteError",
    "ResourceLimitExceeded",
    "ResourceManager",
    "RuntimeConfig",
    "ServiceHooks",
    "SyncClient",
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
