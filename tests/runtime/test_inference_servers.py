"""Inference servers as GPU services (tangram.runtime.managers.inference), against real server
processes on loopback: the stand-in (stand_in_server.py) speaks vLLM's and SGLang's
protocols for health, sleep, wake-up and scoring. Every hook directly, for both protocols:
start on the device's UUID, concurrent scoring in input order, sleep and wake-up, cold
start onto another device, startup failures and timeouts, error answers, a server that
dies, stopping the whole process group, attaching to a running server; then two servers
through the orchestrator, which evicts one to restore the other on a shared device."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tangram import Call, Inventory, Orchestrator, Service, ValidationError
from tangram.devices import GpuDevice
from tangram.runtime.managers.gpu import GpuManager
from tangram.runtime.managers.inference import InferenceServer, InferenceServerError, ServerHandle, SglangServer, VllmServer

STAND_IN = Path(__file__).with_name("stand_in_server.py")
PROTOCOLS = ["vllm", "sglang"]
CLASSES: dict[str, type[InferenceServer]] = {"vllm": VllmServer, "sglang": SglangServer}
SLEEP_FLAG = {"vllm": "--enable-sleep-mode", "sglang": "--enable-memory-saver"}
LOAD_SECONDS = 0.2


def device(index: int) -> GpuDevice:
    return GpuDevice(index, f"GPU-fake-{index}", "Fake GPU", 1000.0, index, source="fake")


def command(protocol: str, *extra: str, flag: bool = True) -> list[str]:
    return [sys.executable, str(STAND_IN), "--host", "{host}", "--port", "{port}", "--protocol", protocol,
            "--load-seconds", str(LOAD_SECONDS), *([SLEEP_FLAG[protocol]] if flag else []), *extra]


def score(answer: dict[str, Any]) -> tuple[float, str]:
    """(score, device) from either protocol's answer."""
    value = answer["data"][0]["data"][0] if "data" in answer else answer["embedding"][0]
    return value, answer["device"]


def stats(handle: ServerHandle) -> dict[str, Any]:
    with urllib.request.urlopen(f"{handle.url}/stats", timeout=5) as answer:
        return json.loads(answer.read())


def running_stand_in(protocol: str, env: dict[str, str],
                     log: Any = subprocess.DEVNULL) -> tuple[subprocess.Popen[bytes], str]:
    """A stand-in started by the test itself (not by tangram), and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a.replace("{host}", "127.0.0.1").replace("{port}", str(port)) for a in command(protocol)]
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def gone(pid: int) -> bool:
    """Whether `pid` has ended: no such process, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


Start = Callable[..., tuple[InferenceServer, ServerHandle]]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """start(protocol, *stand-in options, on=device, **server options): a server loaded on
    `on` (GPU-fake-0 by default); every one is closed after the test."""
    loaded: list[tuple[InferenceServer, ServerHandle]] = []

    def start(protocol: str, *extra: str, on: GpuDevice | None = None, flag: bool = True,
              **options: Any) -> tuple[InferenceServer, ServerHandle]:
        options.setdefault("response", score)
        options.setdefault("stop_timeout", 2.0)
        options.setdefault("startup_timeout", 20.0)
        if "log" not in options:
            options["log"] = tmp_path / f"{protocol}-{len(loaded)}.log"
        server = CLASSES[protocol](command=command(protocol, *extra, flag=flag), **options)
        handle = server.load(device(0) if on is None else on)
        loaded.append((server, handle))
        return server, handle

    yield start
    for server, handle in loaded:
        server.close(handle)
    assert all(handle.pid is None or wait_gone(handle.pid) for _, handle in loaded)


# ------------------------------------------------------------------ hooks, directly


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_load_starts_the_server_on_the_devices_uuid(start: Start, protocol: str) -> None:
    server, handle = start(protocol, on=device(1), env={"STAND_IN_TAG": "rm-1"})
    seen = stats(handle)
    assert seen["cuda_visible_devices"] == "GPU-fake-1" == handle.device_uuid
    dev_mode = "1" if protocol == "vllm" else os.environ.get("VLLM_SERVER_DEV_MODE")  # only vLLM's needs it
    assert seen["env"] == {"TANGRAM_GPU_MEMORY_MIB": "1000", "STAND_IN_TAG": "rm-1", "VLLM_SERVER_DEV_MODE": dev_mode}
    assert seen["pid"] == handle.pid and seen["loaded"] and not handle.attached
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", handle.url)
    assert handle.last_start_seconds is not None and handle.last_start_seconds >= LOAD_SECONDS
    assert server.healthy(handle) and server.handles == [handle]
    assert handle.log_path is not None and "starting" in Path(handle.log_path).read_text()
    assert (handle.sleeps, handle.wakes, handle.cold_starts, handle.asleep) == (0, 0, 0, False)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_batch_runs_concurrently_and_keeps_input_order(start: Start, protocol: str) -> None:
    server, handle = start(protocol, "--score-seconds", "0.1", concurrency=6)
    texts = ["x" * n for n in range(1, 17)]
    began = time.monotonic()
    assert server.batch(handle, texts) == [(float(n), "GPU-fake-0") for n in range(1, 17)]
    elapsed = time.monotonic() - began
    seen = stats(handle)
    assert seen["scored"] == 16 and 1 < seen["max_concurrent"] <= 6
    assert elapsed < 16 * 0.1  # not one after another
    # A dict input is the request body as is; `request` builds it otherwise.
    key = "input" if protocol == "vllm" else "text"
    assert server.batch(handle, [{key: "abc"}]) == [(3.0, "GPU-fake-0")]
    custom = CLASSES[protocol](url=handle.url, request=lambda x: {key: x * 2}, response=lambda a: score(a)[0])
    assert custom.batch(handle, ["ab", "c"]) == [4.0, 2.0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_offload_sleeps_and_restore_wakes(start: Start, protocol: str) -> None:
    server, handle = start(protocol, "--wake-seconds", "0.1")
    pid = handle.pid
    server.offload(handle)
    assert handle.asleep and handle.sleeps == 1 and handle.last_sleep_seconds is not None
    with pytest.raises(InferenceServerError) as e:
        server.batch(handle, ["abc"])
    assert e.value.status == 503 and "asleep" in str(e.value) and e.value.field.endswith(server.score_path)
    server.restore(handle, device(0))
    assert not handle.asleep and handle.wakes == 1 and handle.cold_starts == 0 and handle.pid == pid
    assert handle.last_wake_seconds is not None and handle.last_wake_seconds >= 0.1
    assert server.batch(handle, ["abc", "de"]) == [(3.0, "GPU-fake-0"), (2.0, "GPU-fake-0")]
    seen = stats(handle)
    assert (seen["sleeps"], seen["wakes"], seen["asleep"]) == (1, 1, False)
    if protocol == "vllm":
        assert seen["sleep_levels"] == [1]
    server.restore(handle, device(0))  # awake already: nothing to do
    assert stats(handle)["wakes"] == 1


def test_vllm_sleep_level_two(start: Start) -> None:
    server, handle = start("vllm", sleep_level=2)
    server.offload(handle)
    server.restore(handle, device(0))
    assert stats(handle)["sleep_levels"] == [2]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_restore_onto_another_device_is_a_cold_start(start: Start, protocol: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    server, handle = start(protocol)
    first = handle.pid
    assert first is not None
    server.offload(handle)
    with caplog.at_level(logging.WARNING, logger="tangram.gpu"):
        server.restore(handle, device(1))
        assert wait_gone(first)  # the process on device 0 was stopped
        assert handle.pid != first and handle.device_uuid == "GPU-fake-1" and not handle.asleep
        assert handle.cold_starts == 1 and handle.wakes == 0
        assert handle.last_wake_seconds is not None and handle.last_wake_seconds >= LOAD_SECONDS
        seen = stats(handle)
        assert seen["cuda_visible_devices"] == "GPU-fake-1" and seen["pid"] == handle.pid and seen["wakes"] == 0
        assert server.batch(handle, ["abcd"]) == [(4.0, "GPU-fake-1")]
        server.offload(handle)
        server.restore(handle, device(0))  # and back: another cold start, warned of once only
    assert handle.cold_starts == 2 and stats(handle)["cuda_visible_devices"] == "GPU-fake-0"
    warnings = [r for r in caplog.records if "cold start" in r.getMessage()]
    assert len(warnings) == 1 and "movable=False" in warnings[0].getMessage()
    assert handle.log_path is not None and Path(handle.log_path).read_text().count("--- tangram: starting") == 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_that_exits_at_startup_reports_its_log(start: Start, protocol: str) -> None:
    with pytest.raises(InferenceServerError) as e:
        start(protocol, "--crash-at-startup", "3")
    assert e.value.field == "command" and e.value.exit_code == 3
    assert "exited with code 3" in str(e.value) and "CUDA out of memory" in str(e.value)
    assert "CUDA out of memory" in e.value.log_tail


def test_command_that_does_not_exist(tmp_path: Path) -> None:
    server = VllmServer(command=["/nonexistent/vllm", "serve", "--enable-sleep-mode"], log=tmp_path / "vllm.log")
    with pytest.raises(InferenceServerError) as e:
        server.load(device(0))
    assert e.value.field == "command" and "/nonexistent/vllm" in str(e.value)
    assert server.handles == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_startup_timeout_stops_the_server(start: Start, protocol: str, tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    began = time.monotonic()
    with pytest.raises(InferenceServerError) as e:
        start(protocol, "--load-seconds", "60", startup_timeout=1.0, log=log)
    assert time.monotonic() - began < 10
    assert e.value.field == "startup_timeout" and "within 1 s" in str(e.value)
    found = re.search(r"\(pid (\d+)\) starting", log.read_text())
    assert found is not None and "starting" in e.value.log_tail
    assert wait_gone(int(found.group(1)))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_error_answer_fails_the_batch(start: Start, protocol: str) -> None:
    server, handle = start(protocol, "--fail-after", "2")
    with pytest.raises(InferenceServerError) as e:
        server.batch(handle, ["a", "b", "c", "d"])
    assert e.value.status == 500 and "answered 500" in str(e.value) and "stand-in failure" in str(e.value)
    assert e.value.field == f"POST {server.score_path}"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_that_dies_fails_the_batch_and_restarts_on_restore(start: Start, protocol: str) -> None:
    server, handle = start(protocol, "--exit-after", "1")
    assert server.batch(handle, ["ab"]) == [(2.0, "GPU-fake-0")]
    with pytest.raises(InferenceServerError) as e:
        server.batch(handle, ["abc"])
    assert e.value.exit_code == 4 and "exited with code 4" in str(e.value)
    assert "exiting at scoring request 2" in e.value.log_tail
    assert not server.healthy(handle)
    with pytest.raises(InferenceServerError) as e:  # later calls say the same at once
        server.offload(handle)
    assert e.value.exit_code == 4
    dead = handle.pid
    server.restore(handle, device(0))  # a restore starts it afresh
    assert handle.pid != dead and handle.cold_starts == 1 and server.healthy(handle)
    assert server.batch(handle, ["x"]) == [(1.0, "GPU-fake-0")]


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_close_stops_the_process_group(start: Start, ignore_sigterm: bool) -> None:
    options = ["--spawn-child"] + (["--ignore-sigterm"] if ignore_sigterm else [])
    stop_timeout = 0.5 if ignore_sigterm else 30.0
    server, handle = start("vllm", *options, stop_timeout=stop_timeout, log=None)  # a temporary log
    pid, child = handle.pid, stats(handle)["child_pid"]
    assert pid is not None and child is not None and not gone(child)
    began = time.monotonic()
    server.close(handle)
    elapsed = time.monotonic() - began
    assert handle.process is not None and handle.process.returncode == (-signal.SIGKILL if ignore_sigterm else 0)
    assert gone(pid) and wait_gone(child)  # the server and what it started
    assert elapsed >= stop_timeout if ignore_sigterm else elapsed < stop_timeout  # SIGKILL after stop_timeout
    assert handle.closed and handle.log_file is None and not server.healthy(handle)
    assert handle.log_path is not None and "model loaded" in Path(handle.log_path).read_text()  # kept after close
    os.unlink(handle.log_path)
    server.close(handle)  # idempotent
    with pytest.raises(InferenceServerError) as e:
        server.offload(handle)
    assert e.value.field == "handle"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_attached_server_is_neither_started_nor_stopped(protocol: str, tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-fake-0", "VLLM_SERVER_DEV_MODE": "1"}
    with open(tmp_path / "attached.log", "wb") as log:
        process, url = running_stand_in(protocol, env, log)
    try:
        server = CLASSES[protocol](url=url + "/", response=score, startup_timeout=20)
        handle = server.load(device(0))  # waits until it is healthy
        assert handle.attached and handle.process is None and handle.pid is None
        assert handle.url == url and handle.log_path is None
        assert server.batch(handle, ["abc", "d"]) == [(3.0, "GPU-fake-0"), (1.0, "GPU-fake-0")]
        server.offload(handle)
        server.restore(handle, device(0))
        assert (handle.sleeps, handle.wakes) == (1, 1)
        server.offload(handle)
        with pytest.raises(InferenceServerError) as e:
            server.restore(handle, device(1))  # tangram cannot start it elsewhere
        assert e.value.field == "url" and "movable=False" in str(e.value)
        server.close(handle)
        assert process.poll() is None and stats(handle)["pid"] == process.pid  # still running
        assert server.log_tail(handle) == ""
    finally:
        process.terminate()
        process.wait(10)


def test_vllm_sleep_endpoints_need_dev_mode() -> None:
    """VllmServer sets VLLM_SERVER_DEV_MODE=1 for a server it starts; a server started
    without it answers 404, and the error says why."""
    process, url = running_stand_in("vllm", {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"})
    try:
        server = VllmServer(url=url, startup_timeout=20)
        handle = server.load(device(0))
        with pytest.raises(InferenceServerError) as e:
            server.offload(handle)
        assert e.value.status == 404 and "VLLM_SERVER_DEV_MODE=1" in str(e.value)
        assert e.value.field == "POST /sleep?level=1" and not handle.asleep
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_without_its_sleep_flag(start: Start, protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tangram.gpu"):
        server, handle = start(protocol, flag=False)
    assert any(SLEEP_FLAG[protocol] in r.getMessage() for r in caplog.records)
    with pytest.raises(InferenceServerError) as e:
        server.offload(handle)
    assert e.value.status == 500 and f"started without {SLEEP_FLAG[protocol]}" in str(e.value)
    assert not handle.asleep and handle.sleeps == 0


@pytest.mark.parametrize("options, field", [
    ({}, "command"),
    ({"command": ["x"], "url": "http://127.0.0.1:1"}, "command"),
    ({"command": "vllm serve m"}, "command"),
    ({"command": []}, "command"),
    ({"command": ["vllm", 3]}, "command"),
    ({"url": "127.0.0.1:8000"}, "url"),
    ({"url": "ftp://host:1"}, "url"),
    ({"url": "http://host:99999"}, "url"),
    ({"url": "http://h:1", "score_path": "pooling"}, "score_path"),
    ({"url": "http://h:1", "request": 3}, "request"),
    ({"url": "http://h:1", "response": "x"}, "response"),
    ({"url": "http://h:1", "concurrency": 0}, "concurrency"),
    ({"url": "http://h:1", "concurrency": True}, "concurrency"),
    ({"url": "http://h:1", "startup_timeout": 0}, "startup_timeout"),
    ({"url": "http://h:1", "request_timeout": float("nan")}, "request_timeout"),
    ({"url": "http://h:1", "stop_timeout": "soon"}, "stop_timeout"),
    ({"url": "http://h:1", "env": {"A": 1}}, "env"),
    ({"url": "http://h:1", "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
    ({"url": "http://h:1", "env": {"VLLM_SERVER_DEV_MODE": "0"}}, "env"),
    ({"url": "http://h:1", "log": 3}, "log"),
    ({"url": "http://h:1", "sleep_level": 3}, "sleep_level"),
])
def test_options_are_validated(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        VllmServer(**options)
    assert e.value.field == field
    VllmServer(url="http://h:1", env={"VLLM_SERVER_DEV_MODE": "1", "HF_HOME": "/models"})  # what it sets anyway


# ------------------------------------------------------------------ through the orchestrator


def test_two_servers_share_a_device_through_the_orchestrator(tmp_path: Path) -> None:
    """A vLLM and an SGLang stand-in on one 1,000 MiB device, each holding 600 MiB awake and
    100 MiB asleep: they never fit awake together, so the core evicts (puts to sleep) one
    to restore (wake up) the other, and every action gets its own server's answer."""
    servers = {"vllm": VllmServer(command=command("vllm", "--score-seconds", "0.02"), response=score,
                                  log=tmp_path / "vllm.log", stop_timeout=2),
               "sglang": SglangServer(command=command("sglang", "--score-seconds", "0.02"), response=score,
                                      log=tmp_path / "sglang.log", stop_timeout=2)}
    services = [Service(name, memory=600, restore_seconds=0.05, max_batch=8, asleep_memory=100, movable=False)
                for name in servers]
    inventory = Inventory.uniform(1, {"cpu": 2, "memory": 4096}, gpus=[1000], services=services)

    def call(service: str, text: str) -> Call:
        return Call(args=(text,), service=service, resources={}, kind="reward")

    async def main() -> None:
        gpu = GpuManager(services=servers, devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"gpu": gpu}) as orch:
            for service in ("vllm", "sglang", "vllm"):  # one phase each: the other sleeps
                texts = ["y" * n for n in range(1, 13)]
                assert await orch.map([call(service, t) for t in texts]) == [(float(len(t)), "GPU-fake-0")
                                                                              for t in texts]
            # Both at once: the core alternates the two, each action with its own server.
            calls = [call(s, "z" * n) for n in range(1, 9) for s in servers]
            assert await orch.map(calls) == [(float(n), "GPU-fake-0") for n in range(1, 9) for _ in servers]
            handles = {name: server.handles[0] for name, server in servers.items()}
            seen = {name: stats(h) for name, h in handles.items()}
            for name, h in handles.items():
                assert seen[name]["cuda_visible_devices"] == "GPU-fake-0" and h.cold_starts == 0
                assert seen[name]["sleeps"] == h.sleeps and seen[name]["wakes"] == h.wakes
            assert handles["vllm"].sleeps >= 1 and handles["vllm"].wakes >= 1  # evicted for sglang, then back
            assert handles["sglang"].sleeps >= 1
            assert handles["vllm"].asleep or handles["sglang"].asleep  # never both awake
            assert seen["vllm"]["scored"] == 12 + 12 + 8 and seen["sglang"]["scored"] == 12 + 8
            assert all(r.outcome == "ok" for r in orch.records)
        for h in handles.values():  # closed with the orchestrator
            assert h.closed and h.pid is not None and wait_gone(h.pid)

    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_server_that_dies_is_restarted_by_the_gpu_manager(protocol: str, tmp_path: Path) -> None:
    """Its process exits at the second scoring request: that action fails, the manager finds
    it unhealthy and starts it again on its device, and the next action is served."""
    server = CLASSES[protocol](command=command(protocol, "--exit-after", "1"), response=score,
                               log=tmp_path / "server.log", stop_timeout=2)
    service = Service("rm", memory=600, restore_seconds=0.05, max_batch=1, asleep_memory=100, movable=False)
    inventory = Inventory.uniform(1, {"cpu": 2, "memory": 4096}, gpus=[1000], services=[service])

    def call(text: str) -> Call:
        return Call(args=(text,), service="rm", resources={}, kind="reward")

    async def main() -> None:
        gpu = GpuManager(services={"rm": server}, devices="inventory")
        async with Orchestrator(inventory=inventory, default_managers=False, managers={"gpu": gpu}) as orch:
            assert await orch.run(call("ab")) == (2.0, "GPU-fake-0")
            first = server.handles[0].pid
            with pytest.raises(Exception, match="exited with code 4"):
                await orch.run(call("abc"))
            assert await orch.run(call("abcd")) == (4.0, "GPU-fake-0")  # on a new process
            assert len(server.handles) == 2 and server.handles[1].pid != first
            assert gpu.describe()["services"]["rm"]["restarts"] == 1
        assert wait_gone(server.handles[1].pid)

    asyncio.run(asyncio.wait_for(main(), 60))
