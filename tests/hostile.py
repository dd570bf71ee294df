"""Random mixes of good and hostile calls, shared by the in-process test
(tests/test_hostile_calls.py) and the server test (tests/runtime/test_hostile_server.py).

A plan is a list of integers: n >= 0 is good call n, n < 0 is HOSTILE[-1 - n]. Each submit
is recorded as (handle or the error submit raised, expected result, hostile spec or None);
`check_outcomes` then awaits them all: every good call gets its result, every bad one a
typed error naming its field (or, from a manager, the action).
"""

from __future__ import annotations

import math
import operator
import threading
from typing import Any, Callable

from hypothesis import strategies as st

import tangram
from tangram import Action, Call
from tangram.runtime import ActionError

NAN, INF = math.nan, math.inf


def good_call(i: int) -> tuple[Call, Any]:
    """A call that must succeed, and its result: a sandboxed function, an API call under
    quota "q", a mock manager's sleep."""
    kind = i % 3
    if kind == 0:
        return Call(fn=operator.add, args=(i, 1000), resources={"cpu": 0.1}, trajectory=i % 2), i + 1000
    if kind == 1:
        return Call(fn=operator.mul, args=(i, 2), quota="q", resources={}), i * 2
    return Call(manager="mock", runtime=0.0, resources={}, kind="mock"), None


# One field (or two) made hostile in a good sandboxed call; each must end with a typed
# error. Some are refused at submit, some by the core at the flush, some by the manager
# (and through a server, some by the client, some by the server).
HOSTILE: list[Any] = [
    *(dict(trajectory=v) for v in (2**64, 2**64 + 5, -1, True, 1.5, "1", None, 2**20000)),
    *(dict(resources=v) for v in (None, ["cpu"], "cpu", {"cpu": NAN}, {"cpu": INF}, {"cpu": -1}, {"cpu": 2**2000},
                                  {"cpu": 1e13}, {"cpu": "1"}, {"cpu": [1]}, {1: 1}, {"tpu": 1},
                                  {f"kind{i}": 1 for i in range(2000)})),
    *(dict(env=v) for v in ({"A": 1}, {1: "a"}, {"": "a"}, {"A=B": "a"}, {"A": "\0"}, None, ["A"])),
    dict(fn=5), dict(fn=None), dict(command="true"), dict(fn=None, command=[]), dict(fn=None, command=[1, 2]),
    dict(fn=None, command=5), dict(fn=None, command="echo \0"),
    *(dict(args=v) for v in (None, 5, "ab", {})), dict(args=(threading.Lock(), 1)),
    *(dict(kwargs=v) for v in (None, {1: 2}, [1])),
    *(dict(timeout=v) for v in (0, -1, NAN, INF, 1e10, "1", True)),
    *(dict(runtime=v) for v in (NAN, -1, INF, 2e9, "slow", tangram.Amdahl(1, 2), tangram.Constant(NAN),
                                lambda u: 1 / 0)),
    dict(elastic="cpu"), dict(elastic="nope", max_units=2), dict(elastic=5, max_units=2),
    dict(elastic=["cpu"], max_units=2), *(dict(elastic="cpu", max_units=v) for v in ("x", NAN, 1e13, 0.05)),
    dict(max_units=4),
    *(dict(priority=v) for v in (2**31, -2**31 - 1, 1.5, "1")),
    *(dict(gpu_memory=v) for v in (NAN, -1, 2**2000, 5, "x")),
    *(dict(tokens=v) for v in (2**63, -1, 1.5, 5)),
    *(dict(quota=v) for v in ("nope", 5, ["q"])), *(dict(service=v) for v in ("nope", 5)),
    *(dict(manager=v) for v in ("nope", 5, ["x"])), *(dict(kind=v) for v in (5, None, ["x"])),
    *(dict(affinity=v) for v in ("nope", 2**40, -1, 1.5, 99)),
    None, 5, "call", Action(1, {"cpu": 1}),  # not a Call at all
    "mutate",  # a good call whose trajectory goes beyond the core after submit
]


def plans(hostile: list[Any], max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.one_of(st.integers(0, 29), st.sampled_from(range(len(hostile))).map(lambda i: -1 - i)),
                    min_size=1, max_size=max_size)


def hostile_call(spec: Any) -> Any:
    if spec in ("mutate", "own range"):
        # "own range": trajectory 2**32, beyond a server client's own trajectory numbers but
        # fine in the shared space.
        spec = {} if spec == "mutate" else dict(trajectory=2**32)
    if isinstance(spec, dict):
        return Call(**{"fn": operator.add, "args": (1, 2), "resources": {"cpu": 0.1}, **spec})
    return spec


def assert_typed(error: BaseException, spec: Any) -> None:
    """A bad call's error: a TangramError naming the call's field (or, from a manager, the
    action)."""
    assert isinstance(error, tangram.TangramError), (spec, error)
    assert isinstance(error, ActionError) or error.field.startswith("call"), (spec, error)


class Mix:
    """The submits of one plan or more, in one event-loop iteration."""

    def __init__(self) -> None:
        self.waits: list[tuple[Any, Any, Any]] = []  # (handle or raised error, expected result, spec)
        self.mutated: list[Call] = []

    def submit(self, submit: Callable[[Any], Any], spec: Any) -> None:
        """A hostile call of `spec`, submitted."""
        call = hostile_call(spec)
        try:
            handle = submit(call)
        except Exception as e:
            self.waits.append((e, None, spec))
            return
        if spec == "mutate":
            self.mutated.append(call)
        self.waits.append((handle, None, spec))

    def submit_plan(self, submit: Callable[[Any], Any], plan: list[int], hostile: list[Any],
                    fine_here: tuple[str, ...] = ()) -> None:
        """Good call 0, then the plan's calls; the specs in `fine_here` are good for this
        submitter (their result is 1 + 2)."""
        for n in [0, *plan]:
            if n >= 0:
                call, expected = good_call(n)
                self.waits.append((submit(call), expected, None))
            elif hostile[-1 - n] in fine_here:
                self.waits.append((submit(hostile_call(hostile[-1 - n])), 3, None))
            else:
                self.submit(submit, hostile[-1 - n])

    async def check_outcomes(self) -> None:
        """Breaks the mutated calls (after submit, before the flush), then awaits every
        outcome."""
        for call in self.mutated:
            call.trajectory = 2**64
        for handle, expected, spec in self.waits:
            if isinstance(handle, BaseException):
                assert_typed(handle, spec)
                continue
            try:
                value = await handle
            except Exception as e:
                assert spec is not None, f"a good call failed: {e!r}"
                assert_typed(e, spec)
            else:
                assert spec is None, f"{spec!r} got a result: {value!r}"
                assert value == expected
