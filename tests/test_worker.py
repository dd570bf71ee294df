"""tangram.worker, inside an action: the live grant, the jobserver hand-off, and an executor
whose number of running tasks follows the grant (real processes; the grant file is written
here the way the CPU manager writes it)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tangram import worker
from tangram.runtime.sandbox.grant import GRANT_WIDTH


def set_grant(path: Path, cores: float) -> None:
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.write(f"{cores:{GRANT_WIDTH - 1}.4f}\n".encode())


def live_grant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: float) -> Path:
    """A grant file saying `cores`, named by TANGRAM_GRANT_FILE as the CPU manager names it."""
    path = tmp_path / "t0.grant"
    set_grant(path, cores)
    monkeypatch.setenv("TANGRAM_GRANT_FILE", str(path))
    return path


def busy_interval(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def most_at_once(intervals: list[tuple[float, float]], after: float = 0.0, before: float = float("inf")) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for t, step in events:
        running += step
        if after <= t <= before:
            peak = max(peak, running)
    return peak


def test_grant_reads_the_live_file_then_the_start_grant_then_the_cpus(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANGRAM_GRANT_FILE", raising=False)
    monkeypatch.delenv("TANGRAM_GRANT", raising=False)
    assert worker.grant() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("TANGRAM_GRANT", "1.25")
    assert worker.grant() == 1.25 and worker.cores() == 2
    path = tmp_path / "t0.grant"
    set_grant(path, 3.5)
    monkeypatch.setenv("TANGRAM_GRANT_FILE", str(path))
    assert worker.grant() == 3.5 and worker.cores() == 4
    set_grant(path, 0.0)  # between actions: no live grant, the start grant holds
    assert worker.grant() == 1.25


def test_jobserver_fds_outside_and_inside_a_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANGRAM_JOBSERVER", raising=False)
    assert worker.jobserver_fds() == ({}, ())
    fifo = tmp_path / "t0.jobserver"
    os.mkfifo(fifo)
    monkeypatch.setenv("TANGRAM_JOBSERVER", f"fifo:{fifo}")
    env, fds = worker.jobserver_fds()
    (fd,) = fds
    assert env == {"MAKEFLAGS": f" -j --jobserver-auth={fd},{fd}"}
    assert worker.jobserver_fds() == (env, fds)  # one descriptor, kept
    os.write(fd, b"+")
    assert os.read(fd, 1) == b"+"  # the FIFO itself


def test_the_executor_runs_as_many_tasks_as_the_grant_and_follows_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = live_grant(tmp_path, monkeypatch, 1.0)
    with worker.GrantedExecutor(max_workers=3, poll=0.01) as pool:
        list(pool.map(int, range(6)))  # the processes are up
        futures = [pool.submit(busy_interval, 0.25) for _ in range(9)]
        time.sleep(0.6)
        grown = time.time()
        set_grant(path, 2.5)  # three at once from now on
        intervals = [f.result() for f in futures]
        assert [pool.submit(lambda x: x * 2, 21).result()] == [42]  # a lambda travels too
    assert most_at_once(intervals, before=grown) == 1
    assert most_at_once(intervals, after=grown + 0.3) == 3
    with pytest.raises(RuntimeError):
        pool.submit(int)


def test_the_executor_reports_errors_and_refuses_bad_options() -> None:
    with worker.GrantedExecutor(max_workers=1) as pool:
        with pytest.raises(ZeroDivisionError) as e:
            pool.submit(divmod, 1, 0).result()
        assert "Traceback" in str(e.value.__cause__)  # the remote traceback, as text
        with pytest.raises(RuntimeError, match="cannot be pickled"):
            pool.submit(lambda: threading.Lock()).result()  # a result that cannot travel back
        with pytest.raises(TypeError, match="pickle"):
            pool.submit(id, threading.Lock()).result()  # a task that cannot travel there
        assert pool.submit(abs, -3).result() == 3 and pool.workers == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_workers"):
            worker.GrantedExecutor(max_workers=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="poll"):
        worker.GrantedExecutor(max_workers=1, poll=0)


def written_limits(fd: int) -> list[str]:
    try:
        return os.read(fd, 4096).decode().splitlines()
    except BlockingIOError:
        return []


# Inside an action (TANGRAM_ACTION, TANGRAM_LIMIT as the CPU manager sets them), the
# executor limits the grant to the tasks it has left once fewer are left than cores, and
# raises the limit when more come; what it writes is "<action> <cores>" lines.
def test_the_executor_limits_the_grant_to_the_tasks_it_has_left(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    grant_path, fifo = live_grant(tmp_path, monkeypatch, 2.0), tmp_path / "t0.limit"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the manager's end
    monkeypatch.setenv("TANGRAM_LIMIT", str(fifo))
    monkeypatch.setenv("TANGRAM_ACTION", "7")
    with worker.GrantedExecutor(max_workers=2, poll=0.01) as pool:
        long = pool.submit(time.sleep, 0.8)
        pool.submit(time.sleep, 0.05).result()
        time.sleep(0.05)
        assert written_limits(fd) == ["7 1.0000"]  # one task left of a two-core grant
        set_grant(grant_path, 1.0)  # the manager's resize
        more = [pool.submit(time.sleep, 0.05) for _ in range(3)]
        assert written_limits(fd) == ["7 2.0000"]  # more work than the limit: raised again
        long.result()
        for f in more:
            f.result()
        time.sleep(0.05)
        assert written_limits(fd) == ["7 1.0000"]  # down to the last task
        monkeypatch.setenv("TANGRAM_ACTION", "8")  # the next action of the sandbox starts unlimited
        set_grant(grant_path, 2.0)
        pool.submit(time.sleep, 0.01).result()
        time.sleep(0.05)
        assert written_limits(fd) == ["8 1.0000"]
    assert worker.limit_grant(1.5) and written_limits(fd) == ["8 1.5000"]
    with pytest.raises(ValueError, match="cores"):
        worker.limit_grant(0)
    monkeypatch.delenv("TANGRAM_LIMIT")
    assert not worker.limit_grant(1.0)  # outside a sandbox: nobody to tell
    os.close(fd)


def kill_own_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# Workers start on demand: a one-core grant never starts a second process. A task whose
# worker dies fails alone (TaskCrashed); a worker killed while idle is replaced; the
# executor goes on either way.
def test_the_executor_starts_workers_on_demand_and_survives_their_deaths(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = live_grant(tmp_path, monkeypatch, 1.0)
    with worker.GrantedExecutor(max_workers=3, poll=0.01) as pool:
        assert list(pool.map(abs, [-1, -2, -3, -4])) == [1, 2, 3, 4]
        assert pool.workers == 1
        with pytest.raises(worker.TaskCrashed, match="exit code 3"):
            pool.submit(os._exit, 3).result()
        with pytest.raises(worker.TaskCrashed, match="killed by signal 9"):
            pool.submit(kill_own_process).result()
        assert pool.submit(abs, -5).result() == 5
        pid = pool.submit(os.getpid).result()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        assert pool.submit(os.getpid).result() != pid
        assert pool.workers == 1
        set_grant(path, 3.0)
        assert sorted(pool.map(busy_interval, [0.2] * 3))  # three at once: three workers
        assert pool.workers == 3


# The manager's end of the limit FIFO: the running action's last well-formed limit reaches
# the callback; garbled lines (no id, extra words, not a positive finite number) and lines
# naming another action (a sandbox limiting another's grant) are dropped.
def test_the_grant_channel_reads_limits_and_drops_garbled_lines(tmp_path: Path) -> None:
    from tangram.runtime.sandbox.grant import GrantChannel

    async def main() -> list[tuple[int, float]]:
        heard: list[tuple[int, float]] = []
        channel = GrantChannel(str(tmp_path / "t0"), lambda action, cores: heard.append((action, cores)))
        channel.start(2.0, 7)
        try:
            fd = os.open(channel.limit_path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"x 1\n7 3.0\n9 1.5 extra\n7 2.0\n8 1.0\n8 nan\n8 inf\n8 0\n8 -1\n10 0\n")
            os.close(fd)
            for _ in range(50):
                if heard:
                    break
                await asyncio.sleep(0.01)
        finally:
            channel.close()
        return heard

    assert asyncio.run(main()) == [(7, 2.0)]


# A sandbox that writes its limit FIFO as fast as it is read cannot keep the manager's
# reader (a callback of the event loop every action's timeout runs on) from returning: one
# turn reads a bounded share of a full FIFO and leaves the rest for a later turn.
def test_one_turn_reads_a_bounded_share_of_a_flooded_limit_fifo(tmp_path: Path) -> None:
    import fcntl

    from tangram.runtime.sandbox.grant import LIMIT_READ_BYTES, GrantChannel

    async def main() -> tuple[int, int, list[tuple[int, float]]]:
        heard: list[tuple[int, float]] = []
        channel = GrantChannel(str(tmp_path / "t0"), lambda action, cores: heard.append((action, cores)))
        channel.start(2.0, 1)
        fd = os.open(channel.limit_path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
            written = 0
            while True:
                try:
                    written += os.write(fd, b"1 1.0\n" * 1024)
                except BlockingIOError:
                    break
            channel._read_limits()
            left = 0
            while True:
                try:
                    left += len(os.read(channel._limit_fd, 1 << 16))
                except BlockingIOError:
                    break
        finally:
            os.close(fd)
            channel.close()
        return written, left, heard

    written, left, heard = asyncio.run(main())
    assert written > 2 * LIMIT_READ_BYTES
    assert left >= written - LIMIT_READ_BYTES - 4096 and heard == [(1, 1.0)]


# A process the sandbox left behind shrinks the jobserver FIFO and keeps it full: the next
# action's start (which puts its tokens there) must not fail on the full pipe.
def test_a_full_jobserver_fifo_does_not_fail_the_next_start(tmp_path: Path) -> None:
    import fcntl

    from tangram.runtime.sandbox.grant import GrantChannel

    async def main() -> str:
        channel = GrantChannel(str(tmp_path / "t0"))
        fd = os.open(channel.fifo_path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 4096)
            channel.start(1.0, 1)
            while True:  # (a start drains the FIFO first, so only a process writing all along
                try:     # fills it before the start's put; a grow puts with no drain)
                    os.write(fd, b"+" * 512)
                except BlockingIOError:
                    break
            channel.resize(4.0)  # its three more tokens find no room: no error, and the grant is told
            with open(channel.grant_path) as f:
                return f.read()
        finally:
            os.close(fd)
            channel.close()

    assert float(asyncio.run(main())) == 4.0
