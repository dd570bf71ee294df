"""The Sandbox Fusion endpoint against clients that misbehave: clients that leave while
their program runs, mid-body or mid-answer; slow, idle and silent connections; more
connections than file descriptors; bodies over the limit, nested too deeply or in an
unknown charset; more sessions than the cap; answers too big to build; clients that do
not read their answers. Each runs against a real server on loopback (`tangram serve`, or
tangram.server.sandbox_fusion.SandboxFusionEndpoint in a process of its own when a test
sets the endpoint's options), through real sockets, with real sandboxes; it asserts
outcomes (the program was killed, the server closed the connection, the status and the
body of each answer, the server's descriptors and memory back where they were), with
generous waits rather than tight timings."""

from __future__ import annotations

import base64
import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

requests = pytest.importorskip("requests")

INVENTORY = """
[inventory]
nodes = [{ name = "n0", resources = { cpu = 2, memory = 8192 } }]
"""

# SandboxFusionEndpoint with the options of argv[2] (JSON), on the orchestrator of the
# config argv[1]: started as `tangram serve` starts it (its GC thresholds, gc.freeze), and
# announced as `tangram serve` announces it.
OPTIONS_SERVER = r"""
import asyncio, gc, json, signal, sys
from tangram import RuntimeConfig
from tangram.runtime.orchestrator import Orchestrator
from tangram.server.command import GC_THRESHOLDS
from tangram.server.sandbox_fusion import SandboxFusionEndpoint

async def main():
    orchestrator = Orchestrator(RuntimeConfig.from_file(sys.argv[1]))
    await orchestrator.start()
    endpoint = SandboxFusionEndpoint(orchestrator, port=0, **json.loads(sys.argv[2]))
    await endpoint.start()
    gc.freeze()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("options server: up", flush=True)
    print("Sandbox Fusion API on http://%s:%d/run_code" % endpoint.address, flush=True)
    await stop.wait()
    endpoint.stop_accepting()
    await orchestrator.close()
    await endpoint.close()

gc.set_threshold(*GC_THRESHOLDS)
asyncio.run(main())
"""


class Served:
    """A server process on loopback: `tangram serve --sandbox-fusion-port 0`, or (with
    `options`) the endpoint alone with those options. `url` is its HTTP root; its stderr
    goes to a file (a log storm must not block it on a full pipe)."""

    def __init__(self, tmp: Path, options: dict[str, Any] | None = None, nofile: int | None = None,
                 args: tuple[str, ...] = ()) -> None:
        config = tmp / "server.toml"
        config.write_text(INVENTORY)
        if options is None:
            argv = [sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--sandbox-fusion-port", "0",
                    "--grace", "2", "--config", str(config), *args]
        else:
            argv = [sys.executable, "-P", "-c", OPTIONS_SERVER, str(config), json.dumps(options)]
        self.errpath = tmp / f"stderr.{uuid.uuid4().hex}"
        self._err = open(self.errpath, "wb")
        environ = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}

        def limits() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._err, env=environ, text=True,
                                     preexec_fn=limits)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60.0)
        first = self.proc.stdout.readline() if ready else ""
        lines = [first, self.proc.stdout.readline() if first else ""]  # (the second may be buffered already)
        match = re.search(r"Sandbox Fusion API on (http://\S+)/run_code", lines[-1])
        if match is None:
            self.stop()
            raise AssertionError(f"no Sandbox Fusion address: {lines!r}; stderr: {self.stderr()}")
        self.url = match.group(1)
        host, port = self.url[len("http://"):].rsplit(":", 1)
        self.address = (host, int(port))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def connections(self) -> int:
        """The HTTP connections it holds open: its sockets on the endpoint's port, listener
        aside (its descriptors count more: the CPU manager's cgroup files, a warm sandbox
        started in the background...)."""
        inodes = set()
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                link = os.readlink(f"/proc/{self.proc.pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        found = 0
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{self.proc.pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port == self.address[1] and fields[3] != "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found += 1
        return found

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.errpath.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Starts servers (`serve(options=..., nofile=...)`, or `serve(args=...)`: flags of
    `tangram serve`); each is stopped after the test."""
    started: list[Served] = []

    def start(options: dict[str, Any] | None = None, nofile: int | None = None, args: tuple[str, ...] = ()) -> Served:
        directory = tmp_path / f"server{len(started)}"
        directory.mkdir()
        served = Served(directory, options, nofile, args)
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One `tangram serve` for the tests that need no options of their own."""
    served = Served(tmp_path_factory.mktemp("sf-abuse"))
    yield served
    served.stop()


def post(url: str, body: Any, timeout: float = 60, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    """POST /run_code on a connection of its own, which the server closes after answering
    (so that no connection the client keeps counts against the server's limits)."""
    headers = {"Connection": "close"} | (headers or {})
    return requests.post(url + "/run_code", json=body, timeout=timeout, headers=headers, **kw)


def healthy(served: Served) -> bool:
    answer = post(served.url, {"code": "print(6 * 7)", "language": "python"})
    return answer.status_code == 200 and answer.json()["run_result"]["stdout"] == "42\n"


def raw_request(body: bytes, path: str = "/run_code", extra: str = "", version: str = "1.1") -> bytes:
    head = (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


def read_answer(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of one HTTP answer (its Content-Length's worth, or
    up to the connection's end)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection ended before an answer: {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        body += chunk
    return status, headers, body


def closed_by_server(sock: socket.socket, within: float = 20.0, trickle: bool = False) -> bool:
    """The server closes the connection within `within` seconds (an EOF or a reset, after
    whatever answer it sent), while the client sends a byte now and then (`trickle`)."""
    deadline = time.monotonic() + within
    sock.settimeout(0.3)
    while time.monotonic() < deadline:
        try:
            if trickle:
                sock.send(b"a")
            if sock.recv(65536) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:  # reset, or a broken pipe on the trickle
            return True
    return False


def eventually(check: Callable[[], bool], within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def big_file_code(mib: float) -> str:
    return f"open('big', 'wb').write(b'x' * {int(mib * (1 << 20))})"


# ------------------------------------------------------------------ clients that leave


def test_a_client_that_disconnects_has_its_program_killed(serve: Callable[..., Served]) -> None:
    """The client leaves while its program runs: the program is killed then (its action
    cancelled), not at its run_timeout, and its core serves the next client."""
    served = serve()
    markers = [f"{4000 + i}.{uuid.uuid4().int % 10**6}" for i in range(2)]
    socks = []
    for marker in markers:  # both cores taken
        code = f"import subprocess\nsubprocess.run(['sleep', '{marker}'])"
        sock = socket.create_connection(served.address)
        sock.sendall(raw_request(json.dumps({"code": code, "language": "python", "run_timeout": 3600}).encode()))
        socks.append(sock)
    assert eventually(lambda: all(processes_with(m) for m in markers)), "the programs did not start"
    for sock in socks:
        sock.close()
    assert eventually(lambda: not any(processes_with(m) for m in markers)), "the programs outlived their clients"
    assert healthy(served)


def test_a_client_that_leaves_mid_answer_leaves_no_memory_behind(serve: Callable[..., Served]) -> None:
    """Clients that read 1 KiB of a 32 MiB answer and leave: the answers are freed (under
    `tangram serve`'s GC thresholds and gc.freeze), not kept until a full collection."""
    served = serve()
    body = {"code": big_file_code(24), "language": "python", "fetch_files": ["big"]}
    for _ in range(2):  # the allocator's high-water mark, before measuring
        answer = post(served.url, body)
        assert answer.status_code == 200 and len(answer.json()["files"]["big"]) == 32 << 20
    time.sleep(1)
    before = served.rss_mb()
    for _ in range(8):
        sock = socket.create_connection(served.address)
        sock.sendall(raw_request(json.dumps(body).encode()))
        sock.settimeout(60)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        sock.close()
        time.sleep(0.3)
    assert healthy(served)
    time.sleep(2)
    grown = served.rss_mb() - before
    assert grown < 100, f"the server's memory grew {grown:.0f} MiB after 8 departed 32 MiB answers"


def test_bad_bodies_are_typed_422s_and_client_faults_log_no_traceback(serve: Callable[..., Served]) -> None:
    served = serve()
    deep = post(served.url, None, data=b"[" * 100_000 + b"]" * 100_000,
                headers={"Content-Type": "application/json"})
    assert deep.status_code == 422
    detail = deep.json()["detail"][0]
    assert detail["type"] == "json_invalid" and "nested" in detail["msg"]
    nested_files = ('{"code":"1","language":"python","files":' + '{"a":' * 50_000 + "null" + "}" * 50_000 + "}")
    assert post(served.url, None, data=nested_files.encode(),
                headers={"Content-Type": "application/json"}).status_code == 422
    charset = post(served.url, None, data=b'{"code":"print(1)","language":"python"}',
                   headers={"Content-Type": "application/json; charset=nonsense-xyz"})
    assert charset.status_code == 422 and "nonsense-xyz" in charset.json()["detail"][0]["msg"]
    utf16 = post(served.url, None, data=json.dumps({"code": "print(1)", "language": "python"}).encode("utf-16"),
                 headers={"Content-Type": "application/json; charset=utf-16"})
    assert utf16.status_code == 200 and utf16.json()["status"] == "Success"
    end = requests.post(served.url + "/end_session", data=b"[" * 100_000, timeout=30, headers={"Connection": "close"})
    assert end.status_code == 422 and end.json()["detail"][0]["type"] == "json_invalid"
    for _ in range(3):  # leaving mid-body
        sock = socket.create_connection(served.address)
        sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"code\":")
        time.sleep(0.2)
        sock.close()
    answer = {"code": big_file_code(8), "language": "python", "fetch_files": ["big"]}
    for _ in range(2):  # leaving mid-answer
        sock = socket.create_connection(served.address)
        sock.sendall(raw_request(json.dumps(answer).encode()))
        sock.settimeout(60)
        assert sock.recv(1024)
        sock.close()
    assert healthy(served)
    time.sleep(1)
    assert served.stop() == 0
    log = served.stderr()
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]


@pytest.mark.parametrize("body, loc", [
    ({"files": False}, ["body", "files"]),
    ({"files": ""}, ["body", "files"]),
    ({"fetch_files": 0}, ["body", "fetch_files"]),
    ({"files": {".": "eA=="}}, ["body", "files", "."]),
    ({"files": {"d/": "eA=="}}, ["body", "files", "d/"]),
    ({"files": {"a": "eA==", "a/b": "eA=="}}, ["body", "files", "a/b"]),
    ({"files": {"a/" * 3000 + "x": "eA=="}}, ["body", "files", "a/" * 3000 + "x"]),
    ({"fetch_files": ["d/"]}, ["body", "fetch_files", 0]),
    ({"code": "print('\ud800')"}, ["body", "code"]),
    ({"stdin": "\udc00"}, ["body", "stdin"]),
    ({"files": {"\ud800": "eA=="}}, ["body", "files", "\ud800"]),
])
def test_bad_fields_are_422s_naming_them(shared: Served, body: dict[str, Any], loc: list[Any]) -> None:
    """Fields that used to pass as empty, or failed in the sandbox with a raw
    IsADirectoryError / RecursionError / UnicodeEncodeError: refused up front, naming
    the field (and the path)."""
    served = shared
    payload = json.dumps({"code": "print(1)", "language": "python"} | body).encode()  # lone surrogates escaped
    answer = post(served.url, None, data=payload, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text[:500]
    assert answer.json()["detail"][0]["loc"] == loc


# ------------------------------------------------------------------ slow, idle and too many connections


def test_slow_idle_and_silent_connections_are_closed(serve: Callable[..., Served]) -> None:
    """client_timeout: a connection that sends no whole request head in time (silent,
    half a head, a head trickled a byte at a time, idle after an answer) is closed; a body
    that does not arrive in time is answered 408 and its connection closed."""
    served = serve(options={"client_timeout": 1.0})
    assert healthy(served)
    silent = socket.create_connection(served.address)
    half = socket.create_connection(served.address)
    half.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\n")
    trickled = socket.create_connection(served.address)
    trickled.sendall(b"POST /run_code HTTP/1.1\r\nX-Slow: ")
    assert closed_by_server(silent) and closed_by_server(half) and closed_by_server(trickled, trickle=True)
    slow_body = socket.create_connection(served.address)
    slow_body.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    status, _, body = read_answer(slow_body)
    assert status == 408 and "client_timeout" in json.loads(body)["detail"]
    assert closed_by_server(slow_body)
    kept = socket.create_connection(served.address)  # keep-alive, then idle
    kept.sendall(raw_request(json.dumps({"code": "print(1)", "language": "python"}).encode()))
    status, _, body = read_answer(kept)
    assert status == 200 and json.loads(body)["status"] == "Success"
    assert closed_by_server(kept)
    assert healthy(served)
    for sock in (silent, half, trickled, slow_body, kept):
        sock.close()
    assert eventually(lambda: served.connections() == 0), served.connections()


def test_a_body_announced_over_the_limit_is_refused_at_once_with_json(shared: Served,
                                                                     serve: Callable[..., Served]) -> None:
    """Content-Length over max_body: 413 (JSON) as soon as the head arrives, without
    waiting for the body; a chunked body that grows past it: 413 (JSON) too."""
    served = shared
    sock = socket.create_connection(served.address)
    sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{")
    status, headers, body = read_answer(sock, timeout=20)
    sock.close()
    assert status == 413 and headers["content-type"].startswith("application/json")
    assert "max_body" in json.loads(body)["detail"]
    small = serve(options={"max_body": 4096})
    sock = socket.create_connection(small.address)
    chunk = b"x" * 2048
    sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
                 b"%x\r\n%s\r\n" % (len(chunk), chunk) * 3 + b"0\r\n\r\n")
    status, headers, body = read_answer(sock, timeout=20)
    sock.close()
    assert status == 413 and headers["content-type"].startswith("application/json")
    assert "4096" in json.loads(body)["detail"]


def test_connections_over_max_connections_are_refused(serve: Callable[..., Served]) -> None:
    served = serve(options={"max_connections": 4, "client_timeout": 60.0})
    assert healthy(served)
    assert eventually(lambda: served.connections() == 0)
    held = [socket.create_connection(served.address) for _ in range(4)]
    assert eventually(lambda: served.connections() == 4)
    over = socket.create_connection(served.address)
    over.sendall(raw_request(json.dumps({"code": "print(1)", "language": "python"}).encode()))
    status, headers, body = read_answer(over)
    assert status == 503 and "max_connections" in json.loads(body)["detail"]
    assert closed_by_server(over)
    over.close()
    for sock in held:
        sock.close()
    assert eventually(lambda: served.connections() == 0), served.connections()
    assert healthy(served)


def connect_up_to(served: Served, n: int) -> list[socket.socket]:
    """Up to `n` connections to the server, fewer if it refuses one."""
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(served.address, timeout=5))
        except OSError:
            break
    return socks


def assert_no_log_storm(served: Served) -> list[str]:
    """The server's stderr lines, checked to be few and none of asyncio's accept errors."""
    lines = served.stderr().splitlines()
    assert len(lines) < 20 and not any("out of system resource" in line for line in lines), lines[:20]
    return lines


def test_idle_connections_cannot_exhaust_the_descriptors(serve: Callable[..., Served]) -> None:
    """Under a descriptor limit of 128, 200 idle connections: the ones over the default
    max_connections (half the limit) are refused, the server keeps its
    descriptors and answers once they go, and nothing floods its log."""
    served = serve(nofile=128)
    socks = connect_up_to(served, 200)
    time.sleep(2)
    assert served.fds() < 100
    tcp = socket.create_connection(served.address, timeout=10)  # the server still accepts (and refuses)
    tcp.sendall(raw_request(b"{}"))
    status, _, _ = read_answer(tcp)
    assert status in (503, 422)
    tcp.close()
    for sock in socks:
        sock.close()
    assert eventually(lambda: served.fds() < 40)
    assert healthy(served)
    assert_no_log_storm(served)


def test_running_out_of_descriptors_sheds_connections_without_a_log_storm(serve: Callable[..., Served]) -> None:
    """max_connections above what the descriptor limit allows: once they run out, new
    connections are closed at once (a spare descriptor makes room to accept them), with
    one warning, not asyncio's line per attempt; the server answers again once they go."""
    served = serve(options={"max_connections": 10_000}, nofile=96)
    socks = connect_up_to(served, 160)
    time.sleep(3)
    for sock in socks:
        sock.close()
    assert eventually(lambda: served.fds() < 40)
    assert healthy(served)
    lines = assert_no_log_storm(served)
    assert any("file descriptors" in line for line in lines), lines


# ------------------------------------------------------------------ sessions and answers


def test_sessions_are_capped(serve: Callable[..., Served]) -> None:
    """max_sessions: a new session past it is refused in-band (a SandboxError naming the
    cap, as the endpoint answers what it cannot run); the open ones go on, and ending one
    makes room."""
    served = serve(args=("--sandbox-fusion-max-sessions", "2"))  # as `tangram serve` users set it
    code = {"code": "print('in')", "language": "python"}
    for name in ("s1", "s2"):
        assert post(served.url, code | {"session_id": name}).json()["status"] == "Success"
    refused = post(served.url, code | {"session_id": "s3"})
    assert refused.status_code == 200
    assert refused.json()["status"] == "SandboxError" and "max_sessions" in refused.json()["message"]
    assert post(served.url, code | {"session_id": "s1"}).json()["status"] == "Success"
    assert post(served.url, code).json()["status"] == "Success"  # no session: not counted
    ended = requests.post(served.url + "/end_session", json={"session_id": "s1"}, timeout=10,
                          headers={"Connection": "close"}).json()
    assert ended["ended"] is True
    assert post(served.url, code | {"session_id": "s3"}).json()["status"] == "Success"


def test_answers_over_max_answer_are_refused_and_big_ones_stream(serve: Callable[..., Served]) -> None:
    served = serve(options={"max_answer": 8 << 20})
    body = {"code": big_file_code(5), "language": "python", "fetch_files": ["big"]}
    answer = post(served.url, body)
    assert answer.status_code == 200 and base64.b64decode(answer.json()["files"]["big"]) == b"x" * (5 << 20)
    sock = socket.create_connection(served.address)  # HTTP/1.0: no chunked encoding, the body ends with the connection
    sock.sendall(raw_request(json.dumps(body).encode(), version="1.0"))
    status, _, data = read_answer(sock, timeout=60)
    sock.close()
    assert status == 200 and len(json.loads(data)["files"]["big"]) == len(b64(b"x" * (5 << 20)))
    over = post(served.url, {"code": big_file_code(7) + "\nprint('made')", "language": "python",
                             "fetch_files": ["big"]}).json()
    assert over["status"] == "SandboxError" and "max_answer" in over["message"] and "'big'" in over["message"]
    assert over["files"] == {} and over["run_result"]["stdout"] == "made\n"


def test_an_answer_sent_a_piece_at_a_time_is_json_dumps_text() -> None:
    """The pieces a big answer is encoded in join into json.dumps's text, escapes and all
    (a long string cut anywhere: each character escapes on its own)."""
    from tangram.server.sandbox_fusion import PIECE, _json_pieces

    answer = {"status": "Success", "files": {"big": "x" * (3 * PIECE + 7), "\u00e9": "\u20ac\ud800\"\n" * PIECE},
              "run_result": {"stdout": "\U0001F600" * (PIECE + 1), "return_code": 0, "execution_time": 0.5},
              "compile_result": None, "list": [True, None, 1.5, "a" * (PIECE + 1)]}
    pieces = list(_json_pieces(answer))
    assert "".join(pieces) == json.dumps(answer)
    assert max(len(piece) for piece in pieces) <= 12 * PIECE  # a piece: PIECE characters, each escaped at most 12 long


def test_a_client_that_does_not_read_its_answer_is_dropped(serve: Callable[..., Served]) -> None:
    """An answer its client does not take within client_timeout: the connection is
    closed, and with it the answer (the server's descriptors back where they were)."""
    served = serve(options={"client_timeout": 1.0})
    assert healthy(served)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect(served.address)
    sock.sendall(raw_request(json.dumps({"code": big_file_code(30), "language": "python",
                                         "fetch_files": ["big"]}).encode()))
    time.sleep(8)
    received, head = 0, b""
    sock.settimeout(10)
    try:
        while chunk := sock.recv(1 << 20):
            head = head or chunk[:200]
            received += len(chunk)
    except ConnectionResetError:
        pass
    sock.close()
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()  # the big answer, sent a piece at a time
    assert received < len(b64(b"x" * (30 << 20)))  # ... and cut off
    assert eventually(lambda: served.connections() == 0), served.connections()
    assert healthy(served)


def test_an_answer_not_of_run_codes_shape_is_a_sandbox_error() -> None:
    """Code in the worker can send any plain data as the action's result: the endpoint and
    the adapters take only a run_code answer's shape, else a SandboxError (not a 500)."""
    from tangram.runtime.sandbox.run_code import checked_answer, checked_timed_answer, sandbox_error

    good = sandbox_error("fine", files={"a.txt": "eA=="})
    assert checked_answer(good) is good
    assert checked_timed_answer((good, 0.5)) == (good, 0.5)
    for bad in ("text", ("a", "b"), {"status": 1}, {"status": "Success", "files": {"a": b"x"}},
                {"status": "Success", "run_result": ["x"]}, {"status": "Success", "message": None}):
        answer = checked_answer(bad)
        assert answer["status"] == "SandboxError" and "malformed" in answer["message"], bad
    assert checked_timed_answer("not a pair")[0]["status"] == "SandboxError"
