"""The CPU manager with real subprocesses: per-action grants (guarantees and ceilings),
resizes, the jobserver, warm workers, sandbox state,
kills of whole process trees, crash recovery, memory and output limits, a clean
environment, cancellation. Every test runs under the cgroup mechanism when this machine
has a writable one, and under forced affinity; after each, no process of any manager is
left and the CPU pool is exactly full."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tangram import Amdahl, Inventory, Node, Orchestrator
from tangram.runtime.call import Call, CommandResult, Placement
from tangram.runtime.managers.cpu import CpuManager, CpuPool
from tangram.runtime.errors import (
    ActionCrashed,
    ActionFailed,
    ManagerError,
    ResourceLimitExceeded,
)
from tangram._arguments import int_ranges
from tangram.runtime.sandbox.isolation import cpu_weight, descendants, detect
from tangram.runtime.sandbox.namespaces import HOME
from tangram.runtime.sandbox.namespaces import detect as detect_boundary
from tangram.runtime.managers.base import LiveAction, manager_class
from tangram.runtime.sandbox.kills import marked_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandboxes need Linux")

DETECTED = detect("auto") if sys.platform.startswith("linux") else None
CGROUP = DETECTED is not None and DETECTED.cgroup
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
BOUNDARY = detect_boundary("auto") if sys.platform.startswith("linux") else None
NAMESPACES = BOUNDARY is not None and BOUNDARY.namespaces
_NO_CGROUP = pytest.mark.skipif(not CGROUP, reason="no writable cgroup on this machine")
_NO_NAMESPACES = pytest.mark.skipif(not NAMESPACES, reason=f"no namespaces here: {BOUNDARY.reason if BOUNDARY else ''}")
_CG = DETECTED.mechanism if DETECTED else "auto"
# (resource control, isolation): every case under the cgroup mechanism when this machine has
# a writable one and under forced affinity, each inside namespaces and as a bare process.
MECHANISMS = [pytest.param(("auto", "namespaces"), id=f"{_CG}-namespaces", marks=[_NO_CGROUP, _NO_NAMESPACES]),
              pytest.param(("affinity", "namespaces"), id="affinity-namespaces", marks=_NO_NAMESPACES),
              pytest.param(("auto", "process"), id=f"{_CG}-process", marks=_NO_CGROUP),
              pytest.param(("affinity", "process"), id="affinity-process")]
_ids = itertools.count(1)


@pytest.fixture(params=MECHANISMS)
def mechanism(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param


def manager(mechanism: tuple[str, str], **options: Any) -> CpuManager:
    return CpuManager(resource_control=mechanism[0], isolation=mechanism[1], **options)


@pytest.fixture(autouse=True)
def no_leaked_process() -> Any:
    yield
    leaked = marked_processes(f"{os.getpid()}.")  # every manager of this process
    assert leaked == [], f"processes left behind: {leaked}"


def placement(cores: float = 1.0, memory: float = 0.0, env: dict[str, str] | None = None) -> Placement:
    return Placement(action_id=0, node=0, node_name="local", device=None, grant=cores, cores=cores,
                     memory=memory, gpu_memory=0.0, env=env or {})


async def run(mgr: CpuManager, call: Call, cores: float = 1.0, memory: float = 0.0, **kw: Any) -> Any:
    return await mgr.execute(LiveAction(next(_ids), call), placement(cores, memory, **kw))


def with_manager(mechanism: tuple[str, str], body: Callable[[CpuManager], Awaitable[None]], **options: Any) -> CpuManager:
    """Runs `body` with a started manager, then closes it and checks that nothing is left:
    no process, no cgroup, no directory, and the pool exactly full."""
    if mechanism[1] != "process" and CGROUP:  # the cases read their cgroup's files from inside
        options.setdefault("visible_paths", ["/sys/fs/cgroup"])
    mgr = manager(mechanism, **options)

    async def main() -> None:
        await mgr.start()
        cgroups = list(mgr._cgroups.made) if mgr._cgroups is not None else []
        base = mgr._dir
        try:
            await body(mgr)
            assert mgr.pool.full, mgr.usage
        finally:
            await mgr.close()
        assert mgr.pool.full and all(v == 0 for v in mgr.usage.values())
        assert mgr.processes() == []
        assert not any(os.path.exists(d) for d in cgroups), cgroups
        assert base is not None and not os.path.exists(base)

    asyncio.run(main())
    return mgr


def namespaced(mgr: CpuManager) -> bool:
    return mgr.boundary is not None and mgr.boundary.namespaces


def worker_host_pid(mgr: CpuManager, key: int = 0) -> int:
    """The host pid of `key`'s live worker: under namespaces it runs in the sandbox's PID
    namespace (os.getpid() there is not the host's), bwrap's grandchild."""
    proc = mgr._sandboxes[key].proc
    assert proc is not None
    if not namespaced(mgr):
        return proc.pid
    for pid in descendants(proc.pid):
        try:
            cmdline = read(f"/proc/{pid}/cmdline")
        except OSError:
            continue
        if "inside_worker" in cmdline and "bwrap" not in cmdline.split("\0")[0]:
            return pid
    raise AssertionError(f"no worker under {proc.pid}")


async def worker_pid(mgr: CpuManager, key: int = 0) -> int:
    """Runs a call in `key`'s sandbox (starting its worker if need be) and returns the
    worker's host pid."""
    await run(mgr, Call(fn=int, trajectory=key))
    return worker_host_pid(mgr, key)


def host_pids(mgr: CpuManager, key: int, inner: list[int]) -> list[int]:
    """Host pids of processes of `key`'s sandbox known by their pids inside it."""
    if not namespaced(mgr):
        return inner
    proc = mgr._sandboxes[key].proc
    assert proc is not None
    found: dict[int, int] = {}
    for pid in descendants(proc.pid):
        try:
            ns = [int(x) for x in read(f"/proc/{pid}/status").split("NSpid:")[1].splitlines()[0].split()]
        except (OSError, IndexError, ValueError):
            continue
        found[ns[-1]] = pid
    return [found[i] for i in inner]


# A token of the worker process that runs it: the test module is imported once per worker.
WORKER_TOKEN = os.urandom(8).hex()


def worker_token() -> str:
    return WORKER_TOKEN


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def wait_gone(pids: list[int], timeout: float = 2.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Waits (letting the event loop run) until `condition()` holds; False if it never did."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def children() -> set[int]:
    """This process's child processes, zombies (exited, not reaped) included."""
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


# ---------------------------------------------------------------------------- options
def test_bad_options_name_the_option(tmp_path: Any) -> None:
    cases = [
        (dict(isolation="docker"), "managers.cpu.isolation"),
        (dict(isolation="affinity"), "managers.cpu.isolation"),  # a resource control, not an isolation
        (dict(resource_control="docker"), "managers.cpu.resource_control"),
        (dict(network="yes"), "managers.cpu.network"),
        (dict(visible_paths="/opt"), "managers.cpu.visible_paths"),
        (dict(visible_paths=["relative/path"]), "managers.cpu.visible_paths"),
        (dict(visible_paths=[str(tmp_path / "missing")]), "managers.cpu.visible_paths"),
        (dict(pids_limit=3), "managers.cpu.pids_limit"),
        (dict(pids_limit=True), "managers.cpu.pids_limit"),
        (dict(disk_limit=0), "managers.cpu.disk_limit"),
        (dict(disk_limit="1G"), "managers.cpu.disk_limit"),
        (dict(output_limit=-1), "managers.cpu.output_limit"),
        (dict(output_limit="big"), "managers.cpu.output_limit"),
        (dict(cpus=[]), "managers.cpu.cpus"),
        (dict(cpus=[max(CPUS) + 1000]), "managers.cpu.cpus"),
        (dict(cpus="zero"), "managers.cpu.cpus"),
        (dict(root=str(tmp_path / "missing")), "managers.cpu.root"),
        (dict(env={"A": 1}), "managers.cpu.env"),
        (dict(inherit_env="HOME"), "managers.cpu.inherit_env"),
        (dict(preload="json"), "managers.cpu.preload"),
        (dict(preload=["json", "not a module"]), "managers.cpu.preload"),
    ]
    for options, field in cases:
        with pytest.raises(ManagerError) as e:
            CpuManager(**options)
        assert e.value.field == field, options
    assert manager_class("cpu") is CpuManager


def test_detect_and_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    iso = detect()
    assert iso.mechanism in ("cgroup-v2", "cgroup-v1", "affinity") and iso.description
    assert detect("affinity").mechanism == "affinity"
    monkeypatch.setenv("TANGRAM_RESOURCE_CONTROL", "affinity")
    assert detect().mechanism == "affinity"
    assert detect("auto").mechanism == "affinity"
    monkeypatch.setenv("TANGRAM_RESOURCE_CONTROL", "chroot")
    with pytest.raises(ManagerError) as e:
        detect()
    assert e.value.field == "TANGRAM_RESOURCE_CONTROL"
    monkeypatch.delenv("TANGRAM_RESOURCE_CONTROL")
    for forced in ("cgroup-v2", "cgroup-v1"):
        try:
            assert detect(forced).mechanism == forced
        except ManagerError as err:  # not usable here: an error naming the option, no fallback
            assert err.field == "resource_control" and forced in err.reason


def test_a_disk_limit_without_namespaces_is_refused_at_start() -> None:
    mgr = CpuManager(isolation="process", disk_limit=64)
    with pytest.raises(ManagerError) as e:
        asyncio.run(mgr.start())
    assert e.value.field == "managers.cpu.disk_limit" and "namespaces" in e.value.reason


def test_isolation_detect_and_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    boundary = detect_boundary()
    assert boundary.isolation in ("namespaces", "process") and boundary.description
    assert detect_boundary("process").isolation == "process"
    assert "UNSAFE" in detect_boundary("process").description
    monkeypatch.setenv("TANGRAM_ISOLATION", "process")
    assert detect_boundary().isolation == "process"
    monkeypatch.setenv("TANGRAM_ISOLATION", "affinity")  # the old meaning: a clear error, no fallback
    with pytest.raises(ManagerError) as e:
        detect_boundary()
    assert e.value.field == "TANGRAM_ISOLATION" and "resource_control" in e.value.reason
    monkeypatch.delenv("TANGRAM_ISOLATION")
    # bubblewrap missing: namespaces forced is an error naming the cause; auto falls back, saying why
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ManagerError) as e:
        detect_boundary("namespaces")
    assert e.value.field == "isolation" and "bubblewrap is not installed" in e.value.reason
    fallback = detect_boundary("auto")
    assert fallback.isolation == "process" and "bubblewrap is not installed" in fallback.reason


def test_a_sandbox_cgroup_that_cannot_be_made_is_a_manager_error(tmp_path: Any) -> None:
    """A cgroup directory the kernel refuses: ManagerError naming it, and what was made is
    removed (nothing half-built is left to fail on)."""
    from types import SimpleNamespace

    from tangram.runtime.sandbox.isolation import SandboxCgroup

    parent = tmp_path / "cpu"
    parent.mkdir()
    mgr = SimpleNamespace(v2=True, dirs={"cpu": str(parent), "cpuset": str(parent), "memory": str(tmp_path / "gone")},
                          mems="0")
    with pytest.raises(ManagerError) as e:
        SandboxCgroup(mgr, "sb-1")  # type: ignore[arg-type]
    assert e.value.field == "managers.cpu.resource_control" and "sb-1" in str(e.value)
    assert not (parent / "sb-1").exists()


def test_pool_prefers_exclusive_cpus_and_releases_exactly() -> None:
    pool = CpuPool([0, 1, 2, 3])
    a = pool.take(2)
    assert a == {0: 1000, 1: 1000}
    b = pool.take(0.5)
    c = pool.take(0.25)
    assert len(b) == 1 and len(c) == 1 and set(b) == set(c) and not set(b) & set(a)  # fractions packed
    d = pool.take(1)
    assert d and set(d).isdisjoint(b) and set(d).isdisjoint(a) and list(d.values()) == [1000]  # whole CPU kept whole
    e = pool.take(0.25)
    assert set(e) == set(b)
    assert pool.used[next(iter(b))] == 1000
    for g in (a, b, c, d, e):
        pool.release(g)
    assert pool.full
    # fragmented: 0.4 free on each of two CPUs, 0.8 asked: it spans both
    pool2 = CpuPool([0, 1])
    x, y = pool2.take(0.6), pool2.take(0.6)
    assert set(x) != set(y)
    z = pool2.take(0.8)
    assert sum(z.values()) == 800 and len(z) == 2
    over = pool2.take(3)  # oversubscribed inventory: shares, and still releases exactly
    assert sum(over.values()) == 3000
    for g in (x, y, z, over):
        pool2.release(g)
    assert pool2.full


# ---------------------------------------------------------------------------- grants
def test_a_guarantee_runs_on_every_cpu_with_a_weight_of_its_grant(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        aff = await run(mgr, Call(fn=lambda: sorted(os.sched_getaffinity(0))), cores=0.25)
        assert aff == CPUS  # a quarter core may use every idle CPU
        r = await run(mgr, Call(command="grep Cpus_allowed_list /proc/self/status; echo $TANGRAM_CPUS"), cores=1)
        listed, env = r.stdout.decode().split("\n")[:2]
        assert listed.split()[-1] == env == int_ranges(CPUS)
        cg = mgr._sandbox(0).cgroup
        if cg is None:
            return
        v2 = mgr.isolation.mechanism == "cgroup-v2"  # type: ignore[union-attr]
        weight_file = os.path.join(cg.dirs["cpu"], "cpu.weight" if v2 else "cpu.shares")
        quota_file = os.path.join(cg.dirs["cpu"], "cpu.max" if v2 else "cpu.cfs_quota_us")
        for cores, weight in ((1.5, cpu_weight(1.5, v2)), (0.25, cpu_weight(0.25, v2))):
            r = await run(mgr, Call(command=["cat", weight_file, quota_file]), cores=cores)
            got_weight, got_quota = r.stdout.decode().split("\n")[:2]
            assert int(got_weight) == weight and got_quota.split()[0] in ("-1", "max")
        assert cpu_weight(1.5, v2) == 3 * cpu_weight(0.5, v2)  # weights keep the grants' ratio

    with_manager(mechanism, body)


def test_pinning_is_observed_from_inside_the_action_under_ceilings(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        aff = await run(mgr, Call(fn=lambda: sorted(os.sched_getaffinity(0))), cores=1)
        assert len(aff) == 1 and aff[0] in CPUS
        r = await run(mgr, Call(command="grep Cpus_allowed_list /proc/self/status; echo $TANGRAM_CPUS"), cores=1)
        listed, env = r.stdout.decode().split("\n")[:2]
        assert listed.split()[-1] == env and len(env.split(",")) == 1
        if len(CPUS) >= 2:
            aff = await run(mgr, Call(fn=lambda: sorted(os.sched_getaffinity(0))), cores=2)
            assert len(aff) == 2
            r = await run(mgr, Call(command=["grep", "Cpus_allowed_list", "/proc/self/status"]), cores=2)
            assert r.stdout.decode().split()[-1] in (f"{aff[0]}-{aff[1]}", f"{aff[0]},{aff[1]}")

            # two trajectories at once, one core each: disjoint CPUs, exclusively theirs
            def probe() -> list[int]:
                time.sleep(0.3)
                return sorted(os.sched_getaffinity(0))
            a, b = await asyncio.gather(run(mgr, Call(fn=probe, trajectory=1), cores=1),
                                        run(mgr, Call(fn=probe, trajectory=2), cores=1))
            assert len(a) == 1 and len(b) == 1 and a != b

    with_manager(mechanism, body, cpu_limit="ceiling")


def test_the_grant_is_passed_to_the_action(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        cores = min(2, len(CPUS))
        names = ("TANGRAM_CORES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        got = await run(mgr, Call(fn=lambda: {k: os.environ.get(k) for k in names}), cores=cores)
        assert got == dict.fromkeys(names, str(cores))
        r = await run(mgr, Call(command='echo "$TANGRAM_CORES $OMP_NUM_THREADS"'), cores=cores)
        assert r.stdout == f"{cores} {cores}\n".encode()
        grant = lambda: (os.environ["TANGRAM_CORES"], os.environ["TANGRAM_GRANT"])  # noqa: E731
        assert await run(mgr, Call(fn=grant), cores=0.5) == ("1", "0.5")  # at least 1
        assert await run(mgr, Call(fn=grant), cores=1.25) == ("2", "1.25")  # every fraction usable
        # the grant is the action's only while it runs
        assert await run(mgr, Call(fn=lambda: os.environ.get("TANGRAM_FOO", "unset"))) == "unset"
        r = await run(mgr, Call(command="echo $TANGRAM_FOO $CUDA_VISIBLE_DEVICES", env={"TANGRAM_FOO": "bar"}),
                      env={"CUDA_VISIBLE_DEVICES": "3"})
        assert r.stdout == b"bar 3\n"

    with_manager(mechanism, body)


def test_fractional_ceilings_share_a_cpu(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        def probe(quota_file: str | None) -> tuple[list[int], str]:
            quota = ""
            if quota_file is not None:
                with open(quota_file) as f:
                    quota = f.read().split()[0]
            time.sleep(0.3)
            return sorted(os.sched_getaffinity(0)), quota

        v2 = mgr.isolation.mechanism == "cgroup-v2"  # type: ignore[union-attr]
        results = []
        for t in (1, 2):
            cg = mgr._sandbox(t).cgroup
            quota_file = os.path.join(cg.dirs["cpu"], "cpu.max" if v2 else "cpu.cfs_quota_us") if cg else None
            results.append(run(mgr, Call(fn=probe, args=(quota_file,), trajectory=t), cores=0.5))
        (a, qa), (b, qb) = await asyncio.gather(*results)
        assert a == b and len(a) == 1  # both halves on one CPU, the other CPUs kept whole
        if mgr.isolation.cgroup:  # type: ignore[union-attr]
            assert qa == qb == "50000"  # 0.5 of a 100 ms period
        else:
            assert qa == qb == ""
        assert mgr.usage == dict.fromkeys(CPUS, 0.0)

    with_manager(mechanism, body, cpu_limit="ceiling")


@pytest.mark.skipif(not CGROUP, reason="no writable cgroup on this machine")
def test_leftover_processes_get_the_lowest_weight_between_actions() -> None:
    async def body(mgr: CpuManager) -> None:
        cg = mgr._sandbox(0).cgroup
        assert cg is not None
        v2 = mgr.isolation.mechanism == "cgroup-v2"  # type: ignore[union-attr]
        weight_file = os.path.join(cg.dirs["cpu"], "cpu.weight" if v2 else "cpu.shares")
        await run(mgr, Call(command="true"), cores=2)
        assert int(read(weight_file)) == cpu_weight(2, v2)  # nothing left running: untouched
        await run(mgr, Call(command="sleep 60 &"), cores=2)
        assert int(read(weight_file)) == cpu_weight(0, v2)  # only idle cores for a background job
        r = await run(mgr, Call(command=["cat", weight_file]), cores=2)
        assert int(r.stdout) == cpu_weight(2, v2)  # the action has its whole grant

    with_manager(("auto", "auto"), body)


@pytest.mark.skipif(not CGROUP, reason="no writable cgroup on this machine")
def test_leftover_processes_are_throttled_between_actions_under_ceilings() -> None:
    async def body(mgr: CpuManager) -> None:
        cg = mgr._sandbox(0).cgroup
        assert cg is not None
        v2 = mgr.isolation.mechanism == "cgroup-v2"  # type: ignore[union-attr]
        quota_file = os.path.join(cg.dirs["cpu"], "cpu.max" if v2 else "cpu.cfs_quota_us")

        def quota() -> str:
            with open(quota_file) as f:
                return f.read().split()[0]

        await run(mgr, Call(command="true"))
        assert quota() in ("-1", "max")  # nothing left running: untouched
        await run(mgr, Call(command="sleep 60 &"))
        assert quota() == "1000"  # a background job gets 1% of a CPU until the next action
        r = await run(mgr, Call(command=["cat", quota_file]))
        assert r.stdout.split()[0] in (b"-1", b"max")  # the action has its whole grant

    with_manager(("auto", "auto"), body, cpu_limit="ceiling")


@pytest.mark.skipif(not CGROUP, reason="no writable cgroup on this machine")
def test_cgroups_of_a_dead_manager_are_removed_at_start() -> None:
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert DETECTED is not None
    stale = [os.path.join(d, f"tangram-{dead.pid}-1") for d in dict.fromkeys(DETECTED.dirs.values())]
    for d in stale:
        os.makedirs(os.path.join(d, "sb-0"), exist_ok=True)

    async def body(mgr: CpuManager) -> None:
        assert not any(os.path.exists(d) for d in stale)

    with_manager(("auto", "auto"), body)


# ---------------------------------------------------------------------------- resizes
MAKEFILE = """\
JOBS := $(shell seq 1 {jobs})
all: $(JOBS)
$(JOBS):
\t@echo "+ $$(date +%s.%N)" >> jobs.log; sleep {seconds}; echo "- $$(date +%s.%N)" >> jobs.log
.PHONY: all $(JOBS)
"""


def most_at_once(log: str, after: float = 0.0) -> int:
    """The most jobs running at once in a make run's jobs.log (start after `after`)."""
    events = sorted((float(t), 1 if sign == "+" else -1) for sign, t in (line.split() for line in log.splitlines()))
    running = peak = 0
    for t, step in events:
        running += step
        if t >= after:
            peak = max(peak, running)
    return peak


@pytest.mark.skipif(shutil.which("make") is None, reason="no GNU make on this machine")
def test_make_runs_as_many_jobs_as_the_grant_through_the_jobserver(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        for cores, expected in ((1, 1), (2.5, 3)):
            await run(mgr, Call(fn=write, args=("Makefile", MAKEFILE.format(jobs=6, seconds=0.3))))
            r = await run(mgr, Call(command="rm -f jobs.log; make -s all"), cores=cores)
            assert r.returncode == 0, r.stderr
            log = await run(mgr, Call(fn=read, args=("jobs.log",)))
            assert most_at_once(log) == expected, (cores, log)

    with_manager(mechanism, body)


@pytest.mark.skipif(shutil.which("make") is None, reason="no GNU make on this machine")
def test_a_resize_reaches_a_running_build_and_a_running_function(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        await run(mgr, Call(fn=write, args=("Makefile", MAKEFILE.format(jobs=12, seconds=0.25))))
        build = LiveAction(next(_ids), Call(command="rm -f jobs.log; make -s all"))
        task = asyncio.ensure_future(mgr.execute(build, placement(1)))
        assert await until(lambda: os.path.exists(os.path.join(mgr.sandbox_dir(0), "jobs.log")))
        await asyncio.sleep(0.3)
        grown = time.time()
        mgr.resize(build, placement(3))  # two more tokens: make starts more jobs at once
        assert (await task).returncode == 0
        log = await run(mgr, Call(fn=read, args=("jobs.log",)))
        starts = sorted(float(line.split()[1]) for line in log.splitlines() if line.startswith("+"))
        assert all(b - a > 0.2 for a, b in zip(starts, starts[1:]) if b < grown)  # one at a time before
        assert most_at_once(log, after=grown + 0.05) == 3

        # a function reads its live grant; a shrink withdraws the tokens a build could take
        def watch_grant() -> list[float]:
            from tangram.worker import grant
            seen = [grant()]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(seen) < 3:
                g = grant()
                if g != seen[-1]:
                    seen.append(g)
                time.sleep(0.005)
            return seen

        fn = LiveAction(next(_ids), Call(fn=watch_grant, trajectory=1))
        task = asyncio.ensure_future(mgr.execute(fn, placement(2)))
        await asyncio.sleep(0.3)
        mgr.resize(fn, placement(3.5))
        await asyncio.sleep(0.3)
        mgr.resize(fn, placement(1.25))
        channel = mgr._sandboxes[1].grant
        assert channel._tokens == 1 and channel._owed == 0  # ceil(1.25) - 1; nobody held the other two
        assert await task == [2.0, 3.5, 1.25]
        assert channel._tokens == 0 and read(channel.grant_path).strip() == "0.0000"  # ended: no grant
        mgr.resize(fn, placement(4))  # after its end: ignored
        assert read(channel.grant_path).strip() == "0.0000"

    with_manager(mechanism, body)


def nap(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def suite(seconds: list[float]) -> list[tuple[float, float]]:
    from tangram.worker import shared_executor
    return list(shared_executor().map(nap, seconds))


# A suite of two tests on two cores (t(u) = 10 / u: taking a core back never pays the
# core, so a 1-core program would wait for the whole suite): when its short test ends, its
# executor has one task left and limits the grant to one core, and the program starts in
# the core given back while the long test still runs. A real orchestrator, real sandboxes.
def test_an_executor_with_fewer_tasks_than_cores_gives_them_back(mechanism: str) -> None:
    async def main() -> None:
        inventory = Inventory([Node("local", {"cpu": 2})])
        async with Orchestrator(inventory=inventory, default_managers=False,
                                managers={"cpu": manager(mechanism, warm_sandboxes=2)}) as orch:
            tests = orch.submit(Call(fn=suite, args=([1.5, 0.1],), resources={"cpu": 1}, elastic="cpu", max_units=2,
                                     runtime=Amdahl(10.0, 1.0), trajectory=1))
            await asyncio.sleep(0.05)
            program = orch.submit(Call(fn=nap, args=(0.05,), resources={"cpu": 1}, runtime=0.05, trajectory=2))
            (long_start, long_end), _ = await tests
            program_start, _ = await program
            assert program_start < long_end - 0.5, (program_start - long_start, long_end - long_start)
            record = next(r for r in orch.records if r.id == tests.id)
            assert record.grant == 1.0  # limited by its executor: the latest grant

    asyncio.run(main())


@pytest.mark.skipif(not CGROUP, reason="no writable cgroup on this machine")
def test_a_resize_moves_the_weight_or_the_ceiling_of_the_running_action() -> None:
    for limit in ("guarantee", "ceiling"):
        async def body(mgr: CpuManager) -> None:
            cg = mgr._sandbox(0).cgroup
            v2 = mgr.isolation.mechanism == "cgroup-v2"  # type: ignore[union-attr]
            weight_file = os.path.join(cg.dirs["cpu"], "cpu.weight" if v2 else "cpu.shares")
            quota_file = os.path.join(cg.dirs["cpu"], "cpu.max" if v2 else "cpu.cfs_quota_us")
            action = LiveAction(next(_ids), Call(fn=time.sleep, args=(0.5,)))
            task = asyncio.ensure_future(mgr.execute(action, placement(0.5)))
            await asyncio.sleep(0.2)
            assert int(read(weight_file)) == cpu_weight(0.5, v2)
            mgr.resize(action, placement(1.5))
            assert int(read(weight_file)) == cpu_weight(1.5, v2)
            quota = read(quota_file).split()[0]
            if limit == "ceiling":
                assert quota == "150000" and sum(mgr.usage.values()) == 1.5  # the pool charges the new grant
            else:
                assert quota in ("-1", "max")
            await task
            assert mgr.pool.full

        with_manager(("auto", "auto"), body, cpu_limit=limit)


def test_a_new_trajectory_starts_in_a_warm_worker(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        assert await until(lambda: len(mgr.warm_processes()) == 2)
        warm = mgr.warm_processes()
        cwd, env = await run(mgr, Call(fn=lambda: (os.getcwd(), dict(os.environ)), trajectory=7))
        pid = mgr._sandboxes[7].proc.pid
        assert pid in warm  # started before the trajectory existed
        home = HOME if namespaced(mgr) else mgr.sandbox_dir(7)
        assert cwd == env["HOME"] == home and env["TANGRAM_SANDBOX"].endswith("/7")
        assert env["TMPDIR"] == ("/tmp" if namespaced(mgr) else os.path.join(home, ".tmp"))
        assert await until(lambda: len(mgr.warm_processes()) == 2)  # replaced
        assert pid not in mgr.warm_processes()
        # its log is the sandbox's: a crash report carries the worker's last words
        with pytest.raises(ActionCrashed) as e:
            await run(mgr, Call(fn=print_and_exit, trajectory=7))
        assert "last words" in str(e.value)
        victim = mgr.warm_processes()[0]
        os.kill(victim, signal.SIGKILL)  # a warm worker killed while idle is skipped
        assert wait_gone([victim]) == []
        assert await run(mgr, Call(fn=os.getcwd, trajectory=8)) == (HOME if namespaced(mgr) else mgr.sandbox_dir(8))

    with_manager(mechanism, body, warm_sandboxes=2)


# A warm worker has imported the preloaded modules (tangram.worker by default) before it is
# taken, from the orchestrator's sys.path; one that cannot be imported is reported in the
# worker's log and fails no action.
def test_warm_workers_preload_modules(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        assert await until(lambda: len(mgr.warm_processes()) == 1)
        loaded = await run(mgr, Call(fn=lambda: [m in sys.modules for m in ("tangram.worker", "colorsys", "_pyio")],
                                     trajectory=3))
        assert loaded == [True, True, False]
        log = mgr._sandboxes[3].log_tail(100_000)
        assert "preloading no_such_module_here failed: ModuleNotFoundError" in log
        assert mgr.describe()["preload"] == ["tangram.worker", "colorsys", "no_such_module_here"]

    with_manager(mechanism, body, warm_sandboxes=1, preload=["tangram.worker", "colorsys", "no_such_module_here"])


def print_then(value: str) -> str:
    print(f"printed {value}")  # not flushed: the worker's log gets it all the same
    return value


# A GPU function action runs in a child forked for it; what it prints reaches the worker's
# log once, and what the worker printed before is not written again.
def test_gpu_function_output_reaches_the_log_once(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        gpu = {"CUDA_VISIBLE_DEVICES": "GPU-fake-0"}
        # first a GPU action: a namespaced sandbox's worker starts with the GPU devices then
        assert await run(mgr, Call(fn=print_then, args=("first",), trajectory=4), env=gpu) == "first"
        assert await run(mgr, Call(fn=print_then, args=("by the worker",), trajectory=4)) == "by the worker"
        assert await run(mgr, Call(fn=print_then, args=("on a GPU",), trajectory=4), env=gpu) == "on a GPU"
        await run(mgr, Call(fn=lambda: sys.stdout.flush(), trajectory=4))
        log = mgr._sandboxes[4].log_tail(100_000)
        assert log.count("printed by the worker") == 1 and log.count("printed on a GPU") == 1

    with_manager(mechanism, body)


def print_and_exit() -> None:
    print("last words", flush=True)
    os._exit(5)


# Replacements for taken warm workers start only once no action runs on the manager (a
# busy rollout step does not pay for interpreters it will not use), and warm workers wait
# in a cgroup of the lowest CPU weight, then move into their sandbox's cgroup when taken.
def test_warm_workers_are_replaced_when_no_action_runs(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        assert await until(lambda: len(mgr.warm_processes()) == 2)
        first = set(mgr.warm_processes())
        if mgr._cgroups is not None:
            v2 = mgr.isolation.mechanism == "cgroup-v2"  # type: ignore[union-attr]
            warm_dir = os.path.join(mgr._cgroups.dirs["cpu"], "warm")
            assert first <= {int(p) for p in read(os.path.join(warm_dir, "cgroup.procs")).split()}
            assert int(read(os.path.join(warm_dir, "cpu.weight" if v2 else "cpu.shares"))) == cpu_weight(0, v2)
        busy = asyncio.ensure_future(run(mgr, Call(fn=time.sleep, args=(1.0,), trajectory=1)))
        assert await until(lambda: len(mgr.warm_processes()) == 1)  # trajectory 1 took one
        await run(mgr, Call(fn=int, trajectory=2))  # ends while trajectory 1 runs
        pid = mgr._sandboxes[2].proc.pid
        assert pid in first and mgr.warm_processes() == [] and busy.done() is False
        await asyncio.sleep(0.2)
        assert mgr.warm_processes() == []  # no replacement while an action runs
        await busy
        assert await until(lambda: len(mgr.warm_processes()) == 2)  # idle: both replaced
        assert not first & set(mgr.warm_processes())

    with_manager(mechanism, body, warm_sandboxes=2)


def write(name: str, text: str) -> None:
    with open(name, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------- state
counter = 0


def bump() -> int:
    global counter
    counter += 1
    return counter


def test_state_persists_across_a_trajectorys_actions(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        where = await run(mgr, Call(fn=lambda: (os.getcwd(), os.environ["HOME"], os.environ["TMPDIR"]), trajectory=7))
        home = mgr.sandbox_dir(7)
        inside = HOME if namespaced(mgr) else home
        assert where == (inside, inside, "/tmp" if namespaced(mgr) else os.path.join(home, ".tmp"))
        r = await run(mgr, Call(command="echo hello > notes.txt; pwd", trajectory=7))
        assert r.returncode == 0 and r.stdout.decode().strip() == inside
        assert read(os.path.join(home, "notes.txt")) == "hello\n"  # the sandbox's files, on the host
        assert await run(mgr, Call(fn=read, args=("notes.txt",), trajectory=7)) == "hello\n"
        assert [await run(mgr, Call(fn=bump, trajectory=7)) for _ in range(3)] == [1, 2, 3]  # module state
        assert await run(mgr, Call(fn=bump, trajectory=8)) == 1  # another trajectory: its own worker
        r = await run(mgr, Call(command="cat notes.txt", trajectory=8))
        assert r.returncode != 0  # and its own directory
        await mgr.end_trajectory(7)
        assert not os.path.exists(home)
        assert await run(mgr, Call(fn=bump, trajectory=7)) == 1  # a new trajectory 7 starts fresh

    with_manager(mechanism, body)


def test_concurrent_actions_of_one_trajectory_are_serialised(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        def step(i: int) -> tuple[float, float]:
            t0 = time.monotonic()
            time.sleep(0.1)
            return t0, time.monotonic()

        spans = sorted(await asyncio.gather(*(run(mgr, Call(fn=step, args=(i,), trajectory=3)) for i in range(3))))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))

    with_manager(mechanism, body)


def test_pooled_calls_share_as_many_sandboxes_as_run_at_once(mechanism: str) -> None:
    """Call.pooled: the sandbox is taken as the action starts, so 12 calls of 12
    trajectories, at most 3 running at once, need 3 sandboxes; one whose action did not
    answer is not used again; the pooled ones go with the manager."""
    async def body(mgr: CpuManager) -> None:
        gate = asyncio.Semaphore(3)  # what the core does: at most 3 start at once

        async def pooled(i: int, fn: Any = worker_token) -> Any:
            async with gate:
                return await run(mgr, Call(fn=fn, trajectory=100 + i, pooled=True))

        pids = await asyncio.gather(*(pooled(i) for i in range(12)))
        assert mgr.pooled_sandbox_count == 3 and len(set(pids)) == 3
        assert mgr.sandbox_count == 3  # no trajectory of the 12 holds one
        assert (await run(mgr, Call(fn=os.getcwd, trajectory=5, pooled=True))).startswith(
            HOME if namespaced(mgr) else mgr._dir + "/pool")

        def broken() -> None:
            raise ValueError("left the sandbox in a state nobody knows")

        with pytest.raises(ActionFailed):
            await run(mgr, Call(fn=broken, trajectory=7, pooled=True))
        await asyncio.sleep(0.2)  # its sandbox is ended in the background
        assert mgr.pooled_sandbox_count == 2
        after = set(await asyncio.gather(*(pooled(i) for i in range(12))))
        assert len(after) == 3 and len(after & set(pids)) == 2  # the two kept, and a new one

    with_manager(mechanism, body)


# ---------------------------------------------------------------------------- failures
def test_a_function_that_raises_is_action_failed(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        def broken() -> None:
            raise ValueError("no such file")

        with pytest.raises(ActionFailed) as e:
            await run(mgr, Call(fn=broken))
        assert e.value.error_type == "ValueError" and "broken" in e.value.remote_traceback
        import threading
        with pytest.raises(ActionFailed) as e:  # a result that cannot come back (not plain data)
            await run(mgr, Call(fn=threading.Lock))
        assert e.value.error_type == "UnsupportedResult" and "lock" in str(e.value)
        with pytest.raises(ActionFailed) as e:  # an argument that cannot go there
            await run(mgr, Call(fn=len, args=(threading.Lock(),)))
        assert await run(mgr, Call(fn=lambda: 42)) == 42  # the sandbox is fine

        def sandbox_only_object() -> object:
            with open("sandboxonly.py", "w") as f:
                f.write("class Thing:\n    pass\n")
            sys.path.insert(0, os.getcwd())
            import sandboxonly  # type: ignore[import-not-found]
            return sandboxonly.Thing()

        with pytest.raises(ActionFailed) as e:  # a class the orchestrator does not load from a sandbox
            await run(mgr, Call(fn=sandbox_only_object))
        assert e.value.error_type == "UnsupportedResult" and "sandboxonly.Thing" in str(e.value)

        async def coroutine() -> str:
            await asyncio.sleep(0)
            return os.environ["TANGRAM_CORES"]

        assert await run(mgr, Call(fn=coroutine)) == "1"  # an async def runs to completion in the sandbox

    with_manager(mechanism, body)


def test_commands_exit_codes_and_signals_are_results(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        r = await run(mgr, Call(command="echo out; echo err >&2; exit 3"))
        assert r == CommandResult(3, b"out\n", b"err\n", False)
        r = await run(mgr, Call(command="kill -SEGV $$"))
        assert r.returncode == -signal.SIGSEGV
        r = await run(mgr, Call(command=["/nonexistent/tool", "-x"]))
        assert r.returncode == 127 and b"nonexistent" in r.stderr
        r = await run(mgr, Call(command="sleep 30 & echo detached"))  # a background job does not hold the action
        assert r.stdout == b"detached\n"

    with_manager(mechanism, body)


def test_crash_recovery(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        await run(mgr, Call(command="echo kept > file.txt; (setsid sleep 60 & echo $! > daemon.pid)"))
        pid0 = await worker_pid(mgr)
        daemon = host_pids(mgr, 0, [int(await run(mgr, Call(fn=read, args=("daemon.pid",))))])[0]
        assert pid_alive(daemon)
        with pytest.raises(ActionCrashed) as e:
            await run(mgr, Call(fn=os._exit, args=(3,)))
        assert e.value.exit_code == 3 and e.value.signal is None
        assert mgr.pool.full
        assert wait_gone([pid0, daemon]) == []  # the escaped daemon too
        pid1 = await worker_pid(mgr)
        assert pid1 != pid0
        with pytest.raises(ActionCrashed) as e:
            await run(mgr, Call(fn=lambda: os.kill(os.getpid(), signal.SIGSEGV)))
        assert e.value.signal == signal.SIGSEGV and e.value.exit_code is None
        assert await run(mgr, Call(fn=read, args=("file.txt",))) == "kept\n"  # files survive
        assert await run(mgr, Call(fn=bump)) == 1  # memory state does not

    with_manager(mechanism, body)


# A worker killed while idle fails no action: its exit is noticed without any action asking
# (it is reaped, and what it left running is killed), and the trajectory's next action runs
# in a new worker that sees the files written before, with fresh interpreter state; also
# when that action comes before the event loop has handled the exit.
def test_a_worker_killed_while_idle_is_replaced_at_the_next_action(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        t = 5
        await run(mgr, Call(command="echo kept > file.txt; (setsid sleep 60 & echo $! > daemon.pid)", trajectory=t))
        assert await run(mgr, Call(fn=bump, trajectory=t)) == 1
        pid0 = await worker_pid(mgr, t)
        daemon = host_pids(mgr, t, [int(read(os.path.join(mgr.sandbox_dir(t), "daemon.pid")))])[0]
        launcher = mgr._sandboxes[t].proc.pid  # this process's child: the worker, or its bwrap
        os.kill(pid0, signal.SIGKILL)
        assert await until(lambda: launcher not in children() and not pid_alive(daemon))
        assert mgr._sandboxes[t].proc is None  # forgotten: no worker until the next action
        pid1 = await worker_pid(mgr, t)
        assert pid1 != pid0 and pid_alive(pid1)
        assert await run(mgr, Call(fn=read, args=("file.txt",), trajectory=t)) == "kept\n"
        assert await run(mgr, Call(fn=bump, trajectory=t)) == 1  # interpreter state is lost
        launcher = mgr._sandboxes[t].proc.pid
        os.kill(pid1, signal.SIGKILL)
        assert wait_gone([pid1, launcher]) == []  # a blocking wait: the loop has not handled the exit yet
        pid2 = await worker_pid(mgr, t)
        assert pid2 not in (pid0, pid1) and launcher not in children()
        assert mgr._sandboxes[t].starts == 3

    with_manager(mechanism, body)


# A worker killed while it runs an action takes that action with it (ActionCrashed with the
# signal, its CPUs back in the pool); the trajectory's next action succeeds in a new worker.
def test_a_worker_killed_during_an_action_crashes_that_action(mechanism: str) -> None:
    def start_then_sleep() -> None:
        open("started", "w").close()
        time.sleep(60)

    async def body(mgr: CpuManager) -> None:
        t = 6
        pid0 = await worker_pid(mgr, t)
        launcher = mgr._sandboxes[t].proc.pid
        task = asyncio.ensure_future(run(mgr, Call(fn=start_then_sleep, trajectory=t)))
        assert await until(lambda: os.path.exists(os.path.join(mgr.sandbox_dir(t), "started")))
        os.kill(pid0, signal.SIGKILL)
        with pytest.raises(ActionCrashed) as e:
            await task
        assert e.value.signal == signal.SIGKILL and e.value.exit_code is None
        assert mgr.pool.full and launcher not in children()
        pid1 = await worker_pid(mgr, t)
        assert pid1 != pid0

    with_manager(mechanism, body)


def exit_while_a_raw_fork_holds_the_channel() -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fork() == 0:  # libc's fork runs no Python at-fork hook: the child keeps the channel open
        libc.sleep(60)
        libc._exit(0)
    os._exit(3)


# A worker that dies during an action ends that action (ActionCrashed with its exit status)
# even when a process it forked still holds the worker's end of the channel, so that the
# channel never reaches EOF: the action never waits on a dead worker, and that process is
# killed with the sandbox.
def test_a_worker_death_ends_its_action_even_if_its_channel_stays_open(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        with pytest.raises(ActionCrashed) as e:
            await asyncio.wait_for(run(mgr, Call(fn=exit_while_a_raw_fork_holds_the_channel)), 30)
        assert e.value.exit_code == 3
        assert await until(lambda: mgr.processes() == [])
        assert await run(mgr, Call(fn=lambda: 42)) == 42

    with_manager(mechanism, body)


# Idle workers killed during a burst of other trajectories' actions fail none of them; the
# killed trajectories carry on in new workers; every dead worker is reaped when it exits,
# and once the manager is closed this process has exactly the child processes and open
# file descriptors it had before.
def test_idle_workers_killed_during_a_burst_fail_no_other_action_and_leak_nothing(mechanism: str) -> None:
    def work(i: int) -> int:
        return sum(range(1000 * (i % 7 + 1)))

    async def main() -> None:
        fds, kids = open_fds(), children()
        mgr = manager(mechanism)
        await mgr.start()
        try:
            idle = range(100, 112)
            await asyncio.gather(*(run(mgr, Call(fn=int, trajectory=t), cores=0.25) for t in idle))
            victims = [worker_host_pid(mgr, t) for t in idle]
            launchers = [mgr._sandboxes[t].proc.pid for t in idle]
            burst = [asyncio.ensure_future(run(mgr, Call(fn=work, args=(i,), trajectory=i % 6), cores=0.25)) if i % 3
                     else asyncio.ensure_future(run(mgr, Call(command=f"echo {i}", trajectory=i % 6), cores=0.25))
                     for i in range(90)]
            pending = set(burst)
            for pid in victims:  # one kill after each completion in the burst, while the rest runs
                if pending:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                os.kill(pid, signal.SIGKILL)
            results = await asyncio.gather(*burst, return_exceptions=True)
            for i, r in enumerate(results):
                assert r == (work(i) if i % 3 else CommandResult(0, f"{i}\n".encode(), b"", False)), (i, r)
            assert await until(lambda: not set(launchers) & children())
            assert all(mgr._sandboxes[t].proc is None for t in idle)
            await asyncio.gather(*(run(mgr, Call(fn=int, trajectory=t), cores=0.25) for t in idle))
            again = [worker_host_pid(mgr, t) for t in idle]
            assert not set(again) & set(victims)
            assert mgr.pool.full
        finally:
            await mgr.close()
        assert children() == kids
        assert open_fds() == fds

    asyncio.run(main())


def test_timeout_kills_the_whole_process_tree(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        tree = ("sleep 60 & echo $! >> pids; sleep 60 & echo $! >> pids; "
                "(setsid sleep 60 & echo $! >> pids); sh -c 'sleep 60 & echo $! >> pids; wait' & "
                "echo $$ >> pids; sleep 60")
        worker = None
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run(mgr, Call(command=tree, trajectory=4)), 1.0)
        assert time.monotonic() - t0 < 5
        assert mgr.pool.full
        pids = [int(p) for p in read(os.path.join(mgr.sandbox_dir(4), "pids")).split()]
        assert len(pids) == 5
        if namespaced(mgr):  # pids inside its PID namespace: every process of the sandbox must be gone
            assert await until(lambda: mgr.processes() == [])
        else:
            assert wait_gone(pids) == []
        assert mgr._sandboxes[4].proc is None  # recreated at the next action
        r = await run(mgr, Call(command="wc -l < pids", trajectory=4))
        assert r.stdout.strip() == b"5"
        worker = await worker_pid(mgr, 4)
        assert pid_alive(worker)

    with_manager(mechanism, body)


def test_cancellation(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        pid0 = await worker_pid(mgr)
        task = asyncio.ensure_future(run(mgr, Call(fn=time.sleep, args=(30,)), cores=len(CPUS)))
        await asyncio.sleep(0.3)
        assert not mgr.pool.full
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert mgr.pool.full
        assert wait_gone([pid0]) == []
        # cancelling an action that waits for its trajectory's sandbox leaves the running one alone
        first = asyncio.ensure_future(run(mgr, Call(fn=lambda: time.sleep(0.4) or worker_token())))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(run(mgr, Call(fn=worker_token)))
        await asyncio.sleep(0.05)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        token1 = await first
        assert worker_host_pid(mgr) != pid0 and await run(mgr, Call(fn=worker_token)) == token1

    with_manager(mechanism, body)


# ---------------------------------------------------------------------------- limits
def allocate(mib: int) -> int:
    block = b"\1" * (mib << 20)  # written, so resident
    return len(block)


def test_memory_limit(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        assert await run(mgr, Call(fn=allocate, args=(20,)), memory=200) == 20 << 20
        with pytest.raises(ResourceLimitExceeded) as e:
            await run(mgr, Call(fn=allocate, args=(400,)), memory=100)
        assert e.value.limit == "memory"
        assert mgr.pool.full
        assert await run(mgr, Call(fn=allocate, args=(400,))) == 400 << 20  # no limit asked: none applied
        script = [sys.executable, "-c", "b = b'1' * (400 << 20)"]
        if mgr.isolation.cgroup:  # type: ignore[union-attr]
            with pytest.raises(ResourceLimitExceeded) as e:
                await run(mgr, Call(command=script), memory=100)
            assert e.value.limit == "memory"
        else:  # RLIMIT_AS: the command's allocation fails, and its result says so
            r = await run(mgr, Call(command=script), memory=100)
            assert r.returncode != 0 and b"MemoryError" in r.stderr
        assert (await run(mgr, Call(command=script), memory=1000)).returncode == 0

    with_manager(mechanism, body)


def address_space_limit() -> int:
    import resource
    return resource.getrlimit(resource.RLIMIT_AS)[0]


def test_gpu_actions_never_run_under_rlimit_as(mechanism: str) -> None:
    """CUDA reserves far more address space than it uses: a GPU action (its placement sets
    CUDA_VISIBLE_DEVICES) runs without the affinity mode's RLIMIT_AS (a cgroup, where there
    is one, still limits its memory)."""
    import resource

    async def body(mgr: CpuManager) -> None:
        gpu = {"CUDA_VISIBLE_DEVICES": "GPU-fake-0"}
        assert await run(mgr, Call(fn=address_space_limit), memory=100, env=gpu) == resource.RLIM_INFINITY
        r = await run(mgr, Call(command="ulimit -v"), memory=100, env=gpu)
        assert r.stdout.strip() == b"unlimited"
        if not mgr.isolation.cgroup:  # type: ignore[union-attr]
            assert await run(mgr, Call(fn=address_space_limit), memory=100) != resource.RLIM_INFINITY
            assert (await run(mgr, Call(command="ulimit -v"), memory=100)).stdout.strip() != b"unlimited"

    with_manager(mechanism, body)


def test_output_is_capped_and_drained(mechanism: str) -> None:
    async def body(mgr: CpuManager) -> None:
        r = await run(mgr, Call(command="head -c 3000000 /dev/zero; head -c 5000 /dev/zero >&2; echo done >&2"))
        assert r.returncode == 0 and r.truncated
        assert r.stdout == bytes(1000) and r.stderr == bytes(1000)
        r = await run(mgr, Call(command="echo small"))
        assert r == CommandResult(0, b"small\n", b"", False)

    with_manager(mechanism, body, output_limit=1000)


def test_environment_has_no_parent_secrets(mechanism: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_TEST_API_TOKEN", "s3cret-token")
    monkeypatch.setenv("TANGRAM_TEST_PASSED", "yes")

    async def body(mgr: CpuManager) -> None:
        env = await run(mgr, Call(fn=lambda: dict(os.environ)))
        assert "TANGRAM_TEST_API_TOKEN" not in env and env["TANGRAM_TEST_PASSED"] == "yes"
        assert env["EXTRA"] == "1" and env["HOME"] == (HOME if namespaced(mgr) else mgr.sandbox_dir(0))
        r = await run(mgr, Call(command="env"))
        assert b"s3cret" not in r.stdout and b"TANGRAM_TEST_PASSED=yes" in r.stdout
        names = {line.split("=", 1)[0] for line in r.stdout.decode().splitlines()}
        allowed = {"PATH", "LANG", "HOME", "TMPDIR", "PWD", "SHLVL", "_", "OLDPWD", "EXTRA", "TANGRAM_TEST_PASSED",
                   "TANGRAM_SANDBOX", "TANGRAM_CORES", "TANGRAM_GRANT", "TANGRAM_CPUS", "TANGRAM_GRANT_FILE",
                   "TANGRAM_JOBSERVER", "TANGRAM_LIMIT", "TANGRAM_ACTION", "MAKEFLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                   "OPENBLAS_NUM_THREADS"}
        assert names <= allowed, names - allowed
        sid, pgid, pid = await run(mgr, Call(fn=lambda: (os.getsid(0), os.getpgid(0), os.getpid())))
        # its own session and process group (namespaced: bwrap's init leads it, inside)
        assert sid == pgid == (1 if namespaced(mgr) else pid)
        assert os.getsid(worker_host_pid(mgr)) != os.getsid(0)

    with_manager(mechanism, body, env={"EXTRA": "1"}, inherit_env=["TANGRAM_TEST_PASSED"])


def test_close_kills_every_sandbox_and_describe(mechanism: str) -> None:
    pids: list[int] = []

    async def body(mgr: CpuManager) -> None:
        for t in range(3):
            await run(mgr, Call(command="(setsid sleep 60 &); sleep 60 & echo $!", trajectory=t))
            pids.append(await worker_pid(mgr, t))
        assert len(mgr.processes()) >= 9
        d = mgr.describe()
        assert d["resource_control"] == mgr.isolation.mechanism and d["output_limit"] == 1 << 20  # type: ignore[union-attr]
        assert d["isolation"] == mgr.boundary.isolation  # type: ignore[union-attr]
        assert d["sandboxes"] == 3

    with_manager(mechanism, body)
    assert wait_gone(pids) == []
