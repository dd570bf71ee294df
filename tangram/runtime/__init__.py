"""The live runtime: the orchestrator and its resource managers (CPU sandboxes, GPU
services, API quotas) carrying the core's decisions out on real resources."""

from .call import Call, CommandResult, Placement
from .config import RuntimeConfig
from .errors import (
    ActionCancelled,
    ActionCrashed,
    ActionError,
    ActionFailed,
    ActionInfeasible,
    ActionTimeout,
    ManagerError,
    ResourceLimitExceeded,
)
from .manager import LiveAction, MockManager, ResourceManager, manager_class, register_manager
from .orchestrator import ActionHandle, Orchestrator, OrchestratorClosed
from .records import ActionRecord
from .sync import SyncHandle, SyncOrchestrator

__all__ = [
    "ActionCancelled", "ActionCrashed", "ActionError", "ActionFailed", "ActionHandle", "ActionInfeasible",
    "ActionRecord", "ActionTimeout", "Call", "CommandResult", "LiveAction", "ManagerError", "MockManager",
    "Orchestrator", "OrchestratorClosed", "Placement", "ResourceLimitExceeded", "ResourceManager",
    "RuntimeConfig", "SyncHandle", "SyncOrchestrator", "manager_class", "register_manager",
]
