"""A sandbox: one long-lived worker process per trajectory, seen from the orchestrator.

The worker (tangram/runtime/sandbox/inside_worker.py) runs in its own session and process group
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

A worker that dies on its own (killed from outside, the OOM killer, a crash) is noticed
when it exits, through a pidfd the event loop watches: one fd per worker, and unlike the
channel's EOF it cannot be held back by a process the worker forked that kept the socket.
Dying between actions costs nothing but the worker: what it left is killed, it is reaped
and forgotten at once, and the next action starts a new one (lazily: a sandbox killed for
good does not come back as a process). An action is handed over when its request is
written; the worker is checked just before (`ready`), so a death that the loop has not yet
handled is still caught there. A worker that dies after the hand-over, however soon, takes
that action with it (ActionCrashed).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import ManagerError
from .grant import GrantChannel
from .isolation import SandboxCgroup
from .isolation import alive as _alive
from .kills import MARKER, kill_descendants, kill_marked
from .replies import MAX_REPLY_BYTES
from .namespaces import (CONTROL, HOME, Boundary, UidAllocator, bwrap_argv, mount_tmpfs, outermost, seccomp_fd,
                         seccomp_filter, unmount, unmount_under)
from .rootfs import host_python_argv, host_python_paths, inside, mount_image_root, remount_image_root

_HEADER = struct.Struct(">Q")
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inside_worker.py")
_DRAIN_ABOVE = 1 << 16  # await drain() only when this much is still unsent
# Seconds without an action before taken warm workers are replaced (WarmWorkers): longer
# than a rollout's pauses between calls, far shorter than the trainer's part of a step.
REFILL_AFTER_IDLE = 0.5


class ReplyTooLarge(Exception):
    """The worker announced a reply longer than MAX_REPLY_BYTES: not read (the worker is
    killed)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class WorkerDied(Exception):
    """The worker's channel closed: it exited (`returncode` >= 0) or a signal killed it (< 0)."""

    def __init__(self, returncode: int | None, log_tail: str) -> None:
        super().__init__(returncode)
        self.returncode = returncode
        self.log_tail = log_tail


@dataclass(frozen=True)
class SlotDirs:
    """The places of a slot under its `root` on the host: the sandbox's directory `home`
    (HOME inside), `control` (CONTROL inside, read-only: its grant channel) and its
    worker's log. Shared by tangram's slots and containers' (tangram.runtime.sandbox.containers)."""

    root: str

    @property
    def home(self) -> str:
        return os.path.join(self.root, "home")

    @property
    def control(self) -> str:
        return os.path.join(self.root, "control")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "worker.log")


@dataclass(frozen=True)
class Slot(SlotDirs):
    """Where a namespaced sandbox lives on the host, `<manager dir>/s<n>`: its directory
    `home` (HOME inside), `tmp` (/tmp inside), `control` (CONTROL inside, read-only: its
    grant channel) and its worker's log. `uid`: the sandbox's own user (None: the
    orchestrator's, in a user namespace). A warm worker is started in a fresh slot, which
    its sandbox then keeps for all its workers."""

    uid: int | None
    mounted: bool = False  # a tmpfs of the disk limit at `root`
    image: str | None = None  # the task image's unpacked root: its sandboxes' / (tangram.runtime.sandbox.rootfs)

    @property
    def rootfs(self) -> str | None:
        """The sandbox's / on the host (an image sandbox's overlay), else None."""
        return None if self.image is None else os.path.join(self.root, "rootfs")

    @property
    def tmp(self) -> str:
        return os.path.join(self.root, "tmp")


@dataclass(frozen=True)
class Needs:
    """What a worker was started with, beyond the default: the network, the GPU device
    nodes, host directories bound writable (an MPS pipe directory)."""

    network: bool = False
    gpu: bool = False
    writable: tuple[str, ...] = ()

    def covers(self, other: Needs) -> bool:
        return ((self.network or not other.network) and (self.gpu or not other.gpu)
                and set(other.writable) <= set(self.writable))


class Jail:
    """How a manager starts namespaced workers (tangram.runtime.sandbox.namespaces): the boundary,
    the host paths they see read-only, their slots and uids, the network by default.
    (tangram.runtime.sandbox.containers.ContainerJail starts them in containers instead: the same
    methods.)"""

    base_processes = 3  # what runs in a sandbox's cgroup between actions: bwrap, its init, the worker

    def __init__(self, boundary: Boundary, directory: str, read_only: list[str], network: bool,
                 pids_limit: int | None = None, disk_limit: int | None = None) -> None:
        """`pids_limit`: RLIMIT_NPROC of each sandbox's uid (None where a cgroup limits its
        processes); `disk_limit`: bytes a sandbox may write, its slot a tmpfs of that size
        (root only)."""
        self.boundary, self.directory, self.read_only, self.network = boundary, directory, read_only, network
        self.pids_limit, self.disk_limit = pids_limit, disk_limit
        self.seccomp = seccomp_filter() is not None
        self._uids = UidAllocator() if boundary.own_uids else None
        self._slots = itertools.count(1)  # next() is atomic: image slots are made off the loop

    @property
    def default(self) -> Needs:
        return Needs(network=self.network)

    def new_slot(self, image: str | None = None, needs: Needs | None = None) -> Slot:
        """A fresh slot; with `image` (an unpacked root filesystem, root only) its root is
        that image under an overlay of its own. (`needs` is a container's business: a
        jail's workers get theirs at each spawn.)"""
        n = next(self._slots)
        slot = Slot(os.path.join(self.directory, f"s{n}"), None if self._uids is None else self._uids.take(n),
                    self.disk_limit is not None, image)
        os.mkdir(slot.root, 0o755)
        try:
            if slot.mounted:
                mount_tmpfs(slot.root, self.disk_limit)  # type: ignore[arg-type]
            os.mkdir(slot.control, 0o755)
            self._make_writable(slot)
            if image is not None:
                assert slot.uid is not None, "image sandboxes need uids of their own (root)"
                mount_image_root(image, slot.root, slot.uid)
        except BaseException:
            self.remove(slot)
            raise
        return slot

    @staticmethod
    def _make_writable(slot: Slot) -> None:
        os.mkdir(slot.home, 0o700)
        if slot.uid is not None:
            os.chown(slot.home, slot.uid, slot.uid)
        # /tmp as on any system (sticky, everyone's): bwrap, root without capabilities, must
        # pass through it to start a Python that lives under the host's /tmp (a venv there)
        os.mkdir(slot.tmp)
        os.chmod(slot.tmp, 0o1777)

    def wipe(self, slot: Slot) -> None:
        """Empties the sandbox's directory and /tmp, and drops its changes to its image (a
        sandbox that filled its disk limit), its worker killed first."""
        for d in (slot.home, slot.tmp):
            shutil.rmtree(d, ignore_errors=True)
        self._make_writable(slot)
        if slot.rootfs is not None:
            unmount(slot.rootfs)
            for d in ("upper", "work"):
                shutil.rmtree(os.path.join(slot.root, d), ignore_errors=True)
            remount_image_root(slot.root, slot.uid)  # type: ignore[arg-type]

    @classmethod
    def remove(cls, slot: Slot, where: str | None = None) -> None:
        """Unmounts the slot's mounts (its tmpfs, its image's), if any, and deletes `where`
        (default: the slot)."""
        cls.detach(slot)
        shutil.rmtree(where or slot.root, ignore_errors=True)

    @staticmethod
    def detach(slot: Slot) -> None:
        """Before its files go: the slot's mounts (its tmpfs, its image's) unmounted, so
        that deleting its files never walks into an image."""
        if slot.mounted or slot.image is not None:
            unmount_under(slot.root)

    @functools.cached_property
    def image_read_only(self) -> list[str]:
        """The host paths an image sandbox is shown under rootfs.HOST: the manager's, and
        what the host's Python needs to run there (its loader and library directories)."""
        return outermost([*self.read_only, *host_python_paths()])

    def spawn(self, slot: Slot, needs: Needs, env: Mapping[str, str],
              preload: Preload | None) -> tuple[subprocess.Popen[bytes], socket.socket]:
        image = slot.rootfs is not None
        argv = bwrap_argv(self.boundary, home=slot.home, tmp=slot.tmp, control=slot.control,
                          read_only=self.image_read_only if image else self.read_only, network=needs.network,
                          gpu=needs.gpu, writable=needs.writable, rootfs=slot.rootfs)
        fds: tuple[int, ...] = ()
        if self.seccomp:
            fds = (seccomp_fd(),)
            argv[-1:-1] = ["--seccomp", str(fds[0])]  # before the closing "--"
        options: dict[str, Any] = {}
        if slot.uid is not None:
            options["user"] = slot.uid
            if self.pids_limit is not None:
                options["nproc"] = self.pids_limit  # RLIMIT_NPROC: per uid, so per sandbox
        if image:  # the host's Python, its paths under rootfs.HOST (tangram.runtime.sandbox.rootfs)
            if preload is not None:
                preload = Preload(tuple(inside(p) for p in preload.path), preload.modules)
            options["sys_path"] = [inside(p) for p in sys.path if p]
        try:
            return spawn_worker(slot.root, env, slot.log, preload, prefix=argv, options=options, fds=fds,
                                python=host_python_argv() if image else None,
                                worker_file=inside(WORKER_FILE) if image else WORKER_FILE)
        finally:
            for fd in fds:
                os.close(fd)


class WarmWorker:
    """A worker started ahead of its sandbox: Python is up and its imports are done. It
    carries a marker of its own (`<manager id>/w<n>`); its sandbox sends the directory and
    environment in the hello. A namespaced one comes with its slot."""

    def __init__(self, proc: subprocess.Popen[bytes], channel: socket.socket, marker: str, log_path: str,
                 slot: Slot | None = None) -> None:
        self.proc = proc
        self.channel = channel
        self.marker = marker
        self.log_path = log_path
        self.slot = slot


class WarmWorkers:
    """Up to `size` idle workers, so that a new trajectory's first action does not wait for
    an interpreter to start (nor start it under its own small grant). Taken workers are
    replaced once the owner has called `refill_soon` (the CPU manager: when no action
    runs) and not `hold_refill` for REFILL_AFTER_IDLE seconds, one per turn of the event
    loop: a rollout step's short pauses between calls (the policy generating) start no
    interpreters to compete with its programs, nor hold the loop for all of them at once;
    between steps the pool is full again. `place(pid)`, when given, is called with each new worker: the CPU manager
    puts it in a cgroup of the lowest CPU weight (a worker taken before it is ready
    finishes starting under its sandbox's grant)."""

    def __init__(self, directory: str, marker: str, base_env: Mapping[str, str], size: int,
                 place: Callable[[int], None] | None = None, preload: Preload | None = None,
                 jail: Jail | None = None, image: str | None = None) -> None:
        """`image`: workers for sandboxes of that task image (a jail's), each in a slot of it."""
        self.directory = directory
        self.image = image
        self.marker = marker
        self.place = place
        self.preload = preload
        self.jail = jail
        self.env = ({**base_env, "HOME": HOME, "TMPDIR": "/tmp"} if jail is not None else
                    {**base_env, "HOME": directory, "TMPDIR": directory})
        self.size = size
        self.idle: list[WarmWorker] = []
        self._count = 0
        self._closed = False
        self._refill: asyncio.Handle | None = None

    def fill(self) -> None:
        """All the missing workers, now (at the manager's start)."""
        while not self._closed and len(self.idle) < self.size:
            self.idle.append(self._spawn())

    def _fill_one(self) -> None:
        self._refill = None
        if self._closed or len(self.idle) >= self.size:
            return
        self.idle.append(self._spawn())
        if len(self.idle) < self.size:
            self._refill = asyncio.get_running_loop().call_soon(self._fill_one)

    def _spawn(self) -> WarmWorker:
        self._count += 1
        marker = f"{self.marker}w{self._count}"
        slot = None
        if self.jail is not None:
            slot = self.jail.new_slot(self.image)
            log_path = slot.log
            proc, channel = self.jail.spawn(slot, self.jail.default, {**self.env, MARKER: marker}, self.preload)
        else:
            log_path = os.path.join(self.directory, f"w{self._count}.log")
            proc, channel = spawn_worker(self.directory, {**self.env, MARKER: marker}, log_path, self.preload)
        if self.place is not None:
            try:
                self.place(proc.pid)
            except OSError:  # it died at once: take() skips it
                pass
        return WarmWorker(proc, channel, marker, log_path, slot)

    def refill_soon(self) -> None:
        """Start the missing workers once REFILL_AFTER_IDLE seconds pass without
        `hold_refill`."""
        if self._refill is None and not self._closed and len(self.idle) < self.size:
            self._refill = asyncio.get_running_loop().call_later(REFILL_AFTER_IDLE, self._fill_one)

    def hold_refill(self) -> None:
        """Work started: no worker is started until `refill_soon` again."""
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None

    def take(self) -> WarmWorker | None:
        """An idle live worker (None when none is left)."""
        while self.idle:
            warm = self.idle.pop(0)
            if warm.proc.poll() is None:
                return warm
            warm.channel.close()  # it died idle (killed from outside): the next one
        return None

    async def close(self) -> None:
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
        idle, self.idle = self.idle, []
        for warm in idle:
            warm.channel.close()
            try:
                os.killpg(warm.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for warm in idle:
            await _wait(warm.proc, timeout=None)
            if warm.slot is not None:
                await asyncio.to_thread(Jail.remove, warm.slot)


@dataclass(frozen=True)
class Preload:
    """Modules a worker imports as it starts, from `path` (the orchestrator's sys.path):
    a warm worker does it before it is taken, off the critical path of the step."""

    path: tuple[str, ...]
    modules: tuple[str, ...]


def spawn_worker(directory: str, env: Mapping[str, str], log_path: str, preload: Preload | None = None, *,
                 prefix: Sequence[str] = (), options: Mapping[str, Any] | None = None,
                 fds: Sequence[int] = (), python: Sequence[str] | None = None,
                 worker_file: str = WORKER_FILE) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A new worker process in its own session, and the orchestrator's end of its channel.
    `prefix`: what runs it (bwrap's argv, for a namespaced sandbox); `options`: more for
    the worker's start ("user": the uid it takes first; "nproc": its RLIMIT_NPROC;
    "sys_path": its sys.path); `fds`: more descriptors it inherits (bwrap's seccomp
    filter); `python` and `worker_file`: the interpreter's argv and the worker's file
    (default: this interpreter with -I, and the worker's path here)."""
    start: dict[str, Any] = dict(options or {})
    if preload is not None and preload.modules:
        start.update(path=list(preload.path), preload=list(preload.modules))

    def popen(child: socket.socket, log: BinaryIO) -> subprocess.Popen[bytes]:
        argv = [*prefix, *(python or (sys.executable, "-I")), worker_file, str(child.fileno())]
        if start:
            argv.append(json.dumps(start))
        return subprocess.Popen(  # a new worker in the same sandbox logs after the last one's words
            argv, cwd=directory, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            pass_fds=(child.fileno(), *fds), start_new_session=True, close_fds=True)

    return start_with_channel(log_path, popen)


def start_with_channel(log_path: str, popen: Callable[[socket.socket, BinaryIO], subprocess.Popen[bytes]],
                       ) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A worker started by `popen(child, log)`, given its end of a new socket pair and its
    log open for appending, and the orchestrator's end of that pair (closed if the start
    fails; the worker's end is closed here either way, the worker holding its own copy)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with open(log_path, "ab") as log:
            proc = popen(child, log)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, parent


class Sandbox:
    """The worker process of one trajectory, started on demand and restarted after a kill."""

    def __init__(self, trajectory: int, directory: str, marker: str, base_env: Mapping[str, str],
                 cgroup: SandboxCgroup | None, hello: tuple[Any, ...], warm: WarmWorkers | None = None,
                 preload: Preload | None = None, *, jail: Jail | None = None,
                 on_limit: Callable[[int, float], None] | None = None) -> None:
        """`directory`: the sandbox's directory under isolation="process" (in a jail it is
        its slot's home, known at its first start); `hello`: ("hello", sys_path,
        output_limit, _, affinity_mode); `on_limit`: for its grant channel."""
        self.trajectory = trajectory
        self.marker = marker
        self.cgroup = cgroup
        self.jail = jail
        self.slot: Slot | None = None
        self.image: str | None = None  # a task image's unpacked root: set before its first start (a jail's)
        self.needs = Needs()  # what the live worker was started with (a jail's)
        self._on_limit = on_limit
        self._directory = directory
        self.grant: GrantChannel | None
        if jail is None:
            self.grant = GrantChannel(directory, on_limit)
            home, tmp = directory, os.path.join(directory, ".tmp")
        else:  # made with the slot; the sandbox sees its files at CONTROL
            self.grant = None
            home, tmp = HOME, "/tmp"
        grant_env = GrantChannel.env_for(CONTROL + "/sandbox") if jail is not None else self.grant.env  # type: ignore[union-attr]
        self.env = {**base_env, **grant_env, "HOME": home, "TMPDIR": tmp, MARKER: marker}
        self.hello = (*hello[:3], home, hello[4], self.env)
        self.warm = warm
        self.preload = preload
        # markers its workers were started with: its own, and each warm worker's (in affinity
        # mode a burial scans for all of them: a forked child keeps its worker's first environment)
        self._markers = [marker]
        self.lock = asyncio.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dying: list[subprocess.Popen[bytes]] = []
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._channel: socket.socket | None = None
        self._pidfd = -1  # watched by the loop while the worker lives
        self._loop: asyncio.AbstractEventLoop | None = None
        self._talking = False  # start() or request() is using the channel: it sees a death itself
        self._burial: asyncio.Task[None] | None = None
        self.starts = 0
        self.closed = False

    @property
    def directory(self) -> str | None:
        """The sandbox's directory on the host (in a jail: None before its first start)."""
        if self.jail is None:
            return self._directory
        return None if self.slot is None else self.slot.home

    @property
    def log_path(self) -> str:
        if self.jail is None:
            return self._directory.rstrip("/") + ".log"
        return "" if self.slot is None else self.slot.log

    @property
    def alive(self) -> bool:
        return self.proc is not None

    @property
    def base_processes(self) -> int:
        """Processes of its cgroup that are not the action's: the worker and what runs it."""
        return 1 if self.jail is None else self.jail.base_processes

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # ------------------------------------------------------------------ lifecycle
    async def ready(self, needs: Needs = Needs()) -> None:
        """A live worker for the next action: one that died since the last action is buried
        and replaced, and so is a jail's worker started without something the action
        `needs` (the network, the GPUs). The check is a waitpid, so it also catches an exit
        the loop has not handled yet, plus /proc, for a worker already dead but not yet
        reapable; nothing awaits between it and the request's write (the hand-over)."""
        proc = self.proc
        if proc is not None and proc.poll() is None and not _alive(proc.pid):
            # Killed, but not reapable yet (its exit is still being torn down, e.g. its
            # memory uncharged from a cgroup): handing it the action would crash it.
            await _wait(proc, timeout=None)
        if proc is not None and proc.poll() is None and self.cgroup_is_engines and not self.cgroup.procs():  # type: ignore[union-attr]
            # A container's worker is not our child: the engine's exec, which is, ends a moment
            # after it. Its cgroup, empty but for the container's init, says it is gone.
            await _wait(proc, timeout=5.0)
        if proc is not None and proc.poll() is not None:
            self._died(proc)
        if self.proc is not None and self.jail is not None and not self.needs.covers(needs):
            self.kill()  # its mounts and namespaces are fixed: a new worker in the same slot
            await self._settle()
        if self.proc is None:
            await self.start(needs)

    async def start(self, needs: Needs = Needs()) -> None:
        await self._settle()
        jail = self.jail
        warm = None
        if jail is None:
            os.makedirs(os.path.join(self._directory, ".tmp"), exist_ok=True)
            warm = self.warm.take() if self.warm is not None else None
        elif self.slot is None and self.warm is not None and jail.default.covers(needs) and self.warm.image == self.image:
            warm = self.warm.take()
        if warm is not None:
            proc, parent = warm.proc, warm.channel
            if warm.slot is not None:
                self.slot, self.needs = warm.slot, jail.default  # type: ignore[union-attr]
            else:
                os.replace(warm.log_path, self.log_path)
            if warm.marker not in self._markers:
                self._markers.append(warm.marker)
        elif jail is not None:
            if self.slot is None:
                # an image's mounts take milliseconds, a container's start a tenth of a second: off the loop
                self.slot = (jail.new_slot() if self.image is None else
                             await asyncio.to_thread(jail.new_slot, self.image, needs))
                engine_cgroup = getattr(self.slot, "cgroup", None)  # a container's, made by its engine
                if engine_cgroup is not None:
                    self.cgroup = engine_cgroup
            network = getattr(self.slot, "network", needs.network or jail.network)  # a container's is fixed
            self.needs = Needs(network, needs.gpu, needs.writable)
            proc, parent = jail.spawn(self.slot, needs, self.env, self.preload)
        else:
            proc, parent = spawn_worker(self._directory, self.env, self.log_path, self.preload)
        if self.grant is None and self.slot is not None:
            self.grant = GrantChannel(os.path.join(self.slot.control, "sandbox"), self._on_limit, owner=self.slot.uid,
                                      inside=CONTROL + "/sandbox", shared=self.cgroup_is_engines)
        self.proc = proc
        self._channel = parent
        self.starts += 1
        self._talking = True
        try:
            self._watch(proc)
            if self.cgroup is not None and not self.cgroup_is_engines:
                try:
                    self.cgroup.add_tree(proc.pid)  # before it runs anything of the caller's
                except OSError as e:
                    raise ManagerError("managers.cpu.resource_control", f"cannot move the sandbox worker into its "
                                       f"cgroup {self.cgroup.dirs['cpu']}: {e.strerror}; resource_control='affinity' "
                                       "avoids cgroups") from None
            self.reader, self.writer = await asyncio.open_connection(sock=parent, limit=1 << 20)
            hello = self.hello
            if self.slot is not None and self.slot.image is not None:  # the host's paths, as an image sandbox sees them
                hello = (hello[0], [inside(p) for p in hello[1]], *hello[2:])
            self._send(hello)
        except BaseException:
            if self.writer is None:
                parent.close()
            self.kill()
            await self.reap()
            raise
        finally:
            self._talking = False

    @property
    def cgroup_is_engines(self) -> bool:
        """Its cgroup is its container's (made, filled and removed by the engine)."""
        return self.cgroup is not None and self.cgroup is getattr(self.slot, "cgroup", None)

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3): `ready` finds the death instead
            return
        self._loop = asyncio.get_running_loop()
        self._pidfd = fd
        self._loop.add_reader(fd, self._exited, proc)

    def _unwatch(self) -> None:
        fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            self._loop.remove_reader(fd)  # type: ignore[union-attr]
            os.close(fd)

    def _exited(self, proc: subprocess.Popen[bytes]) -> None:
        """The loop saw the worker exit."""
        self._unwatch()
        if proc is not self.proc:
            return
        if not self._talking:
            self._died(proc)
            return
        # An action (or the start) is using the channel: it reads what the worker sent
        # before dying, then EOF, even if a process the worker forked still holds the
        # worker's end, and ends as a crash of that action.
        try:
            self._channel.shutdown(socket.SHUT_RD)  # type: ignore[union-attr]
        except OSError:
            pass

    def _died(self, proc: subprocess.Popen[bytes]) -> None:
        """The worker exited on its own: forget it, kill what it left in its process group
        and cgroup, and bury it in the background (`_bury`); the next start waits for that."""
        if proc is not self.proc:
            return
        self.kill()
        # No other burial is pending: a worker starts only once the last one is settled.
        self._burial = asyncio.get_running_loop().create_task(self._bury())

    async def _bury(self) -> None:
        if self.cgroup is None:  # affinity: its orphans that left its session carry its markers
            markers, self._markers = self._markers, [self.marker]  # the next worker adds its own
            for marker in markers:
                await asyncio.to_thread(kill_marked, marker, True)  # a /proc scan: off the loop
        await self.reap()

    async def _settle(self) -> None:
        """Waits until no process of an earlier worker is left (buried, reaped): a new
        worker carries the same marker, which the burial's scan must not find."""
        burial = self._burial
        if burial is not None:
            try:
                await asyncio.shield(burial)  # a cancelled waiter leaves the burial running
            finally:
                if burial.done() and self._burial is burial:
                    self._burial = None
        await self.reap()

    def _send(self, msg: tuple[Any, ...]) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_HEADER.pack(len(payload)) + payload)  # type: ignore[union-attr]

    async def request(self, payload: bytes) -> bytes:
        """Sends one pickled request (call `ready` first) and returns the worker's pickled
        reply; raises WorkerDied when the worker goes away instead (it is buried and the
        sandbox marked for restart). Anything else that interrupts the exchange (a cancel)
        kills the worker: its channel would no longer be in step."""
        proc, writer, reader = self.proc, self.writer, self.reader
        assert proc is not None and writer is not None and reader is not None
        self._talking = True
        try:
            writer.write(_HEADER.pack(len(payload)) + payload)
            if writer.transport.get_write_buffer_size() > _DRAIN_ABOVE:
                await writer.drain()
            header = await reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(header)
            if size > MAX_REPLY_BYTES:  # the sandbox's memory limit does not hold in this process
                raise ReplyTooLarge(size)  # (below: the worker is killed, its channel out of step)
            data = await reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if self.jail is not None:  # bwrap exits right after the worker, with its status
                await _wait(proc, timeout=1.0)
            self._died(proc)
            await self._settle()
            raise WorkerDied(self._status(proc), self.log_tail()) from e
        except BaseException:
            self.kill()
            raise
        finally:
            self._talking = False
        if proc.poll() is not None:  # it replied, then died (the loop already saw it exit): bury it now
            self._died(proc)
        return data

    def _status(self, proc: subprocess.Popen[bytes]) -> int | None:
        """The worker's exit status as Popen gives it (-N: killed by signal N). bwrap
        reports a signal as 128 + N."""
        code = proc.returncode
        if self.jail is not None and code is not None and code > 128:
            return -(code - 128)
        return code

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
        self._unwatch()
        if self.writer is not None:
            self.writer.close()
            self.writer = self.reader = None
        self._channel = None
        if proc is None:
            return
        self.proc = None
        self._dying.append(proc)
        if self.cgroup is None:
            kill_descendants(proc.pid)  # its tree, daemons included (it is their subreaper)
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
        if self.grant is not None:
            self.grant.close()
            for path in self.grant.paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.kill()
        await self._settle()
        if self.cgroup is not None:
            self.cgroup.remove()
        if remove_files:
            if self.jail is not None:
                where = None if self.slot is None else self.slot.root
                if self.slot is not None:  # its mounts (a mount point cannot be renamed), its container
                    await asyncio.to_thread(self.jail.detach, self.slot)
            else:
                where = self._directory
                try:
                    os.unlink(self.log_path)
                except OSError:
                    pass
            if where is not None:
                doomed = f"{where}.closing-{id(self):x}"
                try:
                    os.rename(where, doomed)
                except OSError:
                    doomed = where
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


__all__ = ["MARKER", "WORKER_FILE", "Jail", "Needs", "ReplyTooLarge", "Sandbox", "Slot", "SlotDirs", "WarmWorkers",
           "WorkerDied"]
