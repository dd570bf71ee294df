"""The isolation boundary of a sandbox: Linux namespaces, set up by bubblewrap.

Under `isolation="namespaces"` (the CPU manager's default where bubblewrap works) every
sandbox worker starts as

    bwrap <mounts> <namespaces> -- python -I inside_worker.py FD OPTIONS

bubblewrap (`bwrap`, the Debian package `bubblewrap`) is the sandbox tool Flatpak uses: it
makes the namespaces and the mount tree, then execs the worker. Inside:

  namespaces   PID (the sandbox sees only its own processes; its init is bwrap's, and when
               that dies every process of the sandbox dies with it), mount, IPC, UTS
               (hostname "sandbox"), network (loopback only, unless the sandbox was started
               with network), cgroup; a user namespace too when the orchestrator is not root.
  user         as root: an unprivileged uid and gid of the sandbox's own (SANDBOX_UID_BASE
               and up, one per sandbox of a manager), taken by the worker before it reads
               anything of the caller's; otherwise the orchestrator's own uid, in a user
               namespace. No capabilities, no_new_privs (setuid binaries do not raise it).
  files        read-only: the system directories (/usr, /etc, /bin, /lib...), the
               orchestrator's Python (its prefixes and sys.path directories, the cwd entry
               excepted) and the manager's `visible_paths`; nothing else of the host (no
               /home, /root, /var, /run, no other sandbox). Writable: the sandbox's
               directory at HOME (/sandbox), a private /tmp and /dev/shm. /proc is the
               sandbox's own; /dev holds null, zero, full, random, urandom, tty and, for a
               sandbox started for a GPU placement, the /dev/nvidia* devices.
  control      CONTROL (/run/tangram): the grant file, the jobserver and the limit FIFO of
               tangram.runtime.sandbox.grant, bound one by one from the sandbox's control directory.

A warm worker is started with a fresh slot (its directories and uid) and its sandbox takes
the slot with it, so the mount tree never has to change after the start. Network and GPU
devices are fixed when a worker starts: a call that needs one its worker lacks gets a new
worker in the same slot (files stay, module state does not; docs/sandbox.md).
"""

from __future__ import annotations

import functools
import glob
import os
import platform
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ManagerError

ISOLATIONS = ("auto", "namespaces", "process")
ENV_VAR = "TANGRAM_ISOLATION"
HOME = "/sandbox"  # the sandbox's directory, inside
CONTROL = "/run/tangram"  # its grant file and FIFOs, inside
# uids of sandboxes when the orchestrator is root: SANDBOX_UID_BASE + (pid % 2**14) * 2**16
# + n, distinct across the sandboxes of a manager and, but for a clash of pids modulo 2**14,
# across the managers of a machine; all below 2**31.
SANDBOX_UID_BASE = 1 << 30
# Paths a sandbox has of its own: a host path under one of them cannot be shown to it.
SANDBOX_OWN_PATHS = ("/run", "/dev", "/proc", HOME)
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_CPU_INFO = "/sys/devices/system/cpu"  # os.cpu_count() and nproc read it


@dataclass(frozen=True)
class Boundary:
    """The isolation in force: "namespaces" (with the bwrap binary and whether sandboxes get
    a uid of their own, as under root) or "process" (no boundary; `reason` says why when
    it was not asked for)."""

    isolation: str
    bwrap: str | None = None
    own_uids: bool = False
    reason: str = ""

    @property
    def namespaces(self) -> bool:
        return self.isolation == "namespaces"

    @property
    def summary(self) -> str:
        """One line for users, without this machine's paths."""
        if self.namespaces:
            return ("namespaces: each its own unprivileged user, processes, files and /tmp; the host read-only; "
                    "no network")
        return "bare processes (unsafe for untrusted code)" + (f": {self.reason}" if self.reason else "")

    @property
    def description(self) -> str:
        if self.namespaces:
            user = ("each sandbox its own unprivileged uid" if self.own_uids
                    else "the orchestrator's uid in a user namespace")
            return (f"namespaces (bubblewrap {self.bwrap}): PID, mount, IPC, UTS, network, cgroup namespaces; {user}, "
                    "no capabilities, no_new_privs; the host read-only but for the sandbox's directory, /tmp and "
                    "/dev/shm; no network unless asked")
        return "process (UNSAFE for untrusted code: same user, files and network as the orchestrator)" + (
            f": {self.reason}" if self.reason else "")


def _base_flags(own_uids: bool) -> list[str]:
    flags = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox",
             "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if own_uids:  # the worker drops to the sandbox's uid itself; it needs these two for that
        flags += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        flags += ["--unshare-user"]
    return flags


def _system_mounts() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


@functools.lru_cache(maxsize=None)
def _probe(bwrap: str, own_uids: bool) -> str:
    """Runs a sandbox with the real flags and mounts around /bin/true; '' when it works,
    else what bwrap said."""
    argv = [bwrap, *_base_flags(own_uids), "--unshare-net", *_system_mounts(), "--proc", "/proc", "--dev", "/dev",
            "--", "true"]
    try:
        out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{bwrap} did not run: {e}"
    if out.returncode != 0:
        said = out.stderr.decode("utf-8", "replace").strip() or f"exit status {out.returncode}"
        return f"{bwrap} cannot make a sandbox here: {said}"
    return ""


def detect(force: str | None = None, *, field: str = "isolation") -> Boundary:
    """The isolation usable here. `force` ("auto" or None: detect; "namespaces" or
    "process") takes precedence over the environment variable TANGRAM_ISOLATION. Forcing
    namespaces where they do not work is a ManagerError naming the cause."""
    source = field
    if force in (None, "", "auto"):
        env = os.environ.get(ENV_VAR, "").strip()
        force, source = (env, ENV_VAR) if env and env != "auto" else (None, source)
    if force is not None and force not in ISOLATIONS:
        raise ManagerError(source, f"unknown isolation {force!r}; expected one of {', '.join(ISOLATIONS)} (the cgroup "
                           "mechanism is the option resource_control, TANGRAM_RESOURCE_CONTROL)")
    if force == "process":
        return Boundary("process")
    bwrap = shutil.which("bwrap")
    own_uids = os.geteuid() == 0
    why = ("bubblewrap is not installed (bwrap not on PATH; Debian/Ubuntu: apt-get install bubblewrap)"
           if bwrap is None else _probe(bwrap, own_uids))
    if not why:
        return Boundary("namespaces", bwrap, own_uids)
    if force == "namespaces":
        raise ManagerError(source, f"namespaces forced but not usable: {why}")
    return Boundary("process", reason=why)


def python_paths(sys_path: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """The host paths a worker needs read-only to run the orchestrator's Python: its
    prefixes, the directory of its executable, every sys.path entry but the cwd's (''),
    tangram's own package and cloudpickle (an editable install maps them from elsewhere),
    and `extra`. Existing paths only, none inside another, none inside the system dirs."""
    import cloudpickle

    import tangram

    wanted = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)),
              os.path.dirname(os.path.dirname(os.path.abspath(tangram.__file__))),
              os.path.dirname(os.path.dirname(os.path.abspath(cloudpickle.__file__)))]
    wanted += [p for p in sys_path if p]
    wanted += list(extra)
    return outermost(os.path.realpath(p) for p in wanted if p and os.path.exists(p))


def outermost(paths: Iterable[str]) -> list[str]:
    """`paths` (resolved) to show a sandbox: none inside another, none in or above the
    system directories, /tmp or a place the sandbox has of its own; sorted."""
    system = tuple(d + "/" for d in SYSTEM_DIRS)
    own = ("/tmp", *SANDBOX_OWN_PATHS)
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if p in SYSTEM_DIRS or (p + "/").startswith(system) or p == "/":
            continue
        if any(o == p or o.startswith(p + "/") for o in own):  # /tmp itself, a parent of it: never shown
            continue
        if any(p == q or p.startswith(q + "/") for q in out):
            continue
        out.append(p)
    return sorted(out)


def gpu_devices() -> list[str]:
    """The NVIDIA device nodes of this machine (bound into a sandbox started for a GPU)."""
    return sorted(glob.glob("/dev/nvidia*"))


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def bwrap_argv(boundary: Boundary, *, home: str, tmp: str, control: str, read_only: Sequence[str],
               network: bool, gpu: bool = False, writable: Sequence[str] = (), rootfs: str | None = None) -> list[str]:
    """bwrap's argv up to `--` for one worker: `home` (the sandbox directory on the host)
    at HOME, `tmp` at /tmp, `control` (a directory holding grant, jobserver and limit) at
    CONTROL, `read_only` host paths at the same paths inside, and `writable` ones too (an
    MPS pipe directory). With `rootfs` (an image sandbox's root, tangram.runtime.sandbox.rootfs)
    that is /, and the system directories and `read_only` paths are under rootfs.HOST."""
    from .rootfs import HOST

    assert boundary.bwrap is not None
    argv = [boundary.bwrap, *_base_flags(boundary.own_uids)]
    if not network:
        argv.append("--unshare-net")
    shown = "" if rootfs is None else HOST  # where host paths are, inside
    if rootfs is None:
        argv += _system_mounts()
    else:
        argv += ["--bind", rootfs, "/"]
    # The sandbox's own places first, then the host paths it is shown on top of them: a
    # Python installed under /tmp (a venv there) stays visible above the sandbox's /tmp.
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm",
             "--perms", "0755", "--tmpfs", "/run", "--ro-bind", control, CONTROL,
             "--bind", home, HOME, "--bind", tmp, "/tmp"]
    made: set[str] = {*SYSTEM_DIRS, "/proc", "/dev", "/run", HOME, "/tmp"}
    if rootfs is not None:
        argv += ["--perms", "0755", "--dir", HOST]
        made = {"/proc", "/dev", "/run", HOME, "/tmp", HOST}
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                target = os.readlink(d)  # /lib -> usr/lib: to HOST/usr/lib, not the image's
                argv += ["--symlink", HOST + target if os.path.isabs(target) else target, HOST + d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, HOST + d]
            made.add(HOST + d)
    shown_paths = [shown + p for p in read_only]
    if os.path.isdir(_CPU_INFO):
        read_only, shown_paths = [*read_only, _CPU_INFO], [*shown_paths, _CPU_INFO]
    for path in [*shown_paths, *writable]:
        for parent in _parents(path):  # traversable by the sandbox's uid (bwrap makes them 0700)
            if parent not in made:
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
    for path, inside in zip(read_only, shown_paths):
        argv += ["--ro-bind", path, inside]
    if gpu:
        for dev in gpu_devices():
            argv += ["--dev-bind", dev, dev]
    for path in writable:
        argv += ["--bind", path, path]
    argv += ["--chdir", "/", "--"]  # the worker moves to HOME as its user
    return argv


# ---------------------------------------------------------------------------- seccomp
# A deny list in classic BPF, handed to bwrap (--seccomp FD), which installs it just before
# it execs the worker: what Flatpak and Docker's default profile keep from sandboxed code.
# Tracing and mounting of any kind, new user namespaces (clone with CLONE_NEWUSER, unshare,
# setns), kernel keyrings, modules, kexec, BPF, perf, userfaultfd and io_uring (the kernel
# surface local exploits use most), handles that reopen files by inode, and the syscalls of
# foreign ABIs (i386, x32: a filter on x86_64 numbers says nothing of them), POSIX message
# queues (they outlive a pooled request, and a sandbox cannot list them to remove), and sockets of
# AF_VSOCK (a VM's channel to its host and hypervisor, which no network namespace
# separates). Each fails with EPERM; clone3 fails with ENOSYS, so that libc falls back to
# clone, whose flags a classic filter can read. x86_64 only; elsewhere no filter is
# installed (Boundary.seccomp says so).
_DENIED_X86_64 = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "pivot_root": 155, "acct": 163, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172,
    "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "finit_module": 313, "kexec_file_load": 320,
    "mq_open": 240, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
}
_NR_CLONE, _NR_CLONE3, _NR_SOCKET = 56, 435, 41
_AF_VSOCK = 40
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_CLONE_NEWUSER = 0x10000000
_EPERM, _ENOSYS = 1, 38
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
# classic BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


@functools.lru_cache(maxsize=None)
def seccomp_filter() -> bytes | None:
    """The compiled filter (struct sock_filter[]), or None on a machine it is not for."""
    if platform.machine() != "x86_64":
        return None
    prog: list[tuple[int, int, int, int]] = []

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        prog.append((code, jt, jf, k))

    deny, enosys = (_RET_K, 0, 0, _RET_ERRNO | _EPERM), (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS)
    numbers = sorted(_DENIED_X86_64.values())
    op(_LD_W_ABS, 4)                                    # arch
    op(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1)                # x86_64: on
    prog.append(deny)                                   # i386 and others: denied
    op(_LD_W_ABS, 0)                                    # nr
    op(_JGE_K, _X32_SYSCALL_BIT, jt=len(numbers) + 9)   # x32: denied (to the last deny)
    for i, nr in enumerate(numbers):
        op(_JEQ_K, nr, jt=len(numbers) - i + 8)         # to the last deny
    op(_JEQ_K, _NR_CLONE3, jt=7)                        # to enosys
    op(_JEQ_K, _NR_CLONE, jf=2)                         # not clone: to the socket check
    op(_LD_W_ABS, 16)                                   # clone's flags (args[0], low word)
    op(_JSET_K, _CLONE_NEWUSER, jt=5, jf=3)             # to deny, else to allow
    op(_JEQ_K, _NR_SOCKET, jf=2)                        # not socket: to allow
    op(_LD_W_ABS, 16)                                   # socket's family (args[0])
    op(_JEQ_K, _AF_VSOCK, jt=2)                         # to deny
    op(_RET_K, _RET_ALLOW)
    prog.append(enosys)
    prog.append(deny)
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


def seccomp_fd() -> int:
    """A file holding the filter, at offset 0, for one bwrap (it reads it to the end);
    the caller closes it once bwrap has started."""
    data = seccomp_filter()
    assert data is not None
    fd = os.memfd_create("tangram-seccomp", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# ---------------------------------------------------------------------------- disk limits
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


def mount_tmpfs(path: str, size_bytes: int) -> None:
    """A tmpfs of `size_bytes` at `path` (root only): a sandbox's writable storage under a
    disk limit. Its pages are memory, charged to the cgroup of the process that writes them."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size_bytes},mode=0755".encode()
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount a tmpfs at {path}: {os.strerror(err)}")


def unmount(path: str) -> None:
    """Detaches the mount at `path` (nothing when there is none)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(path.encode(), _MNT_DETACH)


def unmount_under(directory: str) -> None:
    """Detaches every mount at or below `directory` (deepest first)."""
    prefix = os.path.realpath(directory).rstrip("/") + "/"
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return
    for point in sorted((p for p in points if (p + "/").startswith(prefix)), key=len, reverse=True):
        unmount(point)


def unmount_orphans(parent: str) -> list[str]:
    """Detaches the mounts left under `parent` by CPU managers whose process is gone (an
    orchestrator killed before its close(): a disk limit's tmpfs, an image's layers), and
    removes their directories (`tangram-<pid>.<n>-*`). Returns the directories cleaned."""
    import re

    pattern = re.compile(r"tangram-(\d+)\.\d+-[^/]+")
    prefix = os.path.realpath(parent).rstrip("/") + "/"
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return []
    orphans = set()
    for point in points:
        if not point.startswith(prefix):
            continue
        match = pattern.match(point[len(prefix):])
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            orphans.add(prefix + match.group(0))
    for directory in sorted(orphans):
        unmount_under(directory)
        shutil.rmtree(directory, ignore_errors=True)
    return sorted(orphans)


def disk_full(path: str) -> bool:
    """Whether the file system at `path` has no block left for unprivileged writes."""
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


class UidAllocator:
    """Sandbox uids for a manager under root (see SANDBOX_UID_BASE)."""

    def __init__(self) -> None:
        self.base = SANDBOX_UID_BASE + (os.getpid() % (1 << 14)) * (1 << 16)

    def take(self, n: int) -> int:
        """The uid of the manager's n-th sandbox slot."""
        return self.base + n % (1 << 16)


__all__ = ["CONTROL", "ENV_VAR", "HOME", "ISOLATIONS", "SANDBOX_OWN_PATHS", "SANDBOX_UID_BASE", "SYSTEM_DIRS", "Boundary", "UidAllocator",
           "bwrap_argv", "detect", "disk_full", "gpu_devices", "mount_tmpfs", "outermost", "python_paths", "unmount",
           "unmount_orphans", "unmount_under"]
