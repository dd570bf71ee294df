"""The sandbox side of a Sandbox Fusion request: what runs in the trajectory's sandbox
worker (tangram.runtime.sandbox.run_code checks the request and makes it an action; its docstring
says what this does). The standard library only, in the base layer, so that a sandbox
worker that has imported tangram.worker (every one does, as it starts) imports this at
no cost: a pooled or fresh sandbox's first request pays for nothing else.
"""

from __future__ import annotations

import base64
import errno
import functools
import itertools
import os
import re
import resource  # imported here, not in the forked child: a child's import costs every request milliseconds
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Mapping

# language -> (source file, compile argv or None, run argv); "{src}" and "{exe}" are
# replaced by the source file and the program built from it. "python" runs the
# sandbox's own interpreter.
LANGUAGES: dict[str, tuple[str, tuple[str, ...] | None, tuple[str, ...]]] = {
    "python": ("main.py", None, ("{python}", "{src}")),
    "pytest": ("test_main.py", None, ("{python}", "-m", "pytest", "-q", "{src}")),
    "bash": ("main.sh", None, ("bash", "{src}")),
    "cpp": ("main.cpp", ("g++", "-std=c++17", "{src}", "-o", "{exe}", "-lpthread"), ("{exe}",)),
    "go": ("main.go", ("go", "build", "-o", "{exe}", "{src}"), ("{exe}",)),
    "java": ("Main.java", ("javac", "{src}"), ("java", "-cp", ".", "-ea", "Main")),
    "rust": ("main.rs", ("rustc", "{src}", "-o", "{exe}"), ("{exe}",)),
    "nodejs": ("main.js", None, ("node", "{src}")),
    "typescript": ("main.ts", None, ("tsx", "{src}")),
    "php": ("main.php", None, ("php", "-f", "{src}")),
    "perl": ("main.pl", None, ("perl", "{src}")),
    "ruby": ("main.rb", None, ("ruby", "{src}")),
    "lua": ("main.lua", None, ("lua", "{src}")),
    "R": ("main.R", None, ("Rscript", "{src}")),
    "julia": ("main.jl", None, ("julia", "{src}")),
}

OUTPUT_LIMIT = 1 << 20  # bytes of stdout and of stderr read back per step
# Bytes of fetch_files read back per request, all its files together: one past it ends the
# request in a SandboxError naming the file, and no more than the limit is ever read into
# memory (the answer crosses the worker's channel and the endpoint as base64, 4/3 of it).
FETCH_LIMIT = 32 << 20
# Seconds the scrub after a pooled request waits for the processes it killed to be gone:
# past it the scrub fails (ScrubError) and the sandbox is ended instead of reused.
SCRUB_SECONDS = 5.0


class ScrubError(RuntimeError):
    """A pooled sandbox could not be scrubbed after a request (a process that would not
    die, something it could not remove, a part of the sandbox the request changed): the
    request's action fails with it, so the CPU manager ends the sandbox rather than hand
    it to the next request."""


def run_code(request: Mapping[str, Any], keep_files: bool = False, scrub: bool = False,
             fetch_limit: int = FETCH_LIMIT) -> dict[str, Any]:
    """Runs one checked request (`check_request`) in the current directory (the sandbox's):
    returns the Sandbox Fusion response as a dict (see the module docstring). fetch_files
    past `fetch_limit` bytes in all are a SandboxError naming the file (the run's results
    and the files fetched before it are kept). `scrub` (a sandbox pooled between requests
    without a session): afterwards the sandbox is made as the next request must find it
    (`_scrub`): every process the request left is killed, whatever it did to escape, and
    every place it could write is emptied, and this worker's own limits and scheduling
    (which the request's processes, of its uid, may change from outside) are set back as
    they were before its first request; a scrub that cannot finish raises ScrubError, and
    so does a request that finds the worker changed where it cannot be set back."""
    _note_worker()  # this process's limits and scheduling, before any request of it runs
    if scrub:
        _adopt_orphans()
        own = _own_pid_namespace()
        if own:
            _take_skeleton()  # the sandbox's own file tree as bwrap made it, before any request of this worker
        worker = _worker_at_start()
        try:
            return run_code(request, keep_files=False, fetch_limit=fetch_limit)
        finally:
            _scrub(own, worker)
    language = request["language"]
    entry = LANGUAGES.get(language)
    if entry is None:
        return sandbox_error(f"language {language!r} is not run by tangram's endpoint (it runs "
                             f"{', '.join(LANGUAGES)})")
    source, compile_argv, run_argv = entry
    workdir = os.getcwd() if keep_files else tempfile.mkdtemp(prefix="run_code-", dir=os.getcwd())
    try:
        for path, content in request["files"].items():
            target = os.path.join(workdir, path)
            os.makedirs(os.path.dirname(target) or workdir, exist_ok=True)
            with open(target, "wb") as f:
                f.write(content)
        with open(os.path.join(workdir, source), "w", encoding="utf-8") as f:
            f.write(request["code"])
        names = {"src": source, "exe": os.path.join(workdir, "main.out"), "python": sys.executable}
        memory = request["memory_limit_MB"]
        compile_result = None
        if compile_argv is not None:
            compile_result = _step(compile_argv, names, workdir, None, request["compile_timeout"], memory)
            if compile_result["status"] == "Error":
                return sandbox_error(compile_result["stderr"], compile_result=compile_result)
            if compile_result["status"] != "Finished" or compile_result["return_code"] != 0:
                try:
                    files = _fetch(workdir, request["fetch_files"], fetch_limit)
                except _FetchError as e:
                    return sandbox_error(str(e), compile_result, None, e.files)
                return _response("Failed", compile_result, None, files)
        run_result = _step(run_argv, names, workdir, request["stdin"], request["run_timeout"], memory)
        try:
            files = _fetch(workdir, request["fetch_files"], fetch_limit)
        except _FetchError as e:
            return sandbox_error(str(e), compile_result, run_result, e.files)
        if run_result["status"] == "Error":
            return sandbox_error(run_result["stderr"], compile_result, run_result, files)
        ok = run_result["status"] == "Finished" and run_result["return_code"] == 0
        return _response("Success" if ok else "Failed", compile_result, run_result, files)
    finally:
        if keep_files:
            try:
                os.unlink(os.path.join(workdir, source))
            except OSError:
                pass
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def run_code_timed(request: Mapping[str, Any], keep_files: bool = False, scrub: bool = False,
                   fetch_limit: int = FETCH_LIMIT) -> tuple[dict[str, Any], float]:
    """run_code, and the seconds it took here in the sandbox: everything running the
    request costs, from its files written to its sandbox scrubbed (the endpoint's
    Server-Timing `run` metric; what the endpoint spends beyond it is its own)."""
    began = time.perf_counter()
    answer = run_code(request, keep_files, scrub, fetch_limit)
    return answer, time.perf_counter() - began


# ------------------------------------------------------------------ the scrub of a pooled sandbox


def _scrub(own_namespace: bool, worker: _Expected | None = None) -> None:
    """Makes the sandbox as the next request must find it, or raises ScrubError:

    - processes: in a PID namespace of the sandbox's own (`own_namespace`: a namespaced
      sandbox), every process but bwrap's init and this worker is killed
      (`_kill_namespace`); elsewhere (a bare process, a container) every descendant of this
      worker, at every depth (`_kill_descendants`);
    - the worker itself (`worker`: what `_worker_at_start` said it must be): its resource
      limits, and per thread its scheduling (policy, priority, nice value, slice) and I/O
      priority, which a process of its uid may change from outside (prlimit, setpriority,
      sched_setscheduler, sched_setattr, ioprio_set on it) and its next request's programs
      would inherit, are set back where an unprivileged process can (a soft limit under
      its hard one, the I/O priority, SCHED_BATCH, the slice); what it cannot set back (a
      lowered hard limit, a raised nice value, SCHED_IDLE, SCHED_RESET_ON_FORK) is a
      problem. Its CPU affinity (sched_setaffinity on it) is reset to every CPU, which the
      kernel narrows to the cpuset (`_settle_worker`);
    - files: the sandbox's directory and its TMPDIR are emptied, and in a namespaced sandbox
      its /tmp and /dev/shm too (every place there it can write), directories the request
      made unreadable or read-only included, symlinks removed and never followed, mount
      points (read-only paths shown inside /tmp) left as they are (`_empty`); the parts of
      the sandbox bwrap made (its root, /dev and /run, on tmpfs: writable to a sandbox
      without uids of its own) are checked against what they held before the worker's first
      scrubbed request, what a request added removed (`_check_skeleton`);
    - IPC, in a namespaced sandbox (an IPC namespace of its own): its System V shared
      memory segments, message queues and semaphore sets are removed (`_remove_sysv_ipc`).
    A problem left by any of these is a ScrubError (the sandbox is then ended, not reused).
    """
    deadline = time.monotonic() + SCRUB_SECONDS
    if worker is not None:  # limits first, as far as they go back (a low RLIMIT_NOFILE would stop the kill)
        _settle_limits(worker[0], [])
    if own_namespace:
        _kill_namespace(deadline)
    else:
        _kill_descendants(deadline)
    problems: list[str] = []
    if worker is not None:  # nothing of the request's is left to change it again
        _settle_worker(worker, problems)
    mounts = _mounts()
    home = os.path.realpath(os.getcwd())
    keep: set[str] = set()
    places = [home]
    tmp = os.environ.get("TMPDIR", "")
    if tmp and os.path.isdir(tmp):
        tmp = os.path.abspath(tmp)  # not resolved: a request that made it a symlink gets that removed, not followed
        if tmp.startswith(home + "/"):
            keep.add(tmp)  # the sandbox's .tmp inside its directory stays, emptied
        elif own_namespace:  # a bare process's TMPDIR elsewhere (a call's env) may be the host's
            places.append(tmp)
    if own_namespace:
        places += ["/tmp", "/dev/shm"]
    done: set[str] = set()
    for place in places:
        if place not in done:
            done.add(place)
            _empty(place, mounts, keep, problems)
    for path in keep:  # a request that replaced it (a symlink, a file) had it removed
        if not os.path.isdir(path) or os.path.islink(path):
            try:
                os.mkdir(path)
            except OSError as e:
                problems.append(f"{path}: {e.strerror or e}")
    if own_namespace:
        _check_skeleton(mounts, problems)
        _remove_sysv_ipc(problems)
    if problems:
        raise ScrubError(f"the pooled sandbox could not be scrubbed after the request, so it is ended: "
                         f"{_shown(problems)}")


_subreaper_pid = 0  # the process made a subreaper already (the flag is the process's, for good)


def _adopt_orphans() -> None:
    """Makes this process a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER): a process
    a step detached (setsid, a double fork) becomes its child when its parent exits, where
    `_kill_descendants` finds it."""
    global _subreaper_pid
    if _subreaper_pid == os.getpid():
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # not Linux: the steps' process groups are still killed
        pass
    _subreaper_pid = os.getpid()


def _own_pid_namespace() -> bool:
    """Whether this process is a namespaced sandbox's worker in the sandbox's own PID
    namespace: bwrap starts the worker as pid 2, its init being pid 1
    (tangram.runtime.sandbox.namespaces), so every other process there is the sandbox's.
    Not so for a bare process (isolation="process": the host's namespace) nor a container's
    worker (its init is the engine's), nor a child the worker forked: there, other processes
    than the sandbox's may share the namespace."""
    if os.getpid() != 2 or os.getppid() != 1:
        return False
    try:
        with open("/proc/1/cmdline", "rb") as f:
            init = f.read().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(init) == b"bwrap"


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process /proc shows."""
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            table[int(name)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile
    return table


def _reap(table: Mapping[int, tuple[int, str]]) -> None:
    """Reaps this process's children in `table` that have exited (never waits)."""
    me = os.getpid()
    for pid, (parent, _) in table.items():
        if parent == me:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _kill_namespace(deadline: float) -> None:
    """Kills every process of this PID namespace but its init and this one, and reaps
    those that were this one's children. kill(-1) signals, at once and at any depth, every
    process this one may signal (those of the sandbox all run as its uid), and a process
    killed so cannot fork any more (a fork under way gives its child the signal too), so
    each round leaves only processes on their way out: it repeats until /proc shows none
    alive but init and this one, ScrubError past `deadline`."""
    me = os.getpid()
    pause = 0.0005
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:  # ESRCH: none left to signal
            pass
        table = _processes()
        _reap(table)
        left = sorted(pid for pid, (_, state) in table.items() if pid not in (1, me) and state not in ("Z", "X"))
        if not left:
            return
        if time.monotonic() > deadline:
            raise ScrubError(f"processes the request left did not die within {SCRUB_SECONDS:g} s of SIGKILL "
                             f"(pids {left[:10]} of the sandbox's PID namespace)")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _kill_descendants(deadline: float) -> None:
    """Kills and reaps every descendant of this process, all of them each round: /proc is
    read, every process whose chain of parents leads here is killed (those that detached
    themselves too: as a subreaper this process inherits the orphans), until none is left;
    ScrubError past `deadline`. A process is only signalled while it is still the child of
    the parent /proc named (a pidfd pins it): a pid reused meanwhile by a process outside
    the sandbox is left alone."""
    me = os.getpid()
    pause = 0.0005
    while True:
        if _childless():
            return  # and so without descendants: an orphan comes back here
        table = _processes()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        mine: list[int] = []
        level = children.get(me, [])
        while level:
            mine += level
            level = [c for pid in level for c in children.get(pid, ())]
        if not mine:
            return
        for pid in mine:
            _kill_child_of(pid, table[pid][0])
        _reap(table)
        if time.monotonic() > deadline:
            raise ScrubError(f"processes the request left did not die within {SCRUB_SECONDS:g} s of SIGKILL "
                             f"(pids {sorted(mine)[:10]})")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _childless() -> bool:
    """Whether /proc says this process has no child (False where it cannot tell): what a
    bare process's scrub reads instead of the whole host's /proc when nothing was left."""
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                if f.read().strip():
                    return False
    except OSError:
        return False
    return True


def _kill_child_of(pid: int, parent: int) -> None:
    """SIGKILL to `pid` if it is still `parent`'s child."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    except AttributeError:  # Python without pidfds: the pid as /proc named it a moment ago
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            now = int(f.read().rsplit(b")", 1)[1].split()[1])
        if now == parent:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (OSError, IndexError, ValueError):
        pass
    finally:
        os.close(pidfd)


# ---- the worker's own limits and scheduling
# A request's processes run as the worker's uid, so they may change the worker from outside:
# its resource limits (prlimit), and per thread its nice value (setpriority, also through
# PRIO_PGRP and PRIO_USER), scheduling policy, priority and slice (sched_setscheduler,
# sched_setattr), I/O priority (ioprio_set) and CPU affinity (sched_setaffinity); the
# programs of every later request, the worker's children, would inherit them. Nothing else
# of it is theirs to change: the worker is not dumpable (its /proc files are root's: no
# oom_score_adj, timerslack_ns, comm, memory or file descriptors), not traceable, and its
# umask and directory are its own to change. Its limits, scheduling and I/O priority are
# noted before the first request of the process runs (`_note_worker`) and checked before
# and after each scrubbed one; its affinity is reset after each.

# Every resource limit of the platform, number -> name.
_RLIMIT_NAMES = {getattr(resource, name): name for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
# Linux system calls Python has no function for, per machine: ioprio_set, ioprio_get,
# sched_setattr, sched_getattr. Elsewhere the I/O priority is not checked, nor the slice,
# deadline parameters and utilization clamps of sched_getattr (os's functions still read
# and set the policy, priority and nice value).
_SYSCALLS = {"x86_64": (251, 252, 314, 315), "aarch64": (30, 31, 274, 275)}.get(os.uname().machine)
_IOPRIO_WHO_PROCESS = 1
_SCHED_ATTR = struct.Struct("=IIQiIQQQII")  # struct sched_attr: size, policy, flags, nice, priority,
# runtime, deadline, period, util_min, util_max
_SCHED_RESET_ON_FORK = 0x40000000  # in a policy: its children start with the default scheduling
_SCHED_FLAG_RESET_ON_FORK, _SCHED_FLAG_UTIL_CLAMP = 0x01, 0x60
_POLICIES = {0: "SCHED_OTHER", 1: "SCHED_FIFO", 2: "SCHED_RR", 3: "SCHED_BATCH", 5: "SCHED_IDLE", 6: "SCHED_DEADLINE"}
_SCHED_FIELDS = ("policy", "priority", "nice value", "slice (sched_runtime, ns)", "sched_deadline", "sched_period",
                 "minimum utilization clamp", "maximum utilization clamp")
# Every CPU id there may be: the affinity a thread is reset to, which the kernel narrows to
# its cpuset (a cgroup's, a container's) and that follows the cpuset when it changes.
_ALL_CPUS = range(max(os.sysconf("SC_NPROCESSORS_CONF"), os.cpu_count() or 1, 1024))

_Thread = tuple[tuple[int, ...], "int | None"]  # a thread's scheduling (`_sched`) and I/O priority (None: not read)
# What the worker must be: its limits (number -> soft, hard), and its threads' (thread id ->
# _Thread; one not named there: its main thread's).
_Expected = tuple[dict[int, tuple[int, int]], dict[int, _Thread]]
_worker: tuple[int, _Expected] | None = None  # (pid, how it was before its first request)


def _note_worker() -> None:
    """Notes this process's limits and its threads' scheduling and I/O priority, once per
    process, before its first request (run_code's first call here, whether scrubbed or
    not) runs anything: what every later scrubbed request must find it as."""
    global _worker
    pid = os.getpid()
    if _worker is not None and _worker[0] == pid:
        return
    threads: dict[int, _Thread] = {}
    for tid in _tasks():
        try:
            threads[tid] = (_sched(tid), _ioprio(tid))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    if pid not in threads:
        threads[pid] = (_sched(0), _ioprio(0))
    _worker = (pid, (_limits(), threads))


def _worker_at_start() -> _Expected:
    """Before a scrubbed request: the worker as `_note_worker` found it, set back where
    something changed it since (ScrubError where it cannot be: the sandbox is ended before
    the request runs anything). Returns what the scrub after the request must find: the
    same, with the soft RLIMIT_AS as it is now (the worker sets it per action itself:
    tangram.runtime.sandbox.inside_worker's affinity mode)."""
    _note_worker()
    assert _worker is not None
    limits, threads = dict(_worker[1][0]), _worker[1][1]
    if resource.RLIMIT_AS in limits:
        now = resource.getrlimit(resource.RLIMIT_AS)
        if now[1] == limits[resource.RLIMIT_AS][1]:
            limits[resource.RLIMIT_AS] = now
    problems: list[str] = []
    _settle_worker((limits, threads), problems, affinity=False)  # the worker just pinned itself (affinity mode)
    if problems:
        raise ScrubError(f"the pooled sandbox's worker was changed before the request, so the sandbox is ended: "
                         f"{_shown(problems)}")
    return limits, threads


def _settle_worker(want: _Expected, problems: list[str], affinity: bool = True) -> None:
    """Sets this process back as `want` says where it differs, as far as an unprivileged
    process may; what stays different goes to `problems`, named. `affinity`: every
    thread's CPU affinity is reset too (to every CPU, which the kernel narrows to the
    cpuset: the affinity a thread that never set one has, and that follows a cpuset
    changed later; in affinity mode the worker pins itself again at its next action)."""
    limits, threads = want
    _settle_limits(limits, problems)
    pid = os.getpid()
    for tid in _tasks():
        sched, ioprio = threads.get(tid) or threads[pid]
        who = "the worker's" if tid == pid else f"the worker's thread {tid}'s"
        try:
            now = _sched(tid)
            if now != sched:
                _set_sched(tid, sched)
                now = _sched(tid)
                if now != sched:
                    changed = ", ".join(f"{field} {_sched_value(i, a)} (was {_sched_value(i, b)})" for i, (field, a, b)
                                        in enumerate(zip(_SCHED_FIELDS, now, sched)) if a != b)
                    problems.append(f"{who} scheduling cannot be set back: {changed}")
            if ioprio is not None and _ioprio(tid) != ioprio:
                try:
                    _syscall(_SYSCALLS[0], _IOPRIO_WHO_PROCESS, tid, ioprio)  # type: ignore[index]
                except OSError:
                    pass
                now_io = _ioprio(tid)
                if now_io != ioprio:
                    problems.append(f"{who} I/O priority cannot be set back: {_ioprio_text(now_io)} (was "
                                    f"{_ioprio_text(ioprio)})")
            if affinity and hasattr(os, "sched_setaffinity"):
                try:
                    os.sched_setaffinity(tid, _ALL_CPUS)
                except ProcessLookupError:
                    raise
                except OSError as e:
                    problems.append(f"{who} CPU affinity cannot be reset: {e.strerror or e}")
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def _settle_limits(limits: Mapping[int, tuple[int, int]], problems: list[str]) -> None:
    """Sets each resource limit back to `limits` where it differs: a soft limit goes back
    under its hard one, a hard limit only goes back up with CAP_SYS_RESOURCE; what stays
    different goes to `problems`."""
    for number, was in limits.items():
        try:
            now = resource.getrlimit(number)
            if now == was:
                continue
            try:
                resource.setrlimit(number, was)
            except (OSError, ValueError):  # ValueError: a hard limit to raise
                pass
            after = resource.getrlimit(number)
        except (OSError, ValueError):
            continue
        if after != was:
            problems.append(f"the worker's {_RLIMIT_NAMES.get(number, number)} (soft/hard) cannot be set back: "
                            f"{_limit_text(after)} (was {_limit_text(was)})")


def _limits() -> dict[int, tuple[int, int]]:
    found = {}
    for number in _RLIMIT_NAMES:
        try:
            found[number] = resource.getrlimit(number)
        except (OSError, ValueError):  # a limit this kernel does not have
            pass
    return found


def _tasks() -> list[int]:
    """This process's thread ids (the main one first)."""
    pid = os.getpid()
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return [pid]
    return sorted(tids, key=lambda tid: tid != pid)


def _syscall(number: int, *args: Any) -> int:
    import ctypes

    result = _libc().syscall(number, *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def _has_sched_attr() -> bool:
    """Whether sched_getattr answers here (a seccomp filter may deny it)."""
    return _SYSCALLS is not None and _sched_attr(0) is not None


def _sched_attr(tid: int) -> tuple[int, ...] | None:
    import ctypes

    buffer = ctypes.create_string_buffer(_SCHED_ATTR.size)
    try:
        _syscall(_SYSCALLS[3], tid, buffer, _SCHED_ATTR.size, 0)  # type: ignore[index]
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise ProcessLookupError(e.errno, e.strerror) from None
        return None
    return _SCHED_ATTR.unpack(buffer.raw)  # type: ignore[no-any-return]


def _sched(tid: int) -> tuple[int, ...]:
    """Thread `tid`'s scheduling, as _SCHED_FIELDS names it: its policy (with
    SCHED_RESET_ON_FORK), priority and nice value, and where sched_getattr answers, its
    slice (a normal thread's sched_runtime), deadline parameters and utilization clamps."""
    own = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority, os.getpriority(os.PRIO_PROCESS, tid))
    if not _has_sched_attr():
        return own
    attr = _sched_attr(tid)
    return own + (attr[5:] if attr is not None else (-1,) * 5)


def _set_sched(tid: int, want: tuple[int, ...]) -> None:
    """Sets thread `tid`'s scheduling to `want` (`_sched`'s), as far as this process may."""
    policy, priority, nice = want[:3]
    now = _sched(tid)
    try:
        if now[:2] != (policy, priority):
            os.sched_setscheduler(tid, policy, os.sched_param(priority))
        if _sched(tid)[2] != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass
    if len(want) == 3 or _sched(tid) == want:
        return
    runtime, deadline, period, least, most = want[3:]
    flags = _SCHED_FLAG_RESET_ON_FORK if policy & _SCHED_RESET_ON_FORK else 0
    if (least, most) != _sched(tid)[6:]:
        flags |= _SCHED_FLAG_UTIL_CLAMP
    for slice_ns in dict.fromkeys((0, runtime)):  # 0: a normal thread's default slice, which it most likely had
        attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, policy & ~_SCHED_RESET_ON_FORK, flags, nice, priority, slice_ns,
                                deadline, period, least, most)
        try:
            _syscall(_SYSCALLS[2], tid, attr, 0)  # type: ignore[index]
        except OSError:
            return
        if _sched(tid) == want:
            return


def _ioprio(tid: int) -> int | None:
    """Thread `tid`'s I/O priority (ioprio_get), None where it cannot be read."""
    if _SYSCALLS is None:
        return None
    try:
        return _syscall(_SYSCALLS[1], _IOPRIO_WHO_PROCESS, tid)
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise ProcessLookupError(e.errno, e.strerror) from None
        return None


def _sched_value(field: int, value: int) -> str:
    if field != 0:
        return str(value)
    name = _POLICIES.get(value & ~_SCHED_RESET_ON_FORK, str(value & ~_SCHED_RESET_ON_FORK))
    return name + ("|SCHED_RESET_ON_FORK" if value & _SCHED_RESET_ON_FORK else "")


def _ioprio_text(value: int | None) -> str:
    if value is None:
        return "unreadable"
    return f"class {value >> 13} level {value & 0x1FFF}"


def _limit_text(limit: tuple[int, int]) -> str:
    return "/".join("unlimited" if v == resource.RLIM_INFINITY else str(v) for v in limit)


def _shown(problems: list[str]) -> str:
    return "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")


# ---- files


def _mounts() -> dict[str, str]:
    """Mount point -> file system type, as this process sees them (/proc/self/mountinfo)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split(b" ")
        try:
            fstype = fields[fields.index(b"-") + 1]
        except (ValueError, IndexError):
            continue
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
        found[os.fsdecode(point)] = os.fsdecode(fstype)
    return found


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _empty(directory: str, mounts: Mapping[str, str], keep: set[str], problems: list[str]) -> None:
    """Removes what `directory` holds (a real path), directories the request made
    unreadable or read-only included, never following a symlink; mount points under it
    stay, and the directories on the way to one and those in `keep` stay, emptied. What
    cannot be removed goes to `problems`."""
    on_the_way = {os.path.dirname(p) for p in mounts} | set(keep)
    while True:  # every ancestor of a mount point
        more = {os.path.dirname(p) for p in on_the_way} - on_the_way
        if not more:
            break
        on_the_way |= more
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as e:
        problems.append(f"{directory}: {e.strerror or e}")
        return
    try:
        _unlock(fd)
        _empty_at(fd, directory, mounts, on_the_way, problems)
    except OSError as e:
        problems.append(f"{directory}: {e.strerror or e}")
    finally:
        os.close(fd)


def _empty_at(fd: int, path: str, mounts: Mapping[str, str], on_the_way: set[str], problems: list[str]) -> None:
    try:
        with os.scandir(fd) as entries:
            listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    except OSError as e:
        problems.append(f"{path}: {e.strerror or e}")
        return
    for name, is_dir in listed:
        full = os.path.join(path, name)
        if full in mounts:
            continue
        try:
            if is_dir and full in on_the_way:
                sub = _open_dir(name, fd)
                try:
                    _empty_at(sub, full, mounts, on_the_way, problems)
                finally:
                    os.close(sub)
            else:
                _remove(name, fd, is_dir)
        except OSError as e:
            problems.append(f"{full}: {e.strerror or e}")


def _remove(name: str, dir_fd: int, is_dir: bool) -> None:
    """Removes the entry `name` of the directory open at `dir_fd`, a whole tree if it is a
    directory (not a symlink to one)."""
    if not is_dir:
        os.unlink(name, dir_fd=dir_fd)
        return
    sub = _open_dir(name, dir_fd)
    try:
        _clear(sub)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)


def _clear(top: int) -> None:
    """Removes everything in the directory open at `top` (unlocked): depth first with one
    directory open at a time, so a tree of any depth; each directory gets its owner's rwx
    back before it is read, and symlinks are removed, never followed. Going back up, ".."
    must be the directory come down from (nothing runs in the sandbox any more; else
    OSError)."""
    fd = os.dup(top)
    above: list[tuple[str, int, int]] = []  # per level below `top`: its name, its parent's st_dev and st_ino
    pending: list[list[str]] = [[]]  # per level: subdirectories listed, not yet removed
    try:
        while True:
            if pending[-1]:
                name = pending[-1].pop()
                sub = _open_dir(name, fd)
                st = os.fstat(fd)
                above.append((name, st.st_dev, st.st_ino))
                pending.append([])
                os.close(fd)
                fd = sub
                continue
            with os.scandir(fd) as entries:
                batch = [(e.name, e.is_dir(follow_symlinks=False)) for e in itertools.islice(entries, 1024)]
            for name, is_dir in batch:
                if not is_dir:
                    os.unlink(name, dir_fd=fd)
            pending[-1] = [name for name, is_dir in batch if is_dir]
            if batch:
                continue
            if not above:
                return
            name, dev, ino = above.pop()
            pending.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise OSError(errno.EBUSY, "a directory moved while it was being removed")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


def _open_dir(name: str, dir_fd: int) -> int:
    """The directory `name` of the one open at `dir_fd` (never a symlink's target), opened
    and, where it is this process's own, given its owner's rwx first where it lacks them
    (the request's chmod)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        # unreadable: chmod through an O_PATH descriptor (Linux has no lchmod of a directory)
        path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", stat.S_IMODE(os.fstat(path_fd).st_mode) | 0o700)
        finally:
            os.close(path_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        _unlock(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int) -> None:
    """Gives the directory open at `fd` its owner's rwx where it lacks them."""
    st = os.fstat(fd)
    if st.st_mode & 0o700 != 0o700 and st.st_uid == os.geteuid():
        os.chmod(fd, stat.S_IMODE(st.st_mode) | 0o700)


# The parts of a namespaced sandbox's file tree that bwrap made on tmpfs: its root, /dev and
# /run (not the mounts in them). As its own uid the sandbox cannot write them; in a user
# namespace (a non-root orchestrator) it can, and a change there (a binary under a new
# directory, /lib64 pointing elsewhere) would outlive the request.
_SKELETON = ("/", "/dev", "/run")
_skeleton: tuple[int, dict[str, tuple[Any, ...]]] | None = None  # (worker pid, path -> what it was)


def _take_skeleton() -> None:
    """Notes the skeleton as it is before this worker's first scrubbed request."""
    global _skeleton
    if _skeleton is None or _skeleton[0] != os.getpid():
        _skeleton = (os.getpid(), _skeleton_now(_mounts()))


def _skeleton_now(mounts: Mapping[str, str]) -> dict[str, tuple[Any, ...]]:
    """Path -> (type, mode, owner, link target or size, device and ctime) of every entry of
    the skeleton, mount points as ("mount",), not descended into."""
    seen: dict[str, tuple[Any, ...]] = {}
    todo = [top for top in _SKELETON if mounts.get(top) == "tmpfs"]
    while todo:
        path = todo.pop()
        try:
            names = os.listdir(path)
        except OSError:
            continue
        for name in names:
            full = os.path.join(path, name)
            if full in mounts:
                seen[full] = ("mount",)
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            kind = stat.S_IFMT(st.st_mode)
            what: Any = (st.st_size, st.st_rdev, st.st_ctime_ns)  # ctime: a write or utime() moves it
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(full)
            elif stat.S_ISDIR(st.st_mode):
                what = None  # its entries are compared one by one
                todo.append(full)
            seen[full] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, what)
    return seen


def _check_skeleton(mounts: Mapping[str, str], problems: list[str]) -> None:
    """Removes what a request added to the skeleton; what it changed or removed there
    cannot be put back: a problem (the sandbox is ended)."""
    if _skeleton is None or _skeleton[0] != os.getpid():
        return
    before = _skeleton[1]
    now = _skeleton_now(mounts)
    changed = sorted(p for p, what in before.items() if now.get(p) != what)
    problems += [f"{p}: changed by the request" for p in changed]
    if changed:
        return
    added = sorted(p for p in now if p not in before)
    for path in added:
        if os.path.dirname(path) in added:
            continue  # goes with its directory
        if now[path] == ("mount",):
            problems.append(f"{path}: mounted after the sandbox started")
            continue
        parent, name = os.path.split(path)
        try:
            fd = os.open(parent, _DIR_FLAGS)
            try:
                _remove(name, fd, stat.S_ISDIR(now[path][0]))
            finally:
                os.close(fd)
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")


def _remove_sysv_ipc(problems: list[str]) -> None:
    """Removes the System V shared memory segments, message queues and semaphore sets of
    the sandbox's own IPC namespace (a segment would hand its bytes to the next request).
    POSIX message queues have no list to read without mounting mqueue: not removed."""
    libc = None
    for kind in ("shm", "msg", "sem"):
        ids = _sysv_ids(kind)
        if not ids:
            continue
        if libc is None:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
        for ident in ids:  # IPC_RMID is 0 for all three
            if kind == "sem":
                libc.semctl(ident, 0, 0)
            else:
                getattr(libc, kind + "ctl")(ident, 0, None)
        left = _sysv_ids(kind)
        if left:
            problems.append(f"System V {kind} ids {left[:10]} could not be removed")


def _sysv_ids(kind: str) -> list[int]:
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            return [int(line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]
    except (OSError, IndexError, ValueError):
        return []


def _step(argv: tuple[str, ...], names: Mapping[str, str], workdir: str, stdin: str | None, timeout: float,
          memory_mib: int) -> dict[str, Any]:
    """Runs one step (a compile or the run): a CommandRunResult as a dict."""
    argv = tuple(a.format(**names) for a in argv)
    if shutil.which(argv[0], path=os.environ.get("PATH")) is None and not os.path.isabs(argv[0]):
        return _command("Error", None, None, "", f"{argv[0]} is not installed on this machine")
    limit = memory_mib << 20 if memory_mib > 0 else 0
    with tempfile.TemporaryFile(dir=workdir) as out, tempfile.TemporaryFile(dir=workdir) as err:
        stdin_file = None
        if stdin is not None:
            stdin_file = tempfile.TemporaryFile(dir=workdir)
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
        began = time.monotonic()
        try:
            proc = _spawn(argv, workdir, stdin_file if stdin_file is not None else subprocess.DEVNULL, out, err, limit)
        except OSError as e:
            return _command("Error", None, None, "", f"cannot run {argv[0]}: {e}")
        finally:
            if stdin_file is not None:
                stdin_file.close()
        try:
            proc.wait(timeout=timeout)
            status = "Finished"
        except subprocess.TimeoutExpired:
            status = "TimeLimitExceeded"
        finally:
            try:  # the step's whole process group: what it left running, or all of it at a timeout
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        elapsed = time.monotonic() - began
        return _command(status, elapsed, proc.returncode if status == "Finished" else None, _read(out), _read(err))


def _spawn(argv: tuple[str, ...], workdir: str, stdin: Any, out: Any, err: Any, limit: int) -> subprocess.Popen[bytes]:
    """Starts a step in a session of its own; `limit` > 0: under an RLIMIT_AS of that many
    bytes, soft and hard (the program cannot raise it). A preexec_fn setting it in the
    child would make subprocess fork instead of vfork, which copies this process's page
    tables: milliseconds per step. So, fastest first:
    - a single-threaded process allowed to raise its hard limit again (CAP_SYS_RESOURCE)
      lowers its own for the moment of the start, and the child inherits it (with other
      threads, an allocation of theirs could fail meanwhile);
    - else util-linux's `prlimit` sets it and execs the program (one exec more);
    - else the preexec_fn."""
    def start(command: tuple[str, ...] = argv, preexec: Any = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(command, cwd=workdir, stdin=stdin, stdout=out, stderr=err, start_new_session=True,
                                close_fds=True, preexec_fn=preexec)

    if not limit:
        return start()
    if _may_raise_limits() and threading.active_count() == 1:
        saved = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            return start()
        except MemoryError:
            pass  # this process already maps more than the limit: not this way
        except OSError as e:
            if e.errno != errno.ENOMEM:
                raise
        finally:
            resource.setrlimit(resource.RLIMIT_AS, saved)
    prlimit = _prlimit()
    if prlimit is not None:
        return start((prlimit, f"--as={limit}:{limit}", "--", *argv))

    def in_child() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return start(preexec=in_child)


def _prlimit() -> str | None:
    return shutil.which("prlimit")


_CAP_SYS_RESOURCE = 24


@functools.cache
def _may_raise_limits() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (root in a container often does not)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return False


def _read(f: Any) -> str:
    f.seek(0)
    return f.read(OUTPUT_LIMIT).decode("utf-8", errors="replace")


class _FetchError(Exception):
    """fetch_files that cannot come back: the message, and the files fetched before."""

    def __init__(self, message: str, files: dict[str, str]) -> None:
        super().__init__(message)
        self.files = files


def _fetch(workdir: str, paths: list[str], limit: int = FETCH_LIMIT) -> dict[str, str]:
    """The fetch_files that exist as regular files, base64 (missing ones are left out, as
    Sandbox Fusion does); _FetchError where one cannot be read, or where one takes the
    files past `limit` bytes in all: at most `limit` + 1 bytes are ever read."""
    files: dict[str, str] = {}
    total = 0
    for path in paths:
        if path in files:
            continue
        try:  # O_NONBLOCK: a FIFO put there does not hold the request (it is not a regular file)
            fd = os.open(os.path.join(workdir, path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            raise _FetchError(f"fetch_files: cannot read {path!r}: {e.strerror or e}", files) from None
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            room = limit - total
            chunks: list[bytes] = []
            size = 0
            while size <= room:
                chunk = f.read(min(1 << 20, room + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        if size > room:
            raise _FetchError(f"fetch_files: {path!r} is past the limit on the files a request fetches: "
                              f"{limit} bytes ({limit / (1 << 20):g} MiB) in all (FETCH_LIMIT), {total} of them "
                              f"taken by the files before it", files)
        total += size
        files[path] = base64.b64encode(b"".join(chunks)).decode("ascii")
    return files


def _command(status: str, seconds: float | None, code: int | None, stdout: str, stderr: str) -> dict[str, Any]:
    return {"status": status, "execution_time": seconds, "return_code": code, "stdout": stdout, "stderr": stderr}


def _response(status: str, compile_result: dict[str, Any] | None, run_result: dict[str, Any] | None,
              files: dict[str, str], message: str = "") -> dict[str, Any]:
    return {"status": status, "message": message, "compile_result": compile_result, "run_result": run_result,
            "executor_pod_name": None, "files": files}


def sandbox_error(message: str, compile_result: dict[str, Any] | None = None,
                  run_result: dict[str, Any] | None = None, files: dict[str, str] | None = None) -> dict[str, Any]:
    """The response of a request the sandbox could not run (the endpoint's too, for an
    action that failed, timed out or was cancelled)."""
    return _response("SandboxError", compile_result, run_result, files or {}, message)

