"""Pooled Sandbox Fusion requests (run_code_call(pooled=True): any idle pooled sandbox,
scrubbed after the request) in a real CPU manager under namespaces: what one request
leaves in its pooled sandbox never reaches the next, unrelated one
(tangram.runtime.sandbox.inside_run_code's scrub), a sandbox the scrub cannot clean is
ended rather than reused, and the files a request fetches are bounded (FETCH_LIMIT).

The requests here behave as hostile ones, so they only ever run under
isolation="namespaces" (never in a bare host process)."""

from __future__ import annotations

import base64
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tangram.runtime.call import Call
from tangram.runtime.errors import ActionFailed
from tangram.runtime.managers.base import LiveAction
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.sandbox.run_code import check_request, run_code_call

import namespaced
from namespaced import HAS_NAMESPACES, placement, with_manager

needs_namespaces = pytest.mark.skipif(not HAS_NAMESPACES,
                                      reason="needs namespaced sandboxes (bubblewrap): these requests act as hostile ones")
no_leaked_process = namespaced.no_leaked_process  # its autouse fixture, for this module's tests

_ids = itertools.count(1)


async def pooled(mgr: CpuManager, code: str, fn: Callable[..., Any] | None = None, **fields: Any) -> dict[str, Any]:
    """One Sandbox Fusion request without a session, as the endpoint runs it: a pooled
    run_code action (`fn`: a stand-in for run_code taking the checked request)."""
    request = check_request({"code": code, "language": "python", **fields})
    call = run_code_call(request, trajectory=next(_ids), pooled=True)
    if fn is not None:
        call = Call(fn=fn, args=(request,), trajectory=call.trajectory, pooled=True, kind=call.kind, key=call.key,
                    timeout=call.timeout)
    return await mgr.execute(LiveAction(next(_ids), call), placement())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# A chain of DEPTH shells, each the parent of the next, in a session of their own (the
# step's process group kill misses them); the last one checks in to /tmp and rewrites the
# answer file of any later request in the sandbox's directory. Bounded: 60 s.
CHAIN = r"""
if [ "$1" -gt 0 ]; then
  sh "$0" $(($1 - 1)) "$2" &
  wait
  exit 0
fi
end=$(($(date +%s) + 60))
while [ "$(date +%s)" -lt "$end" ]; do
  echo alive > /tmp/chain.alive
  for d in "$2"/run_code-*; do [ -d "$d" ] && echo TAMPERED > "$d/answer.txt"; done
  sleep 0.02
done
"""

START_CHAIN = """
import os, subprocess, sys, time
home = os.path.dirname(os.getcwd())
subprocess.Popen(["sh", "chain.sh", "150", home], start_new_session=True)
deadline = time.monotonic() + 30
while not os.path.exists("/tmp/chain.alive") and time.monotonic() < deadline:
    time.sleep(0.05)
shells = sum(1 for p in os.listdir("/proc") if p.isdigit() and b"chain.sh" in open(f"/proc/{p}/cmdline", "rb").read())
print(os.path.exists("/tmp/chain.alive"), shells)
"""

AFTER_CHAIN = """
import os, time
open("answer.txt", "w").write("42\\n")
time.sleep(1.0)
own = os.getpid()
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, 2, own)]
print(os.path.exists("/tmp/chain.alive"), len(others))
"""


def run_code_walking_proc(request: dict[str, Any]) -> dict[str, Any]:
    """run_code(scrub=True) as a sandbox that is not its own PID namespace's would run it
    (isolation="process", a container): the scrub finds the leftovers by walking /proc.
    Run here inside a namespaced sandbox, so that the fallback is tested on hostile
    processes without ever signalling anything outside a sandbox."""
    from tangram.runtime.sandbox import inside_run_code

    saved = getattr(inside_run_code, "_own_pid_namespace", None)
    inside_run_code._own_pid_namespace = lambda: False  # type: ignore[attr-defined]
    try:
        return inside_run_code.run_code(request, False, True)
    finally:
        if saved is not None:
            inside_run_code._own_pid_namespace = saved  # type: ignore[attr-defined]


@needs_namespaces
@pytest.mark.parametrize("how", ["pid namespace", "proc walk"])
def test_a_deep_process_chain_does_not_outlive_its_request(how: str) -> None:
    """A 150-deep chain of sleeping processes left by request A is gone, all of it, before
    the next request B runs in the same pooled sandbox: B's file is its own."""
    fn = run_code_walking_proc if how == "proc walk" else None

    async def body(mgr: CpuManager) -> None:
        a = await pooled(mgr, START_CHAIN, fn, files={"chain.sh": b64(CHAIN.encode())})
        assert a["status"] == "Success", a
        alive, shells = a["run_result"]["stdout"].split()
        assert alive == "True" and int(shells) >= 151, a["run_result"]  # the whole chain ran
        b = await pooled(mgr, AFTER_CHAIN, fn, fetch_files=["answer.txt"])
        assert b["status"] == "Success", b
        assert base64.b64decode(b["files"]["answer.txt"]) == b"42\n"  # not TAMPERED by A's chain
        marker, others = b["run_result"]["stdout"].split()
        assert others == "0"  # no process of A's
        # (the /proc walk stands for a bare process, whose scrub leaves a /tmp that is the host's)
        assert marker == ("True" if how == "proc walk" else "False")
        assert mgr.pooled_sandbox_count == 1  # the same pooled sandbox served both

    with_manager(body)


LEAVE = """
import ctypes, os
home = os.path.dirname(os.getcwd())
open("/dev/shm/planted", "w").write("from A")
os.makedirs(f"{home}/keep/inner")
open(f"{home}/keep/inner/planted", "w").write("from A")
os.chmod(f"{home}/keep/inner", 0o500)
os.chmod(f"{home}/keep", 0o500)
os.makedirs(f"{home}/locked/deeper")
open(f"{home}/locked/deeper/planted", "w").write("from A")
os.chmod(f"{home}/locked/deeper", 0)
os.chmod(f"{home}/locked", 0)
os.makedirs("/tmp/ro/inner")
open("/tmp/ro/inner/planted", "w").write("from A")
os.chmod("/tmp/ro/inner", 0o500)
os.chmod("/tmp/ro", 0o500)
os.symlink("/usr", f"{home}/usr-link")  # symlinks are removed, never followed
os.symlink("/run/tangram", "/tmp/control-link")
os.mkfifo("/dev/shm/fifo")
nested = "/tmp/deep"
for _ in range(300):  # deeper than a recursive remover's comfort
    nested += "/d"
os.makedirs(nested)
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(0x7A6E, 4096, 0o1000 | 0o600) >= 0)  # SysV shared memory, the sandbox's IPC namespace
"""

LOOK = """
import ctypes, json, os
home = os.path.dirname(os.getcwd())
libc = ctypes.CDLL(None, use_errno=True)
print(json.dumps({"shm": sorted(os.listdir("/dev/shm")), "home": sorted(os.listdir(home)),
                  "tmp": sorted(os.listdir("/tmp")), "cwd": os.path.basename(os.getcwd()),
                  "sysv": libc.shmget(0x7A6E, 0, 0) >= 0,
                  "shown": open("SHOWN").read() if os.path.exists("SHOWN") else "read-only"}))
"""


@needs_namespaces
def test_files_and_ipc_left_by_a_request_are_gone_for_the_next(tmp_path: Path) -> None:
    """/dev/shm, directories A made read-only (0500, 0000) beside its own and in /tmp, a
    deep tree, symlinks out of the sandbox's writable places (removed, not followed) and a
    SysV shared memory segment: none of it is there for B in the same pooled sandbox. A
    read-only path shown inside the sandbox's /tmp (a visible path under the host's /tmp)
    is left as it is, and does not fail the scrub."""
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "data.txt").write_text("read-only")
    look = LOOK.replace("SHOWN", str(shown / "data.txt"))

    async def body(mgr: CpuManager) -> None:
        a = await pooled(mgr, LEAVE)
        assert a["status"] == "Success" and a["run_result"]["stdout"].strip() == "True", a
        b = await pooled(mgr, look)
        assert b["status"] == "Success", b
        seen = json.loads(b["run_result"]["stdout"])
        assert seen["shm"] == []
        assert seen["home"] == [seen["cwd"]]  # only B's own directory
        assert not {"ro", "control-link", "deep", "chain.alive"} & set(seen["tmp"]), seen["tmp"]
        assert seen["sysv"] is False
        assert seen["shown"] == "read-only"
        assert mgr.pooled_sandbox_count == 1

    if str(tmp_path).startswith("/tmp/"):
        with_manager(body, visible_paths=[str(shown)])
    else:
        with_manager(body)
    assert (shown / "data.txt").read_text() == "read-only"


@needs_namespaces
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a file in the sandbox its own uid cannot remove (root)")
def test_a_sandbox_the_scrub_cannot_clean_is_ended_not_reused() -> None:
    """Something in a pooled sandbox's directory that the sandbox cannot remove (here a
    root-owned directory the host put there): the scrub fails, the request's action
    fails with it, and the sandbox is ended; the next request gets a clean one."""
    async def body(mgr: CpuManager) -> None:
        first = await pooled(mgr, "print('first')")
        assert first["status"] == "Success"
        (key,) = [k for k in mgr._sandboxes if k < 0]
        stuck = os.path.join(mgr.sandbox_dir(key), "stuck")
        os.mkdir(stuck, 0o755)  # root's, in the sandbox's directory
        open(os.path.join(stuck, "file"), "w").close()
        with pytest.raises(ActionFailed) as failed:
            await pooled(mgr, "print('second')")
        assert failed.value.error_type == "ScrubError" and "stuck" in str(failed.value), failed.value
        third = await pooled(mgr, "import os\nprint(sorted(os.listdir('..')))")
        assert third["status"] == "Success" and "stuck" not in third["run_result"]["stdout"], third

    with_manager(body)


@needs_namespaces
def test_fetched_files_are_limited_per_request() -> None:
    """A fetch past FETCH_LIMIT bytes in all is an in-band SandboxError naming the file and
    the limit; the run's own result and the files fetched before it still come back."""
    from tangram.runtime.sandbox import inside_run_code

    limit = getattr(inside_run_code, "FETCH_LIMIT", 32 << 20)
    make = (f"import os\nopen('small.txt', 'w').write('ok')\n"
            f"with open('big.bin', 'wb') as f:\n    f.truncate({limit} + 1)\nprint('made')")

    async def body(mgr: CpuManager) -> None:
        over = await pooled(mgr, make, fetch_files=["small.txt", "big.bin"])
        assert over["status"] == "SandboxError", {k: v for k, v in over.items() if k != "files"}
        assert "big.bin" in over["message"] and str(limit) in over["message"], over["message"]
        assert over["run_result"]["status"] == "Finished" and over["run_result"]["stdout"] == "made\n"
        assert over["files"] == {"small.txt": b64(b"ok")}
        fits = await pooled(mgr, make, fetch_files=["small.txt"])
        assert fits["status"] == "Success" and fits["files"] == {"small.txt": b64(b"ok")}

    with_manager(body)


def test_the_skeleton_check_removes_additions_and_fails_on_changes(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts of the sandbox bwrap made (its root, /dev, /run: writable to a sandbox in
    a user namespace) are compared with what they held before the worker's first scrubbed
    request: an addition is removed, a change is a problem that ends the sandbox. Run on
    a directory standing in for them, in this process: nothing is executed."""
    from tangram.runtime.sandbox import inside_run_code

    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    (root / "lib64").symlink_to("usr/lib64")
    (root / "mounted").mkdir()
    mounts = {str(root): "tmpfs", str(root / "mounted"): "tmpfs"}
    monkeypatch.setattr(inside_run_code, "_SKELETON", (str(root),))
    monkeypatch.setattr(inside_run_code, "_skeleton", None)
    monkeypatch.setattr(inside_run_code, "_mounts", lambda: mounts)
    inside_run_code._take_skeleton()
    (root / "added").mkdir()
    (root / "added" / "inner").mkdir()
    (root / "added" / "inner").chmod(0o500)
    (root / "dir" / "file").write_text("x")
    (root / "mounted" / "left").write_text("a mount's files are not the skeleton's")
    problems: list[str] = []
    inside_run_code._check_skeleton(mounts, problems)
    assert problems == []
    assert sorted(p.name for p in root.iterdir()) == ["dir", "lib64", "mounted"]
    assert list((root / "dir").iterdir()) == [] and (root / "mounted" / "left").exists()
    (root / "lib64").unlink()
    (root / "lib64").symlink_to("/elsewhere")
    inside_run_code._check_skeleton(mounts, problems)
    assert problems == [f"{root / 'lib64'}: changed by the request"]


# ------------------------------------------------ what a request does to its worker (pid 2)
# Programs in a namespaced sandbox run as the worker's uid, so they may change the worker's
# limits and scheduling from outside (prlimit, setpriority, sched_setscheduler,
# sched_setaffinity, ioprio_set on pid 2): what the next request's programs, the worker's
# children, would inherit. The scrub sets back what it can and ends the sandbox otherwise.

STATE = r"""
import ctypes, json, os, resource, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
machine = os.uname().machine
IOPRIO_GET = {"x86_64": 252, "aarch64": 31}.get(machine)
SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}.get(machine)

def state(pid):
    ioprio = libc.syscall(IOPRIO_GET, 1, pid) if IOPRIO_GET else None
    sched = None
    if SCHED_GETATTR:
        buf = ctypes.create_string_buffer(56)
        if libc.syscall(SCHED_GETATTR, pid, buf, 56, 0) == 0:
            sched = list(struct.unpack("=IIQiIQQQII", buf.raw)[1:])
    return {"nice": os.getpriority(os.PRIO_PROCESS, pid), "policy": os.sched_getscheduler(pid),
            "priority": os.sched_getparam(pid).sched_priority, "affinity": sorted(os.sched_getaffinity(pid)),
            "ioprio": ioprio, "sched": sched,
            "limits": {n: list(resource.prlimit(pid, getattr(resource, n)))
                       for n in sorted(dir(resource)) if n.startswith("RLIMIT_")}}
"""

# What a program sees of its own state (a child of the worker inherits the worker's), and
# an honest program's work: more output and a bigger file than a tampered limit allows.
LOOK_AT_ME = STATE + r"""
with open("out.bin", "wb") as f:
    f.write(b"y" * 100000)
print(json.dumps(state(0)))
sys.stdout.write("x" * 100000 + "\n")
"""

# How request A changes the worker (pid 2), and whether the scrub can set it back (else it
# ends the sandbox): an unprivileged process may lower a limit (not raise a hard one),
# raise its nice value (not lower it), leave SCHED_BATCH (not SCHED_IDLE), set its affinity
# and I/O priority (class best-effort or idle) and its slice.
TAMPER = {
    "fsize soft": ("resource.prlimit(2, resource.RLIMIT_FSIZE, (1000, resource.prlimit(2, resource.RLIMIT_FSIZE)[1]))",
                   "restored"),
    "fsize hard": ("resource.prlimit(2, resource.RLIMIT_FSIZE, (1000, 1000))", "RLIMIT_FSIZE"),
    "nofile soft": ("resource.prlimit(2, resource.RLIMIT_NOFILE, (16, resource.prlimit(2, resource.RLIMIT_NOFILE)[1]))",
                    "restored"),
    "as hard": ("resource.prlimit(2, resource.RLIMIT_AS, (1 << 40, 1 << 40))", "RLIMIT_AS"),
    "nice": ("os.setpriority(os.PRIO_PROCESS, 2, 19)", "nice"),
    "nice of the uid": ("os.setpriority(os.PRIO_USER, os.getuid(), 5)", "nice"),
    "sched idle": ("os.sched_setscheduler(2, os.SCHED_IDLE, os.sched_param(0))", "SCHED_IDLE"),
    "sched batch": ("os.sched_setscheduler(2, os.SCHED_BATCH, os.sched_param(0))", "restored"),
    "reset on fork": ("os.sched_setscheduler(2, os.SCHED_OTHER | 0x40000000, os.sched_param(0))", "RESET_ON_FORK"),
    "affinity": ("os.sched_setaffinity(2, {min(os.sched_getaffinity(2))})", "restored"),
    "ioprio": ("assert libc.syscall({'x86_64': 251, 'aarch64': 30}[machine], 1, 2, 3 << 13) == 0", "restored"),
    "slice": ("assert libc.syscall({'x86_64': 314, 'aarch64': 274}[machine], 2, "
              "struct.pack('=IIQiIQQQII', 56, 0, 0, 0, 0, 100000, 0, 0, 0, 0), 0) == 0", "restored"),
}

# A's tampering, also done again and again by a process A leaves behind (detached), which
# the scrub must kill before it looks at the worker.
TAMPERING = STATE + r"""
import subprocess, time
before = state(2)
TAMPER
subprocess.Popen([sys.executable, "-c", "import time\nexec(open('again.py').read())"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.2)
print(json.dumps([before, state(2)]))
"""

AGAIN = STATE + r"""
while True:
    try:
        TAMPER
    except Exception:
        pass
    time.sleep(0.001)
"""


def _pooled_key(mgr: CpuManager) -> int:
    (key,) = [k for k in mgr._sandboxes if k < 0]
    return key


@needs_namespaces
@pytest.mark.parametrize("how", sorted(TAMPER))
def test_what_a_request_did_to_its_worker_never_reaches_the_next(how: str) -> None:
    """Request A changes the limits or scheduling of its worker (pid 2 of the sandbox),
    once and from a process it leaves behind: request B, an honest program after it,
    runs as the first request did, in the same pooled sandbox (the scrub set the worker
    back) or, where an unprivileged process cannot set it back (a lowered hard limit, a
    raised nice value, SCHED_IDLE), in a new one (A's scrub failed, naming the change,
    and its sandbox was ended). B's program always succeeds."""
    tamper, outcome = TAMPER[how]
    tampering = TAMPERING.replace("TAMPER", tamper)
    again = AGAIN.replace("TAMPER", tamper)

    async def body(mgr: CpuManager) -> None:
        first = await pooled(mgr, LOOK_AT_ME)
        assert first["status"] == "Success", first
        original = json.loads(first["run_result"]["stdout"].splitlines()[0])
        key = _pooled_key(mgr)
        if how == "affinity" and len(original["affinity"]) < 2:
            pytest.skip("the sandbox runs on one CPU: no affinity to take away")
        if outcome == "restored":
            a = await pooled(mgr, tampering, files={"again.py": b64(again.encode())})
            assert a["status"] == "Success", a
            before, after = json.loads(a["run_result"]["stdout"])
            assert before != after  # A did change its worker
        else:
            with pytest.raises(ActionFailed) as failed:
                await pooled(mgr, tampering, files={"again.py": b64(again.encode())})
            assert failed.value.error_type == "ScrubError" and outcome in str(failed.value), failed.value
            assert "after the request" in str(failed.value)  # A's own scrub saw it
        b = await pooled(mgr, LOOK_AT_ME)
        assert b["status"] == "Success", b
        lines = b["run_result"]["stdout"].splitlines()
        assert lines[1] == "x" * 100000
        assert json.loads(lines[0]) == original
        assert mgr.pooled_sandbox_count == 1
        assert (_pooled_key(mgr) == key) == (outcome == "restored")

    with_manager(body)


def change_the_worker(request: dict[str, Any]) -> dict[str, Any]:
    """A pooled call of someone's own (not a request: not scrubbed) that changes the worker
    it runs in: its soft RLIMIT_FSIZE ("soft") or its nice value ("nice")."""
    import resource

    if request["code"] == "soft":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    else:
        os.setpriority(os.PRIO_PROCESS, 0, 5)
    return {}


@needs_namespaces
@pytest.mark.parametrize("how", ["soft", "nice"])
def test_a_worker_changed_between_requests_is_set_back_or_ended_before_the_next(how: str) -> None:
    """The worker changed since the first request by something no scrub followed (here a
    pooled call of someone's own, run in the worker itself): before the next request runs
    anything, a soft limit is set back (it runs as the first one did), and a raised nice
    value ends the sandbox (the request fails with ScrubError; the one after it gets a new
    sandbox)."""
    async def body(mgr: CpuManager) -> None:
        first = await pooled(mgr, LOOK_AT_ME)
        assert first["status"] == "Success", first
        original = json.loads(first["run_result"]["stdout"].splitlines()[0])
        key = _pooled_key(mgr)
        assert await pooled(mgr, how, change_the_worker) == {}
        if how == "nice":
            with pytest.raises(ActionFailed) as failed:
                await pooled(mgr, LOOK_AT_ME)
            assert failed.value.error_type == "ScrubError" and "before the request" in str(failed.value)
            assert "nice value" in str(failed.value), failed.value
        b = await pooled(mgr, LOOK_AT_ME)
        assert b["status"] == "Success", b
        assert json.loads(b["run_result"]["stdout"].splitlines()[0]) == original
        assert (_pooled_key(mgr) == key) == (how == "soft")

    with_manager(body)
