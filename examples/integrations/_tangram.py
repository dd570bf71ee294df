"""A `tangram serve` for an example to talk to: the one at $TANGRAM_ADDRESS when set (as
in a real rollout, where one server runs per host), else one started here, in this
process's event loop, on a free port of this machine's loopback."""

from __future__ import annotations

import contextlib
import os
from typing import AsyncIterator

from tangram.server import Server


@contextlib.asynccontextmanager
async def tangram_server() -> AsyncIterator[str]:
    if os.environ.get("TANGRAM_ADDRESS"):
        yield os.environ["TANGRAM_ADDRESS"]
        return
    async with Server(port=0) as server:
        assert server.address is not None
        os.environ["TANGRAM_ADDRESS"] = address = "%s:%d" % server.address
        try:
            yield address
        finally:
            del os.environ["TANGRAM_ADDRESS"]
