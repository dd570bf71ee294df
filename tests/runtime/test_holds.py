"""Quota holds: admission from a tangram quota for work the caller runs itself (a hosted
sandbox's creation, an API the rollout calls), in process, through a real `tangram serve`
with client processes, and with a client that dies holding one; the quota's backoff when
the provider answers 429."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tangram import (Client, Inventory, MockManager, Node, Orchestrator, Quota, SyncOrchestrator, Throttled,
                     UnknownNameError, ValidationError)
from tangram.runtime.managers.api import ApiManager
from tangram.runtime.holds import BACKOFF_FIRST, BACKOFF_MAX

from test_server import Served, _readline, write_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers need Linux")


def _orchestrator(*quotas: Quota) -> Orchestrator:
    return Orchestrator(inventory=Inventory([Node("n0", {"cpu": 2, "memory": 4096})], quotas=list(quotas)),
                        default_managers=False, managers={"cpu": MockManager(), "api": ApiManager()})


def _overlaps(spans: list[tuple[float, float]]) -> int:
    """The most spans open at once (an end before a start at the same instant)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


# Invariant: holds are requests of their quota: never more inside at once than its
# concurrency cap, each recorded as an action of the quota (kind "hold", outcome ok).
def test_holds_respect_the_quotas_concurrency_and_are_recorded() -> None:
    async def main() -> None:
        async with _orchestrator(Quota("e2b", max_concurrency=2)) as orch:
            spans: list[tuple[float, float]] = []

            async def worker(t: int) -> None:
                async with orch.quota("e2b", trajectory=t) as hold:
                    assert hold.id is not None
                    entered = time.monotonic()
                    await asyncio.sleep(0.05)
                    spans.append((entered, time.monotonic()))

            await asyncio.gather(*(worker(t) for t in range(7)))
            assert _overlaps(spans) == 2
            holds = [r for r in orch.records if r.kind == "hold"]
            assert len(holds) == 7 and {r.quota for r in holds} == {"e2b"} and {r.outcome for r in holds} == {"ok"}
            assert await orch.queue_lengths() == {"hold": (0, 0)}

    asyncio.run(main())


# Invariant: a throttle pauses the whole quota (every caller) for its retry_after; without
# one, the pause doubles in a row up to BACKOFF_MAX, throttles while paused (the rest of one
# burst) do not step it up, and a clean hold ends the streak.
def test_a_throttle_pauses_the_quota_for_every_caller() -> None:
    async def main() -> None:
        async with _orchestrator(Quota("api", rate=1000.0, burst=10)) as orch:
            with pytest.raises(Throttled):
                async with orch.quota("api"):
                    raise Throttled(0.4)
            throttled_at = orch.now()
            waiting = [asyncio.ensure_future(orch.quota("api", trajectory=t).acquire()) for t in (1, 2)]
            holds = await asyncio.gather(*waiting)
            admitted = [r.start for r in orch.records if r.kind == "hold" and r.trajectory in (1, 2)]
            for hold in holds:
                await hold.release_and_wait()
            admitted = [r.start for r in orch.records if r.kind == "hold" and r.trajectory in (1, 2)]
            assert len(admitted) == 2 and min(admitted) >= throttled_at + 0.4 - 1e-3
            assert "rate limit" in (next(r for r in orch.records if r.trajectory == 1).wait_reason or "")

            steps = [orch.quota_backoffs.next("other") for _ in range(8)]
            assert steps[:3] == [BACKOFF_FIRST, 2 * BACKOFF_FIRST, 4 * BACKOFF_FIRST] and steps[-1] == BACKOFF_MAX
            assert await orch.back_off_quota("api") == BACKOFF_FIRST
            assert await orch.back_off_quota("api") <= BACKOFF_FIRST  # the same burst: the rest of its pause
            await asyncio.sleep(BACKOFF_FIRST + 0.05)
            assert await orch.back_off_quota("api") == 2 * BACKOFF_FIRST  # a throttle after it: the next step
            assert await orch.back_off_quota("api", 0.0) == 0.0
            async with orch.quota("api"):  # a clean hold (after the pause) ends the streak
                pass
            await asyncio.sleep(0.05)
            assert await orch.back_off_quota("api") == BACKOFF_FIRST

    asyncio.run(main())


def test_bad_holds_get_typed_errors_and_a_cancelled_wait_withdraws_the_hold() -> None:
    async def main() -> None:
        async with _orchestrator(Quota("api", max_concurrency=1)) as orch:
            with pytest.raises(UnknownNameError) as unknown:
                orch.quota("nope")
            assert unknown.value.field == "quota" and "api" in str(unknown.value)
            for bad in (-1.0, float("nan"), 1e9, "5", 10 ** 400, True):
                with pytest.raises(ValidationError) as e:
                    await orch.back_off_quota("api", bad)  # type: ignore[arg-type]
                assert e.value.field == "retry_after"
                with pytest.raises(ValidationError) as e:
                    Throttled(bad)  # type: ignore[arg-type]
                assert e.value.field == "retry_after"
            with pytest.raises(UnknownNameError):
                await orch.back_off_quota("nope", 1.0)
            held = await orch.quota("api").acquire()
            with pytest.raises(ValidationError):
                await held.acquire()  # entered already
            waiter = asyncio.ensure_future(orch.quota("api", kind="waiter").acquire())
            await asyncio.sleep(0.05)
            assert (await orch.queue_lengths())["waiter"] == (1, 0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await asyncio.sleep(0)
            assert (await orch.queue_lengths())["waiter"] == (0, 0)
            await held.release_and_wait()
            assert [r.outcome for r in orch.records] == ["cancelled", "ok"]
            async with orch.quota("api"):
                pass  # the slot came back

    asyncio.run(main())


def test_the_sync_facade_holds_from_threads() -> None:
    inventory = Inventory([Node("n0", {"cpu": 2, "memory": 4096})], quotas=[Quota("api", max_concurrency=1)])
    spans: list[tuple[float, float]] = []
    with SyncOrchestrator(inventory=inventory, default_managers=False,
                          managers={"cpu": MockManager(), "api": ApiManager()}) as orch:
        def worker() -> None:
            for _ in range(3):
                with orch.quota("api"):
                    entered = time.monotonic()
                    time.sleep(0.02)
                    spans.append((entered, time.monotonic()))

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert orch.back_off_quota("api", 0.0) == 0.0
    assert len(spans) == 9 and _overlaps(spans) == 1


HOLDER = textwrap.dedent("""
    import asyncio, sys, time, tangram
    async def main():
        async with tangram.Client(sys.argv[1]) as client:
            for _ in range(int(sys.argv[2])):
                async with client.quota("e2b-create", trajectory=int(sys.argv[3])):
                    entered = time.time()
                    await asyncio.sleep(0.05)
                    print(entered, time.time(), flush=True)
    asyncio.run(main())
""")


# Invariant: one quota for every client of a server: client processes holding it never
# exceed its concurrency together, and a client killed while holding gives the slot back
# when its connection ends.
def test_client_processes_share_one_quota_through_the_server(tmp_path: Path) -> None:
    config = write_config(tmp_path, '\n[[quotas]]\nname = "e2b-create"\nmax_concurrency = 1\n')
    served = Served(config, "--manager", "cpu=mock", "--grace", "0")
    try:
        procs = [subprocess.Popen([sys.executable, "-P", "-c", HOLDER, served.address, "6", str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        spans = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            spans += [tuple(map(float, line.split())) for line in out.splitlines()]
        assert len(spans) == 12 and _overlaps(spans) == 1  # type: ignore[arg-type]

        dying = textwrap.dedent("""
            import asyncio, sys, tangram
            async def main():
                client = await tangram.Client(sys.argv[1]).start()
                await client.quota("e2b-create").acquire()
                print("holding", flush=True)
                await asyncio.sleep(60)
            asyncio.run(main())
        """)
        proc = subprocess.Popen([sys.executable, "-P", "-c", dying, served.address], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert _readline(proc, 20.0) == "holding\n", proc.stderr
        finally:
            proc.kill()
            proc.communicate()

        async def after() -> None:
            async with Client(served.address) as client:
                started = time.monotonic()
                async with client.quota("e2b-create"):
                    assert time.monotonic() - started < 10.0
                with pytest.raises(Throttled):
                    async with client.quota("e2b-create"):
                        raise Throttled(0.5)
                throttled = time.monotonic()
                async with client.quota("e2b-create"):
                    assert time.monotonic() - throttled >= 0.45  # the server paused the quota
                with pytest.raises(UnknownNameError):
                    await client.quota("nope").acquire()
                assert await client.back_off_quota("e2b-create", 0.0) == 0.0
                status = await client.status()
                assert status["quotas"]["e2b-create"] == [0, 0]

        asyncio.run(after())
    finally:
        assert served.stop() == 0, served.stderr
