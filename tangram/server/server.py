"""`tangram serve`: one orchestrator serving many client processes over TCP.

    tangram serve [--config FILE] [--host 127.0.0.1] [--port 7450] [--token T]
                  [--policy P] [--max-frame BYTES] [--grace SECONDS] [--manager KIND=NAME]
                  [--sandbox-fusion-port PORT] [--sandbox-fusion-fresh] [--sandbox-fusion-cpu CORES]

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

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import hmac
import ipaddress
import itertools
import json
import os
import pickle
import signal
import socket
import sys
from typing import Any, Callable, Mapping, Sequence

import cloudpickle

from .._errors import TangramError, ValidationError
from .._model import Inventory
from ..runtime.call import Call
from ..runtime.config import RuntimeConfig
from ..runtime.errors import ActionCancelled, ActionFailed
from ..runtime.holds import QuotaHold
from ..runtime.manager import ResourceManager, manager_class
from ..runtime.orchestrator import ActionHandle, Orchestrator, OrchestratorClosed
from ..runtime.records import ActionRecord
from ..scheduler import OBJECTIVES
from . import protocol as P
from .protocol import AuthenticationError, FrameTooLarge, ProtocolError
from .sandbox_fusion import SandboxFusionEndpoint

_TRAJECTORY_LIMIT = 1 << P.ID_BITS
_ID_MASK = (1 << P.ID_BITS) - 1


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or "" (every interface)


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
                    cpu=self.sandbox_fusion_cpu)
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
        self.shared = bool(hello.get("shared_trajectories", False))
        self.send_records = bool(hello.get("records", False))
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
        for i in ids:
            if not self._own_id(i):
                raise ProtocolError("frame", f"SUBMIT: action id {i} is not in this connection's range")
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
                if not isinstance(t, int) or t < 0:
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


# ---------------------------------------------------------------- the command
def _parser() -> argparse.ArgumentParser:
    from .._arguments import ArgumentParser, non_negative_seconds

    def port(text: str) -> int:
        if not text.isdigit() or int(text) > 65535:
            raise argparse.ArgumentTypeError(f"expected a TCP port, 0 to 65535, got {text!r}")
        return int(text)

    parser = ArgumentParser(
        prog="tangram serve", description="Serve one orchestrator to many client processes (tangram.Client).",
        epilog="Prints 'tangram serve: listening on HOST:PORT ...' once ready. SIGTERM/SIGINT shut it down: "
               "running actions get --grace seconds to finish, the rest are cancelled; a second signal cancels at once.")
    parser.add_argument("--config", help="runtime configuration file (.toml or .json; see tangram.RuntimeConfig)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; anything other "
                                                            "than loopback requires a token)")
    parser.add_argument("--port", type=port, default=P.DEFAULT_PORT,
                        help=f"TCP port (default {P.DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--token", default=None, help="shared secret clients must present (default: $TANGRAM_TOKEN; "
                                                      "prefer the variable: arguments are visible in ps)")
    parser.add_argument("--policy", default=None, help="scheduling policy (default: the config's, else tangram)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=None,
                        help="what the policy's order serves: 'step' (a synchronous trainer's step; the default) or "
                             "'act' (mean ACT, for asynchronous trainers; docs/scheduling.md, Objectives). Default: "
                             "the config's")
    parser.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (overrides the config's "
                             "metrics_port)")
    parser.add_argument("--log-actions", default=None, metavar="FILE",
                        help="append one JSON line per finished action to FILE: its record (tangram.ActionRecord's "
                             "fields)")
    parser.add_argument("--max-frame", type=int, default=P.DEFAULT_MAX_FRAME,
                        help=f"largest frame accepted from a client, bytes (default {P.DEFAULT_MAX_FRAME})")
    parser.add_argument("--grace", type=non_negative_seconds, default=10.0,
                        help="seconds running actions get to finish at shutdown (default 10)")
    parser.add_argument("--sandbox-fusion-port", type=port, default=None, metavar="PORT",
                        help="also serve Sandbox Fusion's HTTP API (POST /run_code, GET /v1/ping) on PORT, same host, "
                             "orchestrator and token (Sandbox Fusion's own default port is 8080; 0 picks a free one)")
    parser.add_argument("--sandbox-fusion-fresh", action="store_true",
                        help="run each Sandbox Fusion request without a session in a new sandbox, ended after it "
                             "(default: a pooled one, in a fresh directory, its processes killed)")
    parser.add_argument("--sandbox-fusion-cpu", type=float, default=1.0, metavar="CORES",
                        help="cores each Sandbox Fusion request is guaranteed (default 1: a single-threaded program "
                             "runs at full speed, so its run_timeout holds under load; 0.5 runs two per core when "
                             "every core is taken)")
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help="schedule a Ray cluster: connect to it (ray.init(address=ADDRESS); default 'auto', the "
                             "cluster this host belongs to) and run every action on its nodes, one scheduler for all "
                             "of them (tangram.ray.RayOrchestrator, options from the config's [managers.ray]); a "
                             "second scheduler on the same cluster is refused (docs/ray.md)")
    parser.add_argument("--manager", action="append", default=[], metavar="KIND=NAME",
                        help="serve KIND's actions with manager NAME (a registered name, or module:Class), e.g. "
                             "cpu=mock to measure the protocol alone (options from the config's [managers.NAME]); "
                             "repeatable")
    return parser


RayOrchestratorFactory = Callable[[str, RuntimeConfig, "str | None", str], Orchestrator]


def cli_main(argv: list[str] | None = None, ray_orchestrator: RayOrchestratorFactory | None = None) -> int:
    """`tangram serve`. `ray_orchestrator(address, config, policy, serves)` makes the
    orchestrator of `--ray` (the command passes tangram.ray.connect_orchestrator: the
    server's layer sits below the Ray backend's)."""
    parser = _parser()
    args = parser.parse_args(argv)
    token = args.token if args.token is not None else os.environ.get("TANGRAM_TOKEN") or None
    try:
        config = _load_config(args.config) if args.config else RuntimeConfig()
        if args.objective is not None:
            config = dataclasses.replace(config, objective=args.objective)
        if args.metrics_port is not None:
            config = dataclasses.replace(config, metrics_port=args.metrics_port)
        managers: dict[str, ResourceManager] = {}
        for item in args.manager:
            kind, sep, name = item.partition("=")
            if not sep or not kind or not name:
                raise ValidationError("--manager", f"expected KIND=NAME, got {item!r}")
            cls = _import_manager(name) if ":" in name else manager_class(name)
            try:
                managers[kind] = cls(**dict(config.managers.get(name, {})))
            except TypeError as e:  # options the manager does not take
                raise ValidationError(f"managers.{name}", f"bad options for {cls.__name__}: {e}") from None
        options: dict[str, Any] = dict(host=args.host, port=args.port, token=token, max_frame=args.max_frame,
                                       sandbox_fusion_port=args.sandbox_fusion_port,
                                       sandbox_fusion_fresh=args.sandbox_fusion_fresh,
                                       sandbox_fusion_cpu=args.sandbox_fusion_cpu)
        if args.ray is not None:
            if managers:
                raise ValidationError("--manager", "not with --ray: the cluster's node agents run every action "
                                                   "(tangram.ray.RayManager)")
            if ray_orchestrator is None:
                raise ValidationError("--ray", "this entry point cannot reach the Ray backend; run `tangram serve`")
            serves = f"tangram serve on {socket.gethostname()}:{args.port}"
            server = Server(orchestrator=ray_orchestrator(args.ray, config, args.policy, serves), **options)
        else:
            server = Server(config, policy=args.policy, managers=managers, **options)
        gc.set_threshold(*GC_THRESHOLDS)
        with ActionLog(args.log_actions) if args.log_actions else contextlib.nullcontext() as log:
            if log is not None:
                server.orchestrator.records.add_listener(log.write)
            return asyncio.run(_serve(server, args.grace))
    except (TangramError, OSError) as e:
        print(f"tangram serve: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


def _load_config(path: str) -> RuntimeConfig:
    """The --config file; one that cannot be read or parsed, or whose shape is wrong, is a
    ValidationError naming the file."""
    try:
        return RuntimeConfig.from_file(path)
    except TangramError:
        raise
    except OSError as e:
        raise ValidationError("--config", f"cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValidationError("--config", f"{path!r} is not UTF-8 text: {e}") from None
    except ValueError as e:  # JSONDecodeError and TOMLDecodeError say the line and column
        raise ValidationError("--config", f"{path!r} is not valid {'JSON' if path.endswith('.json') else 'TOML'}: "
                                          f"{e}") from None
    except (TypeError, KeyError, AttributeError) as e:  # a setting of the wrong shape
        raise ValidationError("--config", f"{path!r}: a setting has the wrong shape "
                                          f"({type(e).__name__}: {e})") from None


def _import_manager(target: str) -> type[ResourceManager]:
    import importlib

    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValidationError("--manager", f"cannot import {target!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ResourceManager)):
        raise ValidationError("--manager", f"{target} is not a ResourceManager subclass")
    return cls


# The server is a long-lived process whose orchestrator keeps up to `max_records` action
# records (100,000 by default): with CPython's default thresholds (700, 10, 10) the cyclic
# garbage collector rescans that growing population so often that throughput halves by
# the time the record log is full. Fewer, larger young collections keep it steady
# (docs/server.md, Measurements); startup objects are frozen out of collections.
GC_THRESHOLDS = (10_000, 20, 20)


class ActionLog:
    """`tangram serve --log-actions FILE`: one JSON object per finished action, a line each,
    with the fields of its ActionRecord, appended as it ends and flushed at once (a reader
    tailing the file sees every ended action; a crash loses none already written)."""

    def __init__(self, path: str) -> None:
        try:
            self._file = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise ValidationError("--log-actions", f"cannot open {path!r} for appending: {e.strerror}") from None

    def write(self, record: ActionRecord) -> None:
        self._file.write(json.dumps(dataclasses.asdict(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def __enter__(self) -> "ActionLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


async def _serve(server: Server, grace: float) -> int:
    await server.start()
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            server.force_close()
        else:
            stop.set()  # first: the note below may fail to reach stderr
            _note(f"tangram serve: {signal.Signals(signum).name}: shutting down (running actions get {grace:g} s)")

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    assert server.address is not None
    orch = server.orchestrator
    print(f"tangram serve: listening on {P.format_address(*server.address)} (policy {orch.policy}; managers "
          f"{', '.join(f'{k}={type(m).__name__}' for k, m in orch.managers.items())}; "
          f"token {'required' if server.token else 'not required'})", flush=True)
    if server.sandbox_fusion is not None and server.sandbox_fusion.address is not None:
        host, port = server.sandbox_fusion.address
        print(f"tangram serve: Sandbox Fusion API on http://{P.format_address(host, port)}/run_code", flush=True)
    ray_manager = orch.managers.get("ray")
    if ray_manager is not None:
        nodes = ", ".join(f"{n.name} ({n.resources.get('cpu', 0):g} cpu, {len(n.gpus)} gpu)"
                          for n in orch.inventory.nodes)
        print(f"tangram serve: scheduling the Ray cluster: {nodes}", flush=True)
        if is_loopback(server.host):
            print("tangram serve: listening on loopback: only clients on this node can reach it (--host 0.0.0.0 "
                  "with a token for the cluster's other nodes)", flush=True)
    await stop.wait()
    await server.close(grace)
    _note("tangram serve: stopped")
    return 0


def _note(text: str) -> None:
    """A line on stderr, which may be closed (a supervisor or a pipe that went away):
    shutting down must not depend on it, and a signal handler never raises."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a broken pipe, a closed descriptor or file
        pass
