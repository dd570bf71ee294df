"""`tangram.Client`: the orchestrator's API, served by `tangram serve`.

    async with tangram.Orchestrator() as orch:                    # in process
    async with tangram.Client("127.0.0.1:7450") as orch:          # one scheduler for many processes
        result = await orch.run(Call(command="pytest -q", resources={"cpu": 1}, trajectory=7))

Same methods, same results, same typed errors (an ActionTimeout on the server is an
ActionTimeout here, with the handle's id as `action_id`). Differences that a network
brings, all explicit:

- `submit` returns at once, as in process, and checks what it can locally (a Call, the
  types of its fields, its trajectory's range). Errors the in-process orchestrator raises
  at submit from what the server alone knows (an unknown resource kind, quota or manager,
  a call its manager cannot run, a resource that is not a finite number) end the action's
  future with the same typed error instead.
- `explain`, `queue_lengths` and `utilisation` ask the server (coroutines, as on the
  Orchestrator). `records` holds this client's own actions: the server sends each one's
  record with its result (times are the server's clock; `trajectory` is this client's
  number). An action that ended here without an answer from the server (ConnectionLost,
  a call that could not be sent) has none.
- `cancel(id)` returns True when the action is still pending here; the server is
  authoritative, so an action that ended at the same moment may still deliver its result.
- The connection dropping (server killed, network gone) ends every pending action with
  ConnectionLost, and later calls raise it. The server cancels the actions of a client
  whose connection drops, and ends its trajectories.
- Trajectory ids are this client's own: trajectory 3 here is not trajectory 3 of another
  client (pass `shared_trajectories=True` to share ids with every client that does).

Submits made in one event-loop iteration go out in one frame (a submit made while nothing
else is outstanding goes out at once, without waiting for the iteration to end); results
come back coalesced the same way. Calls are pickled by the C pickler when that sends what
cloudpickle would (no function of `__main__`, no lambda or closure), else by cloudpickle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import pickle
import socket
from typing import Any, Iterable

import cloudpickle

from .._errors import TangramError, ValidationError
from ..runtime.call import Call, manager_for, validate_call
from ..runtime.errors import ActionCancelled, outcome_of
from ..runtime.holds import Throttled
from ..runtime.errors import OrchestratorClosed
from ..runtime.records import RecordLog
from ..runtime.sync import LoopThread, SyncHandle, copy_outcome
from . import protocol as P
from .discovery import find_address
from .protocol import ConnectionLost, FrameTooLarge, ProtocolError

_ID_LIMIT = 1 << P.ID_BITS


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "no answer in time"
    if isinstance(e, socket.gaierror):
        return f"the name does not resolve: {e.strerror}"
    if isinstance(e, OSError) and e.errno:
        return f"{type(e).__name__}: {os.strerror(e.errno)}"
    return f"{type(e).__name__}: {e}"


class ClientHandle:
    """A submitted action: its id and a future with its result. Awaitable."""

    __slots__ = ("id", "future", "_client", "_call")

    def __init__(self, action_id: int, future: asyncio.Future[Any], client: "Client", call: Call) -> None:
        self.id = action_id
        self.future = future
        self._client = client
        self._call = call  # until its result arrives: to send it again, and for its record

    def cancel(self) -> bool:
        """Cancels the action on the server; False when it has already ended."""
        return self._client.cancel(self.id)

    def _watch(self, future: asyncio.Future[Any]) -> None:
        # The future's done callback until its result arrives: the caller cancelled it
        # (its awaiting task was cancelled), so cancel the action on the server too.
        if future.cancelled():
            self._client._cancelled(self.id)

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.future.__await__()


class _Wire(asyncio.BufferedProtocol):
    """The client's asyncio protocol: hands the transport's events to the client. Reads
    go straight into the frame reader's buffer."""

    def __init__(self, client: "Client") -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client._connection_made(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.client._reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.client._data_received(nbytes)

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._connection_lost(exc)


class Client:
    """A connection to `tangram serve`, with the Orchestrator's API.

    address   "host:port" (or "tcp://host:port", "http://host:port"); default: $TANGRAM_ADDRESS,
              else 127.0.0.1:7450. Nothing listening there: ServerUnreachable, in one line
              naming the address tried and how to start a server
    token     the server's token (default: $TANGRAM_TOKEN)
    shared_trajectories  use the server's shared trajectory ids instead of this client's own
    connect_timeout      seconds to connect and authenticate
    records       keep `records`, the ActionRecord of each of this client's actions that
                  the server answered (default True; False spares the server packing
                  them, bench/server_costs.py measures the cost)
    max_records   how many records `records` keeps, the latest (default 100,000, as the
                  orchestrator's `RuntimeConfig.max_records`)

    `await start()` (or `async with`) connects; a wrong token raises AuthenticationError.
    All methods run on the event loop that connected it (SyncClient for other threads).
    """

    def __init__(self, address: str | tuple[str, int] | None = None, *, token: str | None = None,
                 shared_trajectories: bool = False, connect_timeout: float = 10.0, records: bool = True,
                 max_records: int = 100_000) -> None:
        self.found_by = "given"  # how the address was found (tangram.server.discovery)
        if address is None:
            address, self.found_by = find_address()
        self.host, self.port = P.parse_address(address)
        self.token = token if token is not None else os.environ.get("TANGRAM_TOKEN") or None
        self.shared_trajectories = shared_trajectories
        self.connect_timeout = connect_timeout
        if not isinstance(max_records, int) or isinstance(max_records, bool) or max_records < 0:
            raise ValidationError("max_records", f"must be a non-negative integer, got {max_records!r}")
        self.records = RecordLog(max_records if records else 0, decode=_decode_record)
        self._keep_records = bool(records)
        self.server_info: dict[str, Any] = {}
        self._state = "new"  # -> "connecting" -> "running" -> "closing" -> "closed"
        self._lost: str | None = None  # why the connection ended
        self._server_error: TangramError | None = None
        self._transport: asyncio.Transport | None = None
        self._reader = P.FrameReader(P.PREAUTH_MAX_FRAME)
        self._welcome: asyncio.Future[dict[str, Any]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._base = 0
        self._seq = itertools.count(1)
        self._requests = itertools.count(1)
        self._pending: dict[int, ClientHandle] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._out_ids: list[int] = []
        self._out_calls: list[Call] = []
        self._out_frames: list[bytes] = []  # cancels and requests, after the submits
        self._out_cancel: list[int] = []
        self._flush_scheduled = False
        self._disconnected: asyncio.Future[None] | None = None
        self._max_frame = P.DEFAULT_MAX_FRAME

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "Client":
        if self._state != "new":
            raise ConnectionLost(f"cannot connect: the client is {self._state}")
        self._state = "connecting"
        loop = self._loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        self._disconnected = loop.create_future()
        try:
            await asyncio.wait_for(loop.create_connection(lambda: _Wire(self), self.host, self.port), self.connect_timeout)
            hello = {"protocol": P.PROTOCOL, "token": self.token, "shared_trajectories": self.shared_trajectories,
                     "records": self._keep_records}
            self._transport.write(P.json_frame(P.HELLO, hello))  # type: ignore[union-attr]
            welcome = await asyncio.wait_for(asyncio.shield(self._welcome), self.connect_timeout)
        except TangramError:
            self._abort()
            raise
        except (OSError, asyncio.TimeoutError) as e:
            self._abort()
            where = P.format_address(self.host, self.port)
            if self._transport is not None:  # connected, then dropped or silent before the WELCOME
                raise ConnectionLost(f"cannot connect to {where}: {_why(e)}") from None
            found = "" if self.found_by == "given" else f"; the address is {self.found_by}"
            raise P.ServerUnreachable(f"no tangram server at {where} ({_why(e)}{found}): start one there with "
                                      f"`tangram serve --port {self.port}`, or give its address (Client(address), "
                                      f"$TANGRAM_ADDRESS)") from None
        except BaseException:
            self._abort()
            raise
        self.server_info = welcome
        self._base = int(welcome["connection"]) << P.ID_BITS
        self._max_frame = int(welcome["max_frame"])
        self._state = "running"
        return self

    def _abort(self) -> None:
        self._state = "closed"
        if self._transport is not None:
            self._transport.abort()

    async def __aenter__(self) -> "Client":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, drain: bool = False, timeout: float = 10.0) -> None:
        """Stops accepting actions and ends every pending one: with `drain`, they finish
        first; otherwise they are cancelled on the server (ActionCancelled) and their
        results awaited for up to `timeout` seconds. Then disconnects. Idempotent."""
        if self._state in ("closing", "closed"):
            if self._disconnected is not None:
                await asyncio.shield(self._disconnected)
            return
        if self._state != "running":
            self._abort()
            return
        self._state = "closing"
        if drain:
            while self._pending:
                await asyncio.gather(*(asyncio.shield(h.future) for h in list(self._pending.values())),
                                     return_exceptions=True)
        if self._pending and self._lost is None:
            ids = list(self._pending)
            self._out_cancel.extend(ids)
            self._kick()
            await asyncio.wait([h.future for h in self._pending.values()], timeout=timeout)
        for aid, h in list(self._pending.items()):
            if not h.future.done():
                h.future.set_exception(ActionCancelled(aid, "the client closed"))
        self._pending.clear()
        self._flush()
        if self._transport is not None:
            self._transport.close()
            try:
                await asyncio.wait_for(asyncio.shield(self._disconnected), timeout)  # type: ignore[arg-type]
            except asyncio.TimeoutError:
                self._transport.abort()
        self._state = "closed"

    @property
    def connected(self) -> bool:
        return self._state == "running" and self._lost is None

    # ---------------------------------------------------------------- API
    def submit(self, call: Call, action_id: int | None = None) -> ClientHandle:
        """Queues one action for the server; returns at once with its handle (see the
        module docstring for which errors are raised here and which end the future).
        `action_id`, when given, comes from `reserve_id`."""
        self._check_running("submit")
        self._check_call(call)
        if action_id is None:
            action_id = self.reserve_id()
        elif not isinstance(action_id, int) or action_id >> P.ID_BITS != self._base >> P.ID_BITS:
            raise ValidationError("action_id", f"{action_id!r} was not reserved by this client (use reserve_id)")
        elif action_id in self._pending:
            raise ValidationError("action_id", f"action {action_id} is live")
        return self._submit(call, action_id)

    def reserve_id(self) -> int:
        """The id the next action of this client gets (thread-safe)."""
        seq = next(self._seq)
        if seq >= _ID_LIMIT:
            raise ValidationError("action_id", f"this connection has used all its {_ID_LIMIT - 1} ids; reconnect")
        return self._base | seq

    def _submit(self, call: Call, action_id: int) -> ClientHandle:
        future = self._loop.create_future()  # type: ignore[union-attr]
        handle = ClientHandle(action_id, future, self, call)
        if self._lost is not None:
            future.set_exception(self._lost_error(action_id))
            return handle
        alone = not self._pending and not self._flush_scheduled
        self._pending[action_id] = handle
        future.add_done_callback(handle._watch)
        self._out_ids.append(action_id)
        self._out_calls.append(call)
        if alone:
            # Nothing else outstanding or queued: this request goes out now instead of at
            # the next iteration (what a caller awaiting one action at a time waits for);
            # submits that follow in this iteration are coalesced as usual.
            self._flush()
        else:
            self._kick()
        return handle

    async def run(self, call: Call) -> Any:
        """Submits `call` and awaits its result (or its typed error). Cancelling the
        awaiting task cancels the action."""
        return await self.submit(call).future

    async def map(self, calls: Iterable[Call]) -> list[Any]:
        """Runs many calls at once (one frame, one batch into the core); results in order.
        Errors are returned in place, as exception objects, not raised."""
        handles = [self.submit(c) for c in calls]
        return await asyncio.gather(*(h.future for h in handles), return_exceptions=True)

    def cancel(self, action_id: int) -> bool:
        """Cancels a pending action on the server (it ends with ActionCancelled unless it
        ended at the same moment). False if it is not pending here."""
        handle = self._pending.get(action_id)
        if handle is None or handle.future.done():
            return False
        if self._lost is None:
            self._out_cancel.append(action_id)
            self._kick()
        return True

    def quota(self, name: str, tokens: int = 0, trajectory: int = 0, kind: str = "hold") -> "ClientQuotaHold":
        """A hold of the server's API quota `name` for work this process runs itself (a
        hosted sandbox's creation, an API the rollout calls): `async with
        client.quota("e2b-create"):` waits until the server's core admits it, as any request
        of the quota from any client, and gives the slot back on leaving; `Throttled` raised
        inside pauses the quota for every client (tangram.runtime.holds). A client that dies
        holding one gives it back when its connection ends."""
        self._check_running("quota")
        return ClientQuotaHold(self, name, tokens, trajectory, kind)

    async def back_off_quota(self, name: str, seconds: float | None = None) -> float:
        """The API behind the server's quota `name` answered "too many requests": the
        quota admits nothing new for `seconds` (None: the next step of its exponential
        backoff), for every client. Returns the pause."""
        return float(await self._request("back_off", [name, seconds]))

    async def end_trajectory(self, trajectory: int) -> None:
        """The trajectory's last action is done: the server releases its slot in the core
        and its sandbox."""
        await self._request("end_trajectory", [trajectory])

    async def explain(self, action_id: int) -> str:
        """Why a pending action waits (or where it runs), from the server's core."""
        return await self._request("explain", [action_id])

    async def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """The server's kind -> (waiting, running), over every client."""
        return await self._request("queue_lengths", [])

    async def utilisation(self) -> dict[tuple[str, str], float]:
        """The server's (node, resource) -> share held by running actions."""
        return await self._request("utilisation", [])

    async def status(self) -> dict[str, Any]:
        """The server's snapshot for a live view (tangram.runtime.status documents it)."""
        return await self._request("status", [])

    async def ping(self) -> float:
        """Seconds for one request to the server and back."""
        t0 = self._loop.time()  # type: ignore[union-attr]
        await self._request("ping", [])
        return self._loop.time() - t0  # type: ignore[union-attr]

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ---------------------------------------------------------------- internals
    def _check_call(self, call: Call) -> None:
        validate_call(call)
        if not self.shared_trajectories and call.trajectory >= _ID_LIMIT:
            # The server keeps each client's trajectories apart in the upper bits of its own.
            raise ValidationError("call.trajectory", f"must be below 2**{P.ID_BITS} (this client's own trajectories; "
                                                     f"shared_trajectories=True takes the core's full range), got "
                                                     f"{call.trajectory}")

    def _check_running(self, what: str) -> None:
        if self._state != "running":
            raise OrchestratorClosed("client", f"cannot {what}: it is {self._state}")
        if self._lost is not None:
            raise self._lost_error(None)

    def _lost_error(self, action_id: int | None) -> ConnectionLost:
        error = ConnectionLost(self._lost or "the connection is closed", action_id)
        if self._server_error is not None:
            error.__cause__ = self._server_error
        return error

    async def _request(self, op: str, args: list[Any]) -> Any:
        self._check_running(op)
        rid = next(self._requests)
        future = self._loop.create_future()  # type: ignore[union-attr]
        self._replies[rid] = future
        self._out_frames.append(P.json_frame(P.REQUEST, [rid, op, args]))
        self._kick()
        return await future

    def _cancelled(self, action_id: int) -> None:
        if self._pending.pop(action_id, None) is not None and self._lost is None:
            self._out_cancel.append(action_id)
            self._kick()

    def _kick(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)  # type: ignore[union-attr]

    def _flush(self) -> None:
        self._flush_scheduled = False
        transport = self._transport
        if transport is None or self._lost is not None:
            return
        chunks: list[bytes] = []
        if self._out_ids:
            ids, calls = self._out_ids, self._out_calls
            self._out_ids, self._out_calls = [], []
            self._encode_submits(ids, calls, chunks)
        if self._out_cancel:
            cancel, self._out_cancel = self._out_cancel, []
            chunks.append(P.json_frame(P.CANCEL, cancel))
        if self._out_frames:
            chunks.extend(self._out_frames)
            self._out_frames = []
        if chunks:
            transport.write(b"".join(chunks) if len(chunks) > 1 else chunks[0])

    def _encode_submits(self, ids: list[int], calls: list[Call], out: list[bytes]) -> None:
        try:
            data = _pickle_calls(calls)
        except Exception as e:
            if len(ids) == 1:
                self._fail_local(ids[0], ValidationError("call", f"cannot be pickled to go to the server: "
                                                                 f"{type(e).__name__}: {e}"))
                return
            data = None
        if data is not None and len(data) + 12 + 8 * len(ids) <= self._max_frame:
            out.append(P.submit_frame(ids, data))
            return
        if len(ids) == 1:
            assert data is not None
            self._fail_local(ids[0], FrameTooLarge("call", f"{len(data)} bytes pickled; the server's frame limit is "
                                                           f"{self._max_frame}", action_id=ids[0]))
            return
        half = len(ids) // 2
        self._encode_submits(ids[:half], calls[:half], out)
        self._encode_submits(ids[half:], calls[half:], out)

    def _fail_local(self, aid: int, error: BaseException) -> None:
        handle = self._pending.pop(aid, None)
        if handle is not None and not handle.future.done():
            handle.future.set_exception(error)

    # ---------------------------------------------------------------- protocol events
    def _connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        P.keepalive(transport.get_extra_info("socket"))

    def _data_received(self, nbytes: int) -> None:
        self._reader.deliver(nbytes, self._frame, self._protocol_failure, "the client")

    def _protocol_failure(self, error: TangramError) -> None:
        self._server_error = error
        self._lost = f"the client could not read the server's frames ({error})"
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(error)
        if self._transport is not None:
            self._transport.abort()

    def _frame(self, kind: int, payload: bytes) -> None:
        if kind == P.RESULTS:
            pending = self._pending
            for aid, ok, value, record in pickle.loads(payload):
                handle = pending.pop(aid, None)
                if handle is None:
                    continue
                future = handle.future
                if future.done():
                    continue
                # Its watch has nothing left to do: removing it spares a callback (an
                # event-loop handle) per result.
                future.remove_done_callback(handle._watch)
                if not ok:
                    value = P.decode_error(value)
                    if type(value) is P.SubmitNotLoaded:
                        self._submit_alone(handle)
                        continue
                call, handle._call = handle._call, None
                if record is not None:  # sent only when this client keeps records
                    self.records.append((aid, call.kind, call.trajectory, manager_for(call), record,
                                         "ok" if ok else outcome_of(value), "" if ok else str(value), call.quota or ""))
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
        elif kind == P.REPLY:
            for rid, ok, value in pickle.loads(payload):
                future = self._replies.pop(rid, None)
                if future is None or future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(P.decode_error(value))
        elif kind == P.WELCOME:
            welcome = P.load_json(payload, "WELCOME")
            if not isinstance(welcome, dict) or welcome.get("protocol") != P.PROTOCOL or "connection" not in welcome:
                raise ProtocolError("protocol", f"unexpected WELCOME {welcome!r:.200}")
            self._reader.limit = max(int(welcome.get("max_frame", 0)), P.DEFAULT_MAX_FRAME)
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(welcome)
        elif kind == P.ERROR:
            error = P.decode_error(P.load_json(payload, "ERROR"))
            self._server_error = error
            self._lost = f"the server closed the connection: {type(error).__name__}: {error}"
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_exception(error)
        elif kind == P.GOODBYE:
            message = P.load_json(payload, "GOODBYE")
            reason = message.get("reason") if isinstance(message, dict) else None
            self._lost = f"the server shut down ({reason or 'goodbye'})"
        else:
            raise ProtocolError("frame", f"unexpected {P.FRAME_NAMES.get(kind, f'type {kind}')} frame from the server")

    def _submit_alone(self, handle: ClientHandle) -> None:
        """The server could not load the frame this call went in: it goes again in a frame
        of its own (a failure there is its own, final), after this iteration's submits."""
        handle.future.add_done_callback(handle._watch)
        self._pending[handle.id] = handle
        self._encode_submits([handle.id], [handle._call], self._out_frames)  # type: ignore[list-item]
        self._kick()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost is None:
            self._lost = ("the connection to the server was lost" +
                          (f" ({type(exc).__name__}: {exc})" if exc is not None else
                           " (closed by the server)" if self._state != "closing" else " (the client closed it)"))
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(self._lost_error(None))
        pending, self._pending = self._pending, {}
        for aid, handle in pending.items():
            if not handle.future.done():
                handle.future.set_exception(self._lost_error(aid))
        replies, self._replies = self._replies, {}
        for future in replies.values():
            if not future.done():
                future.set_exception(self._lost_error(None))
        self._out_ids.clear()
        self._out_calls.clear()
        if self._disconnected is not None and not self._disconnected.done():
            self._disconnected.set_result(None)


class ClientQuotaHold:
    """A hold of a server's quota (Client.quota); the server keeps the slot until released."""

    def __init__(self, client: Client, quota: str, tokens: int, trajectory: int, kind: str) -> None:
        self.client = client
        self.quota, self.tokens, self.trajectory, self.kind = quota, tokens, trajectory, kind
        self.id: int | None = None  # the hold's action id on the server, once entered

    async def acquire(self) -> "ClientQuotaHold":
        """Waits until the server admits the hold; cancelling the wait withdraws it there."""
        if self.id is not None:
            raise ValidationError("hold", f"this hold of {self.quota!r} was entered already")
        client = self.client
        self.id = aid = client.reserve_id()
        try:
            await client._request("hold", [aid, self.quota, self.tokens, self.trajectory, self.kind])
        except asyncio.CancelledError:  # withdrawn: the server cancels it, admitted or not
            if client._lost is None:
                client._out_cancel.append(aid)
                client._kick()
            raise
        return self

    async def back_off(self, seconds: float | None = None) -> float:
        """Pauses the quota for every client: `seconds`, or the next exponential step."""
        return await self.client.back_off_quota(self.quota, seconds)

    async def release(self, throttled: bool = False, retry_after: float | None = None) -> None:
        """Gives the slot back (throttled: pausing the quota first); returns once the
        server's core has it."""
        await self.client._request("release", [self.id, throttled, retry_after])

    async def __aenter__(self) -> "ClientQuotaHold":
        return await self.acquire()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.client._lost is not None:
            return  # the connection is gone: the server gave the slot back when it ended
        throttled = isinstance(exc, Throttled)
        try:
            await self.release(throttled, exc.retry_after if isinstance(exc, Throttled) else None)
        except (P.ConnectionLost, OrchestratorClosed):
            if exc is None:  # else the body's own error is the one to see; the slot went with the connection
                raise


def _decode_record(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """A record as Client._frame keeps it (the server's fields still packed) -> the field
    values of an ActionRecord."""
    action_id, kind, trajectory, manager, packed, outcome, error, quota = entry
    submit, start, end, node, device, grant, wait_reason, estimate = P.unpack_record(packed)
    return (action_id, kind, trajectory, manager, submit, start, end, node, device, grant, outcome, wait_reason, error,
            estimate, quota)


def _pickle_calls(calls: list[Call]) -> bytes:
    """The calls as one pickle, as cloudpickle would send them, but through the C pickler
    when that means the same: three times faster, and pickling was the largest cost of a
    round trip in the client.

    The two differ only for what cloudpickle sends by value: objects of `__main__`, of a
    module registered with cloudpickle.register_pickle_by_value, and local ones (lambdas,
    closures). The C pickler refuses local objects and would send the others by a name the
    server cannot resolve, so its bytes are used only when they name neither `__main__`
    nor a registered module (a false alarm only costs the slow path). A first call whose
    function is local or of `__main__` goes to cloudpickle at once.
    """
    fn = calls[0].fn
    if fn is None or not (getattr(fn, "__module__", None) == "__main__" or "<" in getattr(fn, "__qualname__", "")):
        try:
            data = pickle.dumps(calls, protocol=5)
        except Exception:
            pass
        else:
            if b"__main__" not in data and not any(
                    name.encode() in data for name in cloudpickle.list_registry_pickle_by_value()):
                return data
    return cloudpickle.dumps(calls, protocol=5)


# ---------------------------------------------------------------- synchronous flavour
# A submitted action seen from another thread: the same handle as SyncOrchestrator's.
SyncClientHandle = SyncHandle


class SyncClient(LoopThread):
    """`SyncClient(...)` takes the Client's arguments and connects at once; the connection
    lives on an event loop in a background thread, so any number of threads can share it
    (SyncOrchestrator's API: `explain`, `queue_lengths` and `utilisation` block for the
    server's answer; `records` is the client's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.client = Client(*args, **kwargs)
        super().__init__("tangram-client", self.client)

    def submit(self, call: Call) -> SyncClientHandle:
        client = self.client
        client._check_running("submit")
        client._check_call(call)
        action_id = client.reserve_id()
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def on_loop() -> None:
            try:
                handle = client._submit(call, action_id)
            except BaseException as e:
                out.set_exception(e)
                return
            handle.future.add_done_callback(lambda f: copy_outcome(f, out))

        self.loop.call_soon_threadsafe(on_loop)
        return SyncClientHandle(action_id, out, self)
