"""Typed errors. Each names the offending field and says what is wrong with it."""

from __future__ import annotations


class TangramError(Exception):
    """Base of every error tangram raises on purpose."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ValidationError(TangramError, ValueError):
    """A value is out of range, not finite, or inconsistent with another."""


class UnknownNameError(ValidationError):
    """A kind, node, service, quota, table or task pool that does not exist."""


class DuplicateIdError(ValidationError):
    """An action id that is already live (or twice in one batch)."""


class UnknownActionError(TangramError, LookupError):
    """An action id that is not live: never submitted, or already ended."""


class InvalidStateError(TangramError, RuntimeError):
    """The action (or trajectory) exists but the event does not apply to its state."""


__all__ = [
    "TangramError",
    "ValidationError",
    "UnknownNameError",
    "DuplicateIdError",
    "UnknownActionError",
    "InvalidStateError",
]
