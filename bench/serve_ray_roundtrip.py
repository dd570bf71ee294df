"""What `tangram serve --ray` adds to a round trip: the same client against `tangram serve`
scheduling this machine, and against `tangram serve --ray` scheduling a local Ray cluster
of one worker node on this machine.

    python bench/serve_ray_roundtrip.py [--samples 500] [--rounds 3] [--json PATH]

Each sample is one `await client.run(Call(fn=max, args=(6, 7), trajectory=1))` (a real
call: pickled to the server, run in the trajectory's sandbox worker, its result back),
one after another, after a warm-up that starts the sandbox. Without --ray the server's
CPU manager runs it in a local sandbox; with --ray the server's core places it on the
cluster's node and that node's agent (a Ray actor) runs it in its sandbox, so the
difference is the Ray hop: the batched actor call to the agent and the result's way back.
The two servers alternate for `--rounds` rounds (interleaved A/B on a shared machine);
reported: median and p99 per server over all rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: bench is the checkout's package
    sys.path.insert(1, ROOT)

from bench import served  # noqa: E402


async def _round_trips(address: str, samples: int, warmup: int = 30) -> list[float]:
    import tangram

    async with tangram.Client(address) as client:
        call = tangram.Call(fn=max, args=(6, 7), trajectory=1, resources={"cpu": 1}, runtime=0.001)
        for _ in range(warmup):
            assert await client.run(call) == 7
        out = []
        for _ in range(samples):
            started = time.perf_counter()
            await client.run(call)
            out.append(time.perf_counter() - started)
        await client.end_trajectory(1)
    return out


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"median_us": statistics.median(ordered) * 1e6, "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
            "samples": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from ray import cluster_utils

    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 100 * 1024**2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, object_store_memory=100 * 1024**2)
    cluster.wait_for_nodes()
    samples: dict[str, list[float]] = {"serve": [], "serve --ray": []}
    try:
        for _ in range(args.rounds):
            for name, extra in (("serve", ()), ("serve --ray", ("--ray", cluster.address))):
                proc, address = served.start(
                    [sys.executable, "-m", "tangram", "serve", "--port", "0", "--grace", "0", *extra],
                    r"listening on (\S+)", timeout=180, lines=1)
                try:
                    samples[name] += asyncio.run(_round_trips(address, args.samples))
                finally:
                    served.stop(proc)
    finally:
        cluster.shutdown()
    result: dict[str, Any] = {name: _summary(s) for name, s in samples.items()}
    result["ratio_median"] = result["serve --ray"]["median_us"] / result["serve"]["median_us"]
    result["added_median_us"] = result["serve --ray"]["median_us"] - result["serve"]["median_us"]
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    for name in ("serve", "serve --ray"):
        r = result[name]
        print(f"tangram {name:12s} median {r['median_us']:8.0f} us  p99 {r['p99_us']:8.0f} us  ({r['samples']} samples)")
    print(f"--ray adds {result['added_median_us']:.0f} us to the median round trip ({result['ratio_median']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
