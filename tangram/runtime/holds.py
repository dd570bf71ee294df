"""Quota holds: tangram's admission for work it does not run.

A rollout that calls a rate-limited API or a hosted sandbox provider (E2B, Daytona, Modal)
itself still takes its turn from a tangram quota, so that one limit holds across every
caller of the orchestrator (and, through `tangram serve`, every rollout worker):

    async with orch.quota("e2b-create") as hold:
        sandbox = await e2b.AsyncSandbox.create()

Entering waits until the core admits the hold as it admits any request of the quota (its
rate and burst, its concurrency cap, its token budget); the body is the request; leaving
gives the concurrency slot back. A hold is an action of the quota like any other (manager
"api", kind "hold" unless named): it is queued, recorded and shown by `tangram top`, and
its ACT is its wait plus the body's time.

When the provider answers "too many requests", raise `Throttled(retry_after)` in the body
(or call `hold.back_off(seconds)`): the whole quota admits nothing new for that long, for
every caller at once (Scheduler.back_off_quota), and the error propagates, so the caller
retries by entering again. Without a `retry_after` the pause doubles with each throttle in
a row (from `BACKOFF_FIRST` up to `BACKOFF_MAX` seconds) and resets when a hold of the
quota ends without one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .._errors import TangramError, UnknownNameError, ValidationError
from .call import Call

if TYPE_CHECKING:
    from .live import ActionHandle
    from .orchestrator import Orchestrator

BACKOFF_FIRST = 1.0  # seconds: a throttle without retry_after, the first in a row
BACKOFF_MAX = 60.0  # seconds: the longest pause a run of throttles reaches
MAX_RETRY_AFTER = 86_400.0  # a day: a longer Retry-After is a provider's mistake


class Throttled(TangramError):
    """The provider behind a quota answered "too many requests" (HTTP 429). Raised in the
    body of a quota hold, it pauses the quota for `retry_after` seconds (None: the hold's
    exponential backoff) for every caller, then propagates."""

    def __init__(self, retry_after: float | None = None, reason: str = "the provider answered too many requests") -> None:
        super().__init__("retry_after", reason)
        # Checked here, where the caller can see it: a Retry-After header's text, say, must
        # be converted (float(...)) first.
        self.retry_after = None if retry_after is None else check_backoff_seconds(retry_after, "retry_after")


def check_backoff_seconds(seconds: Any, field: str = "seconds") -> float:
    # (a comparison, not math.isfinite: NaN fails it too, and an int of any size compares)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_RETRY_AFTER:
        raise ValidationError(field, f"must be a number of seconds in [0, {MAX_RETRY_AFTER:g}], got {seconds!r}")
    return float(seconds)


class Backoffs:
    """Per quota: the pause a throttle without retry_after asks for (doubling in a row),
    and when its latest pause ends (times on the orchestrator's clock)."""

    def __init__(self) -> None:
        self._streak: dict[str, int] = {}
        self._paused_until: dict[str, float] = {}

    def next(self, quota: str) -> float:
        streak = self._streak.get(quota, 0)
        self._streak[quota] = streak + 1
        return min(BACKOFF_FIRST * 2.0 ** streak, BACKOFF_MAX)

    def clear(self, quota: str) -> None:
        self._streak.pop(quota, None)

    def pause(self, quota: str, seconds: float | None, now: float) -> tuple[float, float | None]:
        """A throttle of `quota` at `now`, asking for `seconds` (None: the next step):
        (the pause, when it ends), or (what is left of it, None) when the quota is paused
        already and `seconds` is None: the throttles of requests sent before the pause
        answer for the same burst, not a new one, so the backoff does not step up for each."""
        paused_until = self._paused_until.get(quota, 0.0)
        if seconds is None and paused_until > now:
            return paused_until - now, None
        pause = self.next(quota) if seconds is None else check_backoff_seconds(seconds, "retry_after")
        until = now + pause
        self._paused_until[quota] = max(paused_until, until)
        return pause, until

    def paused_for(self, quota: str, now: float) -> float:
        """The seconds left of the quota's latest pause (0: none)."""
        return max(0.0, self._paused_until.get(quota, 0.0) - now)


class QuotaHold:
    """One hold of a quota (see the module docstring); made by Orchestrator.quota()."""

    def __init__(self, orch: "Orchestrator", quota: str, tokens: int = 0, trajectory: int = 0,
                 kind: str = "hold") -> None:
        if not isinstance(quota, str) or quota not in {q.name for q in orch.inventory.quotas}:
            raise UnknownNameError("quota", f"no quota named {quota!r} (have: "
                                   f"{', '.join(q.name for q in orch.inventory.quotas) or 'none'})")
        self.orch = orch
        self.quota = quota
        self.call = Call(fn=self._held, quota=quota, tokens=tokens, trajectory=trajectory, kind=kind,
                         resources={}, manager="api", key=f"hold:{quota}")
        self.id: int | None = None  # the hold's action id, once entered
        self._admitted: asyncio.Future[None] | None = None
        self._released: asyncio.Future[None] | None = None
        self._future: asyncio.Future[Any] | None = None

    async def _held(self) -> None:
        """The hold's action as the API manager runs it: admitted, then held until released."""
        assert self._admitted is not None and self._released is not None
        if not self._admitted.done():
            self._admitted.set_result(None)
        await self._released

    def submit(self, action_id: int | None = None) -> ActionHandle:
        """Queues the hold's action (once); `admitted()` waits for its admission."""
        if self._future is not None:
            raise ValidationError("hold", f"this hold of {self.quota!r} was entered already")
        loop = asyncio.get_running_loop()
        self._admitted, self._released = loop.create_future(), loop.create_future()
        handle = self.orch.submit(self.call, action_id)
        self.id, self._future = handle.id, handle.future
        return handle

    async def admitted(self) -> None:
        """Waits until the core admits the submitted hold. Cancelling the waiting task
        withdraws it; an error of the action (the orchestrator closing, a cancel) is raised."""
        assert self._admitted is not None and self._future is not None and self.id is not None
        try:
            await asyncio.wait({self._admitted, self._future}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.orch.cancel(self.id)
            self._future.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen: no warning
            raise
        if not self._admitted.done():
            self._future.result()  # raises the action's error
            raise ValidationError("quota", f"the hold of {self.quota!r} ended before it was admitted")

    async def acquire(self) -> "QuotaHold":
        """submit() and admitted(): returns once the hold has its slot."""
        self.submit()
        await self.admitted()
        return self

    def leave(self, throttled: bool, retry_after: float | None = None) -> None:
        """How the body ended: throttled (pause the quota: `retry_after` seconds, or the next
        backoff step) or not (the quota's backoff streak ends); then the slot goes back,
        whatever the backoff said."""
        try:
            if throttled:
                self.back_off(retry_after)
            else:
                self.orch.quota_backoffs.clear(self.quota)
        finally:
            self.release()

    @property
    def is_admitted(self) -> bool:
        """Whether the core has admitted it (its body may run)."""
        return self._admitted is not None and self._admitted.done()

    def back_off(self, seconds: float | None = None) -> float:
        """Pauses the quota for every caller: `seconds`, or the next exponential step.
        Returns the pause."""
        return self.orch.back_off_quota_now(self.quota, seconds)

    def release(self) -> None:
        """Gives the slot back (idempotent); the action ends as soon as the loop runs."""
        if self._released is not None and not self._released.done():
            self._released.set_result(None)

    async def release_and_wait(self) -> None:
        """Gives the slot back and waits until the core has it: the hold's action has ended."""
        self.release()
        if self._future is not None:
            await asyncio.gather(self._future, return_exceptions=True)

    async def __aenter__(self) -> "QuotaHold":
        return await self.acquire()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.leave(isinstance(exc, Throttled), exc.retry_after if isinstance(exc, Throttled) else None)
        except TangramError:  # the backoff failed (the orchestrator closed): the slot went back anyway
            if exc is None:
                raise  # else the body's own error is the one to see
        finally:
            await self.release_and_wait()
