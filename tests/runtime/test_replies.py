"""A sandbox's reply is loaded as untrusted data (tangram.runtime.sandbox.replies): plain
data comes back whole, and any other global the pickle names is refused before it is called."""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import os
import pathlib
import pickle
import subprocess
from typing import Any

import cloudpickle
import numpy as np
import pytest

from tangram.runtime.errors import ManagerError
from tangram.runtime.managers.cpu import CpuManager
from tangram.runtime.sandbox.replies import UntrustedResult, check_result_types, load_reply

PLAIN = [
    None, True, 3, 2.5, complex(1, 2), "text", b"bytes", bytearray(b"ba"), [1, [2]], (1, 2), {"a": {"b": 1}},
    {1, 2}, frozenset({3}), range(3), slice(1, 5, 2),
    collections.OrderedDict(a=1), collections.deque([1, 2], maxlen=5), collections.Counter("abca"),
    collections.defaultdict(list, {"k": [1]}),
    datetime.datetime(2026, 12, 5, 18, 0, tzinfo=datetime.timezone.utc), datetime.date(2026, 1, 2),
    datetime.timedelta(seconds=3), decimal.Decimal("1.25"), fractions.Fraction(1, 3),
    ValueError("bad", 3), KeyError("k"),
]


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_plain_data_comes_back_whole(protocol: int) -> None:
    for value in PLAIN:
        back = load_reply(pickle.dumps(("ok", value), protocol=protocol))
        if isinstance(value, BaseException):
            assert type(back[1]) is type(value) and back[1].args == value.args
        else:
            assert back == ("ok", value) and type(back[1]) is type(value)


def test_numpy_arrays_and_scalars_come_back_whole() -> None:
    values = [np.arange(6).reshape(2, 3), np.float32(1.5), np.int64(7), np.array(["a", "bc"]),
              np.zeros(2, dtype=[("x", "f4"), ("y", "i2")]), np.array([1, {"a": 2}], dtype=object),
              np.datetime64("2026-12-05")]
    for value in values:
        back = load_reply(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(back) is type(value) and back.dtype == value.dtype
        assert np.array_equal(np.asarray(back), np.asarray(value)) if value.dtype != object else list(back) == list(value)


class _Runs:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


@pytest.mark.parametrize("hostile", [
    _Runs(os.system, "true"), _Runs(eval, "1"), _Runs(getattr, _Runs(__import__, "os"), "system"), _Runs(subprocess.Popen, ["true"]),
    _Runs(__import__, "os"),
], ids=["os.system", "eval", "getattr", "Popen", "__import__"])
def test_a_global_that_runs_code_is_refused_before_it_is_called(hostile: Any) -> None:
    data = pickle.dumps(("ok", [1, {"inner": hostile}]))
    with pytest.raises(UntrustedResult) as refused:
        load_reply(data)
    assert refused.value.module in ("posix", "builtins", "subprocess")


def test_a_class_pickled_by_value_is_refused() -> None:
    """cloudpickle sends a class defined in the call by value: rebuilding it runs its code."""
    namespace: dict[str, Any] = {}
    exec("class Made:\n    def __init__(self):\n        self.x = 1\n", namespace)
    with pytest.raises(UntrustedResult):
        load_reply(cloudpickle.dumps(("ok", namespace["Made"]())))


def test_a_module_class_is_refused_unless_trusted() -> None:
    data = pickle.dumps(("ok", pathlib.PurePosixPath("/a/b")))
    with pytest.raises(UntrustedResult) as refused:
        load_reply(data)
    assert (refused.value.module, refused.value.name) == ("pathlib", "PurePosixPath")
    trusted = check_result_types(["pathlib:PurePosixPath"], "result_types")
    assert load_reply(data, trusted) == ("ok", pathlib.PurePosixPath("/a/b"))


@pytest.mark.parametrize("bad", ["pathlib:PurePosixPath", ["pathlib.PurePosixPath"], [3], ["a:b:c"], [":x"], 7])
def test_result_types_must_be_module_colon_qualname(bad: Any) -> None:
    with pytest.raises(ManagerError) as refused:
        CpuManager(isolation="process", result_types=bad)
    assert refused.value.field == "managers.cpu.result_types"


def test_a_malformed_stream_is_an_unpickling_error_not_a_crash() -> None:
    for data in (b"", b"\x80\x05garbage", pickle.dumps(("ok", 1))[:-3]):
        with pytest.raises(Exception) as refused:
            load_reply(data)
        assert isinstance(refused.value, (pickle.UnpicklingError, EOFError, ValueError, IndexError))
