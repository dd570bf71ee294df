"""A thread-safe synchronous facade over the asyncio orchestrator.

The orchestrator runs on its own event loop in a background thread; every method here
hops onto that loop, so any number of threads (a rollout server's workers) can share one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Iterable

from .call import Call
from .orchestrator import Orchestrator


class SyncHandle:
    """A submitted action, seen from another thread."""

    def __init__(self, action_id: int, future: concurrent.futures.Future[Any], owner: "LoopThread") -> None:
        self.id = action_id
        self.future = future
        self._owner = owner

    def result(self, timeout: float | None = None) -> Any:
        """Blocks until the action ends; returns its result or raises its typed error."""
        return self.future.result(timeout)

    def cancel(self) -> bool:
        return self._owner.cancel(self.id)


class LoopThread:
    """The thread-safe half of a synchronous facade: an asyncio object (the orchestrator,
    or a server's client) lives on an event loop in a background thread, and every call
    hops onto that loop. Subclasses make their object, pass it here, and add `submit`.

    `loop` is that event loop: `asyncio.run_coroutine_threadsafe(coro, facade.loop)` runs
    a coroutine of the object's async API from any thread."""

    def __init__(self, name: str, target: Any) -> None:
        """Starts the loop's thread (named `name`), then `await target.start()` on it."""
        self._target = target
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        try:
            self._call(target.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def submit(self, call: Call) -> SyncHandle:
        raise NotImplementedError

    def run(self, call: Call, timeout: float | None = None) -> Any:
        """Runs one action and returns its result (raises its typed error)."""
        return self.submit(call).result(timeout)

    def map(self, calls: Iterable[Call]) -> list[Any]:
        """Runs many actions in one batch; results (or error objects) in order."""
        return self._call(self._target.map(list(calls)))

    def cancel(self, action_id: int) -> bool:
        async def cancel() -> bool:
            return self._target.cancel(action_id)

        return self._call(cancel())

    def end_trajectory(self, trajectory: int) -> None:
        self._call(self._target.end_trajectory(trajectory))

    def explain(self, action_id: int) -> str:
        """Why a live action waits (or where it runs)."""
        return self._call(self._target.explain(action_id))

    def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """kind -> (waiting, running)."""
        return self._call(self._target.queue_lengths())

    def utilisation(self) -> dict[tuple[str, str], float]:
        """(node, resource) -> share of its capacity held by running actions."""
        return self._call(self._target.utilisation())

    def status(self) -> dict[str, Any]:
        """A snapshot for a live view (tangram.runtime.status documents it)."""
        return self._call(self._target.status())

    def quota(self, name: str, tokens: int = 0, trajectory: int = 0, kind: str = "hold") -> "SyncQuotaHold":
        """A hold of the API quota `name` for work this thread runs itself: `with
        facade.quota("e2b-create"):` blocks until the quota admits it and gives the slot back
        on leaving; `Throttled` raised inside pauses the quota for every caller
        (tangram.runtime.holds)."""
        return SyncQuotaHold(self, name, tokens, trajectory, kind)

    def back_off_quota(self, name: str, seconds: float | None = None) -> float:
        """Pauses quota `name` for every caller (the API answered "too many requests")."""
        return self._call(self._target.back_off_quota(name, seconds))

    @property
    def records(self) -> Any:
        """The records of finished actions (a RecordLog; iterating it from any thread is
        safe: it copies the log in one step)."""
        return self._target.records

    def close(self, drain: bool = False) -> None:
        if self.loop.is_closed():
            return
        try:
            self._call(self._target.close(drain))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncQuotaHold:
    """The blocking form of a quota hold (LoopThread.quota): the hold lives on the facade's
    loop; entering blocks this thread until it is admitted."""

    def __init__(self, owner: LoopThread, name: str, tokens: int, trajectory: int, kind: str) -> None:
        self._owner = owner
        self._args = (name, tokens, trajectory, kind)
        self._hold: Any = None

    def __enter__(self) -> "SyncQuotaHold":
        async def enter() -> Any:
            hold = self._owner._target.quota(*self._args)
            return await hold.__aenter__()

        future = asyncio.run_coroutine_threadsafe(enter(), self._owner.loop)
        try:
            self._hold = future.result()
        except BaseException:  # interrupted while waiting (KeyboardInterrupt): withdraw it
            future.cancel()  # cancels the wait on the loop, which withdraws the hold there
            if future.done() and not future.cancelled() and future.exception() is None:
                self._owner._call(future.result().__aexit__(None, None, None))  # admitted meanwhile
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._owner._call(self._hold.__aexit__(exc_type, exc, tb))


def copy_outcome(source: asyncio.Future[Any], target: concurrent.futures.Future[Any]) -> None:
    """Hands an event-loop future's outcome to a thread's future (used as a done callback)."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


class SyncOrchestrator(LoopThread):
    """`SyncOrchestrator(...)` takes the Orchestrator's arguments and starts at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.orchestrator = Orchestrator(*args, **kwargs)
        super().__init__("tangram-orchestrator", self.orchestrator)

    def submit(self, call: Call) -> SyncHandle:
        """Queues the action; a bad call raises here, with the field named."""
        action_id = self.orchestrator.reserve_id()
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        ready = concurrent.futures.Future()  # type: ignore[var-annotated]

        def on_loop() -> None:
            try:
                handle = self.orchestrator.submit(call, action_id)
            except BaseException as e:
                ready.set_exception(e)
                return
            ready.set_result(None)
            handle.future.add_done_callback(lambda f: copy_outcome(f, out))

        self.loop.call_soon_threadsafe(on_loop)
        ready.result()
        return SyncHandle(action_id, out, self)
