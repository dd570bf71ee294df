"""Inference servers as GPU services: a vLLM or SGLang reward-model server run as a tangram
service, whose offload is the server's sleep and whose restore is its wake-up.

    from tangram import Inventory, Orchestrator, Service
    from tangram.runtime.managers.gpu import GpuManager
    from tangram.runtime.managers.inference import VllmServer

    rm = VllmServer(command=["vllm", "serve", "/models/reward-8b", "--host", "{host}", "--port", "{port}",
                             "--enable-sleep-mode", "--gpu-memory-utilization", "0.45"],
                    response=lambda answer: answer["data"][0]["data"][0])
    service = Service("rm", memory=0.45 * 81559,  # the fraction of an 80 GB H100's total memory
                      restore_seconds=2.0, max_batch=64, asleep_memory=1024, movable=False)
    orch = Orchestrator(inventory=Inventory.local(services=[service]),
                        managers={"gpu": GpuManager(services={"rm": rm})})

A service action (`Call(args=(text,), service="rm")`) then becomes one HTTP request to the
server's scoring endpoint, batched with the service's other waiting actions; the core
decides when the server sleeps and wakes, as for any service.

The hooks
    load      starts `command` ("{host}" and "{port}" in it are replaced by a loopback
              address and a free port) in its own process group, with the device's grant in
              its environment (CUDA_VISIBLE_DEVICES is the device's UUID), and waits until
              GET /health answers 200. With `url` instead, it only waits for that server's
              health: tangram neither starts nor stops it.
    offload   the server's sleep endpoint: vLLM's POST /sleep?level=1 (then GET /is_sleeping
              must say so), SGLang's POST /release_memory_occupation.
    restore   the wake-up endpoint: vLLM's POST /wake_up (then GET /is_sleeping must say
              it is awake), SGLang's POST /resume_memory_occupation. A restore onto another
              device, or after the server's process died, is a cold start (below).
    batch     one POST to the scoring endpoint per input (vLLM's /pooling, SGLang's
              /classify by default), up to `concurrency` at once; outputs in input order.
    close     SIGTERM to the process group; SIGKILL to what is left of it once the server
              has exited, or after `stop_timeout` seconds.

What the servers need
    vLLM serves /sleep, /wake_up and /is_sleeping only when it runs with
    `--enable-sleep-mode` and the environment variable VLLM_SERVER_DEV_MODE=1 (they are
    development endpoints); `VllmServer` sets the variable, the command must carry the
    flag. Sleep level 1 (the default) copies the weights to host RAM and drops the KV
    cache; level 2 (`sleep_level=2`) discards the weights too, so a restore must reload
    them after the wake-up (subclass `VllmServer` and extend `restore`, e.g. with
    `self.send(handle, "POST", "/collective_rpc", {"method": "reload_weights"})` on vLLM
    versions that have it).
    SGLang serves its memory endpoints when started with `--enable-memory-saver`; it keeps
    the weights across a release only with `--enable-weights-cpu-backup` (SGLang 0.5.3
    and later). Its /classify reads the text from "text": the default request is
    {"text": input}.

How to declare the matching `tangram.Service`
    - `memory`: what the server holds awake, not the weights alone. vLLM allocates
      `--gpu-memory-utilization` x the device's total memory (weights, KV cache,
      activations, CUDA graphs) and refuses to start with less than that free; SGLang
      takes `--mem-fraction-static` x the total for weights and KV cache, plus activations.
    - `asleep_memory`: a sleeping server keeps its CUDA context, its allocator pool and
      what CUDA graphs hold on its device: from a few hundred MiB to about 1 GiB (read it
      with nvidia-smi after a sleep). It also holds host RAM for the weights at sleep
      level 1 (pinned memory: the host must have it).
    - `movable=False`: the server's process cannot move to another device (its CUDA
      context is bound to the device it started on). Declare
      `Service(..., asleep_memory=<MiB held asleep>, movable=False)`, so that the core
      counts the memory a sleeping server keeps and restores it where it sleeps. Should a
      restore still go to another device, this class stops the process and starts it
      there: a cold start, as slow as the first load (counted in `ServerHandle.cold_starts`,
      logged once). An attached server (`url`) cannot be moved at all: that restore fails.
    - `restore_seconds` and `offload_seconds`: the wake-up's and the sleep's time
      (`ServerHandle.last_wake_seconds` and `last_sleep_seconds` measure them).

Timeouts: the gpu manager puts a service whose hook call overran its limit out of use. An
`InferenceServer` sets its own limit (`hook_timeout`, a ServiceHooks attribute): a minute
more than the longest of `startup_timeout` (a load and a cold start wait that long for the
server's health), `request_timeout` (each scoring request) and twice `stop_timeout`.

Health: the manager asks `healthy` (the process is alive and /health answers 200) after a
batch failed, and before the next batch on a device that reported an Xid error; an
unhealthy server is restarted in place (close, then load on its device). Batches run
concurrently (`concurrent_batches`): a server batches continuously.

Errors are `InferenceServerError` (a `tangram.TangramError`): its field names the setting
or the endpoint, and a server that exited is reported with its exit code and the last lines
of its log (`log`, by default a temporary file; `ServerHandle.log_path`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import http.client
import json
import logging
import math
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from typing import IO, Any, Callable, ClassVar, Mapping, Sequence

from ..._errors import TangramError, ValidationError
from ...devices import VISIBLE_ENV, GpuDevice
from .gpu import ServiceHooks, grant_environment

logger = logging.getLogger("tangram.gpu")  # the GPU manager's logger: one name for everything GPU

LOOPBACK = "127.0.0.1"
LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 8192  # read from the end of the log for its last lines
_EXIT_GRACE_SECONDS = 1.0  # how long a failed request waits to see whether the server is exiting


class InferenceServerError(TangramError, RuntimeError):
    """An inference server did not do what a hook asked: it could not start, exited, did not
    become healthy in time, or answered with an error. `field` names the setting or the
    endpoint ("command", "startup_timeout", "POST /pooling", ...). `exit_code`: the
    process's exit code when it had exited (negative: the signal that killed it);
    `status`: the HTTP status of an error answer; `log_tail`: the last lines of its log."""

    def __init__(self, field: str, reason: str, *, exit_code: int | None = None, status: int | None = None,
                 log_tail: str = "") -> None:
        super().__init__(field, reason)
        self.exit_code = exit_code
        self.status = status
        self.log_tail = log_tail


@dataclass(eq=False)
class ServerHandle:
    """One server, as its hooks see it (the handle `load` returns; read it in tests and
    monitoring, never change it).

    url: where it answers ("http://127.0.0.1:<port>"). device_uuid: the device it runs on
    (None when loaded without one). attached: tangram did not start it (`url`). process:
    the server's process (None when attached). log_path and log_file: its stdout and
    stderr (None when attached). asleep: whether it sleeps (offloaded). sleeps, wakes: the
    sleeps and wake-ups done. cold_starts: the restarts, onto another device or after its
    process had died. last_start_seconds: how long its last start took until it was
    healthy; last_sleep_seconds and last_wake_seconds: its last sleep's and wake-up's (or
    cold start's) time. closed: `close` has run.
    """

    url: str
    device_uuid: str | None
    attached: bool = False
    process: subprocess.Popen[bytes] | None = None
    log_path: str | None = None
    log_file: IO[bytes] | None = None
    asleep: bool = False
    sleeps: int = 0
    wakes: int = 0
    cold_starts: int = 0
    last_start_seconds: float | None = None
    last_sleep_seconds: float | None = None
    last_wake_seconds: float | None = None
    closed: bool = False

    @property
    def pid(self) -> int | None:
        """The server process's id (its process group's too), None when attached."""
        return self.process.pid if self.process is not None else None


def _positive_seconds(value: Any, field: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ValidationError(field, f"must be a positive number of seconds, got {value!r}")
    return seconds


def _free_port(host: str) -> int:
    """A port free on `host` now. Another process may take it before the server binds it:
    the server then exits at startup, and `load` reports that with its log."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class InferenceServer(ServiceHooks):
    """A reward-model HTTP server as a GPU service (module docstring): offload is its sleep,
    restore its wake-up; its batches run concurrently. `VllmServer` and `SglangServer` fill in the protocol; a subclass
    for another server defines `sleep_server` and `wake_server` (with `send` for its
    requests) and the class attributes `default_score_path`, `input_key`, `server_env`
    and `required_flag`.

    Options (keywords): `command`, the server's argv, in which "{host}" and "{port}" are
    replaced (it runs without a shell); or `url`, a server already running (tangram then
    neither starts nor stops it, and cannot move it to another device). `score_path`: the
    scoring endpoint. `request(input) -> JSON body` (default: the input itself if it is a
    dict, else {input_key: input}); `response(parsed JSON) -> output` (default: the parsed
    JSON). `concurrency`: requests of one batch in flight at once (default 64).
    `startup_timeout`: seconds a start may take until /health answers 200 (default 600).
    `request_timeout`: seconds for any one HTTP request (default 300). `stop_timeout`:
    seconds `close` waits after SIGTERM before SIGKILL (default 10). `env`: extra
    environment for the server (the grant's variables are tangram's: not allowed here).
    `log`: the file for the server's stdout and stderr, appended to (default: a new
    temporary file, kept after close).

    Besides the hooks: `healthy(handle)` (GET /health answers 200, and the process runs),
    `send(handle, method, path, body)` (one request, its parsed answer), `log_tail(handle)`,
    and `handles` (every handle `load` returned, for monitoring).
    """

    default_score_path: ClassVar[str] = "/"
    input_key: ClassVar[str] = "input"  # the default request's field for a non-dict input
    server_env: ClassVar[Mapping[str, str]] = {}  # environment the protocol needs
    health_path: ClassVar[str] = "/health"
    required_flag: ClassVar[str | None] = None  # the server's flag without which it cannot sleep
    concurrent_batches: ClassVar[bool] = True  # the server batches continuously

    def __init__(self, *, command: Sequence[str] | None = None, url: str | None = None,
                 score_path: str | None = None, request: Callable[[Any], Any] | None = None,
                 response: Callable[[Any], Any] | None = None, concurrency: int = 64,
                 startup_timeout: float = 600.0, request_timeout: float = 300.0, stop_timeout: float = 10.0,
                 env: Mapping[str, str] | None = None, log: str | os.PathLike[str] | None = None) -> None:
        if (command is None) == (url is None):
            raise ValidationError("command", "give exactly one of command (a server to start) and url (a server "
                                             "already running)")
        self.command: list[str] | None = None
        self.url: str | None = None
        if command is not None:
            if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
                raise ValidationError("command", f"expected a sequence of argv strings (it runs without a shell), "
                                                 f"got {command!r}")
            if not command or not all(isinstance(a, str) for a in command):
                raise ValidationError("command", f"expected a non-empty sequence of strings, got {command!r}")
            self.command = list(command)
        else:
            self.url = self._check_url(url)
        score_path = self.default_score_path if score_path is None else score_path
        if not isinstance(score_path, str) or not score_path.startswith("/"):
            raise ValidationError("score_path", f"expected a path starting with '/', got {score_path!r}")
        self.score_path = score_path
        for name, fn in (("request", request), ("response", response)):
            if fn is not None and not callable(fn):
                raise ValidationError(name, f"expected a callable or None, got {fn!r}")
        self.request = request
        self.response = response
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValidationError("concurrency", f"must be a positive integer, got {concurrency!r}")
        self.concurrency = concurrency
        self.startup_timeout = _positive_seconds(startup_timeout, "startup_timeout")
        self.request_timeout = _positive_seconds(request_timeout, "request_timeout")
        self.stop_timeout = _positive_seconds(stop_timeout, "stop_timeout")
        # The gpu manager's limit for these hooks: a load waits startup_timeout for health,
        # a batch request_timeout per request, a close stop_timeout twice at most.
        self.hook_timeout = max(self.startup_timeout, self.request_timeout, 2 * self.stop_timeout) + 60.0
        env = dict(env or {})
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValidationError("env", f"expected a mapping of strings to strings, got {key!r}: {value!r}")
        # The grant is the core's decision, and the protocol's variables make the hooks work.
        reserved = {VISIBLE_ENV, "TANGRAM_GPU_MEMORY_MIB", *self.server_env}
        taken = sorted(k for k in env if k in reserved and self.server_env.get(k) != env[k])
        if taken:
            raise ValidationError("env", f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by tangram "
                                         f"(the device grant, or what {type(self).__name__} needs)")
        self.env = env
        if log is not None and not isinstance(log, (str, os.PathLike)):
            raise ValidationError("log", f"expected a file path or None, got {log!r}")
        self.log = None if log is None else os.fspath(log)
        self.handles: list[ServerHandle] = []  # what `load` returned (one per service of a gpu manager)
        self._warned_cold_start = False
        if self.required_flag is not None and self.command is not None and self.required_flag not in self.command:
            logger.warning("%s: the command has no %s; the server cannot free its memory without it (unless a "
                           "wrapper adds it)", type(self).__name__, self.required_flag)

    @staticmethod
    def _check_url(url: Any) -> str:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValidationError("url", f"expected an http:// or https:// URL, got {url!r}")
        try:
            parts.port
        except ValueError as e:
            raise ValidationError("url", f"{url!r}: {e}") from None
        return url.rstrip("/")

    # ---------------------------------------------------------------- protocol
    @abc.abstractmethod
    def sleep_server(self, handle: ServerHandle) -> None:
        """Ask the server to free its device memory (and check that it did)."""

    @abc.abstractmethod
    def wake_server(self, handle: ServerHandle) -> None:
        """Ask the sleeping server to take its device memory back (and check that it did)."""

    def endpoint_hint(self, method: str, path: str, status: int) -> str:
        """What to add to the error for an error `status` of an endpoint (a missing flag)."""
        return ""

    # ---------------------------------------------------------------- hooks
    def load(self, device: GpuDevice | None) -> ServerHandle:
        """Starts the server on `device` (or, attached, waits for its health)."""
        uuid = device.uuid if device is not None else None
        if self.url is not None:
            handle = ServerHandle(self.url, uuid, attached=True)
            started = time.monotonic()
            self._wait_healthy(handle)
            handle.last_start_seconds = time.monotonic() - started
        else:
            handle = ServerHandle("", uuid)
            self._start(handle, device)
        self.handles.append(handle)
        return handle

    def offload(self, handle: ServerHandle) -> None:
        """Puts the server to sleep: its device memory is freed (all but its context)."""
        self._check_open(handle)
        started = time.monotonic()
        self.sleep_server(handle)
        handle.asleep = True
        handle.sleeps += 1
        handle.last_sleep_seconds = time.monotonic() - started

    def restore(self, handle: ServerHandle, device: GpuDevice | None) -> bool | None:
        """Wakes the server up; onto another device (or after its process died), starts it
        afresh there: a cold start, which returns False (it is no restore: the gpu manager
        does not learn restore times from it)."""
        self._check_open(handle)
        uuid = device.uuid if device is not None else None
        moved = uuid != handle.device_uuid
        if handle.attached:
            if moved:
                raise InferenceServerError("url", f"the server at {handle.url} runs on {handle.device_uuid}; it "
                                                  f"cannot move to {uuid} (tangram did not start it, so it cannot "
                                                  f"start it there): declare its Service with movable=False")
        elif moved or handle.process is None or handle.process.poll() is not None:
            self._cold_start(handle, device, "moved" if moved else "died")
            return False
        if not handle.asleep:
            return None  # awake already (an offload that failed before the server slept)
        started = time.monotonic()
        self.wake_server(handle)
        handle.asleep = False
        handle.wakes += 1
        handle.last_wake_seconds = time.monotonic() - started
        return None

    def batch(self, handle: ServerHandle, inputs: list[Any]) -> list[Any]:
        """One POST to the scoring endpoint per input, up to `concurrency` at once; the
        outputs in input order. The first failure (in input order) fails the batch."""
        self._check_open(handle)
        self._check_alive(handle, f"POST {self.score_path}")
        bodies = [self.request(x) if self.request is not None else x if isinstance(x, dict) else {self.input_key: x}
                  for x in inputs]
        if len(bodies) <= 1:
            answers = [self.send(handle, "POST", self.score_path, body) for body in bodies]
        else:
            pool = concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(bodies)),
                                                         thread_name_prefix="tangram-inference")
            try:
                futures = [pool.submit(self.send, handle, "POST", self.score_path, body) for body in bodies]
                answers = [f.result() for f in futures]
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return [self.response(a) for a in answers] if self.response is not None else answers

    def close(self, handle: ServerHandle) -> None:
        """Stops the server's process group (not an attached server). Idempotent."""
        if handle.closed:
            return
        handle.closed = True
        self._stop(handle)

    def healthy(self, handle: ServerHandle) -> bool:
        """Whether the server answers GET /health with 200 (and its process, if tangram
        started it, still runs)."""
        if handle.closed or (handle.process is not None and handle.process.poll() is not None):
            return False
        try:
            status, _ = self._http(handle.url, "GET", self.health_path, None, min(5.0, self.request_timeout))
        except (OSError, http.client.HTTPException):
            return False
        return status == 200

    # ---------------------------------------------------------------- HTTP
    def send(self, handle: ServerHandle, method: str, path: str, body: Any = None,
             timeout: float | None = None) -> Any:
        """One request to the server: `body` (JSON-serialisable, or None for none) to
        `path`; returns the parsed JSON answer (None for an empty one). A non-2xx answer, no
        answer, or an answer that is not JSON raises InferenceServerError; so does a server
        whose process has exited (with its exit code and log tail)."""
        what = f"{method} {path}"
        timeout = self.request_timeout if timeout is None else timeout
        try:
            status, data = self._http(handle.url, method, path, body, timeout)
        except (OSError, http.client.HTTPException) as e:
            if handle.process is not None:  # a dying server closes its sockets before it has exited
                try:
                    handle.process.wait(_EXIT_GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
            self._check_alive(handle, what)
            if isinstance(e, TimeoutError):
                raise InferenceServerError(what, f"no answer from {handle.url} within {timeout:g} s") from None
            raise InferenceServerError(what, f"no answer from {handle.url}: {type(e).__name__}: {e}") from None
        if not 200 <= status < 300:
            text = data[:200].decode(errors="replace")
            hint = self.endpoint_hint(method, path, status)
            raise InferenceServerError(what, f"{handle.url} answered {status}: {text!r}{hint}", status=status)
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError:
            text = data[:200].decode(errors="replace")
            raise InferenceServerError(what, f"{handle.url} answered {status} with a body that is not JSON: "
                                             f"{text!r}", status=status) from None

    @staticmethod
    def _http(base: str, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        """One request on a connection of its own (each thread of a batch has its own)."""
        parts = urllib.parse.urlsplit(base)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = cls(parts.hostname or LOOPBACK, parts.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            connection.request(method, parts.path + path, body=data, headers=headers)
            answer = connection.getresponse()
            return answer.status, answer.read()
        finally:
            connection.close()

    # ---------------------------------------------------------------- processes
    def _start(self, handle: ServerHandle, device: GpuDevice | None) -> None:
        """Starts `command` on `device` and waits for its health; on failure stops it and
        raises with its log tail."""
        assert self.command is not None
        port = _free_port(LOOPBACK)
        argv = [a.replace("{host}", LOOPBACK).replace("{port}", str(port)) for a in self.command]
        env = {**os.environ, **self.env}
        if device is not None:
            env.update(grant_environment(device, device.memory_mib, False))
        env.update(self.server_env)
        if handle.log_path is None:
            if self.log is not None:
                handle.log_path = self.log
            else:
                fd, handle.log_path = tempfile.mkstemp(prefix="tangram-inference-", suffix=".log")
                os.close(fd)
        if handle.log_file is None:
            try:
                handle.log_file = open(handle.log_path, "ab")
            except OSError as e:
                raise InferenceServerError("log", f"cannot open {handle.log_path!r}: {e}") from None
        handle.log_file.write(f"--- tangram: starting {argv} on {env.get(VISIBLE_ENV, 'no device')}\n".encode())
        handle.log_file.flush()
        handle.url = f"http://{LOOPBACK}:{port}"
        handle.device_uuid = device.uuid if device is not None else None
        handle.asleep = False
        started = time.monotonic()
        try:
            # Its own process group: close() stops the server and every process it started.
            handle.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=handle.log_file,
                                              stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            handle.log_file.close()
            handle.log_file = None
            raise InferenceServerError("command", f"cannot start {argv[0]!r}: {type(e).__name__}: {e}") from None
        try:
            self._wait_healthy(handle)
        except BaseException:
            self._stop(handle)
            raise
        handle.last_start_seconds = time.monotonic() - started

    def _wait_healthy(self, handle: ServerHandle) -> None:
        """Polls GET /health until it answers 200; raises if the process exits first or
        startup_timeout passes."""
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.02
        while True:
            if handle.process is not None:
                code = handle.process.poll()
                if code is not None:
                    tail = self.log_tail(handle)
                    raise InferenceServerError("command", f"the server {_exit_text(code)} before {self.health_path} "
                                                          f"answered 200{self._tail_text(handle, tail)}",
                                               exit_code=code, log_tail=tail)
            left = deadline - time.monotonic()
            if left <= 0:
                tail = self.log_tail(handle)
                raise InferenceServerError("startup_timeout", f"{handle.url}{self.health_path} did not answer 200 "
                                                              f"within {self.startup_timeout:g} s"
                                                              f"{self._tail_text(handle, tail)}", log_tail=tail)
            try:
                status, _ = self._http(handle.url, "GET", self.health_path, None, max(0.1, min(5.0, left)))
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass  # not listening yet
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.5)

    def _cold_start(self, handle: ServerHandle, device: GpuDevice | None, why: str) -> None:
        uuid = device.uuid if device is not None else None
        if why == "moved" and not self._warned_cold_start:
            self._warned_cold_start = True
            logger.warning("%s: a restore onto %s of the server sleeping on %s is a cold start: a server process "
                           "cannot move to another device (its CUDA context is bound to its device); declare its "
                           "Service with movable=False", type(self).__name__, uuid, handle.device_uuid)
        elif why == "died":
            code = handle.process.poll() if handle.process is not None else None
            logger.warning("%s: the server at %s %s; starting it afresh on %s", type(self).__name__, handle.url,
                           _exit_text(code) if code is not None else "is gone", uuid)
        started = time.monotonic()
        self._stop(handle, keep_log=True)
        self._start(handle, device)
        handle.cold_starts += 1
        handle.last_wake_seconds = time.monotonic() - started

    def _stop(self, handle: ServerHandle, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group; once the server process has exited (or
        after stop_timeout), SIGKILL to whatever is left of the group: what the server
        started and did not stop itself. Closes the log unless `keep_log`."""
        process = handle.process
        if process is not None:
            pgid = process.pid  # a session leader: its process group has its pid
            deadline = time.monotonic() + self.stop_timeout
            self._signal_group(pgid, signal.SIGTERM)
            while not self._exited(process) and time.monotonic() < deadline:
                time.sleep(0.02)
            # Its group's id cannot be another group's while the server is not reaped (as
            # here, unless a poll saw it exit) or any member of its group is left.
            self._signal_group(pgid, signal.SIGKILL)
            process.wait()
        if not keep_log and handle.log_file is not None:
            handle.log_file.close()
            handle.log_file = None

    @staticmethod
    def _exited(process: subprocess.Popen[bytes]) -> bool:
        """Whether `process` has exited, without reaping it."""
        if process.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped meanwhile (a concurrent poll)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone (PermissionError: its id was reused by another user's group)

    def _check_open(self, handle: ServerHandle) -> None:
        if handle.closed:
            raise InferenceServerError("handle", f"the server at {handle.url} was closed")

    def _check_alive(self, handle: ServerHandle, what: str) -> None:
        """Raises if tangram's server process has exited, with its exit code and log tail."""
        code = handle.process.poll() if handle.process is not None else None
        if code is not None:
            tail = self.log_tail(handle)
            raise InferenceServerError(what, f"the server at {handle.url} {_exit_text(code)}"
                                             f"{self._tail_text(handle, tail)}", exit_code=code, log_tail=tail)

    def log_tail(self, handle: ServerHandle, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's log ("" when it has none)."""
        if handle.log_path is None:
            return ""
        if handle.log_file is not None:
            handle.log_file.flush()
        try:
            with open(handle.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @staticmethod
    def _tail_text(handle: ServerHandle, tail: str) -> str:
        if not tail:
            return f" (its log {handle.log_path} is empty)" if handle.log_path else ""
        return f"; the last lines of its log {handle.log_path}:\n{tail}"


class VllmServer(InferenceServer):
    """A vLLM server (`vllm serve ... --enable-sleep-mode`) as a GPU service: offload is
    POST /sleep?level=`sleep_level`, restore POST /wake_up, each checked with GET
    /is_sleeping; scoring POST /pooling with {"input": input}. Sets VLLM_SERVER_DEV_MODE=1
    in the server's environment (vLLM serves its sleep endpoints only then). Sleep level
    1 keeps the weights in host RAM; level 2 discards them, so a restore must reload them
    (module docstring). Other options: `InferenceServer`."""

    default_score_path = "/pooling"
    input_key = "input"
    required_flag = "--enable-sleep-mode"
    server_env: ClassVar[Mapping[str, str]] = {"VLLM_SERVER_DEV_MODE": "1"}

    def __init__(self, *, sleep_level: int = 1, **options: Any) -> None:
        if type(sleep_level) is not int or sleep_level not in (1, 2):
            raise ValidationError("sleep_level", f"must be 1 (weights kept in host RAM) or 2 (weights discarded), "
                                                 f"got {sleep_level!r}")
        super().__init__(**options)
        self.sleep_level = sleep_level

    def sleep_server(self, handle: ServerHandle) -> None:
        self.send(handle, "POST", f"/sleep?level={self.sleep_level}")
        self._expect_sleeping(handle, True)

    def wake_server(self, handle: ServerHandle) -> None:
        self.send(handle, "POST", "/wake_up")
        self._expect_sleeping(handle, False)

    def _expect_sleeping(self, handle: ServerHandle, asleep: bool) -> None:
        answer = self.send(handle, "GET", "/is_sleeping")
        state = answer.get("is_sleeping") if isinstance(answer, dict) else None
        if state is not asleep:
            raise InferenceServerError("GET /is_sleeping", f"the server at {handle.url} answered {answer!r} after "
                                                           f"{'a sleep' if asleep else 'a wake-up'}; expected "
                                                           f"{{'is_sleeping': {asleep}}}")

    def endpoint_hint(self, method: str, path: str, status: int) -> str:
        if status == 404 and path.split("?")[0] in ("/sleep", "/wake_up", "/is_sleeping"):
            return (" (vLLM serves it only with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 in its "
                    "environment)")
        return ""


class SglangServer(InferenceServer):
    """An SGLang server (`python -m sglang.launch_server ... --enable-memory-saver`) as a
    GPU service: offload is POST /release_memory_occupation, restore POST
    /resume_memory_occupation (each with the JSON body {}); scoring POST /classify with
    {"text": input}. It keeps its weights across a release only with
    --enable-weights-cpu-backup (module docstring). Other options: `InferenceServer`."""

    default_score_path = "/classify"
    input_key = "text"
    required_flag = "--enable-memory-saver"

    def sleep_server(self, handle: ServerHandle) -> None:
        self._expect_success(handle, "/release_memory_occupation")

    def wake_server(self, handle: ServerHandle) -> None:
        self._expect_success(handle, "/resume_memory_occupation")

    def _expect_success(self, handle: ServerHandle, path: str) -> None:
        answer = self.send(handle, "POST", path, {})
        # Versions that report the outcome say {"success": false, "message": ...} on failure.
        if isinstance(answer, dict) and answer.get("success") is False:
            raise InferenceServerError(f"POST {path}", f"the server at {handle.url} answered {answer!r}")

    def endpoint_hint(self, method: str, path: str, status: int) -> str:
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return " (SGLang releases memory only when started with --enable-memory-saver)"
        return ""


__all__ = ["InferenceServer", "InferenceServerError", "ServerHandle", "SglangServer", "VllmServer"]
