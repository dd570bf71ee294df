"""The server of `tangram serve` (tangram.server.command): one orchestrator serving many
client processes over TCP.

The server is an Orchestrator plus a listener. Each connection submits actions with ids in
its own range; the server submits them to the orchestrator as they arrive (the frames read
in one event-loop iteration, from every connection, are one batch into the core, like one
iteration of an in-process caller) and sends results back coalesced: every result that
completes in one event-loop iteration of the server goes out in one RESULTS frame per
connection. A round trip costs two iterations: the orchestrator runs the first step of an
action's execution as it starts it (an eager start), so an action that ends at once (a
no-op, a cached answer) is answered in the iteration after its frame was read, and
results reach their connection from the orchestrator's record log, with no callback hop.
The connections read straight into their frame readers' buffers (asyncio's
BufferedProtocol), with no allocation per read.

Safety: binds to 127.0.0.1 unless told otherwise, and refuses to bind anywhere else
without a token; nothing from a connection is unpickled before its HELLO carried the
token; frames longer than `max_frame` (before authentication: 64 KiB), unknown or
malformed frames end that connection with a typed error, never the server. A connection
that drops has its live actions cancelled and its trajectories ended. Shutdown (SIGTERM,
SIGINT or `Server.close`) stops accepting work, lets running actions finish for `grace`
seconds, cancels the rest, sends every result and a GOODBYE, then closes.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import pickle
from typing import Any, Mapping, Sequence

import cloudpickle

from .._errors import TangramError, ValidationError
from .._model import Inventory
from ..runtime.call import Call
from ..runtime.config import RuntimeConfig
from ..runtime.errors import ActionCancelled, ActionFailed
from ..runtime.holds import QuotaHold
from ..runtime.managers.base import ResourceManager
from ..runtime.errors import OrchestratorClosed
from ..runtime.live import ActionHandle
from ..runtime.orchestrator import Orchestrator
from ..runtime.records import ActionRecord
from . import protocol as P
from .protocol import AuthenticationError, FrameTooLarge, ProtocolError, is_loopback
from .sandbox_fusion import SandboxFusionEndpoint

_TRAJECTORY_LIMIT = 1 << P.ID_BITS
_ID_MASK = (1 << P.ID_BITS) - 1


class Server:
    """An orchestrator behind a TCP listener. Takes the Orchestrator's arguments, plus:

    host, port    where to listen (default 127.0.0.1:7450; port 0 picks a free one)
    token         a shared secret every client must present (TANGRAM_TOKEN); required
                  unless `host` is a loopback address
    max_frame     the largest frame accepted from an authenticated client, in bytes
    hello_timeout seconds a new connection has to authenticate
    sandbox_fusion_port
                  also serve Sandbox Fusion's HTTP API on this port, on the same host and
                  orchestrator, with the same token (tangram.server.sandbox_fusion; 0 picks
                  a free port, None: not served); then `sandbox_fusion.address`
    sandbox_fusion_fresh
                  a new sandbox for each of its requests without a session, rather than
                  a pooled one
    sandbox_fusion_cpu
                  the cores each of its requests is guaranteed (default 1)

    `await start()` (or `async with`), then `address`; `await close(grace)` to stop.
    """

    def __init__(self, config: RuntimeConfig | None = None, *, host: str = "127.0.0.1", port: int = P.DEFAULT_PORT,
                 token: str | None = None, policy: str | None = None, inventory: Inventory | None = None,
                 managers: Sequence[ResourceManager] | Mapping[str, ResourceManager] = (),
                 default_managers: bool = True, max_frame: int = P.DEFAULT_MAX_FRAME,
                 hello_timeout: float = 10.0, sandbox_fusion_port: int | None = None,
                 sandbox_fusion_fresh: bool = False, sandbox_fusion_cpu: float = 1.0,
                 sandbox_fusion_options: Mapping[str, Any] | None = None,
                 orchestrator: Orchestrator | None = None) -> None:
        if not isinstance(max_frame, int) or max_frame < 1024:
            raise ValidationError("max_frame", f"must be an integer of at least 1024 bytes, got {max_frame!r}")
        if token is not None and not isinstance(token, str):
            raise ValidationError("token", "must be a string")
        self.host = host
        self.port = port
        self.token = token or None
        self.max_frame = max_frame
        self.hello_timeout = hello_timeout
        if orchestrator is not None:  # one made elsewhere (tangram serve --ray: a RayOrchestrator)
            if config is not None or inventory is not None or policy is not None or managers:
                raise ValidationError("orchestrator", "a server given an orchestrator takes its configuration, "
                                                      "inventory, policy and managers from it")
            self.orchestrator = orchestrator
        else:
            self.orchestrator = Orchestrator(config, inventory=inventory, policy=policy, managers=managers,
                                             default_managers=default_managers)
        self.address: tuple[str, int] | None = None
        self.sandbox_fusion_port = sandbox_fusion_port
        self.sandbox_fusion_fresh = sandbox_fusion_fresh
        self.sandbox_fusion_cpu = sandbox_fusion_cpu
        # more of SandboxFusionEndpoint's options (max_sessions, max_connections, client_timeout...)
        self.sandbox_fusion_options = dict(sandbox_fusion_options or {})
        self.sandbox_fusion: SandboxFusionEndpoint | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._by_number: dict[int, _Connection] = {}  # authenticated connections, by number
        self._numbers = itertools.count(1)
        self._submitters: set[_Connection] = set()  # connections that submitted in this iteration
        self._writes_handle: asyncio.Handle | None = None
        # Every action's end reaches its connection synchronously, through the record log,
        # instead of through a done callback per future (one more event-loop hop each).
        self.orchestrator.records.add_listener(self._finished)
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._closed: asyncio.Event | None = None
        self._force: asyncio.Event | None = None

    async def start(self) -> "Server":
        if not is_loopback(self.host) and self.token is None:
            raise ValidationError("token", f"refusing to listen on {self.host or 'every interface'!r} without a token: "
                                           "clients' calls are unpickled and run here, so any host that can reach "
                                           "the port could run code; pass --token or set TANGRAM_TOKEN")
        self._closed = asyncio.Event()
        self._force = asyncio.Event()
        await self.orchestrator.start()
        loop = asyncio.get_running_loop()
        try:
            self._listener = await loop.create_server(lambda: _Connection(self), self.host, self.port,
                                                      reuse_address=True)
            if self.sandbox_fusion_port is not None:
                # Its trajectories are a connection number's range, as a client's are.
                number = next(self._numbers)
                self.sandbox_fusion = SandboxFusionEndpoint(
                    self.orchestrator, host=self.host, port=self.sandbox_fusion_port, token=self.token,
                    trajectories=(number << P.ID_BITS, 1 << P.ID_BITS), fresh_sandboxes=self.sandbox_fusion_fresh,
                    cpu=self.sandbox_fusion_cpu, **self.sandbox_fusion_options)
                await self.sandbox_fusion.start()
            sockname = self._listener.sockets[0].getsockname()
            self.address = (sockname[0], sockname[1])
            # (a blocking call to the Ray cluster where there is one)
            await asyncio.to_thread(self.orchestrator.advertise, self.host, self.address[1])
        except BaseException:
            if self._listener is not None:
                self._listener.close()
            if self.sandbox_fusion is not None:
                await self.sandbox_fusion.close()
            await self.orchestrator.close()
            raise
        return self

    async def __aenter__(self) -> "Server":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def force_close(self) -> None:
        """Cuts a running `close(grace)` short: the remaining actions are cancelled now."""
        if self._force is not None:
            self._force.set()

    async def close(self, grace: float = 0.0) -> None:
        """Stops accepting connections and actions (new submits end with OrchestratorClosed),
        waits up to `grace` seconds for live actions to finish, cancels the rest
        (ActionCancelled), sends every connection its results and a GOODBYE, and closes.
        Idempotent; a second call waits for the first."""
        if self._closed is None or self._force is None:  # never started
            self._closing = True
            return
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        endpoint = self.sandbox_fusion
        if endpoint is not None:
            endpoint.stop_accepting()
        live = [h.future for c in list(self._connections) for h in c.live.values()]
        if endpoint is not None:
            live += endpoint.live()
        if grace > 0 and live:
            everything = asyncio.ensure_future(asyncio.gather(*(asyncio.shield(f) for f in live),
                                                              return_exceptions=True))
            forced = asyncio.ensure_future(self._force.wait())
            await asyncio.wait({everything, forced}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for t in (everything, forced):
                t.cancel()
            await asyncio.gather(everything, forced, return_exceptions=True)
        requests = [t for c in self._connections for t in c.requests]
        if requests:
            await asyncio.wait(requests, timeout=max(grace, 1.0))
        await self.orchestrator.close()
        if endpoint is not None:  # its requests were answered as the orchestrator ended their actions
            await endpoint.close()
        for _ in range(3):  # the futures' done callbacks queue the last results
            await asyncio.sleep(0)
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for conn in list(self._connections):
            conn.goodbye("the server is shutting down")
        waiting = [c.closed for c in self._connections]
        if waiting:
            await asyncio.wait(waiting, timeout=5.0)
            for conn in list(self._connections):
                if conn.transport is not None:
                    conn.transport.abort()
        if self._listener is not None:
            await self._listener.wait_closed()
        self._closed.set()

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _submitted(self, conn: _Connection) -> None:
        """`conn` submitted actions in this event-loop iteration."""
        self._submitters.add(conn)
        if self._writes_handle is None:
            self._writes_handle = conn.loop.call_soon(self._queue_writes)

    def _queue_writes(self) -> None:
        """The iteration after the reads. Every connection's submits of the last iteration
        went to the core as one batch (the orchestrator's flush, queued before this; the
        flush() here only makes sure), and the actions it started have run their first
        steps (eager starts): the results of those that ended at once (a no-op, a cached
        answer) leave now, in one frame per connection."""
        self._writes_handle = None
        self.orchestrator.flush()
        submitters, self._submitters = self._submitters, set()
        for conn in submitters:
            if conn.results or conn.replies:
                conn._flush()
        # The actions that just ended free their resources in the core now, not in an
        # iteration of their own (one loop iteration and epoll_wait fewer per request).
        self.orchestrator.flush()

    def _finished(self, record: ActionRecord) -> None:
        """An action ended (the orchestrator calls this in its terminal state, once per
        action): its outcome joins its connection's next RESULTS frame."""
        conn = self._by_number.get(record.id >> P.ID_BITS)
        if conn is not None:
            conn._done(record)


def _hello_flag(hello: dict[str, Any], key: str) -> bool:
    """A true/false option of HELLO (absent: false); anything else is a ProtocolError, not
    a guess ("false" is a non-empty string)."""
    value = hello.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(key, f"HELLO: must be true or false, got {value!r}")
    return value


class _Connection(asyncio.BufferedProtocol):
    """One client: its frames in (read straight into its frame reader's buffer), its
    results out."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.orch = server.orchestrator
        self.loop = asyncio.get_running_loop()
        self.reader = P.FrameReader(P.PREAUTH_MAX_FRAME)
        self.transport: asyncio.Transport | None = None
        self.state = "hello"  # -> "ready" -> "closed"
        self.number = 0
        self.shared = False
        self.send_records = False  # the HELLO asked for each action's record with its result
        self.live: dict[int, ActionHandle] = {}
        self.holds: dict[int, QuotaHold] = {}  # quota holds the client asked for, by action id, until released
        self.trajectories: set[int] = set()
        self.results: list[tuple[int, bool, Any, bytes | None]] = []
        self.replies: list[tuple[int, bool, Any]] = []
        self.requests: set[asyncio.Task[Any]] = set()
        self.flush_handle: asyncio.Handle | None = None  # the write queued for the next iteration
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.hello_timer: asyncio.TimerHandle | None = None

    # ---------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        P.keepalive(transport.get_extra_info("socket"))
        self.server._connections.add(self)
        if self.server._closing:
            self.fail(OrchestratorClosed("server", "the server is shutting down"))
            return
        self.hello_timer = self.loop.call_later(self.server.hello_timeout, self._hello_expired)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        reader = self.reader
        if self.state == "closed":  # read after the end: dropped unread
            reader.start = reader.end = 0
            return
        reader.deliver(nbytes, self._frame, self.fail, "the server", self._is_open)

    def _is_open(self) -> bool:
        return self.state != "closed"

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def pause_writing(self) -> None:
        # A client that does not read its results may not submit more either: the
        # server's buffer for it stays bounded by its live actions.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and self.state != "closed":
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop()
        self.server._connections.discard(self)
        if self.server._by_number.get(self.number) is self:
            del self.server._by_number[self.number]
        if not self.closed.done():
            self.closed.set_result(None)

    def _drop(self) -> None:
        """The client is gone (or is being sent away): cancel its actions, end its
        trajectories once they have ended. Idempotent."""
        self.state = "closed"
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        self.results.clear()
        self.replies.clear()
        for t in self.requests:
            t.cancel()
        handles = list(self.live.values())
        for h in handles:
            self.orch.cancel(h.id)
        self.holds.clear()  # their actions were among the live ones: cancelled, their slots back
        if self.trajectories and not self.server._closing:
            self.server._track(self.loop.create_task(self._end_trajectories(handles, sorted(self.trajectories))))
        self.live.clear()
        self.trajectories.clear()

    async def _end_trajectories(self, handles: list[ActionHandle], trajectories: list[int]) -> None:
        """A dropped client's sandboxes go once its cancelled actions have ended."""
        await asyncio.gather(*(h.future for h in handles), return_exceptions=True)
        for t in trajectories:
            if self.server._closing:
                return
            try:
                await self.orch.end_trajectory(t)
            except Exception:
                pass

    def _hello_expired(self) -> None:
        if self.state == "hello":
            self.fail(AuthenticationError("token", f"no HELLO within {self.server.hello_timeout:g} s"))

    def fail(self, error: BaseException) -> None:
        """Sends a typed error and closes the connection: our side at once (FIN after the
        error frame), reading and discarding whatever the client still sends until it
        closes too, or for at most a second; closing with unread data would send a reset
        that can destroy the error frame before the client reads it."""
        transport = self.transport
        if self.state == "closed" or transport is None:
            return
        self._drop()
        try:
            transport.write(P.error_frame(error))
            if transport.can_write_eof():
                transport.write_eof()
                transport.resume_reading()
                self.loop.call_later(1.0, transport.close)
                return
        except Exception:
            pass
        transport.close()

    def goodbye(self, reason: str) -> None:
        if self.state == "closed" or self.transport is None:
            return
        self._flush()
        self.state = "closed"
        try:
            self.transport.write(P.json_frame(P.GOODBYE, {"reason": reason}))
        finally:
            self.transport.close()

    # ---------------------------------------------------------------- frames
    def _frame(self, kind: int, payload: bytes) -> None:
        if self.state == "hello":
            if kind != P.HELLO:
                raise ProtocolError("frame", f"expected HELLO first, got {P.FRAME_NAMES.get(kind, f'type {kind}')}")
            self._hello(P.load_json(payload, "HELLO"))
        elif kind == P.SUBMIT:
            self._submit(payload)
        elif kind == P.CANCEL:
            ids = P.load_json(payload, "CANCEL")
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ProtocolError("frame", "CANCEL: expected a list of action ids")
            for i in ids:
                if i in self.live:
                    self.orch.cancel(i)
        elif kind == P.REQUEST:
            request = P.load_json(payload, "REQUEST")
            if (not isinstance(request, list) or len(request) != 3 or not isinstance(request[0], int)
                    or not isinstance(request[1], str) or not isinstance(request[2], list)):
                raise ProtocolError("frame", "REQUEST: expected [request id, op, args]")
            self._request(*request)
        else:
            raise ProtocolError("frame", f"unexpected {P.FRAME_NAMES.get(kind, f'type {kind}')} frame from a client")

    def _hello(self, hello: Any) -> None:
        if not isinstance(hello, dict):
            raise ProtocolError("frame", "HELLO: expected a JSON object")
        if hello.get("protocol") != P.PROTOCOL:
            raise ProtocolError("protocol", f"this server speaks protocol {P.PROTOCOL}, the client "
                                            f"{hello.get('protocol')!r}")
        expected = self.server.token
        if expected is not None:
            given = hello.get("token")
            if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
                raise AuthenticationError("token", "missing or wrong token" if given else "this server requires a token "
                                                   "(Client(token=...) or TANGRAM_TOKEN)")
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        self.number = next(self.server._numbers)
        self.server._by_number[self.number] = self
        self.shared = _hello_flag(hello, "shared_trajectories")
        self.send_records = _hello_flag(hello, "records")
        self.state = "ready"
        self.reader.limit = self.server.max_frame
        orch = self.orch
        self.transport.write(P.json_frame(P.WELCOME, {  # type: ignore[union-attr]
            "protocol": P.PROTOCOL, "connection": self.number, "max_frame": self.server.max_frame,
            "policy": orch.policy, "objective": orch.scheduler.policy.objective, "managers": list(orch.managers),
            "server": f"tangram {_version()}",
        }))

    def _submit(self, payload: bytes) -> None:
        ids, pickled = P.parse_submit(payload)
        seen: set[int] = set()
        for i in ids:
            if not self._own_id(i):
                raise ProtocolError("frame", f"SUBMIT: action id {i} is not in this connection's range")
            if i in seen or i in self.live:  # each id gets exactly one RESULT: this one would get two
                raise ProtocolError("frame", f"SUBMIT: action id {i} is given twice or still live on this connection")
            seen.add(i)
        try:
            calls = pickle.loads(pickled)
        except Exception as e:
            # One pickle holds the whole frame, so which call broke it is unknown here: a
            # frame of several calls goes back to the client, which sends each on its own.
            why = f"{type(e).__name__}: {e}"
            error = (ValidationError("call", f"the server cannot unpickle it: {why}") if len(ids) == 1 else
                     P.SubmitNotLoaded("call", f"the server cannot unpickle a batch of {len(ids)} calls: {why}"))
            for i in ids:
                self._result(i, False, error)
            return
        if not isinstance(calls, list) or len(calls) != len(ids):
            raise ProtocolError("frame", f"SUBMIT: {len(ids)} ids but {len(calls) if isinstance(calls, list) else 'no list of'} calls")
        closing = self.server._closing
        submit = self.orch.submit
        live = self.live
        started = False
        for i, call in zip(ids, calls):
            if closing:
                self._result(i, False, OrchestratorClosed("server", "the server is shutting down"))
                continue
            try:
                if isinstance(call, Call):
                    self._map_trajectory(call)
                handle = submit(call, i)
            except TangramError as e:
                self._result(i, False, e)
                continue
            except Exception as e:
                self._result(i, False, ValidationError("call", f"{type(e).__name__}: {e}"))
                continue
            live[i] = handle
            started = True
        if started:
            self.server._submitted(self)

    def _own_id(self, aid: Any) -> bool:
        """Whether `aid` is an action id of this connection's range (connection << 32 | seq)."""
        return isinstance(aid, int) and aid >> P.ID_BITS == self.number and bool(aid & _ID_MASK)

    def _map_trajectory(self, call: Call) -> None:
        call.trajectory = self._server_trajectory(call.trajectory, "call.trajectory")

    def _server_trajectory(self, t: Any, field: str) -> Any:
        """Trajectory ids are the client's own unless it asked for the shared space: the
        server's id is connection << 32 | trajectory."""
        if self.shared or not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return t  # invalid ones are the orchestrator's to reject, with its message
        if t >= _TRAJECTORY_LIMIT:
            raise ValidationError(field, f"must be below 2**{P.ID_BITS} through the server, got {t}")
        mapped = self.number << P.ID_BITS | t
        self.trajectories.add(mapped)
        return mapped

    def _request(self, rid: int, op: str, args: list[Any]) -> None:
        try:
            if op == "ping":
                self._reply(rid, True, "pong")
            elif op == "explain":
                (aid,) = args
                if not isinstance(aid, int) or isinstance(aid, bool):
                    raise ValidationError("action_id", f"must be an integer, got {aid!r}")
                self._reply(rid, True, self.orch.explain_now(aid) if aid in self.live else f"action {aid} is not live")
            elif op == "queue_lengths":
                self._reply(rid, True, self.orch.queue_lengths_now())
            elif op == "utilisation":
                self._reply(rid, True, self.orch.utilisation_now())
            elif op == "status":
                self._reply(rid, True, self.orch.status_now())
            elif op == "hold":
                self._hold(rid, *args)
            elif op == "release":
                self._release(rid, *args)
            elif op == "back_off":
                (quota, seconds) = args
                self._reply(rid, True, self.orch.back_off_quota_now(quota, seconds))
            elif op == "end_trajectory":
                (t,) = args
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValidationError("trajectory", f"must be a non-negative integer, got {t!r}")
                if not self.shared:
                    if t >= _TRAJECTORY_LIMIT:
                        raise ValidationError("trajectory", f"must be below 2**{P.ID_BITS} through the server")
                    t = self.number << P.ID_BITS | t
                task = self.loop.create_task(self._end_trajectory(rid, t))
                self.requests.add(task)
                task.add_done_callback(self.requests.discard)
            else:
                raise ValidationError("op", f"unknown request {op!r}")
        except TangramError as e:
            self._reply(rid, False, e)
        except Exception as e:
            self._reply(rid, False, ValidationError("args", f"{op}: {type(e).__name__}: {e}"))

    # ---------------------------------------------------------------- quota holds
    def _hold(self, rid: int, aid: int, quota: str, tokens: int, trajectory: int, kind: str) -> None:
        """A hold of one of the server's quotas for work the client runs itself
        (tangram.runtime.holds): the reply comes when the core admits it. The hold is an action
        of this connection under the client's id, so a CANCEL or a dropped connection gives
        its slot back like any other action's."""
        if not self._own_id(aid):
            raise ValidationError("hold", f"action id {aid!r} is not in this connection's range")
        if self.server._closing:
            raise OrchestratorClosed("server", "the server is shutting down")
        hold = self.orch.quota(quota, tokens, self._server_trajectory(trajectory, "trajectory"), kind)
        self.live[aid] = hold.submit(aid)
        self.holds[aid] = hold
        self.server._submitted(self)
        task = self.loop.create_task(self._admit(rid, hold))
        self.requests.add(task)
        task.add_done_callback(self.requests.discard)

    async def _admit(self, rid: int, hold: QuotaHold) -> None:
        try:
            await hold.admitted()
        except TangramError as e:
            self.holds.pop(hold.id, None)  # type: ignore[arg-type]
            self._reply(rid, False, e)
        else:
            self._reply(rid, True, hold.id)

    def _release(self, rid: int, aid: int, throttled: bool, retry_after: float | None) -> None:
        """The client left its hold's body (throttled: the provider answered 429); the reply
        comes once the hold's action has ended, its slot back in the core."""
        hold = self.holds.pop(aid, None)
        if hold is None:
            raise ValidationError("hold", f"no hold {aid!r} of this connection is waiting or admitted")
        if not hold.is_admitted:  # given up before its admission (the client stopped waiting)
            self.orch.cancel(aid)
            self._reply(rid, True, None)
            return
        hold.leave(bool(throttled), retry_after)
        task = self.loop.create_task(self._released(rid, hold))
        self.requests.add(task)
        task.add_done_callback(self.requests.discard)

    async def _released(self, rid: int, hold: QuotaHold) -> None:
        await hold.release_and_wait()
        self._reply(rid, True, None)

    async def _end_trajectory(self, rid: int, trajectory: int) -> None:
        try:
            if self.server._closing:
                raise OrchestratorClosed("server", "the server is shutting down")
            await self.orch.end_trajectory(trajectory)
        except TangramError as e:
            self._reply(rid, False, e)
        except Exception as e:
            self._reply(rid, False, ValidationError("trajectory", f"{type(e).__name__}: {e}"))
        else:
            self.trajectories.discard(trajectory)
            self._reply(rid, True, None)

    # ---------------------------------------------------------------- results
    def _done(self, record: ActionRecord) -> None:
        aid = record.id
        self.holds.pop(aid, None)  # a hold ends with its action (released, cancelled, closed)
        handle = self.live.pop(aid, None)
        if handle is None:  # not this connection's, or dropped with it
            return
        packed = P.pack_record(record) if self.send_records else None
        future = handle.future
        if future.cancelled():
            self._result(aid, False, ActionCancelled(aid, "cancelled on the server"), packed)
            return
        error = future.exception()
        if error is None:
            self._result(aid, True, future.result(), packed)
        else:
            self._result(aid, False, error, packed)

    def _result(self, aid: int, ok: bool, value: Any, record: bytes | None = None) -> None:
        """Queues an action's outcome, with its packed record when it has one (an action
        refused before the orchestrator took it has none, as a submit that raises in
        process leaves none)."""
        if self.state == "closed":
            return
        self.results.append((aid, True, value, record) if ok else (aid, False, P.encode_error(value), record))
        if self.flush_handle is None:
            self._queue_flush()

    def _reply(self, rid: int, ok: bool, value: Any) -> None:
        if self.state == "closed":
            return
        self.replies.append((rid, True, value) if ok else (rid, False, P.encode_error(value)))
        if self.flush_handle is None:
            self._queue_flush()

    def _queue_flush(self) -> None:
        """Queues the write for the next iteration: every result and reply of this one go
        in one frame each."""
        if self.state == "closed" or self.flush_handle is not None:
            return
        self.flush_handle = self.loop.call_soon(self._queued_flush)

    def _queued_flush(self) -> None:
        self.flush_handle = None
        self._flush()

    def _flush(self) -> None:
        if self.flush_handle is not None:  # called directly (goodbye): this write replaces the queued one
            self.flush_handle.cancel()
            self.flush_handle = None
        if self.state == "closed" or self.transport is None or self.transport.is_closing():
            self.results.clear()
            self.replies.clear()
            return
        chunks: list[bytes] = []
        if self.results:
            items, self.results = self.results, []
            self._encode(P.RESULTS, items, chunks)
        if self.replies:
            items, self.replies = self.replies, []
            self._encode(P.REPLY, items, chunks)
        if chunks:
            self.transport.write(b"".join(chunks) if len(chunks) > 1 else chunks[0])

    def _encode(self, kind: int, items: list[tuple[Any, ...]], out: list[bytes]) -> None:
        """Pickles a batch into frames within the limit; a value that cannot be pickled or
        does not fit ends its action with a typed error instead."""
        limit = self.server.max_frame - P.HEADER.size
        data, problem = _dumps(items)
        if data is not None and len(data) <= limit:
            out.append(P.frame(kind, data))
            return
        if len(items) > 1:
            half = len(items) // 2
            self._encode(kind, items[:half], out)
            self._encode(kind, items[half:], out)
            return
        ((key, _, _, *record),) = items  # a result's record stays with it
        if data is None:
            error: TangramError = ActionFailed(key, f"its result cannot be pickled to go back to the client: {problem}",
                                               "PicklingError")
        else:
            error = FrameTooLarge("result", f"its result is {len(data)} bytes pickled; the frame limit is {limit}",
                                  action_id=key)
        if kind == P.REPLY:
            error = ProtocolError("reply", error.reason)
        data, _ = _dumps([(key, False, P.encode_error(error), *record)])
        out.append(P.frame(kind, data))  # type: ignore[arg-type]


def _dumps(items: Any) -> tuple[bytes | None, str]:
    try:
        return pickle.dumps(items, protocol=5), ""
    except Exception:
        pass
    try:
        return cloudpickle.dumps(items, protocol=5), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def _version() -> str:
    from .. import __version__

    return __version__
