"""What the tests that run hostile code in namespaced sandboxes share (test_escape.py,
test_pooled_scrub.py): whether this machine has the boundary, a CPU manager under it, a
placement, and the check that no sandbox process outlives a test."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tangram.runtime.call import Placement
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.sandbox.kills import marked_processes
from tangram.runtime.sandbox.namespaces import detect

BOUNDARY = detect("auto") if sys.platform.startswith("linux") else None
HAS_NAMESPACES = BOUNDARY is not None and BOUNDARY.namespaces
WHY_NOT = f"no namespaces here: {BOUNDARY.reason if BOUNDARY else 'not Linux'}"


@pytest.fixture(autouse=True)
def no_leaked_process() -> Any:
    """(autouse in each module that imports it)"""
    yield
    leaked = marked_processes(f"{os.getpid()}.")
    assert leaked == [], f"processes left behind: {leaked}"


def placement(cores: float = 1.0) -> Placement:
    return Placement(action_id=0, node=0, node_name="local", device=None, grant=cores, cores=cores,
                     memory=0.0, gpu_memory=0.0, env={})


def with_manager(body: Callable[[CpuManager], Awaitable[None]], **options: Any) -> None:
    """`body(mgr)` with a started CpuManager(isolation="namespaces") (no warm workers unless
    asked for), closed after it."""
    options.setdefault("warm_sandboxes", 0)
    mgr = CpuManager(isolation="namespaces", **options)

    async def main() -> None:
        await mgr.start()
        try:
            await body(mgr)
        finally:
            await mgr.close()

    asyncio.run(main())
