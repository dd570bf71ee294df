"""Sandbox Fusion's API served by tangram: the programs themselves (tangram.runtime.sandbox.run_code:
languages, compile steps, time and memory limits, files in and out, the status values),
the requests checked as Sandbox Fusion's server checks them, and `tangram serve
--sandbox-fusion-port` end to end: a real server subprocess on loopback, the real
`sandbox-fusion` client from PyPI, the exact requests veRL and SkyRL send parsed the way
they parse them, sessions, concurrent bursts, tokens and shutdown."""

from __future__ import annotations

import asyncio
import base64
import resource
import concurrent.futures
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import tangram
from tangram.runtime.sandbox.run_code import check_request, run_code

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

requests = pytest.importorskip("requests")

INVENTORY = """
[inventory]
nodes = [{ name = "n0", resources = { cpu = 2, memory = 8192 } }]
"""
HAS_GXX = shutil.which("g++") is not None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ------------------------------------------------------------------ the programs


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(**request: Any) -> dict[str, Any]:
    return run_code(check_request(request))


def test_python_reads_stdin_and_a_failure_is_failed(in_tmp: Path) -> None:
    ok = run(code="print(input() * 2)", language="python", stdin="ab")
    assert ok["status"] == "Success" and ok["message"] == "" and ok["compile_result"] is None
    assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["return_code"] == 0
    assert ok["run_result"]["stdout"] == "abab\n" and ok["run_result"]["stderr"] == ""
    assert ok["run_result"]["execution_time"] > 0 and ok["files"] == {} and ok["executor_pod_name"] is None
    bad = run(code="import sys; print('out'); sys.exit(4)", language="python")
    assert bad["status"] == "Failed" and bad["run_result"]["return_code"] == 4 and bad["run_result"]["stdout"] == "out\n"
    assert list(in_tmp.iterdir()) == []  # each request's directory is removed


def test_a_time_limit_kills_the_program_and_keeps_its_output(in_tmp: Path) -> None:
    out = run(code="import time\nprint('started', flush=True)\ntime.sleep(30)", language="python", run_timeout=0.5)
    assert out["status"] == "Failed"
    assert out["run_result"]["status"] == "TimeLimitExceeded" and out["run_result"]["return_code"] is None
    assert out["run_result"]["stdout"] == "started\n" and 0.5 <= out["run_result"]["execution_time"] < 10
    # A child left running in the background is killed with its group.
    left = run(code="sleep 30 & echo $!", language="bash")
    pid = int(left["run_result"]["stdout"])
    assert _dies(pid)


def _dies(pid: int, within: float = 5.0) -> bool:
    """The process is gone, or a zombie its new parent has not reaped yet (SIGKILL takes
    a moment to land)."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_memory_limit_is_the_programs_address_space(in_tmp: Path) -> None:
    out = run(code="x = bytearray(400 << 20)\nprint(len(x))", language="python", memory_limit_MB=200)
    assert out["status"] == "Failed" and out["run_result"]["return_code"] != 0
    assert "MemoryError" in out["run_result"]["stderr"]
    fits = run(code="x = bytearray(20 << 20)\nprint(len(x))", language="python", memory_limit_MB=200)
    assert fits["status"] == "Success"


@pytest.mark.parametrize("way", ["own limit", "prlimit", "preexec_fn"])
def test_each_way_of_setting_the_memory_limit_sets_it_soft_and_hard(in_tmp: Path, way: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit is the program's, soft and hard (it cannot raise it), whichever way the
    sandbox sets it (tangram.runtime.sandbox.inside_run_code._spawn); the sandbox's own limit is as before."""
    from tangram.runtime.sandbox import inside_run_code as _run_code

    if way == "own limit" and not _run_code._may_raise_limits():
        pytest.skip("this process lacks CAP_SYS_RESOURCE: it could not raise its own limit again")
    if way == "prlimit" and _run_code._prlimit() is None:
        pytest.skip("util-linux's prlimit is not installed")
    monkeypatch.setattr(_run_code, "_may_raise_limits", lambda: way == "own limit")
    if way == "preexec_fn":
        monkeypatch.setattr(_run_code, "_prlimit", lambda: None)
    before = resource.getrlimit(resource.RLIMIT_AS)
    seen = run(code="import resource\nprint(*resource.getrlimit(resource.RLIMIT_AS))", language="python",
               memory_limit_MB=300)
    assert seen["run_result"]["stdout"].split() == [str(300 << 20)] * 2
    out = run(code="x = bytearray(400 << 20)", language="python", memory_limit_MB=300)
    assert out["status"] == "Failed" and "MemoryError" in out["run_result"]["stderr"]
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_files_go_in_and_come_back(in_tmp: Path) -> None:
    out = run(code="cat data/in.txt; echo made > out.txt; exit 3", language="bash",
              files={"data/in.txt": b64(b"secret\n"), "skipped": None}, fetch_files=["out.txt", "missing.txt"])
    assert out["status"] == "Failed" and out["run_result"]["stdout"] == "secret\n"
    assert out["files"] == {"out.txt": b64(b"made\n")}  # fetched although the run failed; missing ones left out


@pytest.mark.skipif(not HAS_GXX, reason="no C++ compiler")
def test_cpp_compiles_then_runs(in_tmp: Path) -> None:
    ok = run(code='#include <cstdio>\nint main(){int a; scanf("%d", &a); printf("%d\\n", 2 * a);}', language="cpp",
             stdin="21")
    assert ok["status"] == "Success" and ok["compile_result"]["status"] == "Finished"
    assert ok["compile_result"]["return_code"] == 0 and ok["run_result"]["stdout"] == "42\n"
    broken = run(code="int main() { nope }", language="cpp")
    assert broken["status"] == "Failed" and broken["run_result"] is None
    assert broken["compile_result"]["return_code"] != 0 and "nope" in broken["compile_result"]["stderr"]


def test_languages_it_cannot_run_are_sandbox_errors(in_tmp: Path) -> None:
    unsupported = run(code="select 1", language="sql")
    assert unsupported["status"] == "SandboxError" and "'sql'" in unsupported["message"]
    assert unsupported["run_result"] is None
    if shutil.which("julia") is None:
        missing = run(code="println(1)", language="julia")
        assert missing["status"] == "SandboxError" and "julia is not installed" in missing["message"]


@pytest.mark.parametrize("request_, field", [
    ({"language": "python"}, "request.code"),
    ({"code": "1", "language": "cobol"}, "request.language"),
    ({"code": "1", "language": "python", "run_timeout": 0}, "request.run_timeout"),
    ({"code": "1", "language": "python", "compile_timeout": "10"}, "request.compile_timeout"),
    ({"code": "1", "language": "python", "memory_limit_MB": 0}, "request.memory_limit_MB"),
    ({"code": "1", "language": "python", "stdin": 5}, "request.stdin"),
    ({"code": "1", "language": "python", "files": {"a": "not base64!"}}, "request.files['a']"),
    ({"code": "1", "language": "python", "files": {"/etc/passwd": b64(b"x")}}, "request.files['/etc/passwd']"),
    ({"code": "1", "language": "python", "fetch_files": ["../x"]}, "request.fetch_files[0]"),
    ([1, 2], "request"),
    # not silently "none": only null (or leaving it out) is
    ({"code": "1", "language": "python", "files": False}, "request.files"),
    ({"code": "1", "language": "python", "files": ""}, "request.files"),
    ({"code": "1", "language": "python", "files": []}, "request.files"),
    ({"code": "1", "language": "python", "fetch_files": 0}, "request.fetch_files"),
    ({"code": "1", "language": "python", "fetch_files": ""}, "request.fetch_files"),
    ({"code": "1", "language": "python", "fetch_files": {}}, "request.fetch_files"),
    # paths that name no file, or one the sandbox could not make
    ({"code": "1", "language": "python", "files": {".": "eA=="}}, "request.files['.']"),
    ({"code": "1", "language": "python", "files": {"d/": "eA=="}}, "request.files['d/']"),
    ({"code": "1", "language": "python", "files": {"d/.": "eA=="}}, "request.files['d/.']"),
    ({"code": "1", "language": "python", "files": {"a": "eA==", "a/b": "eA=="}}, "request.files['a/b']"),
    ({"code": "1", "language": "python", "files": {"a/b": "eA==", "a": "eA=="}}, "request.files['a']"),
    ({"code": "1", "language": "python", "files": {"a": "eA==", "./a": "eA=="}}, "request.files['./a']"),
    ({"code": "1", "language": "python", "files": {"main.py/x": "eA=="}}, "request.files['main.py/x']"),
    ({"code": "1", "language": "python", "files": {"a/" * 3000 + "x": "eA=="}},
     f"request.files[{'a/' * 3000 + 'x'!r}]"),
    ({"code": "1", "language": "python", "files": {"n" * 300: "eA=="}}, f"request.files[{'n' * 300!r}]"),
    ({"code": "1", "language": "python", "fetch_files": ["."]}, "request.fetch_files[0]"),
    ({"code": "1", "language": "python", "fetch_files": ["ok", "d/"]}, "request.fetch_files[1]"),
    # text that is not Unicode (a lone surrogate, which JSON's \\uXXXX escapes can carry)
    ({"code": "print('\ud800')", "language": "python"}, "request.code"),
    ({"code": "1", "language": "python", "stdin": "\udc00"}, "request.stdin"),
    ({"code": "1", "language": "python", "files": {"\ud800": "eA=="}}, "request.files['\\ud800']"),
    ({"code": "1", "language": "python", "fetch_files": ["\ud800"]}, "request.fetch_files[0]"),
])
def test_requests_are_checked_field_by_field(request_: Any, field: str) -> None:
    with pytest.raises(tangram.ValidationError) as e:
        check_request(request_)
    assert e.value.field == field


def test_what_a_refusal_says() -> None:
    """It shows the value as sent (not as converted), and names the path and the reason."""
    with pytest.raises(tangram.ValidationError) as e:
        check_request({"code": "1", "language": "python", "memory_limit_MB": 1e300})
    assert "1e+300" in e.value.reason and "1000000" not in e.value.reason
    with pytest.raises(tangram.ValidationError) as e:
        check_request({"code": "1", "language": "python", "files": {"a": "eA==", "a/b": "eA=="}})
    assert "'a'" in e.value.reason and "'a/b'" in e.value.reason
    with pytest.raises(tangram.ValidationError) as e:
        check_request({"code": "1", "language": "python", "files": {"d/": "eA=="}})
    assert "'d/'" in e.value.reason and "directory" in e.value.reason
    with pytest.raises(tangram.ValidationError) as e:
        check_request({"code": "x = '\ud800'", "language": "python"})
    assert "surrogate" in e.value.reason and "position 5" in e.value.reason
    # paths that do name a file inside the directory are taken as they are
    ok = check_request({"code": "1", "language": "python", "files": {"./a": "eA==", "d//b": "eA==", "c/./e": None},
                        "fetch_files": ["./out.txt", "d/x"]})
    assert set(ok["files"]) == {"./a", "d//b"} and ok["fetch_files"] == ["./out.txt", "d/x"]


def test_a_request_takes_sandbox_fusions_defaults() -> None:
    checked = check_request({"code": "1", "language": "python", "unknown_field": 1, "memory_limit_MB": None})
    assert checked["compile_timeout"] == checked["run_timeout"] == 10.0 and checked["memory_limit_MB"] == -1
    assert checked["stdin"] is None and checked["files"] == {} and checked["fetch_files"] == []


# ------------------------------------------------------------------ the endpoint


class Endpoint:
    """`tangram serve --sandbox-fusion-port 0` as a subprocess: `url` is its HTTP root."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--sandbox-fusion-port", "0",
                "--config", str(config), *args]
        environ = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}
        environ.update(env or {})
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
        first = self._readline()  # then the next line at once (it may be in the pipe's buffer already)
        lines = [first, self.proc.stdout.readline() if first and self.proc.stdout else ""]
        match = re.search(r"Sandbox Fusion API on (http://\S+)/run_code", lines[-1])
        if match is None:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"no Sandbox Fusion address from tangram serve: {lines!r}; stderr: {self.stderr}")
        self.url = match.group(1)
        self.stderr = ""

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30.0)
        return self.proc.stdout.readline() if ready else ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, self.stderr = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
        return self.proc.returncode


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    config = tmp_path_factory.mktemp("sf") / "server.toml"
    config.write_text(INVENTORY)
    served = Endpoint(config, "--grace", "5")
    yield served
    assert served.stop() == 0, served.stderr


def test_the_sandbox_fusion_client_runs_against_it(endpoint: Endpoint) -> None:
    """The `sandbox-fusion` package from PyPI, unchanged: its run_code and RunCodeRequest."""
    sandbox_fusion = pytest.importorskip("sandbox_fusion")
    from sandbox_fusion import RunCodeRequest, RunStatus

    ok = sandbox_fusion.run_code(RunCodeRequest(code="print(input()[::-1])", language="python", stdin="olleh"),
                                 endpoint=endpoint.url, max_attempts=1)
    assert ok.status == RunStatus.Success and ok.run_result.stdout == "hello\n" and ok.run_result.return_code == 0
    files = sandbox_fusion.run_code(RunCodeRequest(code="open('b.txt', 'w').write(open('a.txt').read().upper())",
                                                   language="python", files={"a.txt": b64(b"abc")},
                                                   fetch_files=["b.txt"]), endpoint=endpoint.url, max_attempts=1)
    assert files.status == RunStatus.Success and base64.b64decode(files.files["b.txt"]) == b"ABC"
    failed = sandbox_fusion.run_code(RunCodeRequest(code="raise SystemExit(2)", language="python"),
                                     endpoint=endpoint.url, max_attempts=1)
    assert failed.status == RunStatus.Failed and failed.run_result.return_code == 2


def test_the_clients_concurrent_and_async_calls_run_against_it(endpoint: Endpoint) -> None:
    """The client's way of sending many requests (run_concurrent: a thread pool over
    POST /run_code, its batch) and its async client (aiohttp)."""
    sandbox_fusion = pytest.importorskip("sandbox_fusion")
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code_async, run_concurrent

    requests_ = [RunCodeRequest(code=f"print({i} * {i})", language="python") for i in range(12)]
    answers = run_concurrent(sandbox_fusion.run_code, kwargs=[{"request": r, "endpoint": endpoint.url,
                                                               "max_attempts": 1} for r in requests_], concurrency=6)
    assert [a.run_result.stdout for a in answers] == [f"{i * i}\n" for i in range(12)]

    async def both() -> list[Any]:
        return await asyncio.gather(*(run_code_async(r, endpoint=endpoint.url, max_attempts=1) for r in requests_[:4]))

    answers = asyncio.run(both())
    assert all(a.status == RunStatus.Success for a in answers)
    assert [a.run_result.stdout for a in answers] == [f"{i * i}\n" for i in range(4)]


def verl_result(url: str, code: str, stdin: str | None, expected: str | None, language: str = "python",
                timeout: float = 10, memory_limit_mb: int = 1024) -> Any:
    """veRL's request and its reading of the answer, as in
    verl/utils/reward_score/sandbox_fusion/utils.py (call_sandbox_api, _process_single_case):
    True / False for a (wrong) answer, -1 sandbox error, -2 runtime error, -3 time limit,
    -4 compile error."""
    payload = json.dumps({"compile_timeout": timeout, "run_timeout": timeout, "code": code, "stdin": stdin,
                          "memory_limit_MB": memory_limit_mb, "language": language, "files": {}, "fetch_files": []})
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    response = requests.post(url + "/run_code", headers=headers, data=payload, timeout=timeout * 2 + 10)
    response.raise_for_status()
    api = response.json()
    status = api.get("status")
    compile_result, run_result = api.get("compile_result"), api.get("run_result")
    if status == "SandboxError":
        return -1
    if status == "Failed":
        if compile_result and (compile_result.get("status") in ("Error", "TimeLimitExceeded") or
                               compile_result.get("status") == "Finished" and compile_result.get("return_code") != 0):
            return -4
        if run_result:
            if run_result.get("status") == "TimeLimitExceeded":
                return -3
            if run_result.get("status") == "Error" or (run_result.get("status") == "Finished"
                                                        and run_result.get("return_code") != 0):
                return -2
        return -1
    if status == "Success" and run_result and run_result.get("status") == "Finished":
        stdout = run_result.get("stdout", "")
        return expected is None or stdout.rstrip("\n") == str(expected).rstrip("\n")
    return -1


def test_verls_requests_read_as_verl_reads_them(endpoint: Endpoint) -> None:
    url = endpoint.url
    assert verl_result(url, "print(int(input()) + 1)", "41", "42") is True
    assert verl_result(url, "print(int(input()) + 2)", "41", "42") is False
    assert verl_result(url, "raise ValueError('boom')", None, None) == -2
    assert verl_result(url, "while True: pass", None, None, timeout=1) == -3
    if HAS_GXX:
        assert verl_result(url, "int main() { syntax error }", None, None, language="cpp") == -4
    # The code tool hands the model stdout + stderr: both strings on a finished run.
    payload = {"compile_timeout": 30, "run_timeout": 30, "code": "import sys; sys.stderr.write('e')",
               "stdin": None, "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": []}
    run_result = requests.post(url + "/run_code", json=payload, timeout=60).json()["run_result"]
    assert run_result["stdout"] + run_result["stderr"] == "e"


def test_skyrls_verifier_request_reads_as_skyrl_reads_it(endpoint: Endpoint) -> None:
    """SkyRL's coder1 verifier (sandboxfusion_exec.py): {language, code, stdin, run_timeout},
    parsed into its copy of RunCodeResponse (status one of three strings, message required)."""
    response = requests.post(endpoint.url + "/run_code", json={"language": "python", "code": "print(input())",
                                                               "stdin": "x", "run_timeout": 30}, timeout=32)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] in ("Success", "Failed", "SandboxError") and isinstance(body["message"], str)
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "x\n"
    assert requests.get(endpoint.url + "/", timeout=5).status_code == 200  # its liveness check


def test_health_and_bad_requests(endpoint: Endpoint) -> None:
    assert requests.get(endpoint.url + "/v1/ping", timeout=5).json() == "pong"
    unknown = requests.post(endpoint.url + "/run_code", json={"code": "1", "language": "cobol"}, timeout=5)
    assert unknown.status_code == 422
    detail = unknown.json()["detail"][0]
    assert detail["loc"] == ["body", "language"] and "cobol" in detail["msg"]
    not_json = requests.post(endpoint.url + "/run_code", data="{", timeout=5)
    assert not_json.status_code == 422 and not_json.json()["detail"][0]["type"] == "json_invalid"
    assert requests.post(endpoint.url + "/run_code", json={"language": "python"}, timeout=5).status_code == 422


def test_a_session_keeps_its_sandbox_and_a_request_without_one_gets_a_fresh_one(endpoint: Endpoint) -> None:
    post = lambda body, **kw: requests.post(endpoint.url + "/run_code", json=body, timeout=30, **kw).json()  # noqa: E731
    session = {"X-Tangram-Session": "trajectory-7"}
    write = {"code": "open('state.txt', 'w').write('kept')", "language": "python"}
    read = {"code": "import os; print(open('state.txt').read() if os.path.exists('state.txt') else 'none')",
            "language": "python"}
    assert post(write, headers=session)["status"] == "Success"
    assert post(read, headers=session)["run_result"]["stdout"] == "kept\n"
    assert post(read | {"session_id": "trajectory-7"})["run_result"]["stdout"] == "kept\n"  # the field says the same
    assert post(read)["run_result"]["stdout"] == "none\n"  # no session: a sandbox of its own
    assert post(read, headers={"X-Tangram-Session": "another"})["run_result"]["stdout"] == "none\n"
    ended = requests.post(endpoint.url + "/end_session", json={"session_id": "trajectory-7"}, timeout=10).json()
    assert ended == {"session_id": "trajectory-7", "ended": True}
    assert post(read, headers=session)["run_result"]["stdout"] == "none\n"  # a new sandbox for the id


# A session may name its home node (its first request); naming another later, or a home
# without a session, is refused; an unknown node is the action's in-band error.
def test_a_session_names_its_home_node(endpoint: Endpoint) -> None:
    url = endpoint.url + "/run_code"
    code = {"code": "print('home')", "language": "python"}
    home = requests.post(url, json=code | {"session_id": "homed", "node": "n0"}, timeout=30).json()
    assert home["run_result"]["stdout"] == "home\n"
    again = requests.post(url, json=code, headers={"X-Tangram-Session": "homed", "X-Tangram-Node": "n0"}, timeout=30)
    assert again.json()["status"] == "Success"
    moved = requests.post(url, json=code | {"session_id": "homed", "node": "n1"}, timeout=30)
    assert moved.status_code == 422 and "lives on n0" in moved.json()["detail"][0]["msg"]
    alone = requests.post(url, json=code | {"node": "n0"}, timeout=30)
    assert alone.status_code == 422 and alone.json()["detail"][0]["loc"] == ["body", "node"]
    unknown = requests.post(url, json=code | {"session_id": "nowhere", "node": "n9"}, timeout=30).json()
    assert unknown["status"] == "SandboxError" and "n9" in unknown["message"]


# The sandbox worker a program runs in: its parent's pid, and its PID namespace (namespaced
# sandboxes each have their own, where every worker has the same small pid).
WORKER = "os.readlink('/proc/self/ns/pid') + ':' + str(os.getppid())"


def parent_pids(url: str, n: int) -> list[str]:
    """The sandbox worker each of n requests without a session ran in (its program's parent)."""
    body = {"code": f"import os; open('left.txt', 'w').write('x'); print({WORKER}, sorted(os.listdir('.')))",
            "language": "python"}
    answers = [requests.post(url + "/run_code", json=body, timeout=30).json()["run_result"]["stdout"] for _ in range(n)]
    assert all(a.endswith("['left.txt', 'main.py']\n") for a in answers), answers  # a fresh directory every time
    return [a.split()[0] for a in answers]


def test_requests_without_a_session_reuse_pooled_sandboxes(endpoint: Endpoint) -> None:
    assert len(set(parent_pids(endpoint.url, 4))) == 1


def test_a_pooled_sandbox_is_scrubbed_between_requests(endpoint: Endpoint) -> None:
    """What a request leaves in its pooled sandbox is gone for the next: files beside its
    directory, and a process that detached itself (a new session, its parent exited)."""
    leave = ("import os, subprocess\n"
             "open('../escaped.txt', 'w').write('x')\n"
             "p = subprocess.Popen(['sh', '-c', 'sleep 300 >/dev/null & echo $!'], start_new_session=True, "
             "stdout=subprocess.PIPE, text=True)\n"
             f"print({WORKER}, p.stdout.readline().strip())\n")
    post = lambda code: requests.post(endpoint.url + "/run_code", json={"code": code, "language": "python"},  # noqa: E731
                                      timeout=30).json()["run_result"]["stdout"].split()
    worker, detached = post(leave)
    # the detached process, seen from the same sandbox (its pid is the sandbox's own under namespaces)
    look = (f"import os, time; time.sleep(0.5); print({WORKER}, os.path.exists('../escaped.txt'), "
            f"os.path.exists('/proc/{detached}/cmdline') and b'sleep' in open('/proc/{detached}/cmdline', 'rb').read(), "
            "sorted(os.listdir('..')))")
    again, exists, alive, *listing = post(look)
    assert again == worker and exists == "False"  # the same pooled sandbox, emptied
    assert alive == "False"  # the detached process was killed


def test_fresh_sandboxes_when_asked(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text(INVENTORY)
    served = Endpoint(config, "--grace", "0", "--sandbox-fusion-fresh")
    try:
        assert len(set(parent_pids(served.url, 3))) == 3
    finally:
        assert served.stop() == 0, served.stderr


def test_a_burst_of_concurrent_requests_all_answer_from_as_many_sandboxes_as_run_at_once(endpoint: Endpoint) -> None:
    """48 requests, 24 at a time, on 2 cores at one core each: 2 run at once, so 2 pooled
    sandboxes serve them all (each program prints its parent, the sandbox's worker)."""
    def one(i: int) -> Any:
        body = {"code": f"import os\nprint(sum(range({i} * 1000)))\nprint({WORKER})", "language": "python"}
        return i, requests.post(endpoint.url + "/run_code", json=body, timeout=120).json()

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(one, range(48)))
    workers = set()
    for i, answer in answers:
        total, worker = answer["run_result"]["stdout"].split()
        assert answer["status"] == "Success" and total == f"{sum(range(i * 1000))}"
        workers.add(worker)
    assert len(workers) <= 2


def test_a_token_is_required_when_set(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text(INVENTORY)
    served = Endpoint(config, "--grace", "0", env={"TANGRAM_TOKEN": "s3cret"})
    try:
        body = {"code": "print(1)", "language": "python"}
        assert requests.post(served.url + "/run_code", json=body, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert requests.post(served.url + "/run_code", json=body, headers=wrong, timeout=30).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert requests.post(served.url + "/run_code", json=body, headers=good, timeout=30).json()["status"] == "Success"
        # veRL and SkyRL take a URL, not headers: the token as the path's first segment.
        assert requests.post(served.url + "/s3cret/run_code", json=body, timeout=30).json()["status"] == "Success"
        assert requests.get(served.url + "/s3cret/v1/ping", timeout=5).json() == "pong"
        assert requests.get(served.url + "/nope/v1/ping", timeout=5).status_code == 401
    finally:
        assert served.stop() == 0, served.stderr


def test_shutdown_answers_a_running_request(tmp_path: Path) -> None:
    """SIGTERM with no grace: the running request's action is cancelled and its client
    gets a SandboxError, not a dropped connection."""
    config = tmp_path / "server.toml"
    config.write_text(INVENTORY)
    served = Endpoint(config, "--grace", "0")
    body = {"code": "import time; print('up', flush=True); time.sleep(60)", "language": "python", "run_timeout": 120}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, served.url + "/run_code", json=body, timeout=60)
        try:
            ping = requests.get(served.url + "/v1/ping", timeout=5)  # the server is up and the request in
            assert ping.status_code == 200
            time.sleep(1.0)
        finally:
            code = served.stop()
        answer = pending.result(timeout=30).json()
    assert code == 0, served.stderr
    assert answer["status"] == "SandboxError" and "cancel" in answer["message"]


def test_the_cores_each_request_is_guaranteed(tmp_path: Path) -> None:
    """--sandbox-fusion-cpu: each request's action demands that many cores (it may use
    more nobody else is guaranteed); a value the CPU manager cannot take is refused at start."""
    config = tmp_path / "server.toml"
    config.write_text(INVENTORY)
    served = Endpoint(config, "--grace", "0", "--sandbox-fusion-cpu", "0.5")
    try:
        body = {"code": "import os; print(os.environ['TANGRAM_GRANT'])", "language": "python"}
        answer = requests.post(served.url + "/run_code", json=body, timeout=30).json()
        assert answer["status"] == "Success" and float(answer["run_result"]["stdout"]) == 0.5
    finally:
        assert served.stop() == 0, served.stderr
    refused = subprocess.run([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--sandbox-fusion-port",
                              "0", "--sandbox-fusion-cpu", "0", "--config", str(config)], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "sandbox_fusion.cpu" in refused.stderr
