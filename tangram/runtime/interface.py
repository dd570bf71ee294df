"""`tangram.OrchestratorAPI`: what every front of the orchestrator offers.

    async def rollout(orch: tangram.OrchestratorAPI) -> None:
        ...

works unchanged with `tangram.Orchestrator()` (in process), `tangram.Client(address)`
(one `tangram serve` for many processes) and `tangram.ray.RayOrchestrator()`. What needs
the scheduler's state (`explain`, `queue_lengths`, `utilisation`) is a coroutine on every
front, since a client cannot answer without a round trip; `records` is a local container
on every front (a client's holds its own actions, sent with their results).
tests/runtime/test_api_protocol.py checks both classes against this, member by member.
"""

from __future__ import annotations

from typing import Any, Generator, Iterable, Protocol, runtime_checkable

from .call import Call
from .records import RecordLog


@runtime_checkable
class ActionHandleAPI(Protocol):
    """A submitted action: `id` is known at submit (the id in its record and in its typed
    error's `action_id`); awaiting it gives its result or raises its typed error."""

    id: int

    def cancel(self) -> bool:
        """Cancels the action; False when it had already ended."""
        ...

    def __await__(self) -> Generator[Any, None, Any]: ...


@runtime_checkable
class OrchestratorAPI(Protocol):
    """The orchestrator's API, as `Orchestrator` and `Client` both implement it."""

    records: RecordLog

    async def start(self) -> Any:
        """Starts (or connects); returns self."""
        ...

    async def close(self, drain: bool = False) -> None:
        """Ends every live action (with `drain`, after they finish); idempotent."""
        ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: object) -> None: ...

    def submit(self, call: Call, action_id: int | None = None) -> ActionHandleAPI:
        """Queues one action and returns its handle at once."""
        ...

    def reserve_id(self) -> int:
        """An id for a later `submit(call, action_id)`, unique to this front."""
        ...

    async def run(self, call: Call) -> Any:
        """Submits `call` and awaits its result or typed error."""
        ...

    async def map(self, calls: Iterable[Call]) -> list[Any]:
        """Runs many calls in one batch; results (errors in place) in order."""
        ...

    def cancel(self, action_id: int) -> bool:
        """Cancels a live action; False if it is not live."""
        ...

    async def end_trajectory(self, trajectory: int) -> None:
        """Releases the trajectory's slot and sandbox."""
        ...

    async def explain(self, action_id: int) -> str:
        """Why a live action waits, or where it runs."""
        ...

    async def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """Kind -> (waiting, running)."""
        ...

    async def utilisation(self) -> dict[tuple[str, str], float]:
        """(node, resource) -> share of its capacity held by running actions."""
        ...

    async def status(self) -> dict[str, Any]:
        """A snapshot for a live view (`tangram top`; tangram.runtime.status documents it)."""
        ...

    def quota(self, name: str, tokens: int = 0, trajectory: int = 0, kind: str = "hold") -> Any:
        """A hold of API quota `name` for work the caller runs itself: `async with
        orch.quota(name):` waits for the quota's admission and gives the slot back on leaving
        (tangram.runtime.holds)."""
        ...

    async def back_off_quota(self, name: str, seconds: float | None = None) -> float:
        """Pauses quota `name` for every caller (its API answered "too many requests"):
        `seconds`, or the next step of its exponential backoff. Returns the pause."""
        ...
