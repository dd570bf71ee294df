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

Errors of the action itself come back in-band, as Sandbox Fusion reports its own: a
SandboxError with the reason in `message` (the action failed, crashed, timed out past the
request's timeouts, or was cancelled when the server shut down); memory past
memory_limit_MB is a Failed run with return code -9.

Safety: the same rules as the TCP server. It listens where `tangram serve` does (127.0.0.1
unless told otherwise, and anywhere else only with a token). With a token, every request
must carry it, as `Authorization: Bearer TOKEN` or, for clients that cannot set headers
(veRL and SkyRL take a URL), as the first segment of the path: `http://HOST:PORT/TOKEN/run_code`.
Request bodies are limited to `max_body` bytes (`files` come base64).

Built on aiohttp (aiohttp.web): a well-kept asyncio HTTP server that joins the server's
running event loop through a public API (AppRunner, TCPSite) without taking over its
signal handling, and is already installed wherever Ray or the sandbox-fusion client is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from typing import Any

from .._errors import TangramError, ValidationError
from ..runtime.orchestrator import Orchestrator
from ..runtime.sandbox.run_code import TrajectoryPool, check_request, error_answer, run_code_call, sandbox_error
from .protocol import is_loopback

DEFAULT_PORT = 8080  # Sandbox Fusion's (SkyRL's verifier assumes it)
DEFAULT_MAX_BODY = 64 << 20
DEFAULT_SESSION_IDLE = 600.0
SESSION_HEADER = "X-Tangram-Session"
NODE_HEADER = "X-Tangram-Node"  # a session's home: the node its sandbox lives on (Call.affinity)
RUN_SECONDS = "tangram_run_seconds"  # the aiohttp request's key for Server-Timing's `run`


def _web() -> Any:
    """aiohttp.web, imported when the endpoint starts (a Client's import of tangram.server
    does not pay for it)."""
    try:
        from aiohttp import web
    except ImportError:  # pragma: no cover - a dependency of arl-tangram; this names it if it went missing
        raise ValidationError("sandbox_fusion", "the Sandbox Fusion endpoint needs aiohttp (a dependency of "
                                                "arl-tangram): pip install aiohttp") from None
    return web


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
    `await start()`, then `address`; `await close()` to stop."""

    def __init__(self, orchestrator: Orchestrator, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None, trajectories: tuple[int, int] = (1 << 40, 1 << 32),
                 max_body: int = DEFAULT_MAX_BODY, session_idle: float = DEFAULT_SESSION_IDLE,
                 fresh_sandboxes: bool = False, cpu: float = 1.0) -> None:
        if not isinstance(max_body, int) or isinstance(max_body, bool) or max_body < 1024:
            raise ValidationError("max_body", f"must be an integer of at least 1024 bytes, got {max_body!r}")
        if not (isinstance(session_idle, (int, float)) and session_idle > 0):
            raise ValidationError("session_idle", f"must be a positive number of seconds, got {session_idle!r}")
        self.orchestrator = orchestrator
        self.host, self.port = host, port
        self.token = token or None
        self.max_body = max_body
        self.session_idle = float(session_idle)
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
        self._reaper: asyncio.Task[None] | None = None
        self._endings: set[asyncio.Task[None]] = set()
        self._live: set[asyncio.Future[Any]] = set()  # the actions of requests not answered yet
        self._closing = False

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
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
        await self._runner.setup()
        # veRL opens a connection per request: a deep backlog keeps a burst from being refused.
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        host, port = self._runner.addresses[0][:2]  # the port chosen for port 0
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
        (from the handler's start to the answer encoded) and, for a request that ran,
        `run` (running it in the sandbox: tangram.runtime.sandbox.inside_run_code.run_code_timed), in ms."""
        began = time.perf_counter()
        response = await self._answer(request)
        timing = f"total;dur={(time.perf_counter() - began) * 1e3:.3f}"
        if RUN_SECONDS in request:
            timing += f", run;dur={request[RUN_SECONDS] * 1e3:.3f}"
        response.headers["Server-Timing"] = timing
        return response

    async def _answer(self, request: Any) -> Any:
        web = _web()
        body, refusal = await _json_body(request)
        if refusal is not None:
            return refusal
        try:
            checked = check_request(body)
        except ValidationError as e:
            return _invalid(["body", *e.field.split(".")[1:]], e.reason, "value_error")
        session_id = request.headers.get(SESSION_HEADER) or body.get("session_id")
        if session_id is not None and not (isinstance(session_id, str) and session_id):
            return _invalid(["body", "session_id"], "must be a non-empty string", "value_error")
        node = request.headers.get(NODE_HEADER) or body.get("node")
        if node is not None and not (isinstance(node, str) and node):
            return _invalid(["body", "node"], "must be a non-empty string (a node name)", "value_error")
        if node is not None and session_id is None:
            return _invalid(["body", "node"], "names a session's home: give a session_id too (a request without "
                                              "one runs in any pooled sandbox)", "value_error")
        if self._closing:
            return web.json_response(sandbox_error("the server is shutting down"))
        if session_id is None:
            return web.json_response(await self._run_alone(checked, request))
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(self._new_trajectory(), node)
        elif node is not None and node != session.node:
            where = session.node or "the node its first request ran on"
            return _invalid(["body", "node"], f"session {session_id!r} lives on {where}, not {node!r}", "value_error")
        session.running += 1
        try:
            async with session.lock:
                return web.json_response(await self._run(checked, session.trajectory, True, note=request,
                                                         affinity=session.node))
        finally:
            session.running -= 1
            session.used = time.monotonic()
            if session.ended and not session.running:
                self._end_trajectory(session.trajectory)

    async def _run(self, checked: dict[str, Any], trajectory: int, keep_files: bool, pooled: bool = False,
                   note: Any = None, affinity: str | None = None) -> dict[str, Any]:
        """One request as one action: its result, or the in-band error its end says. The
        seconds running it took in the sandbox go to note[RUN_SECONDS] (the aiohttp request).
        `affinity`: the node it must run on (its session's home)."""
        call = run_code_call(checked, trajectory, keep_files, cpu=self.cpu, pooled=pooled, timed=True)
        if affinity is not None:
            call = dataclasses.replace(call, affinity=affinity)
        try:
            handle = self.orchestrator.submit(call)
        except TangramError as e:  # it can never run here (more memory than any node has...)
            return sandbox_error(f"tangram cannot run this request: {e}")
        self._live.add(handle.future)
        try:
            answer, seconds = await handle.future
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
        body, refusal = await _json_body(request)
        if refusal is not None:
            return refusal
        session_id = body.get("session_id") if isinstance(body, dict) else None
        if not isinstance(session_id, str) or not session_id:
            return _invalid(["body", "session_id"], "is required, a non-empty string", "value_error")
        ended = self._end(session_id)
        return web.json_response({"session_id": session_id, "ended": ended})

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


async def _json_body(request: Any) -> tuple[Any, Any]:
    """The request's JSON body and None, or None and the 422 for a body that is not JSON."""
    try:
        return await request.json(), None
    except ValueError as e:
        return None, _invalid(["body"], f"not JSON: {e}", "json_invalid")


def _invalid(location: list[str], message: str, kind: str) -> Any:
    """HTTP 422 in the shape FastAPI (Sandbox Fusion's server) gives a request that does
    not validate."""
    return _web().json_response({"detail": [{"loc": location, "msg": message, "type": kind}]}, status=422,
                                dumps=json.dumps)
