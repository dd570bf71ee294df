"""pytest-benchmark view of bench/runtime_overhead.py: a batch of no-op actions through
the orchestrator (mock manager: the scheduling path alone) and through the CPU manager's
sandboxes, beside asyncio + ProcessPoolExecutor, in one process.

    pytest bench/bench_runtime.py --benchmark-enable
Without --benchmark-enable each runs once, as a correctness test.
"""

from __future__ import annotations

import asyncio

import pytest

from . import runtime_overhead as ro

ACTIONS = 500


@pytest.mark.parametrize("impl", ["pool", "tangram-cpu", "tangram"])
def test_noop_batch(benchmark, impl: str) -> None:  # type: ignore[no-untyped-def]
    make = {"pool": ro.Pool, "tangram-cpu": lambda: ro.Tangram("cpu"), "tangram": lambda: ro.Tangram("mock")}[impl]
    loop = asyncio.new_event_loop()
    try:
        runner = make()
        loop.run_until_complete(runner.__aenter__())
        try:
            benchmark.pedantic(lambda: loop.run_until_complete(runner.many(ro.noop, ACTIONS)), rounds=3, iterations=1)
        finally:
            loop.run_until_complete(runner.__aexit__(None, None, None))
    finally:
        loop.close()
