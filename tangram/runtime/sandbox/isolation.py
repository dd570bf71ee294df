"""How the CPU manager confines a sandbox's resources: detection of the mechanism, and the cgroups.

(The sandbox's isolation boundary, its namespaces, is tangram.runtime.sandbox.namespaces; this is
its resource control, the CPU manager's option `resource_control`.)

Three mechanisms, detected in this order (the first that works here wins):

  cgroup-v2  a writable cgroup2 hierarchy where the cpuset, cpu and memory controllers can
             be enabled for a subtree of this process's cgroup. Per sandbox: cpuset.cpus,
             cpu.weight (the grant), cpu.max (hard ceilings, when asked for), memory.max
             (+ memory.swap.max = 0), cgroup.kill.
  cgroup-v1  writable v1 hierarchies for cpuset, cpu and memory (each may be co-mounted with
             others). Per sandbox: cpuset.cpus, cpu.shares (the grant), cpu.cfs_quota_us
             (hard ceilings), memory.limit_in_bytes (+ memory.memsw.limit_in_bytes when swap
             accounting exists).
  affinity   no writable cgroup: the sandbox worker pins itself with sched_setaffinity
             (children inherit it) and memory is an RLIMIT_AS soft limit. No weights and no
             quota: grants are enforced by the scheduler's accounting only.

A grant is a guarantee by default (the CPU manager's `cpu_limit="guarantee"`): the sandbox
may run on every CPU of the manager, and its CPU weight is proportional to its grant, so an
action uses any core nobody else needs and, when all are busy, gets at least its share.
`cpu_limit="ceiling"` pins each action to its granted CPUs and caps fractions with a CFS
quota. bench/cpu_grants.py measures both.

`TANGRAM_RESOURCE_CONTROL` (or the CPU manager's `resource_control` option) forces one of the three;
forcing a cgroup mechanism that is not usable here is an error, not a silent fallback.
`python -m tangram.runtime.sandbox.isolation` prints what is in force on this machine.

Cgroups are made inside this process's own cgroup of each hierarchy (read from
/proc/self/cgroup and /proc/self/mountinfo), as `<that>/tangram-<pid>-<n>/sb-<trajectory>`,
so they stay under whatever limits the orchestrator itself runs in.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..._arguments import int_ranges
from ..errors import ManagerError

MECHANISMS = ("cgroup-v2", "cgroup-v1", "affinity")
ENV_VAR = "TANGRAM_RESOURCE_CONTROL"
_CONTROLLERS = ("cpuset", "cpu", "memory")
# Used where the hierarchy has it (a sandbox's PIDs limit), not required: without it a
# sandbox under root is held by RLIMIT_NPROC on its own uid instead.
_OPTIONAL = ("pids",)
CFS_PERIOD_US = 100_000
_MIN_QUOTA_US = 1_000  # the kernel refuses less than 1 ms per period
IDLE_CORES = 0.01  # CPU quota of a sandbox's leftover processes between actions (ceilings)
# CPU weight of one granted core: the kernel's weight of one nice-0 task (v1 cpu.shares), and
# the default cpu.weight (v2). Weights are relative, so only the ratio between sandboxes counts.
SHARES_PER_CORE = 1024
WEIGHT_PER_CORE = 100
_SHARES_RANGE = (2, 262_144)
_WEIGHT_RANGE = (1, 10_000)


@dataclass(frozen=True)
class Isolation:
    """The mechanism in force. `dirs`: the base cgroup directory per controller (v1: one
    per hierarchy; v2: the same directory for all three); `reasons`: why the mechanisms
    ahead of it in the detection order were not used."""

    mechanism: str
    description: str
    dirs: Mapping[str, str] = field(default_factory=dict)
    reasons: Sequence[str] = ()

    @property
    def cgroup(self) -> bool:
        return self.mechanism != "affinity"

    @property
    def summary(self) -> str:
        """One line for users, without this machine's paths (`description` has them)."""
        if self.cgroup:
            return (f"{self.mechanism.replace('-', ' ')}: each action's grant is its CPU weight (a guarantee; idle "
                    "cores are used), or a pinned ceiling when asked for, and a memory limit")
        return "CPU affinity: each action pinned to the manager's CPUs (no writable cgroups here)"


# ---------------------------------------------------------------------------- detection
def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount."""
    out = []
    try:
        text = _read("/proc/self/mountinfo")
    except OSError:
        return out
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields_l, fields_r = left.split(), right.split()
        if len(fields_l) < 5 or len(fields_r) < 3:
            continue
        fstype = fields_r[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        root, point = _unescape(fields_l[3]), _unescape(fields_l[4])
        out.append((fstype, root, point, set(fields_r[2].split(","))))
    return out


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _own_cgroups(source: str = "/proc/self/cgroup") -> tuple[str | None, dict[str, str]]:
    """This process's (or `source`'s) cgroup path in the v2 hierarchy and per v1 controller."""
    v2: str | None = None
    v1: dict[str, str] = {}
    try:
        text = _read(source)
    except OSError:
        return None, v1
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":
            v2 = path
        else:
            for c in ctrls.split(","):
                v1[c] = path
    return v2, v1


def _join(point: str, root: str, own: str) -> str:
    if root not in ("/", "") and own.startswith(root):
        own = own[len(root):]
    elif root not in ("/", ""):
        own = "/"  # not visible from this mount: use its top
    own = own.replace(" (deleted)", "")
    return os.path.normpath(point + "/" + own.lstrip("/"))


def _probe(base: str, setup: Iterable[tuple[str, str]] = ()) -> str | None:
    """Makes and removes a child cgroup under `base`; None when that works, else why not."""
    if not os.path.isdir(base):
        return f"{base} does not exist"
    probe = os.path.join(base, f"tangram-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create a cgroup under {base}: {e.strerror}"
    try:
        for name, value in setup:
            _write(os.path.join(probe, name), value)
        return None
    except OSError as e:
        return f"cannot configure a cgroup under {base}: {e.strerror}"
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def _detect_v2(mounts: list[tuple[str, str, str, set[str]]], own: str | None) -> tuple[dict[str, str] | None, str]:
    """The directory to make the manager's cgroup in: this process's own cgroup when the
    three controllers can be enabled for its subtree (the root, or a cgroup that holds no
    process itself), else its parent (a sibling of ours gets them when ours has them and
    the parent is writable, as under systemd delegation)."""
    v2 = [m for m in mounts if m[0] == "cgroup2"]
    if not v2 or own is None:
        return None, "cgroup-v2: no cgroup2 hierarchy for this process"
    _, root, point, _ = v2[0]
    base = _join(point, root, own)
    try:
        available = set(_read(os.path.join(base, "cgroup.controllers")).split())
        enabled = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
    except OSError as e:
        return None, f"cgroup-v2: cannot read {base}: {e.strerror}"
    missing = [c for c in _CONTROLLERS if c not in available]
    if missing:
        return None, f"cgroup-v2: controllers {', '.join(missing)} not available in {base}"
    todo = [c for c in _CONTROLLERS if c not in enabled]
    why = ""
    if todo and os.access(base, os.W_OK):
        try:  # only possible when `base` holds no process of its own (or is the root)
            _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in todo))
            todo = []
        except OSError as e:
            why = f"cannot enable {', '.join(todo)} for the subtree of {base}: {e.strerror}"
    if not todo:
        why = _probe(base, [("cgroup.subtree_control", "+cpuset +cpu +memory")]) or ""
        if not why:
            return _with_pids_v2(base, available), ""
    parent = os.path.dirname(base)
    point = os.path.normpath(point)
    if parent != base and (parent == point or parent.startswith(point + "/")):
        why2 = _probe(parent, [("cgroup.subtree_control", "+cpuset +cpu +memory")])
        if why2 is None:
            try:
                parent_has = set(_read(os.path.join(parent, "cgroup.controllers")).split())
            except OSError:
                parent_has = set()
            return _with_pids_v2(parent, parent_has), ""
        why = f"{why or 'not writable: ' + base}; {why2}"
    return None, "cgroup-v2: " + (why or f"{base} is not writable")


def _with_pids_v2(base: str, available: set[str]) -> dict[str, str]:
    dirs = {c: base for c in _CONTROLLERS}
    if "pids" in available:
        enabled = ""
        try:
            enabled = _read(os.path.join(base, "cgroup.subtree_control"))
            if "pids" not in enabled.split():
                _write(os.path.join(base, "cgroup.subtree_control"), "+pids")
            dirs["pids"] = base
        except OSError:
            pass
    return dirs


def _detect_v1(mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str]) -> tuple[dict[str, str] | None, str]:
    dirs: dict[str, str] = {}
    for c in _CONTROLLERS:
        m = next((m for m in mounts if m[0] == "cgroup" and c in m[3]), None)
        if m is None:
            return None, f"cgroup-v1: no {c} hierarchy mounted"
        base = _join(m[2], m[1], own.get(c, "/"))
        setup: list[tuple[str, str]] = []
        if c == "cpuset":
            try:
                cpus = _read(os.path.join(base, "cpuset.effective_cpus")).strip() or _read(os.path.join(base, "cpuset.cpus")).strip()
                mems = _read(os.path.join(base, "cpuset.effective_mems")).strip() or _read(os.path.join(base, "cpuset.mems")).strip()
            except OSError as e:
                return None, f"cgroup-v1: cannot read the cpuset of {base}: {e.strerror}"
            setup = [("cpuset.cpus", cpus), ("cpuset.mems", mems)]
        why = _probe(base, setup)
        if why is not None:
            return None, "cgroup-v1: " + why
        dirs[c] = base
    for c in _OPTIONAL:
        m = next((m for m in mounts if m[0] == "cgroup" and c in m[3]), None)
        if m is not None:
            base = _join(m[2], m[1], own.get(c, "/"))
            if _probe(base) is None:
                dirs[c] = base
    return dirs, ""


def detect(force: str | None = None, *, field: str = "resource_control") -> Isolation:
    """The isolation mechanism usable here. `force` ("auto" or None: detect; or one of
    MECHANISMS) takes precedence over the environment variable TANGRAM_ISOLATION."""
    source = field
    if force in (None, "", "auto"):
        env = os.environ.get(ENV_VAR, "").strip()
        force, source = (env, ENV_VAR) if env and env != "auto" else (None, source)
    if force is not None and force not in MECHANISMS:
        raise ManagerError(source, f"unknown resource control {force!r}; expected auto, {', '.join(MECHANISMS)}")
    mounts = _mounts()
    own_v2, own_v1 = _own_cgroups()
    reasons: list[str] = []
    if force in (None, "cgroup-v2"):
        dirs, why = _detect_v2(mounts, own_v2)
        if dirs is not None:
            return Isolation("cgroup-v2", f"cgroup v2 under {dirs['cpu']}: per-action cpuset.cpus, cpu.weight (the "
                             "grant), cpu.max for hard ceilings, memory.max (no swap); kill through cgroup.kill",
                             dirs, reasons)
        reasons.append(why)
        if force is not None:
            raise ManagerError(source, f"cgroup-v2 forced but not usable: {why}")
    if force in (None, "cgroup-v1"):
        dirs, why = _detect_v1(mounts, own_v1)
        if dirs is not None:
            where = ", ".join(f"{c} {d}" for c, d in dirs.items())
            return Isolation("cgroup-v1", f"cgroup v1 ({where}): per-action cpuset.cpus, cpu.shares (the grant), "
                             "cpu.cfs_quota_us for hard ceilings, memory.limit_in_bytes (+memsw); kill of every task "
                             "in the cgroup", dirs, reasons)
        reasons.append(why)
        if force is not None:
            raise ManagerError(source, f"cgroup-v1 forced but not usable: {why}")
    why_not = f" ({'; '.join(reasons)})" if reasons else " (forced)"
    return Isolation("affinity", "sched_setaffinity on the sandbox worker (children inherit it), RLIMIT_AS soft limit "
                     "for memory, no CPU weight or quota; kill by process group" + why_not, {}, reasons)


# ---------------------------------------------------------------------------- cgroups
def hierarchy_path(directory: str) -> str:
    """A cgroup directory's path in its hierarchy ("/a/b" for <mount point>/a/b), as a
    container engine's --cgroup-parent names it."""
    directory = os.path.normpath(directory)
    points = [m[2] for m in _mounts() if directory == m[2] or directory.startswith(m[2].rstrip("/") + "/")]
    if not points:
        raise ValueError(f"{directory} is not in a cgroup hierarchy")
    return "/" + directory[len(max(points, key=len)):].strip("/")


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass


def _rmdir(path: str, attempts: int = 50) -> bool:
    for i in range(attempts):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY:
                return False
            time.sleep(0.002 * (i + 1))  # its last tasks are still exiting
    return False


def _procs(path: str) -> list[int]:
    """The live (not zombie) processes of a cgroup."""
    try:
        pids = [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []
    return [p for p in pids if alive(p)]


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    i = stat.rfind(b")")
    return stat[i + 2:i + 3] not in (b"Z", b"X", b"")


class ManagerCgroups:
    """The manager's own cgroup(s): `<base>/tangram-<pid>-<n>` in each hierarchy."""

    def __init__(self, iso: Isolation, name: str, cpus: Sequence[int]) -> None:
        self.iso = iso
        self.v2 = iso.mechanism == "cgroup-v2"
        for d in dict.fromkeys(iso.dirs.values()):
            remove_stale(d)
        self.dirs: dict[str, str] = {c: os.path.join(d, name) for c, d in iso.dirs.items()}
        made: list[str] = []
        try:
            for c in self.dirs:
                d = self.dirs[c]
                if d in made:
                    continue
                _mkdir(d)
                made.append(d)
                if c == "cpuset":
                    parent = iso.dirs[c]
                    mems = _read(os.path.join(parent, "cpuset.effective_mems")).strip() if not self.v2 else ""
                    _write(os.path.join(d, "cpuset.cpus"), int_ranges(cpus))
                    if not self.v2:
                        _write(os.path.join(d, "cpuset.mems"), mems)
                    self.mems = mems
            if self.v2:
                _write(os.path.join(self.dirs["cpu"], "cgroup.subtree_control"),
                       "+cpuset +cpu +memory" + (" +pids" if "pids" in self.dirs else ""))
        except OSError as e:
            for d in reversed(made):
                _rmdir(d, 1)
            raise ManagerError("managers.cpu.resource_control", f"cannot set up the manager's cgroup {made[-1] if made else name}: {e.strerror}") from None
        self.made = made

    def sandbox(self, name: str) -> SandboxCgroup:
        return SandboxCgroup(self, name)

    def remove(self) -> None:
        for d in reversed(self.made):
            for p in _procs(d):  # nothing should be left; never leave it running
                _kill(p)
            _rmdir(d)


def remove_stale(base: str) -> list[str]:
    """Removes the cgroups `tangram-<pid>-<n>` under `base` left by managers whose process
    died without closing them (their sandboxes are killed). Returns what it removed."""
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "tangram" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or alive(pid):
            continue
        d = os.path.join(base, name)
        try:
            subs = [os.path.join(d, e) for e in os.listdir(d) if os.path.isdir(os.path.join(d, e))]
        except OSError:
            continue
        for sub in subs + [d]:
            for _ in range(20):
                pids = _procs(sub)
                if not pids:
                    break
                for p in pids:
                    _kill(p)
                time.sleep(0.002)
            _rmdir(sub, 5)
        if not os.path.exists(d):
            removed.append(d)
    return removed


def children_of(pid: int) -> list[int]:
    """The child pids of every thread of `pid` (none once it is gone)."""
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


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (not `pid` itself), as /proc lists them now."""
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children_of(stack.pop()):
            out.append(child)
            stack.append(child)
    return out


class _EventCount:
    """A cgroup file of "key value" lines the kernel counts in (memory.events, pids.events),
    kept open: read before and after each action, a pread each (close() when done)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1

    def get(self, key: str) -> int | None:
        """The count of `key`; None when the file or the key is not there."""
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            text = os.pread(self._fd, 4096, 0).decode()
        except OSError:
            return None
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        pass


def cpu_weight(cores: float, v2: bool) -> int:
    """The cgroup CPU weight of a grant of `cores`: cpu.weight (v2) or cpu.shares (v1),
    within the kernel's range (a grant past 100 cores on v2, 256 on v1, is capped)."""
    per_core, (low, high) = (WEIGHT_PER_CORE, _WEIGHT_RANGE) if v2 else (SHARES_PER_CORE, _SHARES_RANGE)
    return min(high, max(low, int(round(cores * per_core))))


class SandboxCgroup:
    """One sandbox's cgroup(s). Writes are cached: a setting equal to the last one written
    costs nothing (a trajectory's actions with the same grant write nothing at all).
    `adopt` wraps a cgroup someone else made (a container engine's) instead."""

    def __init__(self, mgr: ManagerCgroups, name: str) -> None:
        dirs = {c: os.path.join(d, name) for c, d in mgr.dirs.items()}
        self.v2 = mgr.v2
        self.dirs = dirs
        self.unique = list(dict.fromkeys(dirs.values()))
        self._made = True
        try:
            for d in self.unique:
                _mkdir(d)
            if not self.v2:
                _write(os.path.join(self.dirs["cpuset"], "cpuset.cpus"), _read(os.path.join(mgr.dirs["cpuset"], "cpuset.cpus")).strip())
                _write(os.path.join(self.dirs["cpuset"], "cpuset.mems"), mgr.mems)
        except OSError as e:
            self.remove()
            raise ManagerError("managers.cpu.resource_control", f"cannot create the sandbox cgroup {self.dirs['cpuset']}: {e.strerror}") from None
        self._attach(dirs, self.v2)

    @classmethod
    def adopt(cls, pid: int, spare: int | None = None) -> SandboxCgroup:
        """The cgroup(s) `pid` runs in, made by someone else (a container engine, which
        also removes them): `remove` kills its processes but leaves the directories, and
        neither it nor `kill_all` kills `spare` (the container's init). OSError when they
        are not found or not writable here."""
        v2_path, v1_paths = _own_cgroups(f"/proc/{pid}/cgroup")
        mounts = _mounts()
        dirs: dict[str, str] = {}
        if v2_path is not None and not v1_paths.keys() & set(_CONTROLLERS):
            m = next((m for m in mounts if m[0] == "cgroup2"), None)
            if m is None:
                raise OSError(errno.ENOENT, f"no cgroup2 hierarchy mounted for process {pid}")
            d = _join(m[2], m[1], v2_path)
            dirs = {c: d for c in (*_CONTROLLERS, *_OPTIONAL)
                    if c in ("cpu", "cpuset", "memory") or os.path.exists(os.path.join(d, f"{c}.max"))}
            v2 = True
        else:
            for c in (*_CONTROLLERS, *_OPTIONAL):
                m = next((m for m in mounts if m[0] == "cgroup" and c in m[3]), None)
                if m is not None and c in v1_paths:
                    dirs[c] = _join(m[2], m[1], v1_paths[c])
                elif c in _CONTROLLERS:
                    raise OSError(errno.ENOENT, f"process {pid} has no {c} cgroup here")
            v2 = False
        for d in dict.fromkeys(dirs.values()):
            if not os.access(os.path.join(d, "cgroup.procs"), os.W_OK):
                raise OSError(errno.EACCES, f"the cgroup {d} of process {pid} is not writable here")
        cg = cls.__new__(cls)
        cg.v2 = v2
        cg.dirs = dirs
        cg.unique = list(dict.fromkeys(dirs.values()))
        cg._made = False
        cg._attach(dirs, v2)
        cg.spare = spare
        return cg

    spare: int | None = None  # a process kill_all leaves (an adopted container's init)

    def _attach(self, dirs: Mapping[str, str], v2: bool) -> None:
        mem = dirs["memory"]
        self._oom_events = _EventCount(os.path.join(mem, "memory.events" if v2 else "memory.oom_control"))
        self._pids_events = _EventCount(os.path.join(dirs["pids"], "pids.events")) if "pids" in dirs else None
        self._memsw = None if v2 else os.path.join(mem, "memory.memsw.limit_in_bytes")
        if self._memsw is not None and not os.path.exists(self._memsw):
            self._memsw = None
        self._swap_max = os.path.join(mem, "memory.swap.max") if v2 else None
        if self._swap_max is not None and not os.path.exists(self._swap_max):
            self._swap_max = None
        self._cpus: str | None = None
        self._procs_file = os.path.join(dirs["cpu"], "cgroup.procs")
        self._quota: int | None = -1  # unlimited when created
        self._weight = -1  # unknown: the first set_weight writes
        self._memory: int = 0  # bytes; 0: unlimited
        self._pids: int | None = None  # unlimited when created

    def add(self, pid: int) -> None:
        for d in self.unique:
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def add_tree(self, pid: int) -> None:
        """`pid` and all its descendants (a namespaced worker is bwrap's grandchild), top
        down: each process is moved before its children are listed, so a child forked
        meanwhile is either listed or born in the cgroup already."""
        self.add(pid)
        stack = [pid]
        while stack:
            for child in children_of(stack.pop()):
                try:
                    self.add(child)
                except ProcessLookupError:
                    continue
                stack.append(child)

    @property
    def has_pids(self) -> bool:
        return "pids" in self.dirs

    def set_pids(self, limit: int | None) -> None:
        """At most `limit` tasks (processes and threads) in the sandbox (None: no limit)."""
        if "pids" in self.dirs and limit != self._pids:
            _write(os.path.join(self.dirs["pids"], "pids.max"), "max" if limit is None else str(limit))
            self._pids = limit

    def pids_refused(self) -> int:
        """Forks refused so far at the PIDs limit (the kernel's count; 0 without pids)."""
        return 0 if self._pids_events is None else self._pids_events.get("max") or 0

    def set_cpus(self, cpus: str) -> None:
        if cpus != self._cpus:
            _write(os.path.join(self.dirs["cpuset"], "cpuset.cpus"), cpus)
            self._cpus = cpus

    def set_quota(self, cores: float | None) -> None:
        """A CFS quota of `cores` CPUs (None: unlimited)."""
        quota = -1 if cores is None else max(_MIN_QUOTA_US, int(round(cores * CFS_PERIOD_US)))
        if quota == self._quota:
            return
        if self.v2:
            _write(os.path.join(self.dirs["cpu"], "cpu.max"), f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}")
        else:
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_quota_us"), str(quota))
        self._quota = quota

    def set_weight(self, cores: float) -> None:
        """CPU weight proportional to `cores` (cpu.weight on v2, cpu.shares on v1): under
        contention the sandbox gets at least its share; idle cores it may use freely."""
        weight = cpu_weight(cores, self.v2)
        if weight == self._weight:
            return
        _write(os.path.join(self.dirs["cpu"], "cpu.weight" if self.v2 else "cpu.shares"), str(weight))
        self._weight = weight

    def set_memory(self, limit: int) -> None:
        """Memory limit in bytes (0: unlimited). Raises OSError(EBUSY) when the sandbox
        already uses more than `limit` and the kernel cannot reclaim it."""
        if limit == self._memory:
            return
        d = self.dirs["memory"]
        if self.v2:
            _write(os.path.join(d, "memory.max"), str(limit) if limit > 0 else "max")
            if self._swap_max is not None:
                _write(self._swap_max, "0" if limit > 0 else "max")
        else:
            value = str(limit) if limit > 0 else "-1"
            mem = os.path.join(d, "memory.limit_in_bytes")
            # memory.memsw.limit_in_bytes must stay >= memory.limit_in_bytes at every step
            order = [mem] if self._memsw is None else (
                [self._memsw, mem] if limit == 0 or 0 < self._memory < limit else [mem, self._memsw])
            for path in order:
                _write(path, value)
        self._memory = limit

    def idle(self, ceiling: bool, base: int = 1) -> None:
        """Between actions: when processes other than the worker outlive the action
        (background jobs, servers), they get the lowest weight (they run on cores nobody
        else wants), or under ceilings a quota of IDLE_CORES, until the next action sets
        its grant. One read of cgroup.procs when there are none."""
        try:
            fd = os.open(self._procs_file, os.O_RDONLY)
            try:
                data = os.read(fd, 64)
            finally:
                os.close(fd)
            if data.count(b"\n") > base:  # more than the worker (and its bwrap, `base` in all)
                if ceiling:
                    self.set_quota(IDLE_CORES)
                else:
                    self.set_weight(0)
        except OSError:  # removed meanwhile (its trajectory ended)
            pass

    @property
    def memory(self) -> int:
        return self._memory

    def oom_kills(self) -> int:
        """Tasks of this cgroup killed by the OOM killer so far (the kernel's count)."""
        kills = self._oom_events.get("oom_kill")
        if kills is not None:
            return kills
        try:  # old v1 kernels without the oom_kill count: fall back to the limit's hit count
            return int(_read(os.path.join(self.dirs["memory"], "memory.failcnt")))
        except (OSError, ValueError):
            return 0

    def procs(self) -> list[int]:
        """Its live processes (an adopted container's init not counted)."""
        out: list[int] = []
        for d in self.unique:
            out.extend(p for p in _procs(d) if p not in out and p != self.spare)
        return out

    def kill_all(self, rounds: int = 100) -> bool:
        """SIGKILL every process in the cgroup, including those that left the sandbox's
        session or process group. True when it is empty afterwards."""
        if self.v2 and self.spare is None:
            try:
                _write(os.path.join(self.dirs["cpu"], "cgroup.kill"), "1")
            except OSError:
                pass
        for i in range(rounds):
            pids = self.procs()
            if not pids:
                return True
            for p in pids:
                _kill(p)
            if i:
                time.sleep(0.001 * min(i, 10))
        return not self.procs()

    def remove(self) -> None:
        self.kill_all()
        for events in (getattr(self, "_oom_events", None), getattr(self, "_pids_events", None)):
            if events is not None:  # (None too when __init__ failed before making them)
                events.close()
        if self._made:
            for d in reversed(self.unique):
                _rmdir(d)


__all__ = ["ENV_VAR", "MECHANISMS", "Isolation", "ManagerCgroups", "SandboxCgroup", "children_of", "descendants", "cpu_weight", "detect",
           "hierarchy_path", "remove_stale"]


if __name__ == "__main__":  # python -m tangram.runtime.sandbox.isolation
    from .namespaces import detect as detect_boundary

    boundary = detect_boundary()
    print(f"isolation: {boundary.isolation}")
    print(f"  {boundary.description}")
    iso = detect()
    print(f"resource control: {iso.mechanism}")
    print(f"  {iso.description}")
    for c, d in iso.dirs.items():
        print(f"  {c}: {d}")
