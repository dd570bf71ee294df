"""Trajectory sandboxes as containers of a local podman or docker engine.

With the CPU manager's option `containers` ("podman" or "docker"), a trajectory whose calls
name an image (`Call.image`, a name in that engine's image store, as `podman images` or
`docker images` lists it) runs in a container of its own, so an existing image store (a
SWE-bench one, say) works unchanged: the image's own environment (its ENV, PATH included),
users and files, as `run` gives them.

  start   `ENGINE run -d` at the trajectory's first action: the image, its entrypoint
          replaced by a small init of the host's Python (it waits and reaps, nothing else),
          no network unless the first call (or the manager) asks for it, the manager's
          PIDs limit, no_new_privs, and, for podman under root, a user namespace of its
          own (the container's root is an unprivileged uid of the host). Bound in: the
          sandbox directory at /sandbox (HOME, the working directory), the grant channel
          at /run/tangram read-only, and what the host's Python needs under /run/host
          read-only, as for tangram's own image sandboxes (tangram.runtime.sandbox.rootfs):
          function actions run the orchestrator's interpreter whatever the image holds.
  exec    one `ENGINE exec -i` per worker, not per action: the sandbox worker
          (tangram/runtime/sandbox/inside_worker.py, "stdio" mode) talks over the engine's relay
          of its stdin and stdout, one frame each way per action, as any sandbox's does.
  resize  through the container's own cgroup, adopted by the sandbox: CPU weight, cpuset,
          quota and memory limit written there at each grant, as for tangram's own
          sandboxes. The containers are made under the manager's cgroup (`--cgroup-parent`)
          where the engine manages cgroups as plain directories (cgroupfs), so their
          weights share the CPUs with the manager's other sandboxes; under the systemd
          driver they land in the engine's slice and compete with its other containers.
  kill    every process of the container's cgroup but its init: the container and its
          files stay for the trajectory's next action, which starts a new worker.
  stop    `ENGINE rm -f` when the trajectory ends or the manager closes; a manager that was
          killed leaves its containers, which the next manager here removes at its start
          (their names carry the pid of the process that made them).

What a container is isolated from is the engine's business (its namespaces, seccomp profile
and capabilities, docs/sandbox.md); tangram adds no network by default, no_new_privs and
the PIDs limit. More `run` options (a runtime, `--cap-drop`, device flags) come from the
manager's `container_options`.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ManagerError
from .isolation import SandboxCgroup
from .namespaces import CONTROL, HOME, SYSTEM_DIRS, outermost
from .rootfs import HOST, host_python_argv, host_python_paths, inside
from .workers import MARKER, WORKER_FILE, Needs, Preload, SlotDirs, start_with_channel

ENGINES = ("podman", "docker")
# Host uids of the containers' user namespaces (podman under root): a range of 2**16 per
# container, CONTAINER_UID_BASE + ((pid % 31) * 2**10 + n % 2**10) * 2**16, above the uids of
# tangram's own sandboxes (tangram.runtime.sandbox.namespaces.SANDBOX_UID_BASE) and below 2**32 - 1.
CONTAINER_UID_BASE = 1 << 31
_ID_RANGE = 1 << 16
_NAME = re.compile(r"tangram-(\d+)\.\d+-c\d+")
# The container's PID 1: waits for orphans and reaps them (what the worker leaves when it dies)
_INIT = ("import os, signal\n"
         "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD, signal.SIGTERM, signal.SIGINT])\n"
         "while True:\n"
         "    signal.sigwait([signal.SIGCHLD])\n"
         "    try:\n"
         "        while os.waitpid(-1, os.WNOHANG)[0]:\n"
         "            pass\n"
         "    except ChildProcessError:\n"
         "        pass\n")


class ContainerError(ManagerError):
    """The engine could not do what a sandbox needed (start, exec): `reason` has its words."""


def _engine_says(result: subprocess.CompletedProcess[str]) -> str:
    text = (result.stderr or result.stdout or "").strip().splitlines()
    return text[-1] if text else f"exit status {result.returncode}"


@dataclass(frozen=True)
class ContainerSlot(SlotDirs):
    """Where a container sandbox lives: its host directory `root` (home, control, log, as a
    tangram slot's), its container, the container's init and adopted cgroup, and what
    the container was made with (its network is fixed from then on)."""

    image: str
    name: str
    init: int
    cgroup: SandboxCgroup | None
    network: bool
    uid: int | None = None  # the container root's host uid (its user namespace), if any
    mounted: bool = False  # (never a tmpfs: disk limits are not offered for containers)
    rootfs: None = None  # the engine's, not tangram's


class ContainerJail:
    """Starts trajectory sandboxes as containers of `engine`: what a Sandbox asks of
    tangram.runtime.sandbox.workers.Jail (default, new_slot, spawn, detach, base_processes)."""

    base_processes = 2  # the container's init and the worker

    def __init__(self, engine: str, directory: str, read_only: Sequence[str], network: bool,
                 pids_limit: int | None, run_options: Sequence[str], cgroup_parent: str | None,
                 owner: str) -> None:
        """`read_only`: host paths the worker needs (shown under /run/host); `owner`: the
        manager's id, in the containers' names (`tangram-<owner>-c<n>`)."""
        self.engine = engine
        self.directory = directory
        self.read_only = read_only
        self.network = network
        self.pids_limit = pids_limit
        self.run_options = list(run_options)
        self.cgroup_parent = cgroup_parent
        self.owner = owner
        self.podman = os.path.basename(engine) == "podman"
        self.own_uids = os.geteuid() == 0 and self.podman
        self._uid_base = CONTAINER_UID_BASE + (os.getpid() % 31) * (1 << 10) * _ID_RANGE
        self._slots = itertools.count(1)
        self.default = Needs(network=network)

    @functools.cached_property
    def mounts(self) -> list[str]:
        """The `-v` options of what the worker needs from the host, read-only under HOST."""
        out: list[str] = []
        # the system directories the host's Python and its loader need, as bwrap shows them to
        # an image sandbox (tangram.runtime.sandbox.namespaces), but /etc: not the host's accounts and
        # configuration (with docker the container's root is the host's root); a symlinked
        # one (/lib -> usr/lib) is reached through its target
        system = [d for d in SYSTEM_DIRS if d != "/etc" and os.path.isdir(d) and not os.path.islink(d)]
        for path in [*system, *outermost([*self.read_only, *host_python_paths()])]:
            out += ["-v", f"{path}:{HOST}{path}:ro"]
        return out

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        try:  # in the manager's directory: the engine's monitor (conmon) writes files where it starts
            return subprocess.run([self.engine, *args], capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, cwd=self.directory)
        except (OSError, subprocess.TimeoutExpired) as e:
            return subprocess.CompletedProcess([self.engine, *args], 125, "", f"{self.engine} {args[0]}: {e}")

    def new_slot(self, image: str, needs: Needs | None = None) -> ContainerSlot:
        """Starts a container of `image` for a sandbox (blocking: the engine takes a tenth of
        a second or more). ContainerError with the engine's words when it fails."""
        n = next(self._slots)
        root = os.path.join(self.directory, f"c{n}")
        name = f"tangram-{self.owner}-c{n}"
        network = self.network or (needs is not None and needs.network)
        uid = self._uid_base + (n % (1 << 10)) * _ID_RANGE if self.own_uids else None
        os.mkdir(root, 0o755)
        dirs = SlotDirs(root)
        home, control = dirs.home, dirs.control
        os.mkdir(home, 0o777)
        os.chmod(home, 0o777)  # whatever user the image runs as (a host directory only the manager's can reach)
        os.mkdir(control, 0o755)
        argv = ["run", "-d", "--name", name, "--security-opt", "no-new-privileges",
                "--env", f"HOME={HOME}", "--workdir", HOME,
                "-v", f"{home}:{HOME}", "-v", f"{control}:{CONTROL}:ro", *self.mounts]
        if not network:
            argv += ["--network", "none"]
        if self.pids_limit is not None:
            argv += ["--pids-limit", str(self.pids_limit)]
        if self.cgroup_parent is not None:
            argv += ["--cgroup-parent", self.cgroup_parent]
        if uid is not None:
            argv += ["--uidmap", f"0:{uid}:{_ID_RANGE}", "--gidmap", f"0:{uid}:{_ID_RANGE}"]
        pidfile = os.path.join(root, "init.pid") if self.podman else None
        if pidfile is not None:  # the init's pid without an `inspect` (docker has no such option)
            argv += ["--pidfile", pidfile]
        python = host_python_argv()
        argv += [*self.run_options, "--entrypoint", python[0], image, *python[1:], "-c", _INIT]
        started = self._run(*argv)
        if started.returncode != 0:
            self._run("rm", "-f", name)
            shutil.rmtree(root, ignore_errors=True)
            raise ContainerError("call.image", f"{self.engine} could not start a container of {image!r}: "
                                 f"{_engine_says(started)}")
        try:
            init = _read_pid(pidfile) if pidfile is not None else 0
            if init <= 0:
                state = self._run("inspect", "--format", "{{.State.Pid}}", name)
                init = int(state.stdout.strip() or 0) if state.returncode == 0 else 0
            if init <= 0:
                raise ContainerError("call.image", f"the container {name} of {image!r} stopped as it started: "
                                     f"{_engine_says(self._run('logs', name))}")
            try:
                cgroup = SandboxCgroup.adopt(init, spare=init)
            except OSError as e:
                raise ContainerError("managers.cpu.containers", f"cannot manage the cgroup of the container {name} "
                                     f"here: {e.strerror}") from None
        except BaseException:
            self._run("rm", "-f", name)
            shutil.rmtree(root, ignore_errors=True)
            raise
        return ContainerSlot(root, image, name, init, cgroup, network, uid)

    def spawn(self, slot: ContainerSlot, needs: Needs, env: Mapping[str, str],
              preload: Preload | None) -> tuple[subprocess.Popen[bytes], socket.socket]:
        """A new worker in the slot's container, and the orchestrator's end of its channel."""
        if needs.network and not slot.network:
            raise ContainerError("call.network", f"the trajectory's container {slot.name} was started without a "
                                 "network; a container's network is fixed at its first call (ask for it there, or "
                                 "set managers.cpu.network)")
        start: dict[str, Any] = {"merge_environ": True, "sys_path": [inside(p) for p in sys.path if p]}
        if preload is not None and preload.modules:
            start.update(path=[inside(p) for p in preload.path], preload=list(preload.modules))
        argv = [self.engine, "exec", "-i", "--env", f"{MARKER}={env.get(MARKER, '')}", slot.name,
                *host_python_argv(), inside(WORKER_FILE), "stdio", json.dumps(start)]
        return start_with_channel(slot.log, lambda child, log: subprocess.Popen(
            argv, cwd=slot.root, stdin=child, stdout=child, stderr=log, start_new_session=True, close_fds=True))

    def detach(self, slot: ContainerSlot) -> None:
        """Before its files go: the container removed (its processes killed)."""
        self._run("rm", "-f", "-t", "0", slot.name)


def _read_pid(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def engine_path(engine: str, field: str) -> str:
    """The engine's executable (`engine`: "podman", "docker" or a path to either)."""
    found = shutil.which(engine)
    if found is None:
        raise ManagerError(field, f"{engine!r} is not installed here (not found on PATH)")
    return found


def check_engine(engine: str, field: str) -> str:
    """The engine's cgroup driver ("cgroupfs", "systemd", ...), after checking that it
    answers. ManagerError with its words when it does not."""
    docker = os.path.basename(engine).startswith("docker")
    fmt = "{{.CgroupDriver}}" if docker else "{{.Host.CgroupManager}}"
    try:
        result = subprocess.run([engine, "info", "--format", fmt], capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ManagerError(field, f"{engine} does not answer: {e}") from None
    if result.returncode != 0:
        raise ManagerError(field, f"{engine} does not work here: {_engine_says(result)}")
    return result.stdout.strip()


def image_known(engine: str, image: str) -> str | None:
    """None when the engine's store has `image`, else the engine's words."""
    result = subprocess.run([engine, "image", "inspect", "--format", "{{.Id}}", image], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    return None if result.returncode == 0 else _engine_says(result)


def remove_orphans(engine: str) -> list[str]:
    """Removes the containers of managers whose process is gone (a killed orchestrator);
    returns their names."""
    try:
        listed = subprocess.run([engine, "ps", "-a", "--filter", "name=tangram-", "--format", "{{.Names}}"],
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gone = []
    for name in listed.stdout.split():
        m = _NAME.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        gone.append(name)
    if gone:
        subprocess.run([engine, "rm", "-f", "-t", "0", *gone], capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    return gone


__all__ = ["CONTAINER_UID_BASE", "ENGINES", "ContainerError", "ContainerJail", "ContainerSlot", "check_engine",
           "engine_path", "image_known", "remove_orphans"]
