"""tangram: action-level orchestration of CPUs, GPUs and API quotas for agentic RL."""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it from here)

from typing import TYPE_CHECKING

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
from ._lazy import lazy_names

# Every public name but the errors is imported on first use of it, so that `import tangram`
# loads the compiled core alone: no NumPy, no asyncio, no cloudpickle, nothing a process
# pays for that needs one light corner (a sandbox's `tangram.worker`) or only schedules.
# Where each name lives (relative to this package); tests/test_layering.py checks the
# TYPE_CHECKING imports below against it.
_LAZY = {
    "Action": "_model",
    "Amdahl": "_model",
    "Constant": "_model",
    "Gpu": "_model",
    "Inventory": "_model",
    "Native": "_model",
    "Node": "_model",
    "Quota": "_model",
    "Service": "_model",
    "Table": "_model",
    "cost_model": "_model",
    "DECISION_DTYPE": "_records",
    "action_dtype": "_records",
    "POLICIES": "scheduler",
    "Decision": "scheduler",
    "Decisions": "scheduler",
    "Policy": "scheduler",
    "Scheduler": "scheduler",
    "ActionCancelled": "runtime.errors",
    "ActionCrashed": "runtime.errors",
    "ActionError": "runtime.errors",
    "ActionFailed": "runtime.errors",
    "ActionInfeasible": "runtime.errors",
    "ActionTimeout": "runtime.errors",
    "ManagerError": "runtime.errors",
    "ResourceLimitExceeded": "runtime.errors",
    "Throttled": "runtime.holds",
    "ActionRecord": "runtime.records",
    "Call": "runtime.call",
    "CommandResult": "runtime.call",
    "MockManager": "runtime.managers.base",
    "ResourceManager": "runtime.managers.base",
    "register_manager": "runtime.managers.base",
    "Orchestrator": "runtime.orchestrator",
    "OrchestratorClosed": "runtime.errors",
    "OrchestratorAPI": "runtime.interface",
    "RuntimeConfig": "runtime.config",
    "SyncOrchestrator": "runtime.sync",
    "ServiceHooks": "runtime.managers.hooks",
    "AuthenticationError": "server.protocol",
    "ConnectionLost": "server.protocol",
    "FrameTooLarge": "server.protocol",
    "ProtocolError": "server.protocol",
    "RemoteError": "server.protocol",
    "ServerUnreachable": "server.protocol",
    "Client": "server.client",
    "SyncClient": "server.client",
}

if TYPE_CHECKING:  # what type checkers see of the names above; never executed
    from ._model import Action, Amdahl, Constant, Gpu, Inventory, Native, Node, Quota, Service, Table, cost_model
    from ._records import DECISION_DTYPE, action_dtype
    from .scheduler import POLICIES, Decision, Decisions, Policy, Scheduler
    from .runtime.call import Call, CommandResult
    from .runtime.config import RuntimeConfig
    from .runtime.errors import (
        ActionCancelled,
        ActionCrashed,
        ActionError,
        ActionFailed,
        ActionInfeasible,
        ActionTimeout,
        ManagerError,
        OrchestratorClosed,
        ResourceLimitExceeded,
    )
    from .runtime.managers.hooks import ServiceHooks
    from .runtime.holds import Throttled
    from .runtime.interface import OrchestratorAPI
    from .runtime.managers.base import MockManager, ResourceManager, register_manager
    from .runtime.orchestrator import Orchestrator
    from .runtime.records import ActionRecord
    from .runtime.sync import SyncOrchestrator
    from .server.client import Client, SyncClient
    from .server.protocol import (AuthenticationError, ConnectionLost, FrameTooLarge, ProtocolError, RemoteError,
                                  ServerUnreachable)
del TYPE_CHECKING


__getattr__ = lazy_names(__name__, _LAZY, globals())


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
    "ServerUnreachable",
    "ServiceHooks",
    "SyncClient",
    "SyncOrchestrator",
    "Throttled",
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
