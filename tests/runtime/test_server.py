"""`tangram serve` and `tangram.Client` end to end: real server subprocesses on loopback,
real sockets, several client processes; the same results and typed errors as the
in-process orchestrator; the token off loopback; malformed and oversized frames; graceful
shutdown and a killed server ending every pending action explicitly; cancels and
disconnects reaching the server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import cloudpickle
import pytest

import tangram
from tangram import Call, CommandResult, Orchestrator, RuntimeConfig
from tangram.runtime import ActionCancelled, ActionFailed, ActionInfeasible, ActionTimeout, OrchestratorClosed
from tangram.server import (
    AuthenticationError,
    Client,
    ConnectionLost,
    FrameTooLarge,
    ProtocolError,
    Server,
    SyncClient,
)
from tangram.server import protocol as P

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

INVENTORY = """
[inventory]
nodes = [{ name = "n0", resources = { cpu = 2, memory = 4096 } }]
"""


class Served:
    """A `tangram serve` subprocess; `address` is parsed from its first line."""

    def __init__(self, config: Path | None, *args: str, env: dict[str, str] | None = None,
                 start_timeout: float = 20.0) -> None:
        argv = [sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", *args]
        if config is not None:
            argv += ["--config", str(config)]
        environ = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}
        environ.update(env or {})
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
        self.line = _readline(self.proc, start_timeout)
        match = re.search(r"listening on (\S+)", self.line)
        if match is None:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"no address from tangram serve: {self.line!r}; stderr: {self.stderr}")
        self.address = match.group(1)
        self.stderr = ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
        return self.proc.returncode


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def write_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "server.toml"
    path.write_text(INVENTORY + extra)
    return path


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The scheduling path alone: the mock manager runs fns inline and sleeps `runtime`."""
    served = Served(write_config(tmp_path_factory.mktemp("mock")), "--manager", "cpu=mock", "--grace", "0",
                    "--max-frame", "65536")
    yield served
    assert served.stop() == 0, served.stderr


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    """Real sandboxes: the CPU manager runs fns and commands in worker processes."""
    config = write_config(tmp_path_factory.mktemp("cpu"), "\n[managers.cpu]\nresource_control = \"affinity\"\n")
    served = Served(config, "--grace", "0")
    yield served, config
    assert served.stop() == 0, served.stderr


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def outcome(value: Any) -> Any:
    """A result or an error, comparable across processes (ids differ)."""
    if isinstance(value, tangram.TangramError):
        field = "action" if isinstance(value, tangram.ActionError) else value.field
        return (type(value).__name__, field, getattr(value, "error_type", None))
    return ("ok", value)


def calls() -> list[Call]:
    def add(a: int, b: int) -> int:
        return a + b

    def cores() -> str:
        return os.environ["TANGRAM_CORES"]

    def boom() -> None:
        raise KeyError("missing")

    def remember(text: str) -> str:
        Path("memo").write_text(text)
        return text.upper()

    def recall() -> str:
        return Path("memo").read_text()

    return [
        Call(fn=add, args=(2, 3)),
        Call(fn=cores, trajectory=1),
        Call(command="echo out; echo err >&2; exit 3"),
        Call(fn=boom),
        Call(command="sleep 5", timeout=0.3),
        Call(command="true", resources={"cpu": 64}),
        Call(resources={"gpu_hours": 1}),
        Call(resources={"cpu": 1}, elastic="cpu"),
        Call(fn=remember, args=("kept",), trajectory=2),
        Call(fn=recall, trajectory=2),
    ]


async def run_all(orch: Any) -> list[Any]:
    """Each call in order (state persists within a trajectory), errors as values; an
    error raised at submit (in process) counts like one ending the future (the client)."""
    out = []
    for call in calls():
        try:
            handle = orch.submit(call)
        except tangram.TangramError as e:
            out.append(e)
            continue
        try:
            value = await handle
        except tangram.TangramError as e:
            if isinstance(e, tangram.ActionError):
                assert e.action_id == handle.id
            value = e
        out.append(value)
    return out


def test_results_and_typed_errors_equal_the_in_process_orchestrator(cpu_server: tuple[Served, Path]) -> None:
    served, config = cpu_server

    async def in_process() -> list[Any]:
        async with Orchestrator(RuntimeConfig.from_file(config)) as orch:
            return await run_all(orch)

    async def remote() -> list[Any]:
        async with tangram.Client(served.address) as client:
            results = await run_all(client)
            await client.end_trajectory(2)
            return results

    local, far = run(in_process()), run(remote())
    assert [outcome(v) for v in far] == [outcome(v) for v in local]
    assert far[0] == 5 and far[1] == "1"
    assert far[2] == CommandResult(3, b"out\n", b"err\n")
    assert isinstance(far[3], ActionFailed) and far[3].error_type == "KeyError" and "KeyError" in far[3].remote_traceback
    assert isinstance(far[4], ActionTimeout)
    assert isinstance(far[5], ActionInfeasible)
    assert isinstance(far[6], tangram.UnknownNameError) and far[6].field == "call.resources"
    assert isinstance(far[7], tangram.ValidationError) and far[7].field == "call.max_units"
    assert far[9] == "kept"


CLIENT_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    import tangram

    def remember(name):
        Path("who").write_text(name)

    def recall():
        return Path("who").read_text()

    class Tag:  # of __main__: travels by value, even as the argument of a builtin
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return "tag " + self.name

    async def main(address, name):
        async with tangram.Client(address) as client:
            await client.run(tangram.Call(fn=remember, args=(name,), trajectory=0))
            squares = await client.map([tangram.Call(fn=lambda i=i: i * i, trajectory=0, resources={"cpu": 0.5})
                                        for i in range(6)])
            who = await client.run(tangram.Call(fn=recall, trajectory=0))
            tag = await client.run(tangram.Call(fn=str, args=(Tag(name),), trajectory=0))
            await client.end_trajectory(0)
        print(json.dumps({"name": name, "who": who, "squares": squares, "tag": tag}))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


def test_several_client_processes_share_one_server(cpu_server: tuple[Served, Path]) -> None:
    served, _ = cpu_server
    names = ["alpha", "beta", "gamma"]
    procs = [subprocess.Popen([sys.executable, "-P", "-c", CLIENT_SCRIPT, served.address, name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in names]
    outputs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    results = [json.loads(out) for out, _ in outputs]
    # Each client's trajectory 0 is its own sandbox: nobody sees another's file.
    assert [r["who"] for r in results] == names
    assert all(r["squares"] == [i * i for i in range(6)] for r in results)
    assert [r["tag"] for r in results] == [f"tag {n}" for n in names]


def _module_level(x: int) -> int:
    return x + 1


def test_calls_take_the_c_pickler_only_where_it_means_what_cloudpickle_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from tangram.server.client import _pickle_calls

    real_dumps = cloudpickle.dumps
    # Commands and importable functions: the C pickler alone (cloudpickle sends the same).
    plain = [Call(command="true"), Call(fn=_module_level, args=(1,), resources={"cpu": 0.5})]
    with monkeypatch.context() as m:
        m.setattr(cloudpickle, "dumps", lambda *a, **k: pytest.fail("cloudpickle used for plain calls"))
        assert _pickle_calls(plain) == pickle.dumps(plain, protocol=5)
    # What cloudpickle sends by value stays by value.
    assert pickle.loads(_pickle_calls([Call(fn=lambda: 7)]))[0].fn() == 7
    Tagged = type("Tagged", (), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "Tagged", Tagged, raising=False)  # resolvable: pickle would refer to it
    by_value = [Call(fn=str, args=(Tagged(),))]
    assert _pickle_calls(by_value) == real_dumps(by_value, protocol=5) != pickle.dumps(by_value, protocol=5)
    registered = [Call(fn=_module_level, args=(1,))]
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        assert _pickle_calls(registered) == real_dumps(registered, protocol=5) != pickle.dumps(registered, protocol=5)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_cancel_explain_and_a_cancelled_awaiting_task(mock_server: Served) -> None:
    async def main() -> None:
        async with Client(mock_server.address) as client:
            running = client.submit(Call(runtime=30.0, resources={"cpu": 2}))
            waiting = client.submit(Call(runtime=30.0, resources={"cpu": 2}))
            await asyncio.sleep(0.05)
            assert "running" in await client.explain(running.id)
            reason = await client.explain(waiting.id)
            assert "cpu" in reason or "resources" in reason
            assert await client.queue_lengths() == {"env": (1, 1)}
            assert waiting.cancel() and running.cancel()
            with pytest.raises(ActionCancelled, match="while waiting"):
                await waiting
            with pytest.raises(ActionCancelled, match="while running") as info:
                await running
            assert info.value.action_id == running.id
            assert not running.cancel() and not client.cancel(12345)
            # Cancelling the task that awaits an action cancels it on the server: the
            # whole node is free again at once.
            task = asyncio.ensure_future(client.run(Call(runtime=30.0, resources={"cpu": 2})))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            started = time.perf_counter()
            assert await client.run(Call(fn=lambda: "free", resources={"cpu": 2})) == "free"
            assert time.perf_counter() - started < 2.0
            assert await client.queue_lengths() == {"env": (0, 0)}

    run(main())


@pytest.mark.parametrize("objective", ["step", "act"])
def test_serve_honours_the_objective(tmp_path: Path, objective: str) -> None:
    # A quota of one request a second. Trajectory 1's first request takes the token; then
    # trajectory 2's first and trajectory 1's second wait for the next. Objective "step"
    # keeps the quota's arrival order; "act" serves trajectory 1, which has started more.
    config = write_config(tmp_path, '\n[[quotas]]\nname = "api"\nrate = 1.0\nburst = 1\n')
    served = Served(config, "--manager", "cpu=mock", "--grace", "0", *(["--objective", objective]
                                                                          if objective == "act" else []))
    try:
        async def main() -> tuple[float, float]:
            async with Client(served.address) as client:
                assert client.server_info["objective"] == objective
                await client.run(Call(fn=time.monotonic, quota="api", trajectory=1))
                second = client.submit(Call(fn=time.monotonic, quota="api", trajectory=2))
                await asyncio.sleep(0.05)
                further = client.submit(Call(fn=time.monotonic, quota="api", trajectory=1))
                return await second, await further

        second_started, further_started = run(main())
        assert (further_started < second_started) == (objective == "act")
    finally:
        assert served.stop() == 0, served.stderr


def test_serve_exports_metrics_by_kind_and_quota_and_logs_each_action(tmp_path: Path) -> None:
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    log = tmp_path / "actions.jsonl"
    config = write_config(tmp_path, '\n[[quotas]]\nname = "search"\nrate = 100.0\nburst = 10\n')
    served = Served(config, "--manager", "cpu=mock", "--grace", "0", "--metrics-port", str(metrics_port),
                    "--log-actions", str(log))
    try:
        with SyncClient(served.address) as client:
            client.map([Call(fn=lambda: 1, quota="search", trajectory=4), Call(fn=lambda: 2, kind="reward")])
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
                text = response.read().decode()
        assert 'tangram_actions_total{kind="env",outcome="ok",quota="search"} 1.0' in text
        assert 'tangram_actions_total{kind="reward",outcome="ok",quota=""} 1.0' in text
    finally:
        assert served.stop() == 0, served.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((r["kind"], r["quota"], r["outcome"]) for r in lines) == [("env", "search", "ok"), ("reward", "", "ok")]
    assert all(r["end"] >= r["start"] >= r["submit"] for r in lines)


def test_serve_refuses_an_action_log_it_cannot_open(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--log-actions",
                           str(tmp_path / "missing" / "log.jsonl")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--log-actions" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _busy_server(tmp_path: Path) -> tuple[Served, SyncClient, list[Any]]:
    """A mock server with four long actions running (one under quota "search") and two waiting."""
    config = write_config(tmp_path, '\n[[quotas]]\nname = "search"\nrate = 1.0\nburst = 1\n')
    served = Served(config, "--manager", "cpu=mock", "--manager", "api=mock", "--grace", "0")
    client = SyncClient(served.address)
    client.run(Call(runtime=0.0))
    handles = [client.submit(Call(runtime=60.0, resources={"cpu": 0.5}, trajectory=t)) for t in range(3)]
    handles.append(client.submit(Call(runtime=60.0, resources={"cpu": 1}, trajectory=3)))  # short of cores
    handles += [client.submit(Call(runtime=60.0, resources={"cpu": 0.25}, quota="search", trajectory=9 + i))
                for i in range(2)]  # the second waits for the quota's rate
    client.queue_lengths()  # the submits have reached the server
    return served, client, handles


def test_top_once_prints_the_servers_state(tmp_path: Path) -> None:
    served, client, handles = _busy_server(tmp_path)
    try:
        assert client.back_off_quota("search", 30.0) == 30.0  # the provider answered 429
        done = subprocess.run([sys.executable, "-P", "-m", "tangram", "top", served.address, "--once"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "100"})
        assert done.returncode == 0, done.stderr
        out = done.stdout
        assert f"tangram {served.address}" in out and "policy tangram (step)" in out
        assert re.search(r"env\s*│\s*2\s*│\s*4", out), out  # kind env: 2 waiting, 4 running
        assert re.search(r"quota search\s*│\s*1\s*│\s*1\s*│ 1/s burst 1 \([01] now\), paused (29|30)\.\d s \(429\)", out), out
        assert "running (4; longest first)" in out and "last minute: 1 ended" in out
    finally:
        for h in handles:
            h.cancel()
        client.close()
        assert served.stop() == 0, served.stderr


def test_top_refreshes_in_a_terminal(tmp_path: Path) -> None:
    # In a real terminal (tmux), redrawn in place about once a second.
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    served, client, handles = _busy_server(tmp_path)
    session = f"tangram-top-{os.getpid()}"
    command = f"{sys.executable} -P -m tangram top {served.address} --interval 0.3"
    try:
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "110", "-y", "40", command], check=True,
                       env={k: v for k, v in os.environ.items() if k != "TMUX"})
        screens = []
        for _ in range(2):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.5)
                screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                        text=True).stdout
                if "utilisation" in screen and (not screens or screen != screens[-1]):
                    break
            screens.append(screen)
        assert "running (4; longest first)" in screens[0], screens[0]
        assert re.search(r"quota search\s*│\s*1\s*│\s*1", screens[0]), screens[0]
        assert screens[1] != screens[0]  # redrawn: the running times have moved on
        assert screens[1].count("running (4; longest first)") == 1  # in place, not scrolled
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        for h in handles:
            h.cancel()
        client.close()
        assert served.stop() == 0, served.stderr


def test_sync_client_mirrors_the_sync_orchestrator(mock_server: Served) -> None:
    with SyncClient(mock_server.address) as client:
        assert client.run(Call(fn=lambda: 7)) == 7
        results = client.map([Call(fn=lambda: 1), Call(resources={"cpu": 64})])
        assert results[0] == 1 and isinstance(results[1], ActionInfeasible)
        handle = client.submit(Call(runtime=30.0, resources={"cpu": 2}))
        time.sleep(0.05)
        assert "running" in client.explain(handle.id)
        assert handle.cancel()
        with pytest.raises(ActionCancelled):
            handle.result(5)
        with pytest.raises(tangram.ValidationError, match=r"call\.timeout"):
            client.submit(Call(timeout=-1))  # checked locally, raised at submit as in process
        client.end_trajectory(0)


def test_token_required_off_loopback(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}
    refused = subprocess.run([sys.executable, "-P", "-m", "tangram", "serve", "--host", "0.0.0.0", "--port", "0",
                              "--config", str(config), "--manager", "cpu=mock"],
                             capture_output=True, text=True, timeout=30, env=env)
    assert refused.returncode == 2 and "token" in refused.stderr and "listening" not in refused.stdout

    served = Served(config, "--host", "0.0.0.0", "--manager", "cpu=mock", env={"TANGRAM_TOKEN": "s3cret"})
    try:
        port = served.address.rsplit(":", 1)[1]
        address = f"127.0.0.1:{port}"

        async def main() -> None:
            for token in ("wrong", None):
                client = Client(address, token=token)
                client.token = token  # no fallback to $TANGRAM_TOKEN for the None case
                with pytest.raises(AuthenticationError) as info:
                    await client.start()
                assert info.value.field == "token"
            async with Client(address, token="s3cret") as client:
                assert await client.run(Call(fn=lambda: "in")) == "in"

        run(main())

        # Nothing is unpickled before the token: a SUBMIT first is refused unread.
        marker = tmp_path / "unpickled"
        evil = cloudpickle.dumps([Call(fn=None, args=(_Touch(str(marker)),))])
        with socket.create_connection(("127.0.0.1", int(port)), timeout=5) as sock:
            sock.sendall(P.submit_frame([1 << 32 | 1], evil))
            _, error = recv_error(sock)
            assert isinstance(error, ProtocolError) and "HELLO" in str(error)
            assert recv_frame(sock) is None  # closed
        assert not marker.exists()
    finally:
        assert served.stop() == 0, served.stderr


class _Touch:
    """Creates a file when unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path(self.path).touch, ())


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    header = recv_exact(sock, P.HEADER.size)
    if header is None:
        return None
    length, kind = P.HEADER.unpack(header)
    payload = recv_exact(sock, length)
    assert payload is not None
    return kind, payload


def recv_error(sock: socket.socket) -> tuple[int, Exception]:
    item = recv_frame(sock)
    assert item is not None, "closed without an error"
    kind, payload = item
    assert kind == P.ERROR, (kind, payload[:200])
    return kind, P.decode_error(json.loads(payload))


def hello(sock: socket.socket) -> int:
    sock.sendall(P.json_frame(P.HELLO, {"protocol": P.PROTOCOL, "token": None}))
    item = recv_frame(sock)
    assert item is not None and item[0] == P.WELCOME
    return json.loads(item[1])["connection"]


def test_malformed_and_oversized_frames_get_a_typed_error_and_spare_the_server(mock_server: Served) -> None:
    host, port = P.parse_address(mock_server.address)

    def connect() -> socket.socket:
        return socket.create_connection((host, port), timeout=5)

    async def main() -> None:
        async with Client(mock_server.address) as bystander:
            assert await bystander.run(Call(fn=lambda: "before")) == "before"
            cases: list[tuple[bool, bytes, type[Exception], str]] = [
                (False, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ProtocolError, "unknown frame type"),
                (False, P.json_frame(P.CANCEL, [1]), ProtocolError, "HELLO"),
                (False, struct.pack("!IB", 1 << 30, P.HELLO), FrameTooLarge, "limit"),
                (False, P.frame(P.HELLO, b"{not json"), ProtocolError, "JSON"),
                (False, P.json_frame(P.HELLO, {"protocol": 99}), ProtocolError, "protocol"),
                (False, P.json_frame(P.HELLO, {"protocol": P.PROTOCOL, "shared_trajectories": "false"}), ProtocolError,
                 "shared_trajectories"),
                (False, P.json_frame(P.HELLO, {"protocol": P.PROTOCOL, "records": 1}), ProtocolError, "records"),
                (True, struct.pack("!IB", 100_000, P.SUBMIT) + b"x" * 1000, FrameTooLarge, "65536"),
                (True, P.frame(P.CANCEL, b"[1, 2"), ProtocolError, "JSON"),
                (True, P.frame(P.SUBMIT, b"\x00\x00"), ProtocolError, "SUBMIT"),
                (True, P.submit_frame([7], pickle.dumps([Call()])), ProtocolError, "range"),
                (True, P.frame(77, b""), ProtocolError, "type 77"),
                (True, P.json_frame(P.WELCOME, {}), ProtocolError, "unexpected WELCOME"),
                (True, P.json_frame(P.REQUEST, {"op": "explain"}), ProtocolError, "REQUEST"),
            ]
            for authenticate, data, error_type, text in cases:
                with connect() as sock:
                    if authenticate:
                        hello(sock)
                    sock.sendall(data)
                    _, error = recv_error(sock)
                    assert isinstance(error, error_type) and text in str(error), (data[:40], error)
                    assert recv_frame(sock) is None  # the server closed the connection
                assert await bystander.run(Call(fn=lambda: "still")) == "still"

            # Random bytes, authenticated or not: an error or a close, never a crash.
            rng = random.Random(5)
            for i in range(30):
                with connect() as sock:
                    if i % 2:
                        hello(sock)
                    sock.sendall(rng.randbytes(rng.randrange(1, 300)))
                    sock.shutdown(socket.SHUT_WR)
                    while recv_frame(sock) is not None:
                        pass
            assert await bystander.run(Call(fn=lambda: "alive")) == "alive"

            # A batch the server cannot unpickle ends its actions, not the connection.
            with connect() as sock:
                number = hello(sock)
                ids = [number << 32 | 1, number << 32 | 2]
                sock.sendall(P.submit_frame(ids, b"\x80\x05garbage"))
                item = recv_frame(sock)
                assert item is not None and item[0] == P.RESULTS
                results = pickle.loads(item[1])
                assert [r[0] for r in results] == ids and not any(r[1] for r in results)
                assert all(isinstance(P.decode_error(r[2]), tangram.ValidationError) for r in results)
                sock.sendall(P.json_frame(P.REQUEST, [1, "ping", []]))
                item = recv_frame(sock)
                assert item is not None and item[0] == P.REPLY and pickle.loads(item[1]) == [(1, True, "pong")]

            # An action id given twice in a frame (or still live) would get two RESULTS: the
            # frame is refused before any of its calls runs.
            with connect() as sock:
                number = hello(sock)
                twice = number << 32 | 1
                sock.sendall(P.submit_frame([twice, twice], pickle.dumps([Call(runtime=0.01), Call(runtime=0.01)])))
                _, error = recv_error(sock)
                assert isinstance(error, ProtocolError) and "given twice" in str(error), error
                assert recv_frame(sock) is None

            # Requests with arguments of the wrong type get a typed error naming the field.
            with connect() as sock:
                hello(sock)
                for rid, op, args, field in [(1, "explain", [[1]], "action_id"), (2, "back_off", ["nope", 1.0], "quota"),
                                             (3, "end_trajectory", [True], "trajectory")]:
                    sock.sendall(P.json_frame(P.REQUEST, [rid, op, args]))
                    item = recv_frame(sock)
                    assert item is not None and item[0] == P.REPLY
                    ((got, ok, error),) = pickle.loads(item[1])
                    assert got == rid and not ok and P.decode_error(error).field == field, (op, error)

            # The client refuses to send a call larger than the server's frame limit.
            big = bystander.submit(Call(fn=len, args=(b"x" * 100_000,)))
            small = bystander.submit(Call(fn=lambda: "small"))
            with pytest.raises(FrameTooLarge) as info:
                await big
            assert info.value.action_id == big.id
            assert await small == "small"
            # A result larger than the frame limit ends its action with a typed error.
            with pytest.raises(FrameTooLarge, match="result"):
                await bystander.run(Call(fn=lambda: b"y" * 100_000))
            assert await bystander.run(Call(fn=lambda: "after")) == "after"

    run(main())


def test_a_dropped_client_has_its_actions_cancelled_on_the_server(mock_server: Served) -> None:
    script = textwrap.dedent("""
        import asyncio, sys, tangram
        async def main():
            client = await tangram.Client(sys.argv[1]).start()
            handle = client.submit(tangram.Call(runtime=60.0, resources={"cpu": 2}))
            while "running" not in await client.explain(handle.id):
                await asyncio.sleep(0.01)
            print("running", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-P", "-c", script, mock_server.address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert _readline(proc, 20.0) == "running\n", proc.stderr
    finally:
        proc.kill()
        proc.communicate()

    async def main() -> None:
        async with Client(mock_server.address) as client:
            started = time.perf_counter()
            assert await client.run(Call(fn=lambda: "mine", resources={"cpu": 2})) == "mine"
            assert time.perf_counter() - started < 5.0
            assert await client.queue_lengths() == {"env": (0, 0)}

    run(main())


def test_sigterm_finishes_or_fails_every_in_flight_action(tmp_path: Path) -> None:
    served = Served(write_config(tmp_path), "--manager", "cpu=mock", "--grace", "1")

    async def main() -> None:
        async with Client(served.address) as client:
            quick = client.submit(Call(runtime=0.3, resources={"cpu": 1}))
            long = client.submit(Call(runtime=60.0, resources={"cpu": 1}))
            waiting = [client.submit(Call(runtime=60.0, resources={"cpu": 2})) for _ in range(2)]
            await asyncio.sleep(0.1)
            served.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            late = client.submit(Call(runtime=0.0))
            started = time.perf_counter()
            with pytest.raises(OrchestratorClosed):
                await late
            assert await quick is None  # finished within the grace period
            for handle in (long, *waiting):
                with pytest.raises(ActionCancelled) as info:
                    await handle
                assert info.value.action_id == handle.id
            assert time.perf_counter() - started < 5.0
            await asyncio.sleep(0.1)
            with pytest.raises(ConnectionLost, match="shut down"):
                client.submit(Call())

    try:
        run(main())
    finally:
        assert served.stop(timeout=10) == 0, served.stderr
    assert "stopped" in served.stderr


def test_server_close_method_ends_every_action() -> None:
    async def main() -> None:
        inventory = tangram.Inventory.uniform(1, {"cpu": 1, "memory": 1024})
        async with Server(inventory=inventory, port=0, default_managers=False, hello_timeout=0.2,
                          managers={"cpu": tangram.MockManager()}) as server:
            assert server.address is not None
            # A connection that never authenticates is closed with a typed error.
            reader, writer = await asyncio.open_connection(*server.address)
            header = await asyncio.wait_for(reader.readexactly(P.HEADER.size), 2.0)
            length, kind = P.HEADER.unpack(header)
            error = P.decode_error(json.loads(await reader.readexactly(length)))
            assert kind == P.ERROR and isinstance(error, AuthenticationError)
            assert await reader.read() == b""
            writer.close()
            await writer.wait_closed()
            async with Client(server.address) as client:
                handles = [client.submit(Call(runtime=60.0)) for _ in range(3)]
                await asyncio.sleep(0.05)
                await server.close()
                for h in handles:
                    with pytest.raises(ActionCancelled):
                        await h

    run(main())


def test_a_killed_server_ends_every_pending_action_with_connection_lost(tmp_path: Path) -> None:
    served = Served(write_config(tmp_path), "--manager", "cpu=mock")

    async def main() -> None:
        client = await Client(served.address).start()
        handles = [client.submit(Call(runtime=60.0, resources={"cpu": 1})) for _ in range(4)]
        await asyncio.sleep(0.1)
        explain = asyncio.ensure_future(client.end_trajectory(0))  # a request in flight too
        served.proc.kill()
        started = time.perf_counter()
        for h in handles:
            with pytest.raises(ConnectionLost) as info:
                await asyncio.wait_for(h.future, 5.0)
            assert info.value.action_id == h.id
        assert time.perf_counter() - started < 2.0
        with pytest.raises((ConnectionLost, tangram.TangramError)):
            await asyncio.wait_for(explain, 5.0)
        with pytest.raises(ConnectionLost):
            client.submit(Call())
        await asyncio.wait_for(client.close(), 5.0)
        with pytest.raises(OrchestratorClosed):
            client.submit(Call())

    try:
        run(main())
    finally:
        served.stop(signal.SIGKILL)
    with pytest.raises(tangram.ServerUnreachable, match=f"no tangram server at {re.escape(served.address)}"):
        run(Client(served.address, connect_timeout=2.0).start())


@pytest.mark.parametrize(("address", "parsed"), [
    ("10.0.0.5:7460", ("10.0.0.5", 7460)),
    ("tcp://10.0.0.5:7460", ("10.0.0.5", 7460)),
    ("http://127.0.0.1:7450", ("127.0.0.1", 7450)),  # pasted from a log line or a browser
    ("http://127.0.0.1:7450/", ("127.0.0.1", 7450)),
    ("  node-3  ", ("node-3", P.DEFAULT_PORT)),
    (":7461", ("127.0.0.1", 7461)),
    ("[::1]:7462", ("::1", 7462)),
    (("10.0.0.6", 7463), ("10.0.0.6", 7463)),
])
def test_addresses_as_users_write_them(address: Any, parsed: tuple[str, int]) -> None:
    assert P.parse_address(address) == parsed


@pytest.mark.parametrize(("address", "says"), [
    ("https://127.0.0.1:7450", "plain TCP, not TLS"),
    ("http://127.0.0.1:8080/run_code", "has no path"),
    ("ftp://host:1", "unknown scheme"),
    ("::1:7450", "in brackets"),
    ("host:http", "the port a number"),
    ("host:70000", "1 to 65535"),
    ("host:0", "1 to 65535"),
    (7450, "a \"host:port\" string"),
])
def test_a_wrong_address_is_refused_in_one_line(address: Any, says: str) -> None:
    with pytest.raises(tangram.ValidationError) as raised:
        Client(address)
    assert raised.value.field == "address" and says in str(raised.value) and "\n" not in str(raised.value)


def test_no_server_at_the_address_says_where_and_how_to_start_one() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(tangram.ServerUnreachable) as raised:
        run(Client(f"http://127.0.0.1:{port}", connect_timeout=2.0).start())
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message and f"tangram serve --port {port}" in message and "\n" not in message
    assert raised.value.field == "address" and isinstance(raised.value, ConnectionError)
    assert not isinstance(raised.value, ConnectionLost)  # no connection ever existed


# Invariant: a Client made without an address looks in the documented order
# (tangram.server.discovery: $TANGRAM_ADDRESS, a server advertised on the connected Ray
# cluster, the default) and its refusal names where the address came from.
def test_a_client_without_an_address_says_where_it_found_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("TANGRAM_ADDRESS", raising=False)
    default = Client()
    assert (default.host, default.port) == ("127.0.0.1", P.DEFAULT_PORT) and default.found_by.startswith("the default")
    monkeypatch.setenv("TANGRAM_ADDRESS", f"tcp://127.0.0.1:{port}")
    client = Client(connect_timeout=2.0)
    assert (client.port, client.found_by) == (port, "$TANGRAM_ADDRESS")
    with pytest.raises(tangram.ServerUnreachable) as raised:
        run(client.start())
    assert "the address is $TANGRAM_ADDRESS" in str(raised.value)
    assert Client(f"127.0.0.1:{port}").found_by == "given"


def test_typed_errors_round_trip_through_the_codec() -> None:
    errors: list[tangram.TangramError] = [
        ActionTimeout(5, "ran past its timeout"),
        tangram.ActionCrashed(6, "died", exit_code=None, signal=9),
        ActionFailed(7, "KeyError: 'x'", "KeyError", "Traceback ..."),
        tangram.ResourceLimitExceeded(8, "memory", "memory"),
        tangram.UnknownNameError("call.resources", "unknown kind"),
        AuthenticationError("token", "wrong"),
        ConnectionLost("gone", 9),
    ]
    for error in errors:
        back = P.decode_error(json.loads(json.dumps(P.encode_error(error))))
        assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)
    unknown = P.decode_error({"type": "os:system", "field": "x", "reason": "y", "attrs": {}})
    assert isinstance(unknown, P.RemoteError) and unknown.error_type == "os:system"


def test_the_frame_reader_reassembles_frames_cut_anywhere() -> None:
    # The connections read into the reader's own buffer (get_buffer / buffer_updated); a
    # stream of frames cut at random points, fed that way or through feed(), comes out
    # whole, however large a frame is; the buffer grows to an announced frame and shrinks
    # back once it is read. A view handed to an earlier read may still be referenced.
    rng = random.Random(7)
    sizes = [0, 1, 5, 300, 5000, 70_000, 300_000]
    for _ in range(200):
        frames = [(rng.choice([P.SUBMIT, P.RESULTS, P.REPLY]), rng.randbytes(rng.choice(sizes)))
                  for _ in range(rng.randrange(1, 8))]
        stream = b"".join(P.frame(kind, payload) for kind, payload in frames)
        reader = P.FrameReader(1 << 20)
        got, pos, kept = [], 0, []
        while pos < len(stream):
            n = min(rng.randrange(1, 100_000), len(stream) - pos)
            if rng.random() < 0.5:
                room = reader.get_buffer(-1)
                n = min(n, len(room))
                room[:n] = stream[pos:pos + n]
                if rng.random() < 0.3:
                    kept.append(room)  # asyncio holds its view until buffer_updated returns
                reader.buffer_updated(n)
            else:
                reader.feed(stream[pos:pos + n])
            pos += n
            while (item := reader.next()) is not None:
                got.append(item)
        assert got == frames
        reader.get_buffer(-1)
        assert len(reader.buffer) == P.FrameReader.INITIAL
    # The limit is checked on the header, before any payload is buffered.
    reader = P.FrameReader(100_000)
    reader.feed(P.HEADER.pack(1_000_000, P.SUBMIT))
    reader.get_buffer(-1)
    assert len(reader.buffer) == P.FrameReader.INITIAL  # no room made for it
    with pytest.raises(FrameTooLarge):
        reader.next()


def test_a_call_pickles_as_its_field_values() -> None:
    call = Call(fn=_module_level, args=(1,), resources={"cpu": 2}, elastic="cpu", max_units=4, runtime=3.0,
                timeout=5, trajectory=3, kind="reward", env={"A": "b"}, affinity="n1")
    small = Call(runtime=0.0, resources={"cpu": 0.001})
    assert b"resources" not in pickle.dumps(small, protocol=5)  # no field names on the wire
    for dumps in (pickle.dumps, cloudpickle.dumps):
        assert pickle.loads(dumps(call, protocol=5)) == call
    # A subclass, or a call carrying extra attributes, pickles the default way.
    Sub = dataclasses.make_dataclass("Sub", [("extra", int, 5)], bases=(Call,))
    sub = Sub(runtime=2.0, extra=7)
    assert pickle.loads(cloudpickle.dumps(sub)) == sub
    call.note = "x"  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(call))
    assert back == call and back.note == "x"
