"""The wire protocol of `tangram serve` and `tangram.Client` (see docs/server.md).

One TCP connection per client; both directions carry frames:

    +----------------+------------+-------------------+
    | length: uint32 | type: uint8| payload (length)  |
    +----------------+------------+-------------------+    big-endian

Before the server has accepted the client's HELLO, only JSON frames of at most
PREAUTH_MAX_FRAME bytes are read; nothing is unpickled. After it, a frame of up to the
server's `max_frame` bytes is accepted; calls travel as one (cloud)pickle per SUBMIT frame
(their functions run on the server, which is why the token is mandatory off loopback).

    client -> server
      HELLO     JSON  {"protocol": 2, "token": str|null, "shared_trajectories": bool,
                       "records": bool}
      SUBMIT    uint32 n, n x uint64 action ids, then pickle([Call] * n), as cloudpickle makes it
      CANCEL    JSON  [action id, ...]
      REQUEST   JSON  [request id, op, args]   ops: end_trajectory, explain, queue_lengths,
                                                    utilisation, status, ping
    server -> client
      WELCOME   JSON  {"protocol": 2, "connection": int, "max_frame": int, "policy": str,
                       "objective": str, "managers": [str], "server": str}
      RESULTS   pickle [(action id, ok, result | error, record | None), ...]: the record
                (when the HELLO asked for records) is the action's ActionRecord fields
                that the client cannot know, packed by pack_record
      REPLY     pickle [(request id, ok, value | error), ...]
      ERROR     JSON  error; the connection is closed after it
      GOODBYE   JSON  {"reason": str}; the server is shutting down, every action of this
                      connection has had its result

Action ids are chosen by the client, in its own range: connection << 32 | sequence, so a
handle's id is known at submit and is the same id in the server's records and errors.
Errors travel as {"type": "module:Class", "field", "reason", "attrs"} and are rebuilt as the
same TangramError subclass on the other side (see encode_error/decode_error).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
from typing import Any, Callable

from .._errors import TangramError, ValidationError

PROTOCOL = 2
DEFAULT_PORT = 7450
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
PREAUTH_MAX_FRAME = 64 * 1024
ID_BITS = 32

HEADER = struct.Struct("!IB")
COUNT = struct.Struct("!I")
# An action's record as it travels with its result: submit, start, end, grant (NaN for
# None), device (-1 for None), the node name's length; then the node name and the wait
# reason, UTF-8. Times are the server's orchestrator clock.
RECORD = struct.Struct("!4diII")
_NAN = float("nan")

HELLO, WELCOME, SUBMIT, CANCEL, REQUEST, RESULTS, REPLY, ERROR, GOODBYE = range(1, 10)
FRAME_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", SUBMIT: "SUBMIT", CANCEL: "CANCEL", REQUEST: "REQUEST",
               RESULTS: "RESULTS", REPLY: "REPLY", ERROR: "ERROR", GOODBYE: "GOODBYE"}


# ---------------------------------------------------------------- errors
class ConnectionLost(TangramError, ConnectionError):
    """The connection to the server is gone (the server died, was shut down, or closed
    the connection after an error). Every action still pending on the client ends with
    it; `action_id` is the action's id, or None for a request or a new call. The server
    cancels the actions of a client whose connection drops."""

    def __init__(self, reason: str, action_id: int | None = None) -> None:
        super().__init__("connection" if action_id is None else f"action {action_id}", reason)
        self.action_id = action_id


class ServerUnreachable(TangramError, ConnectionError):
    """No connection to the server could be made (nothing listens at the address, a
    timeout, a name that does not resolve): field "address", the reason names the address
    tried and how to start a server there. Distinct from ConnectionLost, which ends a
    connection that existed."""

    def __init__(self, reason: str) -> None:
        super().__init__("address", reason)


class AuthenticationError(TangramError, PermissionError):
    """The server refused the client's token (field "token")."""


class ProtocolError(TangramError):
    """A frame the other side cannot accept: unknown type, bad JSON, bad structure, out of
    order. The server sends it back and closes the connection."""


class FrameTooLarge(ProtocolError):
    """A frame longer than the receiver's limit (`max_frame`; before authentication,
    PREAUTH_MAX_FRAME). From the server: the connection is closed. From the client (a call
    too large to send, or a result too large to return): that action ends with it."""

    def __init__(self, field: str, reason: str, action_id: int | None = None) -> None:
        super().__init__(field, reason)
        self.action_id = action_id


class SubmitNotLoaded(ValidationError):
    """The server could not unpickle a SUBMIT frame of several calls (a class or module of
    one of them is missing there). Never reaches a caller: the client sends each of those
    calls again in a frame of its own, so that only the calls that cannot load fail."""


class RemoteError(TangramError):
    """An error of a type the receiving side does not know; `error_type` names it."""

    def __init__(self, field: str, reason: str, error_type: str = "") -> None:
        super().__init__(field, reason)
        self.error_type = error_type


def _known_errors() -> dict[str, type[TangramError]]:
    out: dict[str, type[TangramError]] = {}
    todo: list[type[TangramError]] = [TangramError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "tangram":
            out[f"{cls.__module__}:{cls.__qualname__}"] = cls
        todo.extend(cls.__subclasses__())
    return out


_ERRORS: dict[str, type[TangramError]] = {}


def encode_error(error: BaseException) -> dict[str, Any]:
    """A typed error as plain data (JSON-able when its attributes are)."""
    if isinstance(error, TangramError):
        attrs = {k: v for k, v in vars(error).items()
                 if k not in ("field", "reason") and isinstance(v, (str, int, float, bool, type(None)))}
        cls = type(error)
        return {"type": f"{cls.__module__}:{cls.__qualname__}", "field": error.field, "reason": error.reason,
                "attrs": attrs}
    return {"type": f"{type(error).__module__}:{type(error).__qualname__}", "field": "server",
            "reason": f"{type(error).__name__}: {error}", "attrs": {}}


def decode_error(data: Any) -> TangramError:
    """The same TangramError subclass, with its field, reason and attributes. Only classes
    of tangram (and its plugins' TangramError subclasses living in tangram.*) are built;
    anything else becomes a RemoteError naming the type."""
    if not isinstance(data, dict):
        return ProtocolError("error", f"malformed error: {data!r:.200}")
    name = str(data.get("type", ""))
    field = str(data.get("field", "server"))
    reason = str(data.get("reason", ""))
    attrs = data.get("attrs") or {}
    cls = _ERRORS.get(name)
    if cls is None:
        _ERRORS.update(_known_errors())
        cls = _ERRORS.get(name)
    if cls is None:
        return RemoteError(field, reason, error_type=name)
    error = cls.__new__(cls)
    Exception.__init__(error, f"{field}: {reason}")
    error.field = field
    error.reason = reason
    if isinstance(attrs, dict):
        for k, v in attrs.items():
            if isinstance(k, str) and not k.startswith("__"):
                setattr(error, k, v)
    return error


# ---------------------------------------------------------------- frames
def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def json_frame(kind: int, obj: Any) -> bytes:
    return frame(kind, json.dumps(obj, separators=(",", ":")).encode())


def error_frame(error: BaseException) -> bytes:
    return json_frame(ERROR, encode_error(error))


def load_json(payload: bytes, what: str) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError("frame", f"{what}: not valid JSON ({e})") from None


def submit_frame(ids: list[int], calls_pickle: bytes) -> bytes:
    head = COUNT.pack(len(ids)) + struct.pack(f"!{len(ids)}Q", *ids)
    return HEADER.pack(len(head) + len(calls_pickle), SUBMIT) + head + calls_pickle


def parse_submit(payload: bytes) -> tuple[tuple[int, ...], memoryview]:
    """The ids of a SUBMIT frame (checked before anything is unpickled) and the pickle."""
    if len(payload) < COUNT.size:
        raise ProtocolError("frame", "SUBMIT: shorter than its count")
    (n,) = COUNT.unpack_from(payload, 0)
    end = COUNT.size + 8 * n
    if n == 0 or len(payload) < end:
        raise ProtocolError("frame", f"SUBMIT: {n} ids announced, {max(0, len(payload) - COUNT.size) // 8} present")
    ids = struct.unpack_from(f"!{n}Q", payload, COUNT.size)
    return ids, memoryview(payload)[end:]


def pack_record(record: Any) -> bytes:
    """The fields of an ActionRecord that only the server knows: one struct and three
    strings, not a pickle (its cost per result: bench/server_costs.py)."""
    start, grant, device = record.start, record.grant, record.device
    node = b"" if record.node is None else record.node.encode()
    reason = record.wait_reason.encode()
    return RECORD.pack(record.submit, _NAN if start is None else start, record.end, _NAN if grant is None else grant,
                       -1 if device is None else device, len(node), len(reason)) + node + reason + record.estimate.encode()


def unpack_record(data: bytes) -> tuple[float, float | None, float, str | None, int | None, float | None, str, str]:
    """(submit, start, end, node, device, grant, wait_reason, estimate) from pack_record's bytes."""
    submit, start, end, grant, device, n, r = RECORD.unpack_from(data)
    size = RECORD.size
    return (submit, None if start != start else start, end, data[size:size + n].decode() if n else None,
            None if device < 0 else device, None if grant != grant else grant,
            data[size + n:size + n + r].decode(), data[size + n + r:].decode())


class FrameReader:
    """Splits a byte stream into frames, checking each length against `limit` (which the
    caller may change between frames) before buffering its payload.

    It owns the receive buffer, for an asyncio.BufferedProtocol: the transport reads
    straight into `get_buffer()` (recv_into) and reports `buffer_updated(n)`. A plain
    Protocol's recv allocates 256 KiB per read, which glibc serves with mmap and
    munmap, at a cost per read that bench/server_costs.py measures.
    """

    __slots__ = ("buffer", "start", "end", "limit")

    INITIAL = 16 * 1024  # per connection; also what it shrinks back to after a large frame
    MIN_READ = 4 * 1024  # free room offered to a read at least

    def __init__(self, limit: int) -> None:
        self.buffer = bytearray(self.INITIAL)
        self.start = 0  # the next frame begins here
        self.end = 0  # bytes received end here
        self.limit = limit

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Free room at the end of the buffer for the next read, at least MIN_READ bytes,
        or the whole announced frame when its header is in (within `limit`: a larger one
        fails in next())."""
        buf, start, end = self.buffer, self.start, self.end
        if start == end:
            start = end = self.start = self.end = 0
            if len(buf) > self.INITIAL:  # a large frame is done: give its room back
                buf = self.buffer = bytearray(self.INITIAL)
        want = self.MIN_READ
        pending = end - start
        if pending >= HEADER.size:
            length = HEADER.unpack_from(buf, start)[0]
            if length <= self.limit:
                want = max(want, HEADER.size + length - pending)
        if len(buf) - end < want:
            if start:  # move the unread bytes to the front (same length: no resize, so
                # a view from an earlier read that is still referenced stays valid)
                buf[:pending] = buf[start:end]
                start, end = self.start, self.end = 0, pending
            if len(buf) - end < want:
                grown = bytearray(max(2 * len(buf), 1 << (end + want - 1).bit_length()))
                grown[:end] = buf[:end]
                buf = self.buffer = grown
        return memoryview(buf)[end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes

    def feed(self, data: bytes) -> None:
        """Appends bytes received some other way."""
        rest = memoryview(data)
        while rest:
            with self.get_buffer() as room:
                n = min(len(room), len(rest))
                room[:n] = rest[:n]
            self.end += n
            rest = rest[n:]

    def next(self) -> tuple[int, bytes] | None:
        """The next complete frame, or None. Raises ProtocolError for an unknown type and
        FrameTooLarge as soon as a header announces more than `limit` bytes (the caller
        closes the connection)."""
        buf, pos = self.buffer, self.start
        if self.end - pos < HEADER.size:
            return None
        length, kind = HEADER.unpack_from(buf, pos)
        if kind not in FRAME_NAMES:
            self._reset()
            raise ProtocolError("frame", f"unknown frame type {kind} (not the tangram protocol {PROTOCOL}?)")
        if length > self.limit:
            self._reset()
            raise FrameTooLarge("frame", f"{FRAME_NAMES.get(kind, f'type {kind}')} frame of {length} bytes; "
                                         f"the limit is {self.limit}")
        end = pos + HEADER.size + length
        if end > self.end:
            return None
        self.start = end
        with memoryview(buf) as view:
            return kind, bytes(view[pos + HEADER.size:end])

    def deliver(self, nbytes: int, on_frame: Callable[[int, bytes], None], on_failure: Callable[[TangramError], None],
                handler: str, is_open: Callable[[], bool] | None = None) -> None:
        """Counts `nbytes` more received and hands every complete frame to `on_frame`
        (while `is_open()` holds). A bad frame, or an exception escaping `on_frame` (a bug
        must cost the connection, not the process), goes to `on_failure` as a TangramError;
        `handler` names who failed to handle it in that error."""
        self.end += nbytes
        try:
            while is_open is None or is_open():
                item = self.next()
                if item is None:
                    return
                on_frame(*item)
        except TangramError as e:
            on_failure(e)
        except Exception as e:
            on_failure(ProtocolError("frame", f"{handler} could not handle a frame: {type(e).__name__}: {e}"))

    def _reset(self) -> None:
        self.buffer, self.start, self.end = bytearray(self.INITIAL), 0, 0


def keepalive(sock: socket.socket | None) -> None:
    """TCP keepalive, so a peer that vanished without a FIN is noticed in about a minute."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass


def parse_address(address: str | tuple[str, int] | None, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """"host:port", "[::1]:port", ":port", "host" (the default port), (host, port), or the
    same as a URL without a path: "tcp://host:port" or "http://host:port" (as pasted from a
    browser or a log line; the protocol is tangram's own on plain TCP). Anything else is a
    ValidationError naming "address" that says what was expected."""
    if address is None:
        return default_host, DEFAULT_PORT
    if isinstance(address, tuple):
        if len(address) != 2 or not isinstance(address[0], str):
            raise ValidationError("address", f"expected (host, port), got {address!r}")
        return address[0], _port(address[1], address)
    if not isinstance(address, str):
        raise ValidationError("address", f"expected a \"host:port\" string, got {type(address).__name__}")
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() in ("https", "tls"):
            raise ValidationError("address", f"{address!r}: tangram serve speaks plain TCP, not TLS; give its "
                                             f"host:port (over an SSH tunnel or a private network)")
        if scheme.lower() not in ("tcp", "http"):
            raise ValidationError("address", f"{address!r}: unknown scheme {scheme!r} (give host:port)")
        text = rest
        if text.endswith("/"):
            text = text[:-1]
        if "/" in text or "?" in text:
            raise ValidationError("address", f"{address!r}: a tangram serve address has no path (give host:port; "
                                             f"a Sandbox Fusion URL such as http://host:8080/run_code is for a "
                                             f"Sandbox Fusion client, not tangram.Client)")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    elif ":" in text:
        raise ValidationError("address", f"{address!r}: an IPv6 address goes in brackets: [::1]:{DEFAULT_PORT}")
    else:
        host, port = text, ""
    if any(c.isspace() for c in host):
        raise ValidationError("address", f"{address!r}: expected host:port")
    return host or default_host, _port(port, address) if port else DEFAULT_PORT


def _port(port: object, address: object) -> int:
    try:
        value = int(port)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValidationError("address", f"{address!r}: expected host:port, the port a number") from None
    if not 0 < value < 65536:
        raise ValidationError("address", f"{address!r}: the port must be 1 to 65535, got {value}")
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or "" (every interface)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
