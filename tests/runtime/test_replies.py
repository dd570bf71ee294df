"""A sandbox's reply is plain data (tangram.runtime.sandbox.inside_values, read by
tangram.runtime.sandbox.replies): every plain value comes back whole, anything else is
refused where it is encoded, and bytes a hostile sandbox writes are Malformed, never run,
never a crash, never unbounded work."""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import pickle
import struct
from typing import Any

import numpy as np
import pytest

from tangram.runtime.sandbox.inside_values import MAX_DEPTH, Malformed, Unsupported, decode, encode
from tangram.runtime.sandbox.replies import load_reply

PLAIN = [
    None, True, False, 0, -1, 3, 2 ** 200, -(2 ** 70), 2.5, float("inf"), -0.0, complex(1, -2), "", "text",
    "\ud800 lone surrogate", b"bytes", bytearray(b"ba"), [1, [2, [3]]], (1, (2,)), {"a": {"b": 1}, 3: None, (1, 2): "t"},
    {1, 2}, frozenset({3}), collections.OrderedDict(a=1, b=2), collections.deque([1, 2], maxlen=5),
    collections.deque([1]), collections.Counter("abca"),
    datetime.datetime(2026, 12, 5, 18, 0, 1, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
    datetime.datetime(2026, 1, 2), datetime.date(2026, 1, 2), datetime.time(3, 4, 5),
    datetime.timedelta(days=-3, seconds=7, microseconds=9), decimal.Decimal("-1.25E+7"), fractions.Fraction(-1, 3),
    # packed vectors (more than 8 floats, or 8 ints of 64 bits), and what falls back from them
    [float(i) / 3 for i in range(20)], tuple(range(-10, 10)), [2 ** 70] * 10, [*range(9), 1.5], [True] * 10,
    [-(2 ** 63), 2 ** 63 - 1] * 5,
]


@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_data_comes_back_whole(value: Any) -> None:
    back = decode(encode(value))
    assert back == value and type(back) is type(value)
    if isinstance(value, (list, tuple)):
        assert [type(x) for x in back] == [type(x) for x in value]
    if isinstance(value, collections.deque):
        assert back.maxlen == value.maxlen


def test_exceptions_of_the_standard_library_come_back_with_their_args() -> None:
    for error in (ValueError("bad", 3), KeyError("k"), OSError(2, "No such file"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x")):
        back = decode(encode(error))
        assert type(back) is type(error) and back.args == error.args
    assert decode(encode(ValueError(object()))).args[0].startswith("<object")  # a non-plain argument as its repr


@pytest.mark.parametrize("value", [
    np.arange(6).reshape(2, 3), np.zeros((0, 4), np.float32), np.array([[1 + 2j]]), np.array(["a", "bc"]),
    np.array([b"x"]), np.array(["2026-12-05"], dtype="datetime64[D]"), np.array([True, False]),
    np.arange(10)[::2], np.asfortranarray(np.arange(6).reshape(2, 3)), np.array([1, 2], dtype=">i4"),
], ids=lambda v: v.dtype.str)
def test_numpy_arrays_come_back_whole(value: np.ndarray) -> None:
    back = decode(encode(value))
    assert type(back) is np.ndarray and back.dtype == value.dtype and np.array_equal(back, value)
    back[...] = back  # writable, its own memory


def test_numpy_scalars_come_back_as_scalars() -> None:
    for value in (np.float32(1.5), np.int64(-7), np.bool_(True), np.datetime64("2026-12-05"), np.complex128(1j)):
        back = decode(encode(value))
        assert type(back) is type(value) and back == value


class Custom:
    pass


@pytest.mark.parametrize("value", [
    Custom(), [1, {"x": Custom()}], lambda: 1, np.array([1, None], dtype=object), np.zeros(2, dtype=[("x", "f4")]),
    collections.defaultdict(list), np.ma.masked_array([1]), type, object(),
], ids=lambda v: type(v).__name__)
def test_anything_else_is_refused_where_it_is_encoded(value: Any) -> None:
    with pytest.raises(Unsupported):
        encode(value)


def test_nesting_deeper_than_the_limit_is_refused_on_both_sides() -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(Unsupported):
        encode(deep)
    data = b"l" + struct.pack("<Q", 1)
    with pytest.raises(Malformed, match="deep"):
        decode(data * (MAX_DEPTH + 5) + b"N")


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


@pytest.mark.parametrize("data", [
    pickle.dumps(("ok", 1)),                                     # a pickle is not a reply
    b"",                                                          # nothing
    b"X",                                                         # an unknown tag
    b"s" + u64(10) + b"short",                                    # truncated
    b"l" + u64(2 ** 60),                                          # a count the bytes cannot hold
    b"s" + u64(1) + b"\xff",                                      # not UTF-8
    b"N" + b"N",                                                  # bytes after the value
    b"S" + u64(1) + b"l" + u64(0),                                # a set of a list
    b"d" + u64(1) + b"l" + u64(0) + b"N",                         # a dict keyed by a list
    b"a" + u64(3) + b"|O8" + u64(1) + u64(1) + u64(8) + b"A" * 8,  # an object array: a forged pointer
    b"a" + u64(3) + b"<f8" + u64(1) + u64(2) + u64(8) + b"A" * 8,  # shape and bytes disagree
    b"a" + u64(4) + b"<V8" + u64(0) + u64(8) + b"A" * 8,          # a void/structured dtype
    b"a" + u64(2) + b"U0" + u64(1) + u64(1) + u64(0),             # a zero-width dtype
    b"e" + b"s" + u64(6) + b"system" + b"t" + u64(0),             # not an exception
    b"e" + b"s" + u64(18) + b"UnicodeDecodeError" + b"t" + u64(0),  # args its constructor refuses
    b"q" + b"i" + u64(1) + b"\x01" + b"i" + u64(1) + b"\x00",     # a Fraction over 0
    b"q" + b"i" + u64(20000) + b"\x01" * 20000 + b"i" + u64(1) + b"\x03",  # a Fraction too large to normalise
    b"m" + u64(5000) + b"9" * 5000,                               # a Decimal too long to be a program's
    b"D" + u64(5) + b"nope!",                                     # a date that does not parse
    b"Q" + u64(1) + b"i" + u64(1) + b"\xff" + b"N",               # a deque of maxlen -1
    b"C" + u64(1) + b"i" + u64(1) + b"\x01",                      # a Counter item that is not a pair
    b"v" + b"x" + b"l" + u64(0),                                  # a packed vector of no known type
    b"d" + u64(1) + b"m" + u64(1) + b"1" + b"N",                   # a Decimal key: hashes with ints, compared at length
    b"S" + u64(1) + b"i" + u64(8) + (2 ** 61 - 1).to_bytes(8, "little") ,  # an int member whose hash can be made to collide
    b"e" + b"s" + u64(18) + b"UnicodeDecodeError" + b"t" + u64(5) + b"s" + u64(5) + b"utf-8" + b"b" + u64(1) + b"a"
    + b"i" + u64(8) + (-(10 ** 9)).to_bytes(8, "little", signed=True)
    + b"i" + u64(8) + (-(10 ** 9) + 1).to_bytes(8, "little", signed=True) + b"s" + u64(1) + b"r",  # str() reads out of bounds
    b"a" + u64(3) + b"|b1" + u64(1) + u64(2) + u64(2) + b"\x01\x02",  # a bool array holding 2
    b"a" + u64(3) + b"<U1" + u64(1) + u64(1) + u64(4) + struct.pack("<I", 0x110000),  # past U+10FFFF
    b"a" + u64(7) + b"<M8[0D]" + u64(1) + u64(1) + u64(8) + b"\x00" * 8,  # a datetime unit times 0
    b"a" + u64(3) + b"<M8" + u64(1) + u64(1) + u64(8) + b"\x00" * 8,  # a datetime of no unit
    b"a" + u64(3) + b"|u1" + u64(2) + u64(0) + u64(2 ** 62) + u64(0),  # an empty array no program makes
    b"v" + b"d" + b"l" + u64(7) + b"\x00" * 7,                     # a packed vector of a partial item
], ids=lambda d: repr(d[:12]))
def test_hostile_bytes_are_malformed(data: bytes) -> None:
    with pytest.raises(Malformed):
        decode(data)


@pytest.mark.parametrize("reply, ok", [
    (("ok", {"score": 1.0}), True), (("result", 0, b"out", b"", False), True), (("error", "ValueError", "m", "tb"), True),
    (("memory", "m"), True), (("result",), False), (("error", "X"), False), (("memory",), False),
    (("result", True, b"", b"", False), False), (("ok",), False), (("done", 1), False), (["ok", 1], False), ((), False),
    (("error", ["nested"], "m", "tb"), False),
])
def test_a_reply_must_be_one_of_the_workers_four(reply: Any, ok: bool) -> None:
    if ok:
        assert load_reply(encode(reply)) == reply
    else:
        with pytest.raises(Malformed):
            load_reply(encode(reply))


def test_what_decoding_builds_is_bounded_by_the_bytes() -> None:
    """An empty deque is 10 bytes and a few hundred bytes of objects: past an estimate of
    64 MiB plus 8 bytes per byte of input, the reply is refused rather than built."""
    count = 2_000_000
    data = b"l" + u64(count) + (b"Q" + u64(0) + b"N") * count
    with pytest.raises(Malformed, match="more objects"):
        decode(data)
    assert len(decode(b"l" + u64(1000) + (b"Q" + u64(0) + b"N") * 1000)) == 1000  # a few are fine


def test_keys_whose_hashes_could_collide_are_refused_where_they_are_encoded() -> None:
    for bad in ({decimal.Decimal(1): 1}, {2 ** 61: 1}, {(1, 2 ** 70)}, collections.Counter({fractions.Fraction(1, 2): 1})):
        with pytest.raises(Unsupported):
            encode(bad)
    fine = {None: 1, True: 2, 1.5: 3, "s": 4, b"b": 5, 2 ** 60: 6, (1, "a", (2.5,)): 7, frozenset({1, 2}): 8}
    assert decode(encode(fine)) == fine


def test_nested_exceptions_are_encoded_once_each() -> None:
    """Each argument of an exception is encoded once (as itself or, if not plain data, as
    its repr): 24 levels of exceptions in exceptions once took 2**24 encodings."""
    error: BaseException = ValueError("leaf", object())
    for level in range(24):
        error = RuntimeError(level, error)
    back = decode(encode(error))
    for _ in range(24):
        back = back.args[1]
    assert type(back) is ValueError and back.args[0] == "leaf" and back.args[1].startswith("<object")


def test_more_than_a_few_keys_of_one_hash_are_refused() -> None:
    """Floats x * 2**(61 k) share x's hash (as do tuples of small ints built to): a table of
    many keys of one hash is quadratic to fill, so a container may hold MAX_SAME_HASH."""
    from tangram.runtime.sandbox.inside_values import MAX_SAME_HASH
    same = [1.5 * 2.0 ** (61 * k) for k in range(MAX_SAME_HASH + 1)]
    assert len({hash(x) for x in same}) == 1
    assert decode(encode(dict.fromkeys(same[:MAX_SAME_HASH]))) == dict.fromkeys(same[:MAX_SAME_HASH])
    for value in (dict.fromkeys(same), set(same), frozenset(same), collections.Counter(same),
                  collections.OrderedDict.fromkeys(same)):
        with pytest.raises(Malformed, match="of one hash"):
            decode(encode(value))


def test_a_syntax_error_keeps_its_location_only_within_its_text() -> None:
    try:
        compile("x = = 1", "f.py", "exec")
    except SyntaxError as e:
        real = e
    back = decode(encode(real))
    assert type(back) is SyntaxError and back.args == real.args
    with pytest.raises(Malformed, match="location"):  # a traceback of it would draw 2**31 carets
        decode(encode(SyntaxError("m", ("f", 1, 1, "abc", 1, 2 ** 31 + 5))))
