"""The sandbox worker: one long-lived process per trajectory, started by the CPU manager.

Run as `python -I tangram/runtime/sandbox/inside_worker.py FD [START]` (or `python -m
tangram.runtime.sandbox.inside_worker FD [START]`) with a connected socket on FD, or with FD
"stdio": requests on stdin and replies on stdout (a container's worker, started by the
engine's `exec -i`, whose stdio the engine relays; its output goes to stderr); START, a JSON
object, may hold "merge_environ" (the hello's environment is added to the one the worker
started with, a container's, instead of replacing it), "user" (a uid to take before anything else: a namespaced sandbox under
root), "nproc" (that uid's RLIMIT_NPROC), "sys_path" (its sys.path, for an interpreter run
without site: an image sandbox's, tangram.runtime.sandbox.rootfs) and "path" and "preload": modules to import from that
path before the first frame (a warm worker imports them before it is taken; one that fails
to import is reported in the worker's log and left to the action). Of its own it imports nothing of
tangram (only the standard library and cloudpickle), so it starts fast and the sandbox's
files (the working directory may hold a generated `json.py`) can never shadow its imports.

Protocol: frames of an 8-byte big-endian length and a payload, one request and one reply
per action, strictly in turn. A request is a pickle (the orchestrator's). A reply is plain
data in the format of inside_values.py, never a pickle: the orchestrator must not run
anything a sandbox chose while it reads what came back.

  first frame   ("hello", sys_path, output_limit, home, affinity_mode, environ)
                a worker started ahead of time (a warm worker) learns its sandbox here: it
                moves into `home` and takes `environ` as its whole environment
  requests      ("fn", fn, args, kwargs, env, cpus, memory_bytes)
                ("cmd", command, env, cpus, memory_bytes)
                cpus (a tuple) and memory_bytes (> 0) are only sent in affinity mode: the
                worker then pins itself (all its threads) with sched_setaffinity and applies
                RLIMIT_AS; with cgroups the manager sets the cgroup and sends None and 0.
  replies       ("ok", value) | ("result", returncode, stdout, stderr, truncated)
                ("error", type_name, message, traceback) | ("memory", message)

Functions run in this process, so module state persists across a trajectory's actions;
`env` is set in os.environ for the duration of the call. A function with a GPU grant (`env`
sets CUDA_VISIBLE_DEVICES) runs in a child forked for it instead: CUDA reads its device and
MPS limits once, when it initialises, and keeps its context until the process ends, so a
trajectory's later GPU actions would keep its first device and limits and its context
would stay resident, counted by nobody. The child sees the worker's module state; what it
changes ends with it. (The worker itself must not initialise CUDA: a forked child cannot.)
A GPU action (function or command) never runs under RLIMIT_AS, the affinity mode's memory
limit: CUDA reserves far more address space than it uses, and its initialisation fails
under the limit. Its host memory is enforced only by a cgroup.
Commands run as children (a
string through /bin/sh, a sequence as an argv) in the sandbox's directory, with os.environ
plus `env`; their stdout/stderr are kept up to output_limit bytes each and drained past it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

cloudpickle = None  # imported by main(), once sys.path is the one START gives


def _load_values():  # type: ignore[no-untyped-def]
    """inside_values.py, beside this file, loaded by its path (this worker imports nothing
    of tangram's package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inside_values.py")
    spec = importlib.util.spec_from_file_location("_tangram_inside_values", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


_values = _load_values()

_HEADER = struct.Struct(">Q")
_PR_SET_CHILD_SUBREAPER = 36
_DRAIN_AFTER_EXIT = 0.1  # seconds to keep reading output that background processes still write


class Worker:
    def __init__(self, rfile, write, merge_environ: bool = False) -> None:
        """`rfile`: the channel's reading end (a buffered binary file); `write(bytes)`
        sends all of it."""
        self.rfile = rfile
        self.write = write
        self.merge_environ = merge_environ
        self.output_limit = 1 << 20
        self.home = os.getcwd()
        self.cpus: tuple[int, ...] | None = None
        self.jobserver_fd: tuple[str, int] | None = None

    # --------------------------------------------------------------- framing
    def recv(self) -> object | None:
        header = self.rfile.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack(header)
        payload = self.rfile.read(n)
        if len(payload) < n:
            return None
        return pickle.loads(payload)

    def send(self, msg: tuple) -> None:
        payload = _encode(msg)
        self.write(_HEADER.pack(len(payload)) + payload)

    # --------------------------------------------------------------- main loop
    def serve(self) -> None:
        while True:
            try:
                req = self.recv()
            except Exception as e:  # a request that does not unpickle here (a missing module...)
                self.send(("error", type(e).__name__, f"cannot load the call in the sandbox: {e}", traceback.format_exc()))
                continue
            if req is None:
                return
            kind = req[0]
            if kind == "fn":
                self.send(self.run_fn(*req[1:]))
            elif kind == "cmd":
                self.send(self.run_cmd(*req[1:]))
            elif kind == "hello":
                _, path, self.output_limit, self.home, affinity, environ = req
                sys.path[:] = list(path)
                os.chdir(self.home)
                if not self.merge_environ:
                    os.environ.clear()
                os.environ.update(environ)
                if affinity:
                    _set_subreaper()
            else:
                self.send(("error", "ProtocolError", f"unknown request {kind!r}", ""))

    def pin(self, cpus: tuple[int, ...] | None) -> None:
        """Affinity mode: this thread always (an earlier action may have changed it), every
        thread of the worker when the CPUs change. Children inherit it."""
        if cpus is None:
            return
        if cpus == self.cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass
            return
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
        self.cpus = cpus

    def run_fn(self, fn, args, kwargs, env, cpus, memory) -> tuple:  # type: ignore[no-untyped-def]
        self.pin(cpus)
        if "CUDA_VISIBLE_DEVICES" in env:
            return self.run_fn_in_child(fn, args, kwargs, env)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        old_limit = None
        if memory > 0:
            old_limit = _limit_address_space(memory)
        try:
            return _call(fn, args, kwargs, memory if old_limit is not None else 0)
        finally:
            if old_limit is not None:
                import resource
                try:
                    resource.setrlimit(resource.RLIMIT_AS, old_limit)
                except (OSError, ValueError):
                    pass
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run_fn_in_child(self, fn, args, kwargs, env) -> tuple:  # type: ignore[no-untyped-def]
        """A GPU action: the call in a child forked for it (no RLIMIT_AS: see the module's
        docstring), its reply back through a pipe."""
        read_end, write_end = os.pipe()
        _flush_output()  # the child must not write what the worker printed a second time
        pid = os.fork()
        if pid == 0:  # the child: its own CUDA state, gone with it
            try:
                os.close(read_end)
                os.environ.update(env)
                payload = _encode(_call(fn, args, kwargs, 0))
                with os.fdopen(write_end, "wb") as out:
                    out.write(payload)
            finally:
                _flush_output()  # what the function printed goes to the worker's log
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reply:
            payload = reply.read()
        _, status = os.waitpid(pid, 0)
        if payload:
            return _values.decode(payload)
        how = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else \
            f"exit code {os.WEXITSTATUS(status)}"
        return ("error", "ChildProcessError", f"the process running this GPU action died ({how})", "")

    def run_cmd(self, command, env, cpus, memory) -> tuple:  # type: ignore[no-untyped-def]
        self.pin(cpus)
        child_env = dict(os.environ)
        child_env.update(env)
        pass_fds = self.jobserver(child_env)
        preexec = None
        if memory > 0 and "CUDA_VISIBLE_DEVICES" not in env:  # a GPU command: no RLIMIT_AS (docstring)
            def preexec() -> None:
                import resource
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        try:
            proc = subprocess.Popen(command, shell=isinstance(command, str), cwd=self.home, env=child_env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=preexec, close_fds=True, pass_fds=pass_fds)
        except OSError as e:  # like a shell: 127 not found, 126 not executable
            code = 127 if isinstance(e, FileNotFoundError) else 126
            return ("result", code, b"", f"{command!r}: {e}\n".encode(), False)
        except Exception as e:  # a malformed argv
            return ("error", type(e).__name__, f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            out, err, truncated = self.collect(proc)
        finally:
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
            proc.wait()
        return ("result", proc.returncode, out, err, truncated)

    def jobserver(self, env: dict) -> tuple[int, ...]:
        """The sandbox's GNU make jobserver for a command: MAKEFLAGS names two inherited
        descriptors of the manager's FIFO (the form make 4.x, ninja and cargo all read),
        unless the call set MAKEFLAGS itself. The manager keeps the FIFO holding one token
        less than the cores granted (each client has one implicit token)."""
        where = env.get("TANGRAM_JOBSERVER", "")
        if not where.startswith("fifo:") or "MAKEFLAGS" in env:
            return ()
        path = where[5:]
        if self.jobserver_fd is not None and self.jobserver_fd[0] != path:
            os.close(self.jobserver_fd[1])
            self.jobserver_fd = None
        if self.jobserver_fd is None:
            try:
                self.jobserver_fd = (path, os.open(path, os.O_RDWR | os.O_CLOEXEC))
            except OSError:
                return ()
        fd = self.jobserver_fd[1]
        env["MAKEFLAGS"] = f" -j --jobserver-auth={fd},{fd}"
        return (fd,)

    def collect(self, proc: subprocess.Popen) -> tuple[bytes, bytes, bool]:
        limit = self.output_limit
        bufs = [bytearray(), bytearray()]
        truncated = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 0)  # type: ignore[arg-type]
        sel.register(proc.stderr, selectors.EVENT_READ, 1)  # type: ignore[arg-type]
        pidfd = -1
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, 2)
        except (AttributeError, OSError):
            pass
        streams = 2
        exited_at: float | None = None
        try:
            while streams:
                if exited_at is None:
                    timeout = None if pidfd >= 0 else 0.05
                else:
                    timeout = 0.0
                events = sel.select(timeout)
                if pidfd < 0 and exited_at is None and proc.poll() is not None:
                    exited_at = time.monotonic()
                if not events and exited_at is not None:
                    break  # the command exited and nothing more is ready: stop waiting
                for key, _ in events:
                    if key.data == 2:
                        exited_at = time.monotonic()
                        sel.unregister(pidfd)
                        continue
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fileobj)
                        streams -= 1
                        continue
                    buf = bufs[key.data]
                    room = limit - len(buf)
                    if len(data) > room:
                        truncated = True
                        if room > 0:
                            buf += data[:room]
                    else:
                        buf += data
                if exited_at is not None and time.monotonic() - exited_at > _DRAIN_AFTER_EXIT:
                    break  # background processes keep writing: they do not hold the action
        finally:
            sel.close()
            if pidfd >= 0:
                os.close(pidfd)
        return bytes(bufs[0]), bytes(bufs[1]), truncated


def _call(fn, args, kwargs, memory_limit: int) -> tuple:  # type: ignore[no-untyped-def]
    """A function's reply: ("ok", value), ("memory", ...) when it ran out of the
    `memory_limit` bytes it ran under (0: none), or ("error", ...)."""
    try:
        result = fn(*args, **kwargs)
        if type(result).__name__ == "coroutine":  # an async def: run it to completion here
            import asyncio
            result = asyncio.run(result)
        return ("ok", result)
    except MemoryError as e:
        if memory_limit:
            return ("memory", f"MemoryError under a limit of {memory_limit >> 20} MiB (RLIMIT_AS): {e}")
        return ("error", "MemoryError", f"MemoryError: {e}", traceback.format_exc())
    except BaseException as e:
        return ("error", type(e).__name__, f"{type(e).__name__}: {e}", traceback.format_exc())


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _encode(msg: tuple) -> bytes:
    """A reply as bytes (inside_values), or, for a result that is not plain data, an error
    saying which type cannot come back."""
    try:
        return _values.encode(msg)
    except _values.Unsupported as e:
        return _values.encode((
            "error", "UnsupportedResult",
            f"the result holds {e}, which cannot come back from a sandbox (a reply is plain data: what the "
            "orchestrator reads must not run anything the sandbox chose): return numbers, strings, bytes, "
            "lists, tuples, dicts, sets, datetimes, Decimal, Fraction, numpy arrays of numbers, or exceptions "
            "of the standard library (e.g. dataclasses.asdict(x) for a dataclass)", ""))


def _limit_address_space(extra: int) -> tuple[int, int]:
    """Soft RLIMIT_AS = the address space in use now + `extra` bytes; returns the old limits."""
    import resource
    old = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        size = 0
    soft = size + extra
    if old[1] != resource.RLIM_INFINITY:
        soft = min(soft, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
    return old


def _set_subreaper() -> None:
    """Orphaned descendants (a daemon that double-forked, a background job of a finished
    shell) are re-parented to this worker instead of init, so the manager finds and kills
    every one of them through /proc/<worker>/task/*/children."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:
        pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rfile, write, fds = _channel(argv[0])
    # a function that forks (multiprocessing) must not keep the channel open in its child
    os.register_at_fork(after_in_child=lambda: [_close_quietly(fd) for fd in fds])
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    faulthandler.enable()  # a fatal signal leaves the Python stack in the worker's log
    try:  # no core files: a crashing action must not fill the sandbox's disk
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, OSError, ValueError):
        pass
    start = json.loads(argv[1]) if len(argv) > 1 else {}
    if "user" in start:  # first: nothing of the caller's runs before the worker is its sandbox's user
        _become(int(start["user"]), start.get("nproc"))
    if "sys_path" in start:
        sys.path[:] = [*start["sys_path"], *sys.path]
    global cloudpickle
    import cloudpickle
    if start.get("preload"):
        _preload(start)
    worker = Worker(rfile, write, bool(start.get("merge_environ")))
    try:
        worker.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    os._exit(0)  # do not wait for threads a function left behind


def _channel(name: str):
    """The channel's reading file, its write function and its descriptors: a socket on fd
    `name`, or ("stdio") stdin and stdout moved to descriptors of their own, stdin then
    /dev/null and stdout the log (stderr). Commands never inherit the channel."""
    if name != "stdio":
        fd = int(name)
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        return sock.makefile("rb", buffering=1 << 16), sock.sendall, (fd,)
    read_fd, write_fd = os.dup(0), os.dup(1)  # dup() makes them non-inheritable
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]

    return os.fdopen(read_fd, "rb", buffering=1 << 16), write, (read_fd, write_fd)


def _become(uid: int, nproc: int | None) -> None:
    """A namespaced sandbox under root (tangram.runtime.sandbox.namespaces): bwrap left this
    process uid 0 with CAP_SETUID and CAP_SETGID only, for this. It takes the sandbox's uid
    and gid with no supplementary groups, which drops every capability for good (no_new_privs
    is set, so no exec regains one), and, with `nproc`, caps that uid's processes."""
    _clear_inheritable_capabilities()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if nproc is not None:
        import resource
        resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))


def _clear_inheritable_capabilities() -> None:
    """setresuid clears the permitted and effective sets, not the inheritable one, where bwrap
    put the two it left: emptied first (capget, then capset without them)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two words
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for word in data:
        word.inheritable = 0
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _preload(start: dict) -> None:
    import importlib

    for name in start["preload"]:
        try:
            importlib.import_module(name)
        except BaseException as e:  # the action that needs it fails with the real error
            print(f"tangram sandbox worker: preloading {name} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


if __name__ == "__main__":
    main()
