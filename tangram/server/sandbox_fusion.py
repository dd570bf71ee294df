"""Sandbox Fusion's HTTP API, served by tangram: `tangram serve --sandbox-fusion-port PORT`.

Sandbox Fusion's `POST /run_code` is what RL frameworks send code execution to (veRL's
code rewards and tool, SkyRL's verifiers and tools, the `sandbox-fusion` client). This
endpoint takes the same requests and answers with the same responses and status values
(tangram.runtime.sandbox.run_code), so pointing such a framework at tangram is one URL. Each
request is one tangram action: the requests that arrive in one event-loop iteration reach
the core as one batch, are ordered and placed with every other action of the orchestrator,
and run in a sandbox (the CPU manager's, with its isolation).

Routes:

    POST /run_code      a RunCodeRequest -> a RunCodeResponse (HTTP 200 whatever the
                        program did; 422 with {"detail": [...]} for a request that does not
                        validate, as Sandbox Fusion's server answers); a Server-Timing
                        header says the server's time on it and the part running it
    GET  /v1/ping       "pong" (Sandbox Fusion's health check)
    GET  /              200 (what SkyRL's liveness check asks)
    POST /end_session   {"session_id": ...}: ends a session now (its sandbox is removed)

Sandboxes: a request without a session id runs in a sandbox of its own, in a fresh
working directory. That sandbox is pooled (Call.pooled): the CPU manager hands the
request's action an idle one as it starts, so that a request does not pay for starting a
sandbox process and a burst needs only as many sandboxes as run at once. Once a request
has answered, every process it left is killed (those that detached themselves too: the
sandbox worker adopts orphans) and the sandbox's directory is emptied, and the sandbox
waits for the next request without a session; one whose action crashed or timed out is
ended instead. `fresh_sandboxes=True` (`tangram serve --sandbox-fusion-fresh`) gives each
such request a new sandbox, ended after it, for programs that must not share even the
sandbox's worker process.

Sessions: with a session id (the `X-Tangram-Session` header, or a `session_id` field in
the JSON body, which Sandbox Fusion's server would ignore) the requests of a session share
one trajectory's sandbox: its files persist from one request to the next, and they run
one at a time in the order they arrive. A session ends at `POST /end_session` or after
`session_idle` seconds without a request. A session's first request may name its home,
the node its sandbox lives on (the `X-Tangram-Node` header, or a `node` field: a node name
of the inventory, as `tangram serve --ray` prints them); its requests then all run there.
Without one, a multi-node orchestrator keeps the session where its first request ran.
At most `max_sessions` sessions are open at once (each holds a sandbox: its processes and
the server's descriptors to them); a request that would open one more is answered, in
band, a SandboxError saying so.

Errors of the action itself come back in-band, as Sandbox Fusion reports its own: a
SandboxError with the reason in `message` (the action failed, crashed, timed out past the
request's timeouts, or was cancelled when the server shut down); memory past
memory_limit_MB is a Failed run with return code -9. A client that goes away before its
answer has its action cancelled (its program killed) at once.

Limits, so that one client cannot take the server from the others:

    max_body        a request's body, bytes (`files` come base64); a Content-Length over
                    it is answered 413 at once, without reading the body
    client_timeout  seconds the server waits on a client: for a connection's (next)
                    request head (a connection idle that long is closed), for the whole
                    of a request's body (408, then closed), and for the client to take
                    each part of its answer (the connection is closed)
    max_connections HTTP connections open at once; one more is answered 503 and closed
                    at once (default: half the process's descriptor limit, at most
                    DEFAULT_MAX_CONNECTIONS); when descriptors run out all the same,
                    new connections are closed as they come, with one warning a minute
    max_answer      an answer's size as JSON, bytes; one over it (fetch_files that big)
                    is not built: a SandboxError names the files and their sizes instead.
                    An answer over a MiB is encoded a piece at a time, the event loop
                    serving the other clients between pieces, and sent as it is encoded
    max_sessions    sessions open at once (default: the descriptor limit / 16, at most
                    DEFAULT_MAX_SESSIONS)

Every refusal of the endpoint itself is JSON: {"detail": "..."} (400, 401, 404, 408,
413, 503), or FastAPI's {"detail": [{"loc", "msg", "type"}]} for a 422.

Safety: the same rules as the TCP server. It listens where `tangram serve` does (127.0.0.1
unless told otherwise, and anywhere else only with a token). With a token, every request
must carry it, as `Authorization: Bearer TOKEN` or, for clients that cannot set headers
(veRL and SkyRL take a URL), as the first segment of the path: `http://HOST:PORT/TOKEN/run_code`.

Built on aiohttp (aiohttp.web): a well-kept asyncio HTTP server that joins the server's
running event loop through a public API (AppRunner, SockSite) without taking over its
signal handling, and is already installed wherever Ray or the sandbox-fusion client is.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import errno
import hmac
import json
import logging
import math
import os
import re
import resource
import socket
import time
import weakref
from typing import Any, Iterator

from .._errors import TangramError, ValidationError
from ..runtime.orchestrator import Orchestrator
from ..runtime.sandbox.run_code import (TrajectoryPool, check_request, checked_timed_answer, error_answer, run_code_call,
                                        sandbox_error)
from .protocol import is_loopback

DEFAULT_PORT = 8080  # Sandbox Fusion's (SkyRL's verifier assumes it)
DEFAULT_MAX_BODY = 64 << 20
DEFAULT_SESSION_IDLE = 600.0
DEFAULT_CLIENT_TIMEOUT = 60.0
DEFAULT_MAX_CONNECTIONS = 1024  # or half the descriptor limit, when lower
DEFAULT_MAX_SESSIONS = 256  # or the descriptor limit / 16, when lower
DEFAULT_MAX_ANSWER = 256 << 20
# veRL opens a connection per request: a deep backlog keeps a burst from waiting on SYN
# retries. (Running out of descriptors no longer makes asyncio log once per backlog
# entry: _Listener sheds such connections itself.)
BACKLOG = 1024
MAX_SESSION_ID = 1024  # characters of a session id (it is kept while the session lives)
STREAM_ABOVE = 1 << 20  # answers longer than this (as JSON) are encoded and sent a piece at a time
PIECE = 1 << 20  # characters of a long string encoded at a time
SESSION_HEADER = "X-Tangram-Session"
NODE_HEADER = "X-Tangram-Node"  # a session's home: the node its sandbox lives on (Call.affinity)
RUN_SECONDS = "tangram_run_seconds"  # the aiohttp request's key for Server-Timing's `run`

_log = logging.getLogger("tangram.server.sandbox_fusion")
_http_log = logging.getLogger("tangram.server.sandbox_fusion.http")  # aiohttp's, for the endpoint's connections


def _web() -> Any:
    """aiohttp.web, imported when the endpoint starts (a Client's import of tangram.server
    does not pay for it)."""
    try:
        from aiohttp import web
    except ImportError:  # pragma: no cover - a dependency of arl-tangram; this names it if it went missing
        raise ValidationError("sandbox_fusion", "the Sandbox Fusion endpoint needs aiohttp (a dependency of "
                                                "arl-tangram): pip install aiohttp") from None
    return web


def _descriptor_limit() -> int:
    """The process's soft limit on open descriptors (RLIMIT_NOFILE)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):  # pragma: no cover - every POSIX system has it
        return 1 << 20
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


class _Session:
    __slots__ = ("trajectory", "node", "lock", "used", "running", "ended")

    def __init__(self, trajectory: int, node: str | None = None) -> None:
        self.trajectory = trajectory
        self.node = node  # its home, when its first request named one
        self.lock = asyncio.Lock()  # one request at a time, in arrival order (asyncio's locks are fair)
        self.used = time.monotonic()
        self.running = 0  # its requests not answered yet
        self.ended = False  # its sandbox goes when the last of them is answered


class SandboxFusionEndpoint:
    """The Sandbox Fusion API in front of a started `orchestrator` (see the module
    docstring). `trajectories`: the first trajectory id it may use and how many (the
    server gives it a range of its own; an embedding caller, one its own trajectories do
    not use). `cpu`: the cores each request is guaranteed (its action's minimum demand;
    it may use more that nobody else is guaranteed). The default, one core, lets a
    single-threaded program run at full speed whatever else runs, so that its run_timeout
    means what it says; 0.5 runs two requests per core when every core is taken, which
    hides the hand-over between one request and the next (bench/sandbox_fusion.py
    --tangram-cpu) at the price of programs that run up to twice as long under load.
    `max_body`, `client_timeout`, `max_connections`, `max_answer`, `max_sessions`: the
    limits of the module docstring (None: the default drawn from the descriptor limit).
    `await start()`, then `address`; `await close()` to stop."""

    def __init__(self, orchestrator: Orchestrator, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None, trajectories: tuple[int, int] = (1 << 40, 1 << 32),
                 max_body: int = DEFAULT_MAX_BODY, session_idle: float = DEFAULT_SESSION_IDLE,
                 fresh_sandboxes: bool = False, cpu: float = 1.0, client_timeout: float = DEFAULT_CLIENT_TIMEOUT,
                 max_connections: int | None = None, max_sessions: int | None = None,
                 max_answer: int = DEFAULT_MAX_ANSWER) -> None:
        if not isinstance(max_body, int) or isinstance(max_body, bool) or max_body < 1024:
            raise ValidationError("sandbox_fusion.max_body", f"must be an integer of at least 1024 bytes, got {max_body!r}")
        if not (isinstance(session_idle, (int, float)) and session_idle > 0):
            raise ValidationError("sandbox_fusion.session_idle", f"must be a positive number of seconds, got {session_idle!r}")
        if (isinstance(client_timeout, bool) or not isinstance(client_timeout, (int, float))
                or not (math.isfinite(client_timeout) and 0 < client_timeout <= 86400)):
            raise ValidationError("sandbox_fusion.client_timeout", f"must be a number of seconds in (0, 86400], got "
                                                    f"{client_timeout!r}")
        limit = _descriptor_limit()
        if max_connections is None:
            max_connections = min(DEFAULT_MAX_CONNECTIONS, max(16, limit // 2))
        if not isinstance(max_connections, int) or isinstance(max_connections, bool) or max_connections < 1:
            raise ValidationError("sandbox_fusion.max_connections", f"must be a positive integer (or None: the default), got "
                                                     f"{max_connections!r}")
        if max_sessions is None:
            max_sessions = min(DEFAULT_MAX_SESSIONS, max(4, limit // 16))
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise ValidationError("sandbox_fusion.max_sessions", f"must be a positive integer (or None: the default), got "
                                                  f"{max_sessions!r}")
        if not isinstance(max_answer, int) or isinstance(max_answer, bool) or max_answer < 1024:
            raise ValidationError("sandbox_fusion.max_answer", f"must be an integer of at least 1024 bytes, got {max_answer!r}")
        self.orchestrator = orchestrator
        self.host, self.port = host, port
        self.token = token or None
        self.max_body = max_body
        self.session_idle = float(session_idle)
        self.client_timeout = float(client_timeout)
        self.max_connections = max_connections
        self.max_sessions = max_sessions
        self.max_answer = max_answer
        self.fresh_sandboxes = bool(fresh_sandboxes)
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0 < cpu <= 1024:
            raise ValidationError("sandbox_fusion.cpu", f"must be a number of cores in (0, 1024], got {cpu!r}")
        self.cpu = float(cpu)
        self._pool = TrajectoryPool(self._new_trajectory)  # for requests without a session
        self.address: tuple[str, int] | None = None
        self._first, self._count = trajectories
        self._next = 0
        self._sessions: dict[str, _Session] = {}
        self._runner: Any = None
        # the connections open, on every listener, by descriptor (weakly: one dropped unclosed goes too)
        self._connections: weakref.WeakValueDictionary[int, _Connection] = weakref.WeakValueDictionary()
        self._reaper: asyncio.Task[None] | None = None
        self._endings: set[asyncio.Task[None]] = set()
        self._live: set[asyncio.Future[Any]] = set()  # the actions of requests not answered yet
        self._closing = False

    @property
    def connections(self) -> int:
        """The HTTP connections open now."""
        return len(self._connections)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "SandboxFusionEndpoint":
        if not is_loopback(self.host) and self.token is None:
            raise ValidationError("token", f"refusing to serve Sandbox Fusion on {self.host or 'every interface'!r} "
                                           "without a token: any host that reaches the port could run code")
        web = _web()
        authorize = self._authorize

        async def authorized(request: Any, handler: Any) -> Any:
            return await authorize(request, handler)

        app = web.Application(client_max_size=self.max_body, middlewares=[web.middleware(authorized)])
        for prefix in ("", "/{token}"):
            app.router.add_post(prefix + "/run_code", self._run_code)
            app.router.add_post(prefix + "/end_session", self._end_session)
            app.router.add_get(prefix + "/v1/ping", self._ping)
        app.router.add_get("/", self._root)
        # handler_cancellation: a client that goes away cancels its handler, and so its
        # action (_run); keepalive_timeout: a connection without a whole request head
        # that long (new, or idle after an answer) is closed; lingering_time: how long
        # the unread rest of a refused body is read and dropped before closing.
        _quiet_client_faults()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                                     handler_cancellation=True, keepalive_timeout=self.client_timeout,
                                     lingering_time=min(10.0, self.client_timeout), logger=_http_log)
        await self._runner.setup()
        listeners: list[_Listener] = []
        try:
            listeners = _listen(self.host, self.port, self)
            for listener in listeners:
                await web.SockSite(self._runner, listener, backlog=BACKLOG).start()
        except BaseException:
            for listener in listeners:
                listener.close()
            await self._runner.cleanup()
            self._runner = None
            raise
        host, port = listeners[0].getsockname()[:2]  # the port chosen for port 0
        self.address = (host, port)
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle_sessions())
        return self

    def stop_accepting(self) -> None:
        """New requests are answered at once with a SandboxError (shutting down); the ones
        running go on."""
        self._closing = True

    def live(self) -> list[asyncio.Future[Any]]:
        """The actions of the requests not answered yet (for a shutdown's grace)."""
        return list(self._live)

    async def close(self) -> None:
        """Stops taking requests (the ones running get their answers, as their actions
        end), closes the listener and ends every session. Idempotent."""
        if self._runner is None:
            return
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        runner, self._runner = self._runner, None
        await runner.cleanup()
        for session_id in list(self._sessions):
            self._end(session_id)
        for trajectory in self._pool.drain():
            self._end_trajectory(trajectory)
        if self._endings:
            await asyncio.gather(*self._endings, return_exceptions=True)

    # ---------------------------------------------------------------- requests
    async def _authorize(self, request: Any, handler: Any) -> Any:
        web = _web()
        self._started(request)
        if self.token is not None and request.path != "/":
            given = request.match_info.get("token")
            if given is None:
                header = request.headers.get("Authorization", "")
                given = header[7:] if header.startswith("Bearer ") else None
            if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
                return web.json_response({"detail": "a token is required (Authorization: Bearer TOKEN, or "
                                                    "http://HOST:PORT/TOKEN/run_code)"}, status=401)
        elif request.match_info.get("token") is not None:
            return web.json_response({"detail": "not found"}, status=404)
        return await handler(request)

    async def _ping(self, request: Any) -> Any:
        return _web().json_response("pong")

    async def _root(self, request: Any) -> Any:
        return _web().json_response({"server": "tangram", "api": "Sandbox Fusion", "run_code": "POST /run_code"})

    async def _run_code(self, request: Any) -> Any:
        """POST /run_code. Its answer carries a Server-Timing header, which clients ignore
        and bench/sandbox_fusion.py reads for the endpoint's own time: `total`
        (from the handler's start to the answer encoded, or to its first piece for an
        answer sent a piece at a time) and, for a request that ran, `run` (running it in
        the sandbox: tangram.runtime.sandbox.inside_run_code.run_code_timed), in ms."""
        began = time.perf_counter()
        answer = await self._answer(request)
        if not isinstance(answer, dict):  # a refusal: an HTTP error of its own
            answer.headers["Server-Timing"] = f"total;dur={(time.perf_counter() - began) * 1e3:.3f}"
            return answer
        return await self._send(request, answer, began)

    async def _answer(self, request: Any) -> Any:
        """The request's answer: a RunCodeResponse (a dict), or the web.Response refusing it."""
        body, refusal = await self._json_body(request)
        if refusal is not None:
            return refusal
        try:
            checked = check_request(body)
        except ValidationError as e:
            return _invalid(_loc(e.field), e.reason, "value_error")
        session_id = request.headers.get(SESSION_HEADER) or body.get("session_id")
        if session_id is not None and not (isinstance(session_id, str) and 0 < len(session_id) <= MAX_SESSION_ID):
            return _invalid(["body", "session_id"], f"must be a non-empty string of at most {MAX_SESSION_ID} "
                                                    "characters", "value_error")
        node = request.headers.get(NODE_HEADER) or body.get("node")
        if node is not None and not (isinstance(node, str) and node):
            return _invalid(["body", "node"], "must be a non-empty string (a node name)", "value_error")
        if node is not None and session_id is None:
            return _invalid(["body", "node"], "names a session's home: give a session_id too (a request without "
                                              "one runs in any pooled sandbox)", "value_error")
        if self._closing:
            return sandbox_error("the server is shutting down")
        if session_id is None:
            return await self._run_alone(checked, request)
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                return sandbox_error(f"cannot open session {session_id[:100]!r}: {len(self._sessions)} sessions are "
                                     f"open, the endpoint's limit (max_sessions); end one (POST /end_session) or "
                                     f"let one end by itself ({self.session_idle:g} s without a request)")
            session = self._sessions[session_id] = _Session(self._new_trajectory(), node)
        elif node is not None and node != session.node:
            where = session.node or "the node its first request ran on"
            return _invalid(["body", "node"], f"session {session_id!r} lives on {where}, not {node!r}", "value_error")
        session.running += 1
        try:
            async with session.lock:
                return await self._run(checked, session.trajectory, True, note=request, affinity=session.node)
        finally:
            session.running -= 1
            session.used = time.monotonic()
            if session.ended and not session.running:
                self._end_trajectory(session.trajectory)

    async def _json_body(self, request: Any) -> tuple[Any, Any]:
        """The request's JSON body and None, or None and the answer refusing it: 413 for a
        body over max_body (at once when its Content-Length says so), 408 for one that has
        not all arrived within client_timeout, 400 for one that could not be read, 422 for
        one that is not JSON (in an unknown charset, nested too deeply...)."""
        length = request.content_length
        if length is not None and length > self.max_body:
            return None, _refusal(413, f"the body is {length} bytes, over the endpoint's limit of {self.max_body} "
                                       f"bytes (max_body)")
        web = _web()
        try:
            async with asyncio.timeout(self.client_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return None, _refusal(413, f"the body is over the endpoint's limit of {self.max_body} bytes (max_body)")
        except TimeoutError:
            return None, _refusal(408, f"the body did not all arrive within {self.client_timeout:g} s "
                                       f"(client_timeout)")
        except ConnectionError:  # the client left mid-body: nobody reads this
            return None, _refusal(400, "the connection ended before the body did")
        except Exception as e:  # a malformed body (chunked encoding, compression): aiohttp's payload errors
            return None, _refusal(400, f"the body could not be read: {e}")
        charset: Any = None
        try:
            charset = request.charset or "utf-8"
            text = raw.decode(charset)
        except UnicodeDecodeError as e:
            return None, _invalid(["body"], f"not JSON: {e}", "json_invalid")
        except (LookupError, ValueError, TypeError):
            named = repr(charset) if charset is not None else repr(request.headers.get("Content-Type", ""))
            return None, _invalid(["body"], f"not JSON this endpoint reads: the Content-Type's charset {named[:200]} "
                                            f"is no text encoding Python knows", "json_invalid")
        del raw
        try:
            return json.loads(text), None
        except RecursionError:
            return None, _invalid(["body"], "not JSON this endpoint reads: arrays or objects nested too deeply",
                                  "json_invalid")
        except ValueError as e:
            return None, _invalid(["body"], f"not JSON: {e}", "json_invalid")

    async def _send(self, request: Any, answer: dict[str, Any], began: float) -> Any:
        """Sends a RunCodeResponse: encoded at once if small; a piece at a time, each
        piece sent before the next is encoded and the event loop serving others between
        them, if over STREAM_ABOVE; refused (a SandboxError naming the files) if over
        max_answer. A client that does not take a piece within client_timeout, or that
        went away, loses its connection; the answer is let go either way (its pieces
        are not left to the cyclic garbage collector in a lost write's traceback)."""
        web = _web()
        sent = answer  # let go of at the end, whatever is sent in its place
        try:
            size = _json_size(answer)
        except RecursionError:
            answer, size = sandbox_error("the sandbox's answer is nested too deeply to encode as JSON"), 0
        if size > self.max_answer:
            answer = self._over_max_answer(answer, size)
        body: bytes | None = None
        if size <= STREAM_ABOVE:
            try:
                body = json.dumps(answer).encode()
            except (TypeError, ValueError, RecursionError) as e:
                body = json.dumps(sandbox_error(f"the sandbox's answer cannot be encoded as JSON: {e}")).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
        if body is not None:
            response.content_length = len(body)
        timing = f"total;dur={(time.perf_counter() - began) * 1e3:.3f}"
        if RUN_SECONDS in request:
            timing += f", run;dur={request[RUN_SECONDS] * 1e3:.3f}"
        response.headers["Server-Timing"] = timing
        try:
            async with asyncio.timeout(self.client_timeout):
                await response.prepare(request)
            if body is not None:
                await self._write(response, body)
            else:
                pending: list[str] = []  # small pieces, gathered into about PIECE characters a write
                held = 0
                for piece in _json_pieces(answer):
                    pending.append(piece)
                    held += len(piece)
                    if held >= PIECE:
                        await self._write(response, "".join(pending).encode("ascii"))  # ensure_ascii's
                        pending.clear()
                        held = 0
                        await asyncio.sleep(0)  # a write that did not wait still lets the others in
                if pending:
                    await self._write(response, "".join(pending).encode("ascii"))
            async with asyncio.timeout(self.client_timeout):
                await response.write_eof()
        except (ConnectionError, TimeoutError, ValueError, TypeError, RecursionError) as e:
            # The client went away or does not read; or the sandbox's answer could not be
            # encoded after its first pieces went. Either way the connection goes.
            e.__traceback__ = None
            if request.transport is not None:
                request.transport.abort()
        except asyncio.CancelledError as e:  # handler_cancellation: the connection was lost
            e.__traceback__ = None
            raise
        finally:
            sent.clear()
            answer.clear()
            body = None
        return response

    async def _write(self, response: Any, data: bytes) -> None:
        async with asyncio.timeout(self.client_timeout):
            await response.write(data)

    def _over_max_answer(self, answer: dict[str, Any], size: int) -> dict[str, Any]:
        """The SandboxError that replaces an answer over max_answer: it names the biggest
        fetched files and keeps the steps' results (stdout, stderr) when they fit."""
        files = answer.get("files")
        sizes = sorted(((len(v) if isinstance(v, str) else 0, str(k)) for k, v in files.items()),
                       reverse=True) if isinstance(files, dict) else []
        shown = ", ".join(f"{name[:100]!r} ({n} bytes of base64)" for n, name in sizes[:5])
        more = f" and {len(sizes) - 5} more" if len(sizes) > 5 else ""
        message = (f"the answer would be about {size} bytes of JSON, over the endpoint's limit of {self.max_answer} "
                   f"bytes (max_answer)" + (f"; fetch_files: {shown}{more}" if shown else ""))
        refused = sandbox_error(message, answer.get("compile_result"), answer.get("run_result"))
        try:
            if _json_size(refused) <= self.max_answer:
                return refused
        except RecursionError:
            pass
        return sandbox_error(message)

    async def _run(self, checked: dict[str, Any], trajectory: int, keep_files: bool, pooled: bool = False,
                   note: Any = None, affinity: str | None = None) -> dict[str, Any]:
        """One request as one action: its result, or the in-band error its end says. The
        seconds running it took in the sandbox go to note[RUN_SECONDS] (the aiohttp request).
        `affinity`: the node it must run on (its session's home). Cancelled (the client
        went away: aiohttp cancels the handler), it cancels the action, which kills the
        program."""
        call = run_code_call(checked, trajectory, keep_files, cpu=self.cpu, pooled=pooled, timed=True)
        if affinity is not None:
            call = dataclasses.replace(call, affinity=affinity)
        try:
            handle = self.orchestrator.submit(call)
        except TangramError as e:  # it can never run here (more memory than any node has...)
            return sandbox_error(f"tangram cannot run this request: {e}")
        self._live.add(handle.future)
        try:
            answer, seconds = checked_timed_answer(await handle.future)
            if note is not None:
                note[RUN_SECONDS] = seconds
            return answer
        except TangramError as e:
            return error_answer(e)
        except asyncio.CancelledError:  # the client went away: so does its action
            handle.cancel()
            raise
        finally:
            self._live.discard(handle.future)

    async def _run_alone(self, checked: dict[str, Any], note: Any) -> dict[str, Any]:
        """A request without a session: in a pooled sandbox (Call.pooled, scrubbed after
        it), or in a new one ended after it (`fresh_sandboxes`)."""
        if self.fresh_sandboxes:
            trajectory = self._new_trajectory()
            try:
                return await self._run(checked, trajectory, False, note=note)
            finally:
                self._end_trajectory(trajectory)
        trajectory = self._pool.take()
        try:
            return await self._run(checked, trajectory, False, pooled=True, note=note)
        finally:
            self._pool.give_back(trajectory)

    async def _end_session(self, request: Any) -> Any:
        web = _web()
        body, refusal = await self._json_body(request)
        if refusal is not None:
            return refusal
        session_id = body.get("session_id") if isinstance(body, dict) else None
        if not isinstance(session_id, str) or not session_id:
            return _invalid(["body", "session_id"], "is required, a non-empty string", "value_error")
        ended = self._end(session_id)
        return web.json_response({"session_id": session_id, "ended": ended})

    # ---------------------------------------------------------------- connections
    def _started(self, request: Any) -> None:
        """A request's head arrived whole on its connection: from now on aiohttp's keep-alive
        timeout (after each answer) and the body's and the answer's timeouts bound it."""
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        connection = self._connections.get(sock.fileno()) if sock is not None else None
        if connection is not None:
            connection.started = True

    def _refusal_bytes(self) -> bytes:
        """The whole HTTP answer to a connection over max_connections."""
        body = json.dumps({"detail": f"the server has {self.max_connections} connections open, its limit "
                                     f"(max_connections): try again later"}).encode()
        return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    # ---------------------------------------------------------------- trajectories
    def _new_trajectory(self) -> int:
        trajectory = self._first + self._next
        self._next = (self._next + 1) % self._count
        return trajectory

    def _end_trajectory(self, trajectory: int) -> None:
        task = asyncio.get_running_loop().create_task(self._ending(trajectory))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    async def _ending(self, trajectory: int) -> None:
        try:
            await self.orchestrator.end_trajectory(trajectory)
        except TangramError:  # the orchestrator closed first: it ended every sandbox itself
            pass

    def _end(self, session_id: str) -> bool:
        """Ends a session: its sandbox goes now, or when its last request is answered."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.ended = True
        if not session.running:
            self._end_trajectory(session.trajectory)
        return True

    async def _reap_idle_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(self.session_idle, 30.0))
            idle_since = time.monotonic() - self.session_idle
            for session_id, session in list(self._sessions.items()):
                if session.running == 0 and session.used < idle_since:
                    self._end(session_id)


# -------------------------------------------------------------------- listening


class _ClientFaults(logging.Filter):
    """aiohttp's record of a request it could not parse (the client's fault: answered
    400) or of a connection that went away, demoted to debug: not a traceback on stderr
    for every bad client."""

    def __init__(self, faults: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.faults = faults

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.faults) and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _quiet_client_faults() -> None:
    if not any(isinstance(f, _ClientFaults) for f in _http_log.filters):
        from aiohttp.http_exceptions import HttpProcessingError

        _http_log.addFilter(_ClientFaults((HttpProcessingError, ConnectionError)))



class _Connection(socket.socket):
    """An accepted connection, counted in its endpoint's open connections until closed
    (asyncio's transport closes it). `started`: a request's head arrived whole on it."""

    __slots__ = ("_open", "started")

    def close(self) -> None:
        open_ = getattr(self, "_open", None)
        if open_ is not None:
            self._open = None
            fd = self.fileno()
            if open_.get(fd) is self:
                del open_[fd]
        super().close()


def _close_if_silent(ref: "weakref.ref[_Connection]") -> None:
    """client_timeout after it was accepted: a connection on which no request's head has
    arrived whole (silent, or sending it a byte at a time) is shut down, its transport
    then closing it. (Recent aiohttp closes such a connection at its keep-alive timeout
    too; older versions, which pyproject allows, do not.)"""
    connection = ref()
    if connection is None or getattr(connection, "started", True) or connection.fileno() < 0:
        return
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Listener(socket.socket):
    """The endpoint's listening socket. asyncio accepts through `accept()`, which here
    answers a connection over the endpoint's max_connections 503 and closes it, and,
    when the process has run out of descriptors, closes new connections as they come (a
    spare descriptor, given up for the moment, makes room to accept each) instead of
    letting asyncio log the error once per backlog entry, every second, for as long as it
    lasts."""

    __slots__ = ("_endpoint", "_spare", "_warned", "_quiet_until")

    REFUSE_AT_ONCE = 64  # connections refused or shed per accept(), before the event loop's other work

    def setup(self, endpoint: SandboxFusionEndpoint) -> None:
        self._endpoint = endpoint
        self._warned: dict[str, float] = {}
        self._quiet_until = 0.0
        self._spare: int | None = None
        self._reserve()

    def _reserve(self) -> None:
        if getattr(self, "_spare", None) is None:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._spare = None

    def _accept_fd(self) -> tuple[int, Any]:
        """socket.accept's descriptor and address, the socket object given up."""
        conn, address = super().accept()
        return conn.detach(), address

    def accept(self) -> tuple[socket.socket, Any]:
        endpoint = self._endpoint
        for _ in range(self.REFUSE_AT_ONCE):
            try:
                fd, address = self._accept_fd()
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                shed = self._shed()
                if shed:
                    continue
                if shed is False:  # nothing (more) to accept
                    raise BlockingIOError(errno.EAGAIN, "nothing to accept") from None
                # No spare either (another thread took the descriptor it freed): asyncio logs
                # this and stops accepting for a second (rather than spin on it here); the
                # calls it goes on making in the same round are told there is nothing more,
                # so that it logs it once, not once per backlog entry.
                if time.monotonic() < self._quiet_until:
                    raise BlockingIOError(errno.EAGAIN, "out of descriptors: accepting again soon") from None
                self._quiet_until = time.monotonic() + 0.5
                raise
            if len(endpoint._connections) >= endpoint.max_connections:
                self._refuse(fd, endpoint._refusal_bytes())
                self._warn("connections", f"tangram Sandbox Fusion endpoint: {endpoint.max_connections} "
                                          f"connections open (max_connections): refusing more (503)")
                continue
            connection = _Connection(self.family, self.type, self.proto, fileno=fd)
            connection.started = False
            connection._open = endpoint._connections
            endpoint._connections[fd] = connection
            asyncio.get_running_loop().call_later(endpoint.client_timeout, _close_if_silent, weakref.ref(connection))
            if socket.getdefaulttimeout() is None and self.gettimeout():
                connection.setblocking(True)  # as socket.accept does; asyncio sets it non-blocking
            return connection, address
        raise BlockingIOError(errno.EAGAIN, "the rest on the event loop's next round")

    def _shed(self) -> bool | None:
        """Out of descriptors: gives up the spare, accepts one connection in its place and
        closes it, takes the spare back. False if there was nothing to accept; None if
        there was no spare (or the descriptor it freed went elsewhere first)."""
        if self._spare is None:
            self._reserve()
            if self._spare is None:
                return None
        os.close(self._spare)
        self._spare = None
        try:
            fd, _ = self._accept_fd()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            self._reserve()
            return False
        except OSError:
            self._reserve()
            return None
        os.close(fd)
        self._reserve()
        self._warn("descriptors", f"tangram Sandbox Fusion endpoint: out of file descriptors (RLIMIT_NOFILE "
                                  f"{_descriptor_limit()}): closing new connections as they come")
        return True

    def _refuse(self, fd: int, answer: bytes) -> None:
        """Answers a connection `answer` and closes it."""
        with socket.socket(self.family, self.type, self.proto, fileno=fd) as connection:
            connection.setblocking(False)
            try:
                connection.send(answer)
                for _ in range(4):  # what the client sent already: closing on unread data would reset
                    if not connection.recv(65536):
                        break
            except OSError:
                pass

    def _warn(self, what: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -math.inf) >= 60.0:
            self._warned[what] = now
            _log.warning(message)

    def close(self) -> None:
        spare = getattr(self, "_spare", None)
        if spare is not None:
            self._spare = None
            os.close(spare)
        super().close()


def _listen(host: str, port: int, endpoint: SandboxFusionEndpoint) -> list[_Listener]:
    """Listening sockets for every address `host` resolves to (all of them on the port the
    first one got, for port 0), as asyncio's create_server would bind them."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[_Listener] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            listener = _Listener(family, kind, proto)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(listeners) > 1:
                address = (address[0], listeners[0].getsockname()[1], *address[2:])
            listener.bind(address)
            listener.setup(endpoint)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    return listeners


# -------------------------------------------------------------------- answers


def _json_size(value: Any, depth: int = 0) -> int:
    """About how long `value` is as JSON: its strings' lengths (escapes aside: a
    fetched file's base64 has none), a little for everything else. RecursionError past
    32 levels (an answer is 3 deep)."""
    if isinstance(value, str):
        return len(value) + 2
    if depth > 32:
        raise RecursionError("nested more than 32 deep")
    if isinstance(value, dict):
        return 2 + sum(_json_size(k, depth + 1) + _json_size(v, depth + 1) + 2 for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 2 + sum(_json_size(v, depth + 1) + 1 for v in value)
    return 24


def _json_pieces(value: Any) -> Iterator[str]:
    """`value` as json.dumps writes it (its separators, ensure_ascii), in pieces of about PIECE
    characters or less: a long string is encoded PIECE characters at a time (each
    character escapes on its own, so the pieces join into json.dumps's text)."""
    if isinstance(value, str):
        if len(value) <= PIECE:
            yield json.dumps(value)
            return
        yield '"'
        for i in range(0, len(value), PIECE):
            yield json.dumps(value[i:i + PIECE])[1:-1]
        yield '"'
    elif isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError(f"a key of the sandbox's answer is not a string: {type(key).__name__}")
            yield (", " if i else "") + json.dumps(key) + ": "
            yield from _json_pieces(item)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ", "
            yield from _json_pieces(item)
        yield "]"
    else:
        yield json.dumps(value)


def _loc(field: str) -> list[Any]:
    """A ValidationError's field as FastAPI's `loc`: request.files['a.b'] ->
    ["body", "files", "a.b"], request.fetch_files[0] -> ["body", "fetch_files", 0]."""
    match = re.fullmatch(r"request\.(\w+)(?:\[(.*)\])?", field, re.DOTALL)
    if match is None:
        return ["body"]
    loc: list[Any] = ["body", match.group(1)]
    if match.group(2) is not None:
        try:
            loc.append(ast.literal_eval(match.group(2)))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            loc.append(match.group(2))
    return loc


def _refusal(status: int, detail: str) -> Any:
    """An HTTP error of the endpoint itself, as JSON ({"detail": ...}, FastAPI's shape);
    the connection is closed after it (the rest of a refused body is not read)."""
    response = _web().json_response({"detail": detail}, status=status)
    response.force_close()
    return response


def _invalid(location: list[Any], message: str, kind: str) -> Any:
    """HTTP 422 in the shape FastAPI (Sandbox Fusion's server) gives a request that does
    not validate."""
    return _web().json_response({"detail": [{"loc": location, "msg": message, "type": kind}]}, status=422,
                                dumps=json.dumps)
