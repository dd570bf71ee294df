"""What the framework adapters share: where tangram is, a program run as one action, the
text a model reads back, and a reward from test cases.

Where tangram is: every rollout worker process talks to one `tangram serve` for the host
(the `TANGRAM_ADDRESS` and `TANGRAM_TOKEN` variables, as `tangram.Client` reads them),
over one connection per event loop (`connect`), or to a thread-safe one for synchronous
code (`connect_sync`). `use(orchestrator)` sets the process's own orchestrator instead
(an embedded `tangram.Orchestrator`, or a `tangram.Client` made some other way); a
`SyncOrchestrator` or `SyncClient` serves the synchronous callers.

Programs run as Sandbox Fusion requests do (tangram.runtime.sandbox.run_code): one request, one
action, in a trajectory's sandbox; the adapters keep a trajectory per tool instance,
episode or sandbox, so its files persist across its calls, and end it when it is released.
A program without a trajectory of its own (a test case of a reward) runs in a pooled
sandbox, scrubbed after it (Call.pooled), as the Sandbox Fusion endpoint runs a request
without a session.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import weakref
from typing import Any, Mapping, Sequence

from .._errors import TangramError
from ..runtime.sandbox.run_code import TrajectoryPool, check_request, checked_answer, error_answer, run_code_call

# The adapters' trajectory ids: from 3 x 2**30 up, so that they do not meet the ids a
# caller uses itself on the same orchestrator or client (keep those below), and stay
# below 2**32, the most a Client's trajectory id may be.
FIRST_TRAJECTORY = 3 << 30
_trajectories = itertools.count(FIRST_TRAJECTORY)
_lock = threading.RLock()  # (pools take trajectories under it)
_chosen: Any = None  # the orchestrator set with `use`
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()  # one Client per loop
_sync_client: Any = None
_address: str | None = None  # set by a framework config key (use_address); None: the Client's discovery
_pools: dict[int, tuple[Any, TrajectoryPool]] = {}  # id(orchestrator) -> it and the ids of its pooled calls


def use(orchestrator: Any) -> None:
    """Makes `orchestrator` (an Orchestrator or Client for async callers, a
    SyncOrchestrator or SyncClient for synchronous ones) the one this process's adapters
    run on; None goes back to $TANGRAM_ADDRESS. The adapters' trajectories start at
    FIRST_TRAJECTORY: the caller's own trajectories on it must stay below."""
    global _chosen
    _chosen = orchestrator


def use_address(address: str | None) -> None:
    """The server this process's adapters connect to, from a framework's config key (the
    veRL tool's or the SkyRL environment's `address`); it comes before $TANGRAM_ADDRESS and
    the server a Ray cluster advertises (tangram.server.discovery). A change reaches the
    connections made after it."""
    global _address
    if address is not None and not isinstance(address, str):
        raise TypeError(f"address must be a string, got {address!r}")
    _address = address or None


async def connect() -> Any:
    """The orchestrator async adapters run on: the one set with `use`, else a
    `tangram.Client` to $TANGRAM_ADDRESS, one per event loop, connected on first use."""
    if _chosen is not None:
        return _chosen
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        from ..server.client import Client

        client = _clients[loop] = Client(_address)
        try:
            await client.start()
        except BaseException:
            del _clients[loop]
            raise
    return client


def connect_sync() -> Any:
    """The orchestrator synchronous adapters run on (any thread): the one set with `use`,
    else one `tangram.SyncClient` to $TANGRAM_ADDRESS for the process."""
    global _sync_client
    if _chosen is not None:
        return _chosen
    with _lock:
        if _sync_client is None:
            from ..server.client import SyncClient

            _sync_client = SyncClient(_address)
        return _sync_client


def new_trajectory() -> int:
    """A trajectory id no other adapter call in this process uses, from FIRST_TRAJECTORY up
    (a Client's ids are its own on the server)."""
    with _lock:
        return next(_trajectories)


def code_request(code: str, language: str = "python", stdin: str | None = None, timeout: float = 30.0,
                 memory_limit_mb: int = 1024) -> dict[str, Any]:
    """A checked Sandbox Fusion request (ValidationError naming a bad field)."""
    return check_request({"code": code, "language": language, "stdin": stdin, "compile_timeout": timeout,
                          "run_timeout": timeout, "memory_limit_MB": memory_limit_mb})


def _pool(orch: Any) -> TrajectoryPool:
    """The trajectory ids of the programs without a trajectory of their own on `orch`."""
    with _lock:
        entry = _pools.get(id(orch))
        if entry is None or entry[0] is not orch:
            entry = _pools[id(orch)] = (orch, TrajectoryPool(new_trajectory))
        return entry[1]


async def run_code(code: str, language: str = "python", *, stdin: str | None = None, trajectory: int | None = None,
                   timeout: float = 30.0, memory_limit_mb: int = 1024, orchestrator: Any = None) -> dict[str, Any]:
    """Runs a program as one tangram action and returns its Sandbox Fusion response (an
    action that ends in an error answers as tangram.runtime.sandbox.run_code.error_answer says).
    In `trajectory`'s sandbox (its files kept across calls) when given, else in a pooled
    sandbox, scrubbed after it (Call.pooled)."""
    orch = orchestrator if orchestrator is not None else await connect()
    request = code_request(code, language, stdin, timeout, memory_limit_mb)
    if trajectory is not None:
        try:
            return checked_answer(await orch.run(run_code_call(request, trajectory, keep_files=True)))
        except TangramError as e:
            return error_answer(e)
    pool = _pool(orch)
    with _lock:
        t = pool.take()
    try:
        return checked_answer(await orch.run(run_code_call(request, t, pooled=True)))
    except TangramError as e:
        return error_answer(e)
    finally:
        with _lock:
            pool.give_back(t)


def run_code_sync(code: str, language: str = "python", *, stdin: str | None = None, trajectory: int | None = None,
                  timeout: float = 30.0, memory_limit_mb: int = 1024, orchestrator: Any = None) -> dict[str, Any]:
    """`run_code` for synchronous callers (a SyncClient or SyncOrchestrator)."""
    return _run_many_sync([code_request(code, language, stdin, timeout, memory_limit_mb)], trajectory, orchestrator)[0]


def _run_many_sync(requests: Sequence[dict[str, Any]], trajectory: int | None, orchestrator: Any) -> list[dict[str, Any]]:
    """Checked requests submitted together from a synchronous caller: in `trajectory`'s
    sandbox, one after another, or each in a pooled sandbox."""
    orch = orchestrator if orchestrator is not None else connect_sync()
    if trajectory is not None:
        answers = []
        for request in requests:
            try:
                answers.append(checked_answer(orch.run(run_code_call(request, trajectory, keep_files=True))))
            except TangramError as e:
                answers.append(error_answer(e))
        return answers
    pool = _pool(orch)
    with _lock:
        taken = [pool.take() for _ in requests]
    handles = [orch.submit(run_code_call(request, t, pooled=True)) for request, t in zip(requests, taken)]
    answers = []
    for handle, t in zip(handles, taken):
        try:
            answers.append(checked_answer(handle.result()))
        except TangramError as e:
            answers.append(error_answer(e))
        with _lock:
            pool.give_back(t)
    return answers


def tool_text(response: Mapping[str, Any]) -> str:
    """What a model reads back from a program: its stdout and stderr when it ran to the end
    (whatever its exit status), else what stopped it."""
    run = response.get("run_result") or {}
    compiled = response.get("compile_result") or {}
    if response.get("status") == "SandboxError":
        return f"sandbox error: {response.get('message', '')}"
    if compiled and (compiled.get("status") != "Finished" or compiled.get("return_code") != 0):
        return "compile error:\n" + (compiled.get("stderr") or "")
    if run.get("status") == "TimeLimitExceeded":
        return f"time limit exceeded\n{run.get('stdout') or ''}{run.get('stderr') or ''}"
    return (run.get("stdout") or "") + (run.get("stderr") or "")


_FENCED = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)


def extract_code(text: str, language: str = "python") -> str | None:
    """The program in a model's answer: the last fenced block in `language`, else the last
    fenced block of any language, else None (as veRL's code reward extracts it)."""
    blocks = _FENCED.findall(text)
    for lang, body in reversed(blocks):
        if lang.lower() == language.lower():
            return body
    return blocks[-1][1] if blocks else None


def parse_tests(tests: Any) -> tuple[list[str], list[str]]:
    """Test cases as veRL and most code datasets store them: {"inputs": [...], "outputs":
    [...]} (or that object as JSON text); returns the stdin and expected stdout of each."""
    if isinstance(tests, (str, bytes)):
        tests = json.loads(tests)
    if not isinstance(tests, Mapping) or not isinstance(tests.get("inputs"), list) or not isinstance(
            tests.get("outputs"), list) or len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError("test cases must be {\"inputs\": [...], \"outputs\": [...]} of equal length")
    return [str(x) for x in tests["inputs"]], [str(x) for x in tests["outputs"]]


async def score_tests(code: str, tests: Any, language: str = "python", *, timeout: float = 10.0,
                      memory_limit_mb: int = 1024, orchestrator: Any = None) -> tuple[float, list[dict[str, Any]]]:
    """Runs `code` once per test case, every case its own action and all of them one burst
    for the core; returns the share of cases whose stdout matches (trailing newlines
    aside) and each case's outcome."""
    inputs, outputs = parse_tests(tests)
    if not inputs:
        return 0.0, []
    orch = orchestrator if orchestrator is not None else await connect()
    answers = await asyncio.gather(*(run_code(code, language, stdin=stdin, timeout=timeout,
                                              memory_limit_mb=memory_limit_mb, orchestrator=orch)
                                     for stdin in inputs))
    return _grade(answers, outputs)


def score_tests_sync(code: str, tests: Any, language: str = "python", *, timeout: float = 10.0,
                     memory_limit_mb: int = 1024, orchestrator: Any = None) -> tuple[float, list[dict[str, Any]]]:
    """`score_tests` for synchronous callers: the cases are submitted together and awaited."""
    inputs, outputs = parse_tests(tests)
    if not inputs:
        return 0.0, []
    requests = [code_request(code, language, stdin, timeout, memory_limit_mb) for stdin in inputs]
    return _grade(_run_many_sync(requests, None, orchestrator), outputs)


def _grade(answers: Sequence[Mapping[str, Any]], outputs: Sequence[str]) -> tuple[float, list[dict[str, Any]]]:
    cases = []
    for answer, expected in zip(answers, outputs):
        run = answer.get("run_result") or {}
        passed = answer.get("status") == "Success" and (run.get("stdout") or "").rstrip("\n") == expected.rstrip("\n")
        cases.append({"passed": passed, "status": answer.get("status"), "stdout": run.get("stdout"),
                      "stderr": run.get("stderr")})
    return sum(c["passed"] for c in cases) / len(cases), cases
