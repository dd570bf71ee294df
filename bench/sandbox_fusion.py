"""Sandbox Fusion requests through tangram's endpoint, against a plain pool of workers behind
a minimal server of the same HTTP library.

    python bench/sandbox_fusion.py [--requests 200] [--clients 32] [--sequential 100]
        [--repeat 3] [--tangram-cpu CORES] [--json PATH]

The requests are what a veRL rollout's code reward sends (verl/utils/reward_score/
sandbox_fusion/utils.py): one POST /run_code per test case, each over a new connection
(veRL posts with requests.post, no session), with compile_timeout, run_timeout and
memory_limit_MB set, from a thread pool. Each program is a small CPU-bound Python program
of our own (a sum of squares, 5-60 ms of computing on top of the interpreter's start) that
prints its result; every answer is checked against the expected output.

Two servers, each a subprocess on loopback, run in turn in every repetition:
  tangram  `tangram serve --sandbox-fusion-port 0` with its defaults on this machine (the
           CPU manager, cgroup isolation where it is available; pooled sandboxes; each
           request guaranteed `--tangram-cpu` cores, default 1)
  pool     a minimal aiohttp server whose handler runs the same program runner
           (tangram.runtime.sandbox.run_code.run_code_timed) in a concurrent.futures.ProcessPoolExecutor
           with one worker per core: no scheduler, no sandbox, nothing isolated

Two phases per server:
  sequential  one client, one request at a time (`--sequential` of them, a one-line
              shell program, `echo`): the latency of a request with the machine otherwise
              idle, and what it costs beyond running the code. Both servers send a
              Server-Timing header with `total` (from the handler's start to the answer
              encoded) and `run` (running the request in the worker: writing its files,
              starting and running the program, reading its output back, and for tangram
              scrubbing the pooled sandbox; tangram.runtime.sandbox.inside_run_code.run_code_timed). Reported:
              the endpoint's overhead, total - run: parsing and checking the request and
              handing it to the worker and back (for tangram: scheduling it, the sandbox's
              round trip); running it beyond the program, run - the run step's
              execution_time; and at the client, latency - execution_time (its HTTP, a
              new connection each, the server's, and everything around the program)
  bursts      `--requests` requests from `--clients` threads at once, as a rollout's
              reward step sends them, twice: requests per second over the burst, mean,
              p50 and p99 latency. The first burst makes tangram start a sandbox per
              request running at once (pooled afterwards, see tangram.server.sandbox_fusion);
              the second, like every later step of a rollout, finds them

Reports medians over the repetitions, and tangram's ratios to the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: bench is the checkout's package
    sys.path.insert(1, ROOT)

from bench import served  # noqa: E402

PROGRAM = "import sys\nn = int(sys.stdin.readline())\nprint(sum(i * i for i in range(n)))\n"
SIZES = (100_000, 200_000, 400_000, 800_000)  # about 5 to 60 ms of computing here
ECHO = "echo ok"


def expected(n: int) -> str:
    return f"{sum(i * i for i in range(n))}\n"


def verl_request(n: int) -> str:
    """The body veRL's call_sandbox_api sends (json.dumps of its payload); n = 0: the
    one-line shell program of the sequential phase."""
    code, language = (PROGRAM, "python") if n else (ECHO, "bash")
    return json.dumps({"compile_timeout": 30, "run_timeout": 30, "code": code, "stdin": str(n),
                       "memory_limit_MB": 1024, "language": language, "files": {}, "fetch_files": []})


def post(url: str, n: int) -> tuple[float, float, float, float]:
    """One request as veRL sends it: its latency, the program's own seconds, the server's
    seconds on it and the part running it (its Server-Timing header: total and run)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    began = time.perf_counter()
    response = requests.post(url, headers=headers, data=verl_request(n), timeout=120)
    latency = time.perf_counter() - began
    response.raise_for_status()
    body = response.json()
    run = body.get("run_result") or {}
    if body.get("status") != "Success" or run.get("stdout") != (expected(n) if n else "ok\n"):
        raise RuntimeError(f"wrong answer for n={n}: {body}")
    own = sum((step or {}).get("execution_time") or 0.0 for step in (body.get("compile_result"), run))
    timing = dict(re.findall(r"(\w+);dur=([0-9.]+)", response.headers.get("Server-Timing", "")))
    return latency, own, float(timing["total"]) / 1e3, float(timing["run"]) / 1e3


def measure(url: str, sequential: int, burst: int, clients: int) -> dict[str, float]:
    seq = [post(url, 0) for _ in range(sequential)]
    overhead = sorted(latency - own for latency, own, _, _ in seq)
    endpoint = sorted(total - run for _, _, total, run in seq)
    running = sorted(run - own for _, own, _, run in seq)
    out = {
        "sequential_p50": statistics.median(latency for latency, _, _, _ in seq),
        "overhead_p50": statistics.median(overhead),
        "overhead_p99": _p99(overhead),
        "endpoint_overhead_p50": statistics.median(endpoint),
        "endpoint_overhead_p99": _p99(endpoint),
        "runner_p50": statistics.median(running),
    }
    for name in ("first", "again") if burst else ():  # the same burst twice: the second finds the first one's sandboxes
        with concurrent.futures.ThreadPoolExecutor(clients) as threads:
            began = time.perf_counter()
            results = list(threads.map(lambda i: post(url, SIZES[i % len(SIZES)]), range(burst)))
            wall = time.perf_counter() - began
        latencies = sorted(latency for latency, _, _, _ in results)
        out |= {f"{name}_requests_per_s": burst / wall, f"{name}_mean": statistics.fmean(latencies),
                f"{name}_p50": statistics.median(latencies), f"{name}_p99": _p99(latencies)}
    return out


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# ------------------------------------------------------------------ the servers
def start_tangram(cpu: float) -> tuple[subprocess.Popen[str], str]:
    return served.start([sys.executable, "-m", "tangram", "serve", "--port", "0", "--sandbox-fusion-port", "0",
                         "--sandbox-fusion-cpu", str(cpu), "--grace", "0"], r"Sandbox Fusion API on (http://\S+/run_code)")


def start_pool() -> tuple[subprocess.Popen[str], str]:
    return served.start([sys.executable, __file__, "--serve-pool"], r"pool on (http://\S+/run_code)")


def serve_pool() -> None:
    """The baseline: aiohttp and a process pool of one worker per core, nothing else."""
    from aiohttp import web

    from tangram.runtime.sandbox.run_code import check_request, run_code_timed

    os.chdir(tempfile.mkdtemp(prefix="sandbox-fusion-pool-"))
    pool = concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1)

    async def run(request: web.Request) -> web.Response:
        began = time.perf_counter()
        checked = check_request(await request.json())
        answer, seconds = await asyncio.get_running_loop().run_in_executor(pool, run_code_timed, checked)
        response = web.json_response(answer)
        response.headers["Server-Timing"] = (f"total;dur={(time.perf_counter() - began) * 1e3:.3f}, "  # as tangram's
                                             f"run;dur={seconds * 1e3:.3f}")
        return response

    async def main() -> None:
        list(pool.map(abs, range(os.cpu_count() or 1)))  # the workers start before the step
        app = web.Application()
        app.router.add_post("/run_code", run)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"pool on http://{host}:{port}/run_code", flush=True)
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        await stopped.wait()
        await runner.cleanup()

    asyncio.run(main())
    pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests in the burst (default 200; 0: no bursts)")
    parser.add_argument("--clients", type=int, default=32, help="threads sending the burst (default 32)")
    parser.add_argument("--sequential", type=int, default=100, help="requests sent one at a time (default 100)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tangram-cpu", type=float, default=1.0,
                        help="cores each request is guaranteed by tangram (--sandbox-fusion-cpu; default 1)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--serve-pool", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_pool:
        serve_pool()
        return
    runs: dict[str, list[dict[str, float]]] = {"tangram": [], "pool": []}
    for rep in range(args.repeat):
        for way in (("tangram", "pool") if rep % 2 == 0 else ("pool", "tangram")):
            proc, url = start_tangram(args.tangram_cpu) if way == "tangram" else start_pool()
            try:
                post(url, SIZES[0])  # a first request of each kind: imports and caches warm
                post(url, 0)
                result = measure(url, args.sequential, args.requests, args.clients)
            finally:
                served.stop(proc)
            runs[way].append(result)
            print(f"  repetition {rep + 1}, {way}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()),
                  flush=True)
    medians = {way: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for way, rs in runs.items()}
    print(f"\nSandbox Fusion requests on {os.cpu_count()} CPUs: {args.sequential} one at a time, then a burst of "
          f"{args.requests} from {args.clients} clients; medians of {args.repeat} repetitions\n")
    print("| server | one at a time: p50 latency | at the client: overhead p50 | p99 | endpoint's overhead p50 | "
          "p99 | running it, beyond the program: p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for way, m in medians.items():
        print(f"| {way} | {m['sequential_p50'] * 1e3:.1f} ms | {m['overhead_p50'] * 1e3:.2f} ms | "
              f"{m['overhead_p99'] * 1e3:.2f} ms | {m['endpoint_overhead_p50'] * 1e3:.2f} ms | "
              f"{m['endpoint_overhead_p99'] * 1e3:.2f} ms | {m['runner_p50'] * 1e3:.2f} ms |")
    bursts = ("first", "again") if args.requests else ()
    if bursts:
        print("\n| server | burst | requests/s | mean latency | p50 latency | p99 latency |")
        print("|---|---|---:|---:|---:|---:|")
    for name in bursts:
        for way, m in medians.items():
            print(f"| {way} | {name} | {m[name + '_requests_per_s']:.1f} | {m[name + '_mean'] * 1e3:.0f} ms | "
                  f"{m[name + '_p50'] * 1e3:.0f} ms | {m[name + '_p99'] * 1e3:.0f} ms |")
    t, p = medians["tangram"], medians["pool"]
    print(f"\nthe endpoint's overhead beyond running the code at p50: tangram {t['endpoint_overhead_p50'] * 1e3:.2f} ms, "
          f"the pool {p['endpoint_overhead_p50'] * 1e3:.2f} ms")
    for name in bursts:
        print(f"{name} burst, tangram/pool: requests/s {t[name + '_requests_per_s'] / p[name + '_requests_per_s']:.2f}x,"
              f" mean latency {t[name + '_mean'] / p[name + '_mean']:.2f}x, p50 {t[name + '_p50'] / p[name + '_p50']:.2f}x,"
              f" p99 {t[name + '_p99'] / p[name + '_p99']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "tangram_cpu": args.tangram_cpu, "requests": args.requests,
                       "clients": args.clients,
                       "sequential": args.sequential, "repeat": args.repeat, "runs": runs, "medians": medians}, f,
                      indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
