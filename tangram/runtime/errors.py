"""Terminal errors of live actions. Every action awaited through the orchestrator ends in
exactly one terminal state: its result, or one of these."""

from __future__ import annotations

from .._errors import TangramError


class OrchestratorClosed(TangramError, RuntimeError):
    """The orchestrator is not running (not started yet, or closed)."""


class ActionError(TangramError):
    """An action did not produce a result. `action_id` is the orchestrator's id."""

    def __init__(self, action_id: int, reason: str) -> None:
        super().__init__(f"action {action_id}", reason)
        self.action_id = action_id


class ActionTimeout(ActionError):
    """The action ran past its timeout; its whole process group was killed."""


class ActionCrashed(ActionError):
    """The process running the action died: `exit_code` when it exited, `signal` when a
    signal (not sent by tangram for a timeout or a cancel) killed it."""

    def __init__(self, action_id: int, reason: str, exit_code: int | None = None, signal: int | None = None) -> None:
        super().__init__(action_id, reason)
        self.exit_code = exit_code
        self.signal = signal


class ActionFailed(ActionError):
    """The action's function raised. `error_type` and `remote_traceback` describe it (the
    exception object itself may not survive the trip back from a sandbox)."""

    def __init__(self, action_id: int, reason: str, error_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(action_id, reason)
        self.error_type = error_type
        self.remote_traceback = remote_traceback


class ActionInfeasible(ActionError):
    """The scheduler core rejected the action: it can never run on this inventory."""


class ActionCancelled(ActionError):
    """The caller cancelled the action (waiting or running), or the orchestrator closed."""


class ResourceLimitExceeded(ActionError):
    """The action exceeded a per-action limit other than time: `limit` is "memory" or
    "output"."""

    def __init__(self, action_id: int, reason: str, limit: str) -> None:
        super().__init__(action_id, reason)
        self.limit = limit


class ManagerError(TangramError):
    """A resource manager is misconfigured or unknown (field names the setting)."""


__all__ = [
    "ActionError",
    "ActionTimeout",
    "ActionCrashed",
    "ActionFailed",
    "ActionInfeasible",
    "ActionCancelled",
    "ResourceLimitExceeded",
    "ManagerError",
]


def outcome_of(error: ActionError) -> str:
    """The outcome an action's record gives for this error."""
    if isinstance(error, ActionCrashed):
        return "crashed"
    if isinstance(error, ResourceLimitExceeded):
        return "limit"
    if isinstance(error, ActionTimeout):
        return "timeout"
    if isinstance(error, ActionCancelled):
        return "cancelled"
    if isinstance(error, ActionInfeasible):
        return "infeasible"
    return "failed"
