"""Inside an action: its live CPU grant, and a process pool that follows it.

The CPU manager may change a running action's grant (the core grows it when cores free up
and shrinks it toward its minimum when waiting actions gain more). A command's `make`,
`ninja` or `cargo` follows through the jobserver in MAKEFLAGS without any code; Python code
asks here:

    from tangram.worker import grant, GrantedExecutor

    grant()        # the grant now, in cores (1.25); TANGRAM_GRANT is the grant at the start
    with GrantedExecutor() as pool:          # runs at most ceil(grant()) tasks at once
        results = list(pool.map(check, cases))
    shared_executor().map(check, cases)      # one per sandbox, kept for the trajectory's
                                             # later actions (no process start per action)

`jobserver_fds()` hands the jobserver to a subprocess a function starts itself.
`limit_grant(cores)` tells the orchestrator the action can use at most that many cores from
now on (or more again, up to what it declared): the cores it gives back go to waiting
actions at once. A GrantedExecutor does it by itself when its tasks run out (two left of a
suite on four cores: it keeps two). Outside a sandbox, `grant()` is this process's CPU count,
`limit_grant` does nothing and the executor is a plain process pool.
This module imports nothing of tangram's core: it is cheap to import in a sandbox.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any

import cloudpickle

GRANT_FILE = "TANGRAM_GRANT_FILE"
JOBSERVER = "TANGRAM_JOBSERVER"
LIMIT = "TANGRAM_LIMIT"
ACTION = "TANGRAM_ACTION"


def grant() -> float:
    """The action's CPU grant now, in cores: the live grant file, else TANGRAM_GRANT, else
    the CPUs this process may run on."""
    path = os.environ.get(GRANT_FILE)
    if path:
        for _ in range(3):  # a read racing the manager's 16-byte rewrite: read again
            try:
                with open(path, "rb") as f:
                    value = float(f.read(64))
            except (OSError, ValueError):
                continue
            if value > 0:
                return value
            break
    try:
        return float(os.environ["TANGRAM_GRANT"])
    except (KeyError, ValueError):
        return float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def cores() -> int:
    """Processes or threads to run for the grant now: every fraction rounded up, at least 1."""
    return whole_cores(grant())


def whole_cores(cores: float) -> int:
    """The number of processes or threads a grant of `cores` should run: every granted
    fraction rounded up (a 1.25-core grant runs 2), at least 1. With grants as guarantees,
    the extra process uses the fraction and any idle core."""
    return max(1, math.ceil(cores - 1e-9))


def jobserver_fds() -> tuple[dict[str, str], tuple[int, ...]]:
    """(environment, pass_fds) for a subprocess that should join the action's jobserver:
    `subprocess.run(["make"], env={**os.environ, **env}, pass_fds=fds)`. Empty outside a
    sandbox. The descriptor stays open in this process for further subprocesses."""
    where = os.environ.get(JOBSERVER, "")
    if not where.startswith("fifo:"):
        return {}, ()
    fd = _jobserver_fd(where[5:])
    return {"MAKEFLAGS": f" -j --jobserver-auth={fd},{fd}"}, (fd,)


_fds: dict[str, int] = {}


def _jobserver_fd(path: str) -> int:
    fd = _fds.get(path)
    if fd is None:
        fd = _fds[path] = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    return fd


def limit_grant(cores: float) -> bool:
    """Tells the orchestrator this action can use at most `cores` from now on: a grant above
    that drops to it and the rest goes to waiting actions. Call it again with more when the
    action has more to run (it may grow back, up to its declared maximum, as cores free up).
    Kept within the action's minimum and maximum. False outside a sandbox or when the
    orchestrator cannot be told (the trajectory has ended)."""
    path, action = os.environ.get(LIMIT), os.environ.get(ACTION)
    if not path or not action:
        return False
    if not (isinstance(cores, (int, float)) and math.isfinite(cores) and cores > 0):
        raise ValueError(f"cores: {cores!r} is not a positive number of cores")
    try:
        fd = _limit_fds.get(path)
        if fd is None:
            fd = _limit_fds[path] = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.write(fd, f"{action} {cores:.4f}\n".encode())  # one write, far below PIPE_BUF: atomic
    except OSError:  # no reader (the sandbox is being torn down) or the FIFO is full
        return False
    return True


_limit_fds: dict[str, int] = {}


class GrantedExecutor(Executor):
    """A process pool whose number of running tasks follows the action's grant.

    It starts `max_workers` processes (default: the CPUs this process may run on) and
    hands them at most `cores()` tasks at once, re-reading the grant whenever a task ends
    and every `poll` seconds while tasks wait, so a grow starts waiting tasks at once and a
    shrink lets running tasks finish and starts fewer. Tasks run in submission order.
    With `give_back` (default), when a task ends and fewer tasks are left than the grant's
    cores, it limits the action's grant to what is left (`limit_grant`), and raises the
    limit again when more tasks come.
    Functions travel by cloudpickle, as they came into the sandbox: a lambda, a closure or
    a function of the caller's `__main__` runs here as it would in the action itself.
    """

    def __init__(self, max_workers: int | None = None, poll: float = 0.02, give_back: bool = True,
                 **pool_options: Any) -> None:
        if max_workers is None:
            max_workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers: {max_workers!r} is not a positive number of processes")
        if not (isinstance(poll, (int, float)) and poll > 0):
            raise ValueError(f"poll: {poll!r} is not a positive number of seconds")
        self.max_workers = max_workers
        self._pool = ProcessPoolExecutor(max_workers, **pool_options)
        self._poll = float(poll)
        self._lock = threading.Condition()
        self._waiting: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._running = 0
        self._give_back = bool(give_back)
        self._limited: tuple[str, int] | None = None  # (action, cores) of the last limit written
        self._shutdown = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="GrantedExecutor", daemon=True)
        self._dispatcher.start()

    @property
    def running(self) -> int:
        """Tasks handed to the processes now."""
        return self._running

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.append((future, fn, args, kwargs))
            if self._limited is not None:
                self._follow_demand(rising=True)
            self._lock.notify()
        return future

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        return super().map(fn, *iterables, timeout=timeout)

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._shutdown and not self._waiting:
                        return
                    if self._waiting and self._running < min(cores(), self.max_workers):
                        break
                    self._lock.wait(self._poll if self._waiting else None)
                future, fn, args, kwargs = self._waiting.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                self._running += 1
            try:
                inner = self._pool.submit(_call_pickled, cloudpickle.dumps((fn, args, kwargs)))
            except BaseException as e:
                self._done(future, None, e)
                continue
            inner.add_done_callback(lambda f, outer=future: self._done(outer, f, None))

    def _follow_demand(self, rising: bool) -> None:
        """Under the lock: the action's grant limited to the tasks it has (running and
        waiting, at most max_workers, at least 1): lowered when a task ends and fewer are
        left than the grant's cores, raised when tasks come after a limit."""
        action = os.environ.get(ACTION)
        if not self._give_back or not action:
            return
        want = max(1, min(self.max_workers, self._running + len(self._waiting)))
        last = self._limited[1] if self._limited is not None and self._limited[0] == action else None
        if rising:
            if last is None or want <= last:
                return
        elif want >= (cores() if last is None else last):
            return
        if limit_grant(want):
            self._limited = (action, want)

    def _done(self, outer: Future[Any], inner: Future[Any] | None, error: BaseException | None) -> None:
        with self._lock:
            self._running -= 1
            self._follow_demand(rising=False)
            self._lock.notify()
        if error is None and inner is not None:
            error = inner.exception()
            if error is None:
                outer.set_result(inner.result())
                return
        outer.set_exception(error)  # type: ignore[arg-type]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft()[0].cancel()
            self._lock.notify()
        if wait:
            self._dispatcher.join()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _call_pickled(payload: bytes) -> Any:
    fn, args, kwargs = cloudpickle.loads(payload)
    return fn(*args, **kwargs)


_shared: GrantedExecutor | None = None
_shared_lock = threading.Lock()


def shared_executor() -> GrantedExecutor:
    """This process's GrantedExecutor, made at the first call and kept: a function action
    runs in its trajectory's long-lived sandbox worker, so the trajectory's later actions
    reuse the same worker processes (each following its own action's grant)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._shutdown:
            _shared = GrantedExecutor()
        return _shared


__all__ = ["GrantedExecutor", "cores", "grant", "jobserver_fds", "limit_grant", "shared_executor", "whole_cores"]
