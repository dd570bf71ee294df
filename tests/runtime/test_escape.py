"""The escape suite: code in a namespaced sandbox tries to get out, and every attempt fails.

Each test runs real programs inside a sandbox of a real CPU manager (isolation="namespaces",
bubblewrap) and checks on the host that the attempt changed nothing: files outside the
sandbox, another sandbox's files, /root, the network and the orchestrator's own ports,
processes outside the sandbox (seeing, signalling, ptrace, their environment), mounting,
setuid binaries, device nodes, /proc/sys, a fork bomb, a new user namespace. What the boundary
does not contain is listed in docs/sandbox.md ("Threat model").
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import tangram
from tangram.runtime.call import Call
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.errors import ActionFailed, ResourceLimitExceeded
from tangram.runtime.managers.base import LiveAction
from tangram.runtime.sandbox.namespaces import HOME

import namespaced
from namespaced import HAS_NAMESPACES, WHY_NOT, placement, with_manager

no_leaked_process = namespaced.no_leaked_process  # its autouse fixture, for this module's tests

pytestmark = pytest.mark.skipif(not HAS_NAMESPACES, reason=WHY_NOT)
ROOT = os.geteuid() == 0
_ids = itertools.count(1)


async def python(mgr: CpuManager, code: str, trajectory: int = 1, **call: Any) -> dict[str, Any]:
    """Runs `code` with the orchestrator's Python as a command in `trajectory`'s sandbox;
    the code sets entries of the dict `out`, printed as JSON at the end."""
    program = "import json, os, sys\nout = {}\n" + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    result = await mgr.execute(LiveAction(next(_ids), Call(command=[sys.executable, "-c", program],
                                                          trajectory=trajectory, **call)), placement())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


TRY = '''
def attempt(name, f):
    try:
        out[name] = ["ok", repr(f())]
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)]
'''


def failed(outcome: list[str]) -> bool:
    return outcome[0] != "ok"


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------------------- files
def test_files_outside_the_sandbox_cannot_be_read_or_written(tmp_path: Any) -> None:
    secret = tmp_path / "orchestrator-secret.txt"
    secret.write_text("api-key")
    package = os.path.join(os.path.dirname(tangram.__file__), "__init__.py")
    package_digest = digest(package)

    async def body(mgr: CpuManager) -> None:
        out = await python(mgr, TRY + f'''
attempt("read_secret", lambda: open({str(secret)!r}).read())
attempt("write_beside_secret", lambda: open({str(tmp_path / "planted")!r}, "w").write("x"))
attempt("list_tmp_path", lambda: os.listdir({str(tmp_path)!r}))
attempt("write_package", lambda: open({package!r}, "a").write("# planted"))
attempt("write_etc", lambda: open("/etc/tangram-planted", "w").write("x"))
attempt("write_usr", lambda: open("/usr/tangram-planted", "w").write("x"))
attempt("manager_dir", lambda: os.listdir({mgr._dir!r}))
attempt("via_proc_root", lambda: open("/proc/1/root" + {str(secret)!r}).read())
attempt("home", lambda: open({HOME!r} + "/mine", "w").write("fine"))
attempt("tmp", lambda: open("/tmp/mine", "w").write("fine"))
''')
        for name in ("read_secret", "write_beside_secret", "list_tmp_path", "write_package", "write_etc", "write_usr",
                     "manager_dir", "via_proc_root"):
            assert failed(out[name]), (name, out[name])
        assert out["home"][0] == "ok" and out["tmp"][0] == "ok"  # the sandbox's own places are writable
        assert os.path.exists(os.path.join(mgr.sandbox_dir(1), "mine"))

    with_manager(body)
    assert secret.read_text() == "api-key"
    assert sorted(os.listdir(tmp_path)) == ["orchestrator-secret.txt"]
    assert digest(package) == package_digest
    assert not os.path.exists("/etc/tangram-planted") and not os.path.exists("/usr/tangram-planted")


@pytest.mark.skipif(not ROOT, reason="plants a file in /root (root only)")
def test_root_home_is_not_visible() -> None:
    planted = f"/root/tangram-escape-{os.getpid()}"
    with open(planted, "w") as f:
        f.write("root's")
    try:
        async def body(mgr: CpuManager) -> None:
            out = await python(mgr, TRY + f'''
attempt("read", lambda: open({planted!r}).read())
attempt("list", lambda: os.listdir("/root"))
attempt("write", lambda: open("/root/.bashrc", "a").write("planted"))
''')
            assert failed(out["read"]) and failed(out["write"]), out
            # /root holds only the directories bound for the orchestrator's Python, if any
            listed = [] if failed(out["list"]) else eval(out["list"][1])
            assert os.path.basename(planted) not in listed and ".bashrc" not in listed

        with_manager(body)
    finally:
        os.unlink(planted)


def test_another_sandbox_is_invisible() -> None:
    async def body(mgr: CpuManager) -> None:
        await python(mgr, 'open("secret", "w").write("trajectory 1")', trajectory=1)
        victim = mgr.sandbox_dir(1)
        out = await python(mgr, TRY + f'''
attempt("host_path", lambda: open({os.path.join(victim, "secret")!r}).read())
attempt("write_host_path", lambda: open({os.path.join(victim, "planted")!r}, "w").write("x"))
attempt("own_home_is_empty", lambda: sorted(os.listdir({HOME!r})))
''', trajectory=2)
        assert failed(out["host_path"]) and failed(out["write_host_path"]), out
        assert "secret" not in out["own_home_is_empty"][1]
        assert sorted(os.listdir(victim)) == ["secret"]

    with_manager(body)


# ---------------------------------------------------------------------------- identity
def test_no_capabilities_no_new_privileges_and_an_unprivileged_uid() -> None:
    async def body(mgr: CpuManager) -> None:
        out = await python(mgr, '''
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
out["uid"] = os.getuid(); out["euid"] = os.geteuid(); out["groups"] = os.getgroups()
for key in ("CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs"):
    out[key] = status[key].strip()
out["hostname"] = os.uname().nodename
''')
        assert out["CapPrm"] == out["CapEff"] == out["CapInh"] == out["CapAmb"] == "0000000000000000", out
        assert out["NoNewPrivs"] == "1"
        assert out["hostname"] == "sandbox"
        if ROOT:
            assert out["uid"] == out["euid"] != 0 and out["groups"] in ([], [out["uid"]]), out
        else:
            assert out["uid"] == os.getuid()

    with_manager(body)


@pytest.mark.skipif(not ROOT, reason="makes a setuid-root binary (root only)")
def test_a_setuid_binary_gives_nothing() -> None:
    import pathlib

    tool = pathlib.Path(f"/var/tmp/tangram-escape-{os.getpid()}")  # not under /tmp: a sandbox has its own
    tool.mkdir(mode=0o755)
    shutil.copy("/usr/bin/id", tool / "id")
    os.chmod(tool / "id", 0o4755)  # setuid root

    async def body(mgr: CpuManager) -> None:
        result = await mgr.execute(LiveAction(next(_ids), Call(command=[str(tool / "id"), "-u"], trajectory=1)),
                                   placement())
        assert result.returncode == 0 and int(result.stdout) != 0, result  # the sandbox's uid, not root's
        su = await mgr.execute(LiveAction(next(_ids), Call(command="su -c id root </dev/null", trajectory=1)),
                               placement())
        assert b"uid=0" not in su.stdout

    try:
        with_manager(body, visible_paths=[str(tool)])
    finally:
        shutil.rmtree(tool)


# ---------------------------------------------------------------------------- network
class Listener:
    """A TCP server on the host's loopback and an abstract unix socket, counting connections."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.abstract_name = f"tangram-escape-{os.getpid()}"
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind("\0" + self.abstract_name)
        self.unix.listen()
        self.accepted = 0
        self._stop = False
        self.threads = [threading.Thread(target=self._serve, args=(s,), daemon=True) for s in (self.tcp, self.unix)]
        for t in self.threads:
            t.start()

    def _serve(self, server: socket.socket) -> None:
        server.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        for t in self.threads:
            t.join()
        self.tcp.close()
        self.unix.close()


def network_attempts(listener: Listener) -> str:
    return TRY + f'''
import socket
def tcp(host, port):
    s = socket.create_connection((host, port), timeout=2); s.close()
def abstract():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(2); s.connect("\\0" + {listener.abstract_name!r}); s.close()
attempt("orchestrator_port", lambda: tcp("127.0.0.1", {listener.port}))
attempt("abstract_socket", abstract)
attempt("outside", lambda: tcp("192.0.2.1", 80))
attempt("interfaces", lambda: sorted(name for _, name in socket.if_nameindex()))
'''


def test_no_network_and_no_orchestrator_port() -> None:
    listener = Listener()
    try:
        async def body(mgr: CpuManager) -> None:
            out = await python(mgr, network_attempts(listener))
            assert failed(out["orchestrator_port"]) and failed(out["abstract_socket"]) and failed(out["outside"]), out
            assert out["interfaces"][1] == "['lo']", out

        with_manager(body)
        assert listener.accepted == 0
    finally:
        listener.close()


def test_network_true_opens_the_network() -> None:
    listener = Listener()
    try:
        async def body(mgr: CpuManager) -> None:
            out = await python(mgr, network_attempts(listener), network=True)
            assert out["orchestrator_port"][0] == "ok", out
            # a later call without network in the same sandbox gets a worker without it again
            out = await python(mgr, network_attempts(listener))
            assert out["orchestrator_port"][0] == "ok", out  # the networked worker stays

        with_manager(body)
        assert listener.accepted >= 1
    finally:
        listener.close()


# ---------------------------------------------------------------------------- processes
def test_processes_outside_are_invisible_and_untouchable() -> None:
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={"SECRET_TOKEN": "outside-secret"})
    try:
        async def body(mgr: CpuManager) -> None:
            out = await python(mgr, TRY + f'''
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
def ptrace_attach(pid):
    if libc.ptrace(16, pid, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
attempt("kill_outside", lambda: os.kill({outside.pid}, signal.SIGKILL))
attempt("kill_orchestrator", lambda: os.kill({os.getpid()}, signal.SIGKILL))
attempt("environ_outside", lambda: open("/proc/{outside.pid}/environ").read())
attempt("environ_orchestrator", lambda: open("/proc/{os.getpid()}/environ").read())
attempt("ptrace_outside", lambda: ptrace_attach({outside.pid}))
attempt("ptrace_init", lambda: ptrace_attach(1))
attempt("kill_init", lambda: os.kill(1, signal.SIGKILL))
''')
            assert all(p < 100 for p in out["pids"]), out["pids"]  # its own PID namespace
            for name in ("kill_outside", "kill_orchestrator", "environ_outside", "environ_orchestrator",
                         "ptrace_outside", "ptrace_init"):
                assert failed(out[name]), (name, out[name])
            assert "outside-secret" not in json.dumps(out)

        with_manager(body)
        assert outside.poll() is None  # still alive
    finally:
        outside.kill()
        outside.wait()


# ---------------------------------------------------------------------------- kernel surface
def test_mounting_devices_proc_sys_and_new_namespaces_fail() -> None:
    with open("/proc/sys/kernel/panic") as f:
        panic = f.read()

    async def body(mgr: CpuManager) -> None:
        out = await python(mgr, TRY + '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def check(r):
    if r != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("mount_tmpfs", lambda: check(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
attempt("remount_usr_rw", lambda: check(libc.mount(None, b"/usr", None, 32 | 4096, None)))  # MS_REMOUNT|MS_BIND
attempt("unshare_user", lambda: check(libc.unshare(0x10000000)))
attempt("unshare_mount", lambda: check(libc.unshare(0x00020000)))
attempt("mknod_disk", lambda: os.mknod("/tmp/disk", 0o600 | 0o060000, os.makedev(8, 0)))
attempt("dev_listing", lambda: sorted(os.listdir("/dev")))
attempt("proc_sys_write", lambda: open("/proc/sys/kernel/panic", "w").write("7"))
attempt("sysrq", lambda: open("/proc/sysrq-trigger", "w").write("h"))
attempt("cgroup_fs", lambda: os.listdir("/sys/fs/cgroup"))
attempt("kmsg", lambda: open("/dev/kmsg").read(1))
attempt("sethostname", lambda: check(libc.sethostname(b"pwned", 5)))
import socket
attempt("vsock", lambda: socket.socket(40, socket.SOCK_STREAM).close())  # AF_VSOCK: a VM's host, no netns
attempt("unix_socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())  # still allowed
def mq_open():  # a POSIX message queue outlives a pooled request; the scrub cannot list them
    fd = libc.syscall(240, b"tangram-mq", 0o100 | 0o2, 0o600, None)  # O_CREAT | O_RDWR
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("mq_open", mq_open)
''')
        for name in ("mount_tmpfs", "remount_usr_rw", "unshare_user", "unshare_mount", "mknod_disk", "proc_sys_write",
                     "sysrq", "cgroup_fs", "kmsg", "sethostname", "vsock", "mq_open"):
            assert failed(out[name]), (name, out[name])
        assert out["unix_socket"][0] == "ok", out["unix_socket"]
        devices = eval(out["dev_listing"][1])
        assert not [d for d in devices if d.startswith(("sd", "vd", "nvme", "mem", "kmem", "port", "nvidia"))], devices

    with_manager(body)
    with open("/proc/sys/kernel/panic") as f:
        assert f.read() == panic
    assert os.uname().nodename != "pwned"


# ---------------------------------------------------------------------------- limits
def test_a_fork_bomb_hits_the_pids_limit_and_nothing_else() -> None:
    async def body(mgr: CpuManager) -> None:
        if not (mgr._cgroups is not None and "pids" in mgr._cgroups.dirs) and not ROOT:
            pytest.skip("no PIDs limit here: no pids cgroup, and not root (no uid of its own for RLIMIT_NPROC)")
        bomb = Call(command="bomb() { bomb | bomb & }; bomb; sleep 5", trajectory=1, timeout=60)
        action = LiveAction(next(_ids), bomb)
        outcome: Any
        try:
            outcome = await mgr.execute(action, placement())
        except ResourceLimitExceeded as e:
            outcome = e
        if mgr._cgroups is not None and "pids" in mgr._cgroups.dirs:
            assert isinstance(outcome, ResourceLimitExceeded) and outcome.limit == "pids", outcome
        # the host still forks, and the sandbox works again (a fresh worker, same files)
        assert subprocess.run(["true"]).returncode == 0
        out = await python(mgr, 'out["ok"] = True', trajectory=1)
        assert out["ok"]

    with_manager(body, pids_limit=64)


@pytest.mark.skipif(not ROOT, reason="a disk limit mounts a tmpfs per sandbox (root only)")
def test_filling_the_disk_limit_fails_the_action_and_nothing_else(tmp_path: Any) -> None:
    async def body(mgr: CpuManager) -> None:
        await python(mgr, 'open("kept.txt", "w").write("small")', trajectory=2)
        fill = Call(command="head -c 64M /dev/zero > /tmp/big; head -c 64M /dev/zero > big; echo done", trajectory=1)
        with pytest.raises(ResourceLimitExceeded) as e:
            await mgr.execute(LiveAction(next(_ids), fill), placement())
        assert e.value.limit == "disk" and "16 MiB" in str(e.value)
        # the sandbox works again, emptied; the other sandbox and the host are untouched
        out = await python(mgr, 'out["home"] = os.listdir("."); out["tmp"] = os.listdir("/tmp")', trajectory=1)
        assert out["home"] == [] and "big" not in out["tmp"]  # (/tmp may hold mount points of shown host paths)
        assert (await python(mgr, 'out["kept"] = open("kept.txt").read()', trajectory=2))["kept"] == "small"
        with open(tmp_path / "host.txt", "wb") as f:
            f.write(b"x" * (1 << 20))  # the host's disk still takes writes
        slot = mgr._sandboxes[1].slot
        assert slot is not None and slot.mounted
        root = slot.root

        await mgr.end_trajectory(1)
        with open("/proc/self/mountinfo") as f:
            assert root not in f.read()  # unmounted with its sandbox

    with_manager(body, disk_limit=16)
    with open("/proc/self/mountinfo") as f:
        assert "tangram-" not in f.read()  # nothing of the manager left mounted


def test_the_working_directory_and_tmp_are_never_shown(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """sys.path's '' (the working directory) is not shown, nor /tmp or a parent of it, even
    when sys.path names them: a sandbox's /tmp is its own."""
    from tangram.runtime.sandbox.namespaces import python_paths

    shown = python_paths(["", "/tmp", "/", str(tmp_path)])
    assert "/tmp" not in shown and "/" not in shown
    assert str(tmp_path.resolve()) in shown  # a real module directory under /tmp is shown, read-only
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.txt").write_text("cwd secret")
    monkeypatch.setattr(sys, "path", ["", *sys.path])

    async def body(mgr: CpuManager) -> None:
        out = await python(mgr, TRY + f'''
attempt("cwd_secret", lambda: open({str(tmp_path / "secret.txt")!r}).read())
attempt("tmp_writable", lambda: open("/tmp/mine", "w").write("ok"))
''')
        assert failed(out["cwd_secret"]) and out["tmp_writable"][0] == "ok", out

    with_manager(body)


def test_a_result_cannot_run_code_in_the_orchestrator(tmp_path: Any) -> None:
    """A function runs model-written code and returns what it made: an object whose pickle
    names os.system. A reply is plain data, not a pickle, so the action fails naming the
    type, and nothing runs on the host; the sandbox serves its next call."""
    planted = tmp_path / "planted-by-a-result"
    model_code = textwrap.dedent(f"""
        import os
        class Answer:
            def __reduce__(self):
                return (os.system, ("touch {planted}",))
        answer = Answer()
    """)

    def grade(code: str) -> dict[str, Any]:
        namespace: dict[str, Any] = {}
        exec(code, namespace)
        return {"score": 1.0, "answer": namespace["answer"]}

    async def body(mgr: CpuManager) -> None:
        with pytest.raises(ActionFailed) as refused:
            await mgr.execute(LiveAction(next(_ids), Call(fn=grade, args=(model_code,), trajectory=1)), placement())
        assert refused.value.error_type == "UnsupportedResult" and "Answer" in str(refused.value)
        value = await mgr.execute(LiveAction(next(_ids), Call(fn=lambda: {"score": 0.5}, trajectory=1)), placement())
        assert value == {"score": 0.5}

    with_manager(body)
    assert not planted.exists()


def test_frames_written_to_the_channel_by_hostile_code_are_refused(tmp_path: Any) -> None:
    """Code in the worker writes its own reply frames to the worker's channel (its fd is
    the worker's first argument): a pickle that would run a command on the host, and a
    frame announcing more than a reply may hold. The first is malformed and the second is
    not read; both fail the action, kill the worker (the channel is out of step), run
    nothing on the host, and the trajectory's next call gets a new worker."""
    planted = tmp_path / "planted-by-a-frame"

    class Runs:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {planted}",))

    hostile = pickle.dumps(("ok", Runs()))

    def write_frame(payload: bytes, announced: int) -> str:
        channel = int(sys.argv[1])
        os.write(channel, struct.pack(">Q", announced) + payload[:1 << 16])
        return "the worker's own reply, after the forged one"

    async def body(mgr: CpuManager) -> None:
        with pytest.raises(ActionFailed) as malformed:
            await mgr.execute(LiveAction(next(_ids), Call(fn=write_frame, args=(hostile, len(hostile)), trajectory=1)),
                              placement())
        assert malformed.value.error_type == "ProtocolError", malformed.value
        assert await mgr.execute(LiveAction(next(_ids), Call(fn=lambda: "next", trajectory=1)), placement()) == "next"
        with pytest.raises(ActionFailed) as huge:
            await mgr.execute(LiveAction(next(_ids), Call(fn=write_frame, args=(b"x" * 1000, 1 << 40), trajectory=1)),
                              placement())
        assert huge.value.error_type == "ResultTooLarge", huge.value
        assert await mgr.execute(LiveAction(next(_ids), Call(fn=lambda: "after", trajectory=1)), placement()) == "after"
        big = await mgr.execute(LiveAction(next(_ids), Call(fn=lambda: [b"y" * (3 << 20)], trajectory=1)), placement())
        assert big == [b"y" * (3 << 20)]  # a reply past a MiB, decoded off the event loop

    with_manager(body)
    assert not planted.exists()
