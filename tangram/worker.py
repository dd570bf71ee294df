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
This module imports nothing of tangram's core; a sandbox worker imports it as it starts
(the CPU manager's `preload`), so an action does not pay for it.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from multiprocessing.connection import Pipe
from multiprocessing.connection import wait as wait_for_connections
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
    """A pool of worker processes whose number of running tasks follows the action's grant.

    It runs at most `cores()` tasks at once (and at most `max_workers`, default: the CPUs
    this process may run on), re-reading the grant whenever a task ends and every `poll`
    seconds while tasks wait, so a grow starts waiting tasks at once and a shrink lets
    running tasks finish and starts fewer. Tasks run in submission order.
    Workers are started on demand, when a task may run and no worker is idle, and kept:
    a grant of one core never starts a second process, whatever the machine. A worker that
    dies (a segfault, os._exit, the OOM killer) fails only the task it ran, with
    TaskCrashed; the next task that needs a worker starts a new one.
    With `give_back` (default), when a task ends and fewer tasks are left than the grant's
    cores, it limits the action's grant to what is left (`limit_grant`), and raises the
    limit again when more tasks come.
    Functions travel by cloudpickle, as they came into the sandbox: a lambda, a closure or
    a function of the caller's `__main__` runs here as it would in the action itself.
    `mp_context` chooses how workers start (default: multiprocessing's default: a fork on
    Linux, so a worker starts in a few ms with the modules this process has imported).
    """

    def __init__(self, max_workers: int | None = None, poll: float = 0.02, give_back: bool = True,
                 mp_context: Any = None) -> None:
        if max_workers is None:
            max_workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers: {max_workers!r} is not a positive number of processes")
        if not (isinstance(poll, (int, float)) and poll > 0):
            raise ValueError(f"poll: {poll!r} is not a positive number of seconds")
        self.max_workers = max_workers
        self._context = mp_context if mp_context is not None else multiprocessing.get_context()
        self._poll = float(poll)
        self._lock = threading.Condition()
        self._waiting: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._idle: list[_Worker] = []
        self._busy: dict[Any, tuple[_Worker, Future[Any]]] = {}  # a worker's connection -> it and its task
        self._workers: list[_Worker] = []
        self._running = 0  # tasks taken by the dispatcher and not yet ended
        self._give_back = bool(give_back)
        self._limited: tuple[str, int] | None = None  # (action, cores) of the last limit written
        self._shutdown = False
        self._wake_reader, self._wake_writer = Pipe(duplex=False)  # tells the collector of a new busy worker
        self._dispatcher = threading.Thread(target=self._dispatch, name="GrantedExecutor", daemon=True)
        self._collector = threading.Thread(target=self._collect, name="GrantedExecutor results", daemon=True)
        self._dispatcher.start()
        self._collector.start()

    @property
    def running(self) -> int:
        """Tasks handed to the processes now."""
        return self._running

    @property
    def workers(self) -> int:
        """Worker processes started and alive (idle or running a task)."""
        return len(self._workers)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.append((future, fn, args, kwargs))
            if self._limited is not None:
                self._follow_demand(rising=True)
            self._lock.notify_all()
        return future

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        return super().map(fn, *iterables, timeout=timeout)

    # ------------------------------------------------------------------ threads
    def _dispatch(self) -> None:
        """Hands the first waiting task to a worker whenever the grant allows one more."""
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
                payload = cloudpickle.dumps((fn, args, kwargs))
            except BaseException as e:  # nothing a worker could run
                self._end(future, None, e)
                continue
            worker = self._idle_worker()
            try:
                if worker is None:
                    worker = self._start_worker()
                worker.connection.send_bytes(payload)
            except BaseException as e:
                if worker is not None:
                    self._forget(worker)
                self._end(future, None, e)
                continue
            with self._lock:
                self._busy[worker.connection] = (worker, future)
            self._wake_writer.send_bytes(b"")

    def _idle_worker(self) -> "_Worker | None":
        """An idle worker still alive (one killed while idle is dropped here), or None."""
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.process.is_alive():
                    return worker
                self._workers.remove(worker)
                worker.connection.close()
        return None

    def _start_worker(self) -> "_Worker":
        ours, theirs = Pipe()
        process = self._context.Process(target=_serve, args=(theirs,), name="GrantedExecutor worker", daemon=True)
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _collect(self) -> None:
        """Waits for the busy workers' replies (and their deaths) and ends their tasks."""
        while True:
            with self._lock:
                if self._shutdown and not self._waiting and not self._busy and not self._dispatcher.is_alive():
                    return
                connections = [self._wake_reader, *self._busy]
            for ready in wait_for_connections(connections, timeout=self._poll if self._shutdown else None):
                if ready is self._wake_reader:
                    self._wake_reader.recv_bytes()
                    continue
                with self._lock:
                    worker, future = self._busy.pop(ready)
                try:
                    ok, value, remote = pickle.loads(ready.recv_bytes())
                except (EOFError, OSError):
                    self._forget(worker)
                    code = worker.process.exitcode
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    self._end(future, None, TaskCrashed(f"the worker process running this task died ({how})"))
                    continue
                except BaseException as e:  # a result that does not unpickle here
                    self._idle_again(worker)
                    self._end(future, None, e)
                    continue
                self._idle_again(worker)
                if ok:
                    self._end(future, value, None)
                else:
                    value.__cause__ = _RemoteTraceback(remote)
                    self._end(future, None, value)

    def _idle_again(self, worker: "_Worker") -> None:
        with self._lock:
            self._idle.append(worker)

    def _forget(self, worker: "_Worker") -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        worker.connection.close()
        worker.process.join(1.0)

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

    def _end(self, future: Future[Any], result: Any, error: BaseException | None) -> None:
        with self._lock:
            self._running -= 1
            self._follow_demand(rising=False)
            self._lock.notify_all()
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft()[0].cancel()
            self._lock.notify_all()
        try:
            self._wake_writer.send_bytes(b"")
        except OSError:
            pass
        if not wait:
            return
        self._dispatcher.join()
        self._collector.join()
        with self._lock:
            workers, self._workers, self._idle = self._workers, [], []
        for worker in workers:
            try:
                worker.connection.send_bytes(b"")  # the worker's signal to exit
            except OSError:
                pass
            worker.connection.close()
        for worker in workers:
            worker.process.join(5.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()


class TaskCrashed(RuntimeError):
    """The worker process running a task died (a segfault, os._exit, a kill) before it
    returned; the executor's other tasks go on."""


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return str(self.args[0])


class _Worker:
    __slots__ = ("process", "connection")

    def __init__(self, process: Any, connection: Any) -> None:
        self.process = process
        self.connection = connection


def _serve(connection: Any) -> None:
    """A worker: runs each task it is sent, replies (ok, value, traceback text); an empty
    message or the executor's end closing makes it exit."""
    import traceback

    while True:
        try:
            payload = connection.recv_bytes()
        except (EOFError, OSError):
            return
        if not payload:
            return
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            reply = (True, fn(*args, **kwargs), "")
        except BaseException as e:
            reply = (False, e, traceback.format_exc())
        try:
            data = cloudpickle.dumps(reply)
        except BaseException as e:
            data = cloudpickle.dumps((False, RuntimeError(f"the task's {'result' if reply[0] else 'error'} cannot "
                                                          f"be pickled: {type(e).__name__}: {e}"), reply[2]))
        connection.send_bytes(data)


_shared: GrantedExecutor | None = None
_shared_lock = threading.Lock()


def _forget_shared_in_child() -> None:
    # A forked child (a GPU action's process, a worker of another pool) has a copy of the
    # executor without its threads: it makes its own if it needs one.
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared_in_child)


def shared_executor() -> GrantedExecutor:
    """This process's GrantedExecutor, made at the first call and kept: a function action
    runs in its trajectory's long-lived sandbox worker, so the trajectory's later actions
    reuse the same worker processes (each following its own action's grant)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._shutdown:
            _shared = GrantedExecutor()
        return _shared


__all__ = ["GrantedExecutor", "TaskCrashed", "cores", "grant", "jobserver_fds", "limit_grant", "shared_executor",
           "whole_cores"]
