"""Hostile calls through a real `tangram serve` and two clients on loopback: a bad call
ends alone with a typed error naming its field (raised at the client's submit where the
client can see it, else as its result); the other calls of its frame, the other client
and the server do not notice; SIGTERM stops a server whose stderr is gone; no sandbox
process outlives the server."""

from __future__ import annotations

import asyncio
import math
import operator
import os
import re
import select
import signal
import subprocess
import sys
import threading
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings

import tangram
from tangram import Call
from tangram.runtime.sandbox.kills import marked_processes
from tangram.server import Client

from hostile import HOSTILE, Mix, plans

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

NAN, INF = math.nan, math.inf
CONFIG = """
[[quotas]]
name = "q"

[managers.cpu]
resource_control = "affinity"

[inventory]
nodes = [{ name = "n0", resources = { cpu = 2, memory = 4096 } }]
"""
SERVE = [sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--grace", "0"]


def read_address(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    line = proc.stdout.readline().decode() if ready else ""
    match = re.search(r"listening on (\S+)", line)
    if match is None:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"no address from tangram serve: {line!r}")
    return match.group(1)


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, then the exit status; a server that does not exit in time is killed and
    fails the test."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("tangram serve ignored SIGTERM") from None
    return proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server with real sandboxes (the cpu manager), the api manager with quota "q" and a
    mock manager; after SIGTERM it exits 0 and leaves no sandbox process."""
    config = tmp_path_factory.mktemp("hostile") / "server.toml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}
    stderr = config.with_name("stderr")
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([*SERVE, "--config", str(config), "--manager", "mock=mock"], stdout=subprocess.PIPE,
                                stderr=err, env=env)
    try:
        yield read_address(proc)
        assert proc.poll() is None, f"the server died: {stderr.read_text()}"
        assert stop(proc) == 0, stderr.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.communicate()
    assert marked_processes(f"{proc.pid}.") == []


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))  # a hang fails the test instead of stalling it


# The reported case: a shared-trajectory client's call whose trajectory is beyond the
# core (changed after the client's own check, so only the server sees it) lands in the
# same server iteration as a well-behaved client's 20 calls: it ends alone, with a
# ValidationError naming call.trajectory; every other call gets its result.
def test_a_bad_trajectory_of_a_shared_client_leaves_the_other_client_alone(server: str) -> None:
    async def main() -> None:
        async with Client(server, shared_trajectories=True) as shared, Client(server) as other:
            calm = [other.submit(Call(fn=operator.add, args=(i, 1), resources={"cpu": 0.1})) for i in range(20)]
            first = shared.submit(Call(fn=operator.add, args=(0, 1), resources={"cpu": 0.1}))
            bad_call = Call(fn=operator.add, args=(0, 1), resources={"cpu": 0.1})
            bad = shared.submit(bad_call)
            bad_call.trajectory = 2**64  # before the client's next flush pickles it
            assert await asyncio.gather(*calm) == [i + 1 for i in range(20)]
            assert await first == 1
            with pytest.raises(tangram.ValidationError) as info:
                await bad
            assert info.value.field == "call.trajectory"
            assert await shared.run(Call(fn=operator.add, args=(2, 2), resources={"cpu": 0.1})) == 4

    run(main())


# A call that cannot be pickled for the wire ends alone, with a ValidationError naming
# the call; the calls around it in the same frame go through.
def test_a_call_that_cannot_be_pickled_ends_alone(server: str) -> None:
    async def main() -> None:
        async with Client(server) as client:
            handles = [client.submit(Call(fn=operator.add, args=(i, 1), resources={"cpu": 0.1})) for i in range(3)]
            bad = client.submit(Call(fn=operator.add, args=(threading.Lock(), 1), resources={"cpu": 0.1}))
            handles += [client.submit(Call(fn=operator.add, args=(i, 1), resources={"cpu": 0.1})) for i in range(3)]
            assert await asyncio.gather(*handles) == [1, 2, 3] * 2
            with pytest.raises(tangram.ValidationError) as info:
                await bad
            assert info.value.field == "call"

    run(main())


# A call the server cannot unpickle (its function's module exists only on the client)
# shares a frame with good calls: the frame goes back, each call is sent again on its own,
# and only that call fails, with a ValidationError saying why; the others get their results.
def test_a_call_the_server_cannot_load_ends_alone(server: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    (tmp_path / "client_only_module.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from client_only_module import double  # type: ignore[import-not-found]

    async def main() -> None:
        async with Client(server) as client:
            good = [Call(fn=operator.add, args=(i, 1), manager="mock") for i in range(3)]
            results = await client.map([*good, Call(fn=double, args=(4,), manager="mock"), *good])
            assert results[:3] == results[4:] == [1, 2, 3]
            assert isinstance(results[3], tangram.ValidationError) and results[3].field == "call"
            assert "client_only_module" in str(results[3])
            assert await client.run(Call(fn=operator.mul, args=(6, 7), manager="mock")) == 42

    run(main())


# What the client can check it raises at submit; what only the server knows (its
# managers, its inventory) ends the call's future with the same typed error.
def test_bad_calls_end_with_typed_errors_naming_the_field(server: str) -> None:
    async def main() -> None:
        async with Client(server) as client:
            for call, field in ((Call(fn=len, args=("ab",), env={"A": 1}), "call.env.A"),
                                (Call(fn=len, args=("ab",), trajectory=2**32), "call.trajectory"),
                                (Call(fn=len, args=("ab",), resources=None), "call.resources")):
                with pytest.raises(tangram.ValidationError) as info:
                    client.submit(call)  # type: ignore[arg-type]
                assert info.value.field == field
            for call, field in ((Call(), "call.fn"), (Call(quota="q", resources={}), "call.fn"),
                                (Call(fn=len, args=("ab",), resources={"cpu": NAN}), "call.resources.cpu"),
                                (Call(fn=len, args=("ab",), tokens=2**63), "call.tokens")):
                with pytest.raises(tangram.ValidationError) as info:
                    await client.run(call)
                assert info.value.field == field, str(info.value)
            assert await client.run(Call(fn=len, args=("ab",), resources={"cpu": 0.1})) == 2

    run(main())


# SIGTERM stops a server whose stderr is gone (a pipe nobody reads any more, or no file
# descriptor 2 at all): the note it prints on the way out must not stop the shutdown.
@pytest.mark.parametrize("stderr", ["closed pipe", "closed descriptor"])
def test_sigterm_stops_a_server_without_stderr(stderr: str) -> None:
    serve = [*SERVE, "--manager", "cpu=mock"]
    if stderr == "closed pipe":
        proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        address = read_address(proc)
        assert proc.stderr is not None
        proc.stderr.close()
        proc.stderr = None  # gone: what the server writes there now fails (EPIPE)
    else:
        wrapper = "import os, sys; os.close(2); os.execv(sys.executable, sys.argv[1:])"
        proc = subprocess.Popen([sys.executable, "-c", wrapper, *serve], stdout=subprocess.PIPE)
        address = read_address(proc)

    async def one_call() -> None:
        async with Client(address) as client:
            assert await client.run(Call(runtime=0.0)) is None

    run(one_call())
    assert stop(proc) == 0


# ------------------------------------------------------------------ random hostile mixes

# Through a server also: a trajectory beyond a client's own numbers, fine in the shared space.
SERVER_HOSTILE = [*HOSTILE, "own range"]
PLAN = plans(SERVER_HOSTILE, max_size=20)


# Two clients (one in the shared trajectory space, one in its own) submit random mixes of
# good and hostile calls in the same event-loop iteration: every good call gets its
# result, every bad one a typed error naming its field, nothing hangs, both clients stay
# connected, and the server stays up (the fixture then checks it exits 0 on SIGTERM and
# leaves no sandbox process).
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLAN, PLAN)
def test_random_hostile_calls_end_alone_through_the_server(server: str, shared_plan: list[int],
                                                           own_plan: list[int]) -> None:
    async def main() -> None:
        async with Client(server, shared_trajectories=True) as shared, Client(server) as own:
            mix = Mix()
            mix.submit_plan(shared.submit, shared_plan, SERVER_HOSTILE, fine_here=("own range",))
            mix.submit_plan(own.submit, own_plan, SERVER_HOSTILE)
            await mix.check_outcomes()
            assert shared.connected and own.connected

    run(main())
