"""A sandbox: one long-lived worker process per trajectory, seen from the orchestrator.

The worker (tangram/runtime/_sandbox_worker.py) runs in its own session and process group
(its pgid is its pid), in the sandbox's own directory (cwd = HOME, TMPDIR inside it), with
a minimal environment: PATH, LANG, HOME, TMPDIR, TANGRAM_SANDBOX (a marker naming the
manager and the trajectory) and what the manager was told to pass; nothing else of the
orchestrator's environment (no tokens or keys). With cgroups it is placed in its own cgroup
before it gets its first action. The orchestrator talks to it over a socketpair: one
length-prefixed pickle each way per action.

Killing a sandbox (a cancel, a timeout, a crash, the end of its trajectory) kills every
process it started: its process group, every task of its cgroup (which catches processes
that made themselves a new session), and in affinity mode every descendant of the worker
(the worker is a child subreaper, so orphaned daemons stay its descendants). The directory
survives a kill, so the trajectory's next action finds its files in a fresh worker.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from .errors import ManagerError
from .isolation import SandboxCgroup
from .isolation import alive as _alive

_HEADER = struct.Struct(">Q")
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_worker.py")
MARKER = "TANGRAM_SANDBOX"
_DRAIN_ABOVE = 1 << 16  # await drain() only when this much is still unsent


class WorkerDied(Exception):
    """The worker's channel closed: it exited (`returncode` >= 0) or a signal killed it (< 0)."""

    def __init__(self, returncode: int | None, log_tail: str) -> None:
        super().__init__(returncode)
        self.returncode = returncode
        self.log_tail = log_tail


class Sandbox:
    """The worker process of one trajectory, started on demand and restarted after a kill."""

    def __init__(self, trajectory: int, directory: str, marker: str, base_env: Mapping[str, str],
                 cgroup: SandboxCgroup | None, hello: tuple[Any, ...]) -> None:
        self.trajectory = trajectory
        self.directory = directory
        self.marker = marker
        self.log_path = directory.rstrip("/") + ".log"
        self.cgroup = cgroup
        self.hello = hello
        tmp = os.path.join(directory, ".tmp")
        self.env = {**base_env, "HOME": directory, "TMPDIR": tmp, MARKER: marker}
        self.lock = asyncio.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dying: list[subprocess.Popen[bytes]] = []
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.starts = 0
        self.closed = False

    @property
    def alive(self) -> bool:
        return self.proc is not None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._dying:
            await self.reap()
        os.makedirs(os.path.join(self.directory, ".tmp"), exist_ok=True)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with open(self.log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-I", WORKER_FILE, str(child.fileno())],
                    cwd=self.directory, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=(child.fileno(),), start_new_session=True, close_fds=True)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.proc = proc
        self.starts += 1
        try:
            if self.cgroup is not None:
                try:
                    self.cgroup.add(proc.pid)  # before it runs anything of the caller's
                except OSError as e:
                    raise ManagerError("managers.cpu.isolation", f"cannot move the sandbox worker into its cgroup "
                                       f"{self.cgroup.dirs['cpu']}: {e.strerror}; isolation='affinity' avoids cgroups") from None
            self.reader, self.writer = await asyncio.open_connection(sock=parent, limit=1 << 20)
            self._send(self.hello)
        except BaseException:
            if self.writer is None:
                parent.close()
            self.kill()
            await self.reap()
            raise

    def _send(self, msg: tuple[Any, ...]) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_HEADER.pack(len(payload)) + payload)  # type: ignore[union-attr]

    async def request(self, payload: bytes) -> bytes:
        """Sends one pickled request and returns the worker's pickled reply; raises
        WorkerDied when the worker goes away instead (it is reaped and the sandbox marked
        for restart). Anything else that interrupts the exchange (a cancel) kills the
        worker: its channel would no longer be in step."""
        writer, reader = self.writer, self.reader
        assert writer is not None and reader is not None
        try:
            writer.write(_HEADER.pack(len(payload)) + payload)
            if writer.transport.get_write_buffer_size() > _DRAIN_ABOVE:
                await writer.drain()
            header = await reader.readexactly(_HEADER.size)
            return await reader.readexactly(_HEADER.unpack(header)[0])
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise await self._died() from e
        except BaseException:
            self.kill()
            raise

    async def _died(self) -> WorkerDied:
        proc = self.proc
        assert proc is not None
        self.kill()  # what it left behind (its group is killed before it is reaped), and forget it
        await self.reap()
        return WorkerDied(proc.returncode, self.log_tail())

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL everything the sandbox runs, at once and without waiting, and forget the
        worker: the next action starts a new one. `reap` waits for the killed worker.
        Safe to call more than once."""
        proc = self.proc
        if self.writer is not None:
            self.writer.close()
            self.writer = self.reader = None
        if proc is None:
            return
        self.proc = None
        self._dying.append(proc)
        if self.cgroup is None:
            _kill_descendants(proc.pid)  # its tree, daemons included (it is their subreaper)
        if proc.returncode is None:  # not reaped: its pid (= pgid) cannot have been reused
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.cgroup is not None:
            self.cgroup.kill_all()

    async def reap(self) -> None:
        """Waits for every killed worker of this sandbox to exit (reaping it)."""
        while self._dying:
            proc = self._dying[0]
            await _wait(proc, timeout=None)
            if self._dying and self._dying[0] is proc:
                self._dying.pop(0)

    async def close(self, remove_files: bool = True) -> None:
        """Kills it, waits for its worker, removes its cgroup and (`remove_files`) its
        directory: renamed away at once, deleted in a thread so that a large tree does not
        hold the event loop."""
        self.closed = True
        self.kill()
        await self.reap()
        if self.cgroup is not None:
            self.cgroup.remove()
        if remove_files:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass
            doomed = f"{self.directory}.closing-{id(self):x}"
            try:
                os.rename(self.directory, doomed)
            except OSError:
                doomed = self.directory
            await asyncio.to_thread(shutil.rmtree, doomed, True)


async def _wait(proc: subprocess.Popen[bytes], timeout: float | None) -> int | None:
    """The exit status of `proc` once it has exited (reaping it), without blocking the loop."""
    if proc.poll() is not None:
        return proc.returncode
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = -1
    try:
        if fd >= 0:
            done = loop.create_future()
            loop.add_reader(fd, lambda: done.done() or done.set_result(None))
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout)
            except asyncio.TimeoutError:
                pass
            finally:
                loop.remove_reader(fd)
        else:
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(asyncio.to_thread(proc.wait))), timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        if fd >= 0:
            os.close(fd)
    if proc.poll() is None and timeout is not None:
        try:  # it did not exit after closing its channel: make sure
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await _wait(proc, None)
    return proc.returncode


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def _kill_descendants(pid: int, rounds: int = 20) -> None:
    """SIGKILL every descendant of `pid` (not `pid` itself), until none is left."""
    for _ in range(rounds):
        stack, found = [pid], []
        while stack:
            for c in _children(stack.pop()):
                if _alive(c):
                    found.append(c)
                stack.append(c)
        if not found:
            return
        for c in found:
            try:
                os.kill(c, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def marked_processes(prefix: str, exact: bool = False) -> list[int]:
    """Live processes whose environment has TANGRAM_SANDBOX starting with `prefix`: the
    sandboxes' processes, including any that escaped their session and were orphaned
    when a worker died. A /proc scan: for close() and tests, not for the hot path."""
    needle = f"{MARKER}={prefix}".encode()
    out: list[int] = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        entries = env.split(b"\0")
        if (needle in entries if exact else any(e.startswith(needle) for e in entries)) and _alive(int(name)):
            out.append(int(name))
    return out


def kill_marked(prefix: str, exact: bool = False, rounds: int = 20) -> None:
    """SIGKILL the processes `marked_processes` finds, until none is left."""
    for _ in range(rounds):
        pids = marked_processes(prefix, exact)
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


__all__ = ["MARKER", "WORKER_FILE", "Sandbox", "WorkerDied", "kill_marked", "marked_processes"]
