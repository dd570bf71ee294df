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
import os
import resource  # imported here, not in the forked child: a child's import costs every request milliseconds
import shutil
import signal
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


def run_code(request: Mapping[str, Any], keep_files: bool = False, scrub: bool = False) -> dict[str, Any]:
    """Runs one checked request (`check_request`) in the current directory (the sandbox's):
    returns the Sandbox Fusion response as a dict (see the module docstring). `scrub`
    (a sandbox pooled between requests without a session): afterwards, every process the
    steps left behind is killed, those that detached themselves too, and the sandbox's
    directory is emptied, so the next request finds the sandbox as a new one."""
    if scrub:
        _adopt_orphans()
        try:
            return run_code(request, keep_files=False)
        finally:
            _kill_descendants()
            _empty(os.getcwd())
            tmp = os.environ.get("TMPDIR", "")
            if tmp and os.path.isdir(tmp) and not os.path.realpath(tmp).startswith(os.path.realpath(os.getcwd()) + "/"):
                _empty(tmp)  # a namespaced sandbox's /tmp is its own, beside its directory
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
                return _response("Failed", compile_result, None, _fetch(workdir, request["fetch_files"]))
        run_result = _step(run_argv, names, workdir, request["stdin"], request["run_timeout"], memory)
        files = _fetch(workdir, request["fetch_files"])
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


def run_code_timed(request: Mapping[str, Any], keep_files: bool = False,
                   scrub: bool = False) -> tuple[dict[str, Any], float]:
    """run_code, and the seconds it took here in the sandbox: everything running the
    request costs, from its files written to its sandbox scrubbed (the endpoint's
    Server-Timing `run` metric; what the endpoint spends beyond it is its own)."""
    began = time.perf_counter()
    answer = run_code(request, keep_files, scrub)
    return answer, time.perf_counter() - began


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


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _kill_descendants() -> None:
    """Kills and reaps every child of this process, and the children they leave it (as a
    subreaper it inherits them), until none is left."""
    for _ in range(100):
        children = _children(os.getpid())
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _empty(directory: str) -> None:
    """Removes what `directory` holds; its `.tmp` (the sandbox's TMPDIR) stays, emptied."""
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if entry == ".tmp" and os.path.isdir(path) and not os.path.islink(path):
            _empty(path)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


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


def _fetch(workdir: str, paths: list[str]) -> dict[str, str]:
    """The fetch_files that exist as regular files, base64 (missing ones are left out, as
    Sandbox Fusion does)."""
    files = {}
    for path in paths:
        full = os.path.join(workdir, path)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                files[path] = base64.b64encode(f.read()).decode("ascii")
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

