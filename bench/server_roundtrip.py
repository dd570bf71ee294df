"""Round trip and throughput of `tangram serve` with several client processes on loopback.

    python bench/server_roundtrip.py [--clients 4] [--latency 2000] [--actions 50000]
                                     [--batch 1000] [--depth 2] [--json PATH]

What it measures: the protocol and the scheduling path, not a resource manager. The
server runs with `--manager cpu=server_roundtrip:NoopManager` (defined here): it returns
None at once, on the server's event loop, and keeps nothing per action (unlike the test
MockManager, whose event log grows by one entry per action and slows a long run through
the garbage collector). An action's round trip is client submit -> frame -> server ->
scheduler core -> start decision -> (nothing) -> result -> frame -> client future. The
inventory is one node of 64 cores; each action asks for 0.001 core, so nothing queues on
resources. The server keeps its default records and Prometheus metrics.

  latency      each client process runs `--latency` no-op actions one after another
               (`await client.run(call)`); every round trip is a sample. Reported for one
               client alone and for `--clients` clients at once (then each sample also
               waits behind the other clients' work on the server's one event loop). Also
               the CPU time per round trip of the server and of a client (from /proc and
               time.process_time), steadier than the wall clock on a shared machine.
  throughput   each client process submits `--actions` no-op actions in batches of
               `--batch` (`await client.map(calls)`), `--depth` batches in flight; the
               figure is all clients' actions over the wall time from the first start to
               the last result (time.perf_counter is CLOCK_MONOTONIC, shared by the
               processes). Also the server's CPU seconds per action over that phase.
  in-process   the same two measurements against tangram.Orchestrator with the same
               no-op manager in one process: what the server and the network add.
  echo         the round trip of a bare asyncio echo server over loopback (300 bytes, as
               large as a SUBMIT frame of one call), alone and with `--clients` clients at
               once: the floor that asyncio and the kernel set on this machine, measured in
               the same run (figures on a shared machine move with its load).

Targets: median round trip under 500 us with several clients at once; over 10,000
actions/s batched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

try:
    from tangram.runtime.managers.base import ResourceManager
except ImportError:  # pragma: no cover
    ResourceManager = object  # type: ignore[assignment,misc]


class NoopManager(ResourceManager):  # type: ignore[misc,valid-type]
    """Carries nothing out: every action ends at once with None."""

    name = "noop"

    async def execute(self, action: Any, placement: Any) -> None:
        return None


INVENTORY = '[inventory]\nnodes = [{ name = "bench", resources = { cpu = 64, memory = 65536 } }]\n'


def noop_call() -> Any:
    from tangram import Call

    return Call(runtime=0.0, resources={"cpu": 0.001})


# ---------------------------------------------------------------- client processes
async def worker(address: str, mode: str, count: int, batch: int, depth: int) -> dict[str, Any]:
    from tangram import Client

    if mode == "echo":
        return await echo_worker(address, count)
    async with Client(address) as client:
        await client.map([noop_call() for _ in range(200)])  # warm: connection, pickler, core
        for _ in range(20):
            await client.run(noop_call())
        print("ready", flush=True)
        sys.stdin.readline()  # "go"
        started = time.perf_counter()
        if mode == "latency":
            samples = []
            cpu = time.process_time()
            for _ in range(count):
                t0 = time.perf_counter()
                await client.run(noop_call())
                samples.append(time.perf_counter() - t0)
            return {"start": started, "end": time.perf_counter(), "samples": samples,
                    "cpu": time.process_time() - cpu}
        batches = [min(batch, count - i) for i in range(0, count, batch)]

        async def lane(k: int) -> int:
            done = 0
            for size in batches[k::depth]:
                results = await client.map([noop_call() for _ in range(size)])
                errors = [r for r in results if r is not None]
                if errors:
                    raise RuntimeError(f"unexpected results: {errors[:3]}")
                done += size
            return done

        done = sum(await asyncio.gather(*(lane(k) for k in range(depth))))
        return {"start": started, "end": time.perf_counter(), "actions": done}


# ---------------------------------------------------------------- the floor: a bare asyncio echo
class _Echo(asyncio.Protocol):
    """Sends back whatever arrives."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


class _EchoClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def echo_server() -> None:
    server = await asyncio.get_running_loop().create_server(_Echo, "127.0.0.1", 0)
    print(f"listening on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


async def echo_worker(address: str, count: int) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_EchoClient, host, int(port))
    message = b"x" * 300

    async def once() -> None:
        proto.waiter = loop.create_future()
        transport.write(message)
        await proto.waiter

    for _ in range(200):
        await once()
    print("ready", flush=True)
    sys.stdin.readline()  # "go"
    started = time.perf_counter()
    samples = []
    cpu = time.process_time()
    for _ in range(count):
        t0 = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - t0)
    transport.close()
    return {"start": started, "end": time.perf_counter(), "samples": samples, "cpu": time.process_time() - cpu}


def worker_main(argv: list[str]) -> int:
    address, mode, count, batch, depth = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    result = asyncio.run(worker(address, mode, count, batch, depth))
    print(json.dumps(result), flush=True)
    return 0


def run_clients(address: str, clients: int, mode: str, count: int, batch: int, depth: int,
                server_pid: int) -> tuple[list[dict[str, Any]], float]:
    """Starts the client processes, waits until each is connected and warm, starts them
    together; returns their reports and the server's CPU seconds meanwhile."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", address, mode, str(count), str(batch), str(depth)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"client did not start: {line!r}")
        cpu0 = cpu_seconds(server_pid)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"client failed with {p.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports, cpu_seconds(server_pid) - cpu0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def cpu_seconds(pid: int) -> float:
    """CPU time of a process: its threads' run time in ns from schedstat (clock ticks of
    10 ms are too coarse for a short phase), else utime + stime."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- in process, for reference
async def in_process(latency: int, actions: int, batch: int) -> dict[str, float]:
    from tangram import Inventory, Orchestrator

    inventory = Inventory.uniform(1, {"cpu": 64, "memory": 65536})
    async with Orchestrator(inventory=inventory, default_managers=False, managers={"cpu": NoopManager()}) as orch:
        await orch.map([noop_call() for _ in range(200)])
        samples = []
        for _ in range(latency):
            t0 = time.perf_counter()
            await orch.run(noop_call())
            samples.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, actions, batch):
            await orch.map([noop_call() for _ in range(min(batch, actions - i))])
        rate = actions / (time.perf_counter() - t0)
    return {"median_us": statistics.median(samples) * 1e6, "p99_us": percentile(samples, 99) * 1e6,
            "actions_per_second": rate}


def round_trips(measure: str, address: str, clients: int, count: int, server_pid: int) -> dict[str, Any]:
    """One round-trip row: latency percentiles, and the CPU time each round trip costs the
    server and a client (on a shared machine, steadier than the wall clock)."""
    reports, server_cpu = run_clients(address, clients, "echo" if measure.startswith("echo") else "latency",
                                      count, 1, 1, server_pid)
    samples = [s for r in reports for s in r["samples"]]
    return {"measure": measure, "clients": clients, "median_us": statistics.median(samples) * 1e6,
            "p90_us": percentile(samples, 90) * 1e6, "p99_us": percentile(samples, 99) * 1e6,
            "samples": len(samples), "server_cpu_us_per_round_trip": server_cpu / len(samples) * 1e6,
            "client_cpu_us_per_round_trip": statistics.mean(r["cpu"] for r in reports) / count * 1e6}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


# ---------------------------------------------------------------- main
def start_server(config: str | None) -> tuple[subprocess.Popen[str], str]:
    """`tangram serve` with the no-op manager, or (config None) the echo server."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                      env.get("PYTHONPATH")]))
    argv = ([sys.executable, __file__, "--echo-server"] if config is None else
            [sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--config", config,
             "--manager", "cpu=server_roundtrip:NoopManager", "--grace", "0"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    match = re.search(r"listening on (\S+)", line)
    if match is None:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"tangram serve did not start: {line!r}")
    return proc, match.group(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "--echo-server":
        asyncio.run(echo_server())
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4, help="client processes at once (default 4)")
    parser.add_argument("--latency", type=int, default=2000, help="round trips per client (default 2000)")
    parser.add_argument("--actions", type=int, default=50000, help="actions per client, throughput (default 50000)")
    parser.add_argument("--batch", type=int, default=1000, help="actions per map() (default 1000)")
    parser.add_argument("--depth", type=int, default=2, help="batches in flight per client (default 2)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(INVENTORY)
        config = f.name
    rows: list[dict[str, Any]] = []
    proc, address = start_server(config)
    try:
        for clients in sorted({1, args.clients}):
            rows.append(round_trips("round trip", address, clients, args.latency, proc.pid))
        for clients in sorted({1, args.clients}):
            reports, cpu = run_clients(address, clients, "throughput", args.actions, args.batch, args.depth, proc.pid)
            total = sum(r["actions"] for r in reports)
            wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
            rows.append({"measure": "throughput", "clients": clients, "batch": args.batch, "depth": args.depth,
                         "actions": total, "seconds": wall, "actions_per_second": total / wall,
                         "server_cpu_us_per_action": cpu / total * 1e6})
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        os.unlink(config)
    proc, address = start_server(None)
    try:
        for clients in sorted({1, args.clients}):
            rows.append(round_trips("echo round trip", address, clients, args.latency, proc.pid))
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    reference = asyncio.run(in_process(args.latency, args.actions, args.batch))

    cores = len(os.sched_getaffinity(0))
    print(f"tangram serve on loopback, no-op manager (protocol + scheduling only); {cores} cores, "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'measure':<26} {'clients':>7} {'median us':>10} {'p90 us':>8} {'p99 us':>8} {'actions/s':>10} "
          f"{'server cpu us/action':>21} {'client cpu us/action':>21}")
    order = ["round trip", "echo round trip", "throughput"]
    for r in sorted(rows, key=lambda r: order.index(r["measure"])):
        if r["measure"] in ("round trip", "echo round trip"):
            label = "round trip (run)" if r["measure"] == "round trip" else "bare asyncio echo"
            print(f"{label:<26} {r['clients']:>7} {r['median_us']:>10.0f} {r['p90_us']:>8.0f} "
                  f"{r['p99_us']:>8.0f} {'':>10} {r['server_cpu_us_per_round_trip']:>21.0f} "
                  f"{r['client_cpu_us_per_round_trip']:>21.0f}")
        else:
            print(f"{'throughput (map ' + str(r['batch']) + ')':<26} {r['clients']:>7} {'':>10} {'':>8} {'':>8} "
                  f"{r['actions_per_second']:>10,.0f} {r['server_cpu_us_per_action']:>21.1f}")
    print(f"{'in-process round trip':<26} {'-':>7} {reference['median_us']:>10.0f} {'':>8} "
          f"{reference['p99_us']:>8.0f}")
    print(f"{'in-process throughput':<26} {'-':>7} {'':>10} {'':>8} {'':>8} {reference['actions_per_second']:>10,.0f}")
    # The targets are for several client processes at once; one client alone is shown too.
    alone = next(r["median_us"] for r in rows if r["measure"] == "round trip" and r["clients"] == 1)
    rt = next(r["median_us"] for r in rows if r["measure"] == "round trip" and r["clients"] == args.clients)
    many = [r for r in rows if r["measure"] == "throughput" and r["clients"] == args.clients][0]
    print(f"targets: median round trip < 500 us with {args.clients} clients at once: {rt:.0f} us "
          f"({'met' if rt < 500 else 'NOT met'}; one client alone: {alone:.0f} us); "
          f"> 10,000 actions/s batched with {args.clients} clients: {many['actions_per_second']:,.0f} "
          f"({'met' if many['actions_per_second'] > 10000 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "python": sys.version, "load_average": os.getloadavg()[0],
                       "manager": "NoopManager (no work; protocol and scheduling only)", "args": vars(args),
                       "rows": rows, "in_process": reference}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
