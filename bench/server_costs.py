"""The per-request costs behind `tangram serve`'s round trip, each beside the way it was
done before, in one process (docs/server.md, "Where a round trip goes").

    python bench/server_costs.py

  read          a 300-byte frame sent and read back over a loopback TCP pair: recv() of a
                fresh 256 KiB buffer (what asyncio's plain Protocol does) against
                recv_into() a reused one (BufferedProtocol, the frame reader's buffer)
  send          CPU of one send() to a receiver sleeping in epoll in another process
  encode        one action's core record: its template's bytes with id and trajectory
                packed in (CallEncoder.records, one action) against indexing the
                structured array of templates (the path a batch takes)
  pickle        a small Call, as its field values (Call.__reduce_ex__) against the
                default dict of fields (a subclass, which pickles the default way)
  metrics       one finished action into the metrics: Metrics.observe against
                prometheus_client's Counter + two Histograms with cached children
  server        the server's Python per request, through a fake transport: frame in,
                submit, start, result frame out (no sockets, no kernel); with each
                action's record packed beside its result (what a Client asks for by
                default) and without (Client(records=False))

Times are the best of several repeats, in microseconds of CPU or wall per operation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import select
import socket
import sys
import time
import timeit
from typing import Any, Callable

import numpy as np

from tangram import Call, Inventory
from tangram.runtime.managers.base import ResourceManager
from tangram.runtime.records import ACT_BUCKETS, ActionRecord, Metrics


def best_us(fn: Callable[[], Any], number: int = 20_000, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def read_costs() -> tuple[float, float]:
    a, b = tcp_pair()
    message = b"x" * 300
    room = memoryview(bytearray(16 * 1024))

    def fresh() -> None:
        a.send(message)
        b.recv(256 * 1024)

    def reused() -> None:
        a.send(message)
        b.recv_into(room)

    try:
        return best_us(fresh), best_us(reused)
    finally:
        a.close()
        b.close()


def send_cost(rounds: int = 3000) -> float:
    """CPU of send() while the receiver sleeps in epoll (it answers, so each round waits)."""
    a, b = tcp_pair()
    pid = os.fork()
    if pid == 0:  # the receiver
        a.close()
        poller = select.epoll()
        poller.register(b, select.EPOLLIN)
        for _ in range(rounds):
            poller.poll()
            b.recv(65536)
            b.send(b"y" * 60)
        os._exit(0)
    b.close()
    poller = select.epoll()
    poller.register(a, select.EPOLLIN)
    cpu = 0.0
    for _ in range(rounds):
        c0 = time.thread_time()
        a.send(b"x" * 300)
        cpu += time.thread_time() - c0
        poller.poll()
        a.recv(65536)
    os.waitpid(pid, 0)
    a.close()
    return cpu / rounds * 1e6


class NoopManager(ResourceManager):
    name = "noop"

    async def execute(self, action: Any, placement: Any) -> None:
        return None


async def encode_costs() -> tuple[float, float]:
    from tangram import Orchestrator

    async with Orchestrator(inventory=Inventory.uniform(1, {"cpu": 64, "memory": 65536}), default_managers=False,
                            managers={"cpu": NoopManager()}) as orch:
        encoder = orch._dispatch.encoder
        t = encoder.template(Call(runtime=0.0, resources={"cpu": 0.001}))
        templates = encoder._templates

        def indexed() -> Any:
            rec = templates[np.asarray([t], dtype=np.intp)]
            rec["id"] = [5]
            rec["trajectory"] = [0]
            return rec

        return best_us(lambda: encoder.records([t], [5], [0])), best_us(indexed)


@dataclasses.dataclass
class _DefaultPickled(Call):
    """A Call subclass: pickles the default way (a dict of field names and values)."""


def pickle_costs() -> dict[str, float]:
    compact = [Call(runtime=0.0, resources={"cpu": 0.001})]
    default = [_DefaultPickled(runtime=0.0, resources={"cpu": 0.001})]
    out: dict[str, float] = {}
    for name, calls in (("compact", compact), ("default", default)):
        data = pickle.dumps(calls, protocol=5)
        out[f"{name}_bytes"] = len(data)
        out[f"{name}_dumps"] = best_us(lambda: pickle.dumps(calls, protocol=5))
        out[f"{name}_loads"] = best_us(lambda: pickle.loads(data))
    return out


def metrics_costs() -> tuple[float, float]:
    from prometheus_client import CollectorRegistry, Counter, Histogram

    class Idle:
        def queue_lengths_now(self) -> dict[str, Any]:
            return {}

        def utilisation_now(self) -> dict[str, Any]:
            return {}

    record = ActionRecord(1, "env", 0, "cpu", 0.0, 0.001, 0.002, "node0", None, 1.0, "ok")
    ours = Metrics(Idle())
    registry = CollectorRegistry()
    outcome = Counter("a", "a", ["kind", "outcome"], registry=registry).labels("env", "ok")
    act = Histogram("b", "b", ["kind"], buckets=ACT_BUCKETS, registry=registry).labels("env")
    wait = Histogram("c", "c", ["kind"], buckets=ACT_BUCKETS, registry=registry).labels("env")

    def prometheus() -> None:  # what Metrics.observe did, children cached
        outcome.inc()
        act.observe(record.end - record.submit)  # type: ignore[operator]
        wait.observe(record.start - record.submit)  # type: ignore[operator]

    return best_us(lambda: ours.observe(record)), best_us(prometheus)


async def server_python(requests: int = 20_000, records: bool = True) -> float:
    """CPU per request of the server's Python path, from a SUBMIT frame to the RESULTS
    frame written, through a fake transport (the loop's iterations included)."""
    from tangram.server import protocol as P
    from tangram.server.client import _pickle_calls
    from tangram.server.server import Server, _Connection

    class FakeTransport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.out: list[bytes] = []

        def write(self, data: Any) -> None:
            self.out.append(data)

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return default

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

        def abort(self) -> None:
            pass

    server = Server(inventory=Inventory.uniform(1, {"cpu": 64, "memory": 65536}), port=0, default_managers=False,
                    managers={"cpu": NoopManager()})
    await server.start()
    try:
        conn = _Connection(server)
        transport = FakeTransport()
        conn.connection_made(transport)
        conn.reader.feed(P.json_frame(P.HELLO, {"protocol": P.PROTOCOL, "token": None, "records": records}))
        conn.buffer_updated(0)
        base = conn.number << P.ID_BITS
        frames = [P.submit_frame([base | i], _pickle_calls([Call(runtime=0.0, resources={"cpu": 0.001})]))
                  for i in range(1, requests + 501)]

        async def request(frame: bytes) -> None:
            transport.out.clear()
            conn.reader.feed(frame)
            conn.buffer_updated(0)
            while not transport.out:
                await asyncio.sleep(0)

        for frame in frames[:500]:
            await request(frame)
        cpu = time.process_time()
        for frame in frames[500:]:
            await request(frame)
        return (time.process_time() - cpu) / requests * 1e6
    finally:
        server.force_close()
        await server.close()


def main() -> int:
    fresh, reused = read_costs()
    send = send_cost()
    one, indexed = asyncio.run(encode_costs())
    p = pickle_costs()
    observe, prometheus = metrics_costs()
    python = asyncio.run(server_python())
    bare = asyncio.run(server_python(records=False))
    print(f"read     300 B over loopback: recv of 256 KiB {fresh:.1f} us, recv_into a reused buffer {reused:.1f} us "
          f"(send included in both)")
    print(f"send     CPU of one send to a receiver sleeping in epoll: {send:.1f} us")
    print(f"encode   one action's record: template bytes {one:.2f} us, structured-array indexing {indexed:.2f} us")
    print(f"pickle   a small Call: field values {p['compact_bytes']:.0f} B, dumps {p['compact_dumps']:.2f} us, "
          f"loads {p['compact_loads']:.2f} us; dict of fields {p['default_bytes']:.0f} B, dumps "
          f"{p['default_dumps']:.2f} us, loads {p['default_loads']:.2f} us")
    print(f"metrics  one action: Metrics.observe {observe:.2f} us, prometheus_client objects {prometheus:.2f} us")
    print(f"server   Python per request through a fake transport: {python:.1f} us with its record, "
          f"{bare:.1f} us without")
    return 0


if __name__ == "__main__":
    sys.exit(main())
