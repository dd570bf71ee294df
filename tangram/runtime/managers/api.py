"""The API manager: calls to rate-limited external APIs (search, LLM judges, tools).

Admission is the core's job: every call names a quota (requests per second with burst,
max concurrency, tokens per minute) and the core starts it only when the quota admits it,
for every caller of the orchestrator at once. Time spent waiting for the quota is part of
the action's ACT; the record's `wait_reason` says which limit held it. This manager only
makes the call: a coroutine function is awaited on the orchestrator's loop; a plain
function (a blocking HTTP client) runs in this manager's thread pool.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from ..._errors import ValidationError
from ..call import Call, Placement
from ..errors import ManagerError
from .base import LiveAction, ResourceManager


class ApiManager(ResourceManager):
    name = "api"

    def __init__(self, max_threads: int = 64) -> None:
        if not isinstance(max_threads, int) or max_threads < 1:
            raise ManagerError("managers.api.max_threads", f"must be a positive integer, got {max_threads!r}")
        self.max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None

    def check_call(self, call: Call) -> None:
        if call.fn is None:
            raise ValidationError("call.fn", "an API call needs fn (the function making the request)")

    async def execute(self, action: LiveAction, placement: Placement) -> Any:
        call = action.call
        fn = call.fn
        if inspect.iscoroutinefunction(fn):
            return await fn(*call.args, **call.kwargs)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_threads, thread_name_prefix="tangram-api")
        loop = asyncio.get_running_loop()
        # A cancelled blocking call cannot be interrupted; its result is dropped.
        return await loop.run_in_executor(self._pool, lambda: fn(*call.args, **call.kwargs))

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def describe(self) -> Mapping[str, Any]:
        return {"threads": self.max_threads, "admission": "by the core: quota rate, burst, concurrency, tokens"}
