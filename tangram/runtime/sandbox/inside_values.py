"""Plain data as bytes, for what a sandbox sends back: a reply the orchestrator decodes
without running anything the sandbox chose.

A function's result was once pickled, and unpickling lets the stream pick the callables
it calls: however short the list of allowed ones, their state goes through
`__setstate__`, `setattr` on classes and numpy's raw buffers (a review turned that into a
forged object pointer and into patched classes of the orchestrator). So a reply is data in
this format, which the decoder builds from bytes with a fixed set of constructors, each
bounded by the bytes it is given:

  None, bool, int (any size), float, complex, str, bytes, bytearray;
  list, tuple, dict, set, frozenset, and collections' OrderedDict, Counter and deque;
  datetime's datetime, date, time and timedelta; Decimal and Fraction;
  numpy arrays and scalars of numbers, booleans, fixed-width strings and datetimes (no
  objects, no structured dtypes), C order;
  exceptions of the standard library (builtins), rebuilt from their args.

Anything else in a result (a class of the user's, a function, an object array) cannot be
sent: `encode` raises Unsupported naming its type, inside the sandbox. `decode` raises
Malformed for bytes that are not such a value, at any depth up to MAX_DEPTH.

What decoding may cost is bounded by the bytes: the objects it builds by an estimate of
their memory (at most 64 MiB plus 8 bytes per byte of input: an empty deque costs far more
than its 10 bytes); dict keys and set members by type (None, bool, float, str, bytes, ints
below 2**61 - 1 and tuples and frozensets of those: no key whose comparison with another
of the same hash is costly, as a huge int's with a Decimal is) and by hash (at most
MAX_SAME_HASH keys of one hash in a container: tuples of small ints can be built to share
one, floats x * 2**61k share x's, and a table of many keys of one hash is quadratic to
fill); exceptions whose message reads their arguments by index or length (UnicodeError's,
SyntaxError's) by those arguments' bounds.

Runs on both sides: the sandbox's worker loads this file by its path (standard library
only, as every inside_*.py), and the orchestrator imports it. numpy is imported only for a
value that holds an array, on the side that has one.
"""

from __future__ import annotations

import array
import builtins
import collections
import datetime
import decimal
import fractions
import math
import re
import struct
import sys
from typing import Any

MAX_DEPTH = 200  # containers nested deeper are refused on both sides (no RecursionError)
MAX_PARTS = 1 << 26  # values one encode writes (shared references could make a small value huge)
_KEY_INT = (1 << 61) - 1  # ints below it in magnitude hash to themselves (sys.hash_info.modulus)
MAX_SAME_HASH = 8  # keys of one container sharing a hash (decode): a few by chance, thousands by design
_FRACTION_BITS = 1 << 16
_DTYPE = re.compile(r"[<>|=]?(?:[biufc][1-9][0-9]?|[US][0-9]{1,9}|[mM]8\[(?:[1-9][0-9]{0,8})?(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])")
_ARRAY_KINDS = frozenset("biufcUSmM")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")


class Unsupported(TypeError):
    """A value that is not plain data (encode); `type_name` names it."""

    def __init__(self, type_name: str, why: str = "") -> None:
        super().__init__(f"{type_name}{': ' + why if why else ''}")
        self.type_name = type_name


class Malformed(ValueError):
    """Bytes that are not an encoded value (decode)."""


# ---------------------------------------------------------------------------- encode
def encode(value: Any) -> bytes:
    """`value` as bytes; Unsupported for a value (or part) that is not plain data."""
    out: list[bytes] = []
    try:
        _put(value, out, 0)
    except RecursionError:  # an exception's args nested past the interpreter's limit
        raise Unsupported(_name(value), "nested too deep") from None
    return b"".join(out)


def safe_key(v: Any, members_ok: Any = None) -> bool:
    """Whether `v` may be a dict key or set member in a reply (the module docstring); a
    tuple's or frozenset's members are checked by `members_ok(v)` when given (the decoder
    knows it from when it decoded them), else one by one."""
    t = type(v)
    if v is None or t is bool or t is float or t is str or t is bytes:
        return True
    if t is int:
        return -_KEY_INT < v < _KEY_INT
    if t is tuple or t is frozenset:
        return members_ok(v) if members_ok is not None else all(safe_key(x) for x in v)
    return False


def _key(k: Any) -> None:
    if not safe_key(k):
        raise Unsupported(_name(k), "a dict key or set member must be None, a bool, a float, a str, bytes, an "
                                    "int below 2**61 - 1, or a tuple or frozenset of those")


def _name(value: Any) -> str:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def _put(v: Any, out: list[bytes], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise Unsupported(_name(v), f"nested more than {MAX_DEPTH} deep")
    if len(out) > MAX_PARTS:
        raise Unsupported(_name(v), f"more than {MAX_PARTS} values (shared references written out?)")
    t = type(v)
    if v is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if v else b"F")
    elif t is int:
        n = (v.bit_length() + 8) // 8
        out += [b"i", _U64.pack(n), v.to_bytes(n, "little", signed=True)]
    elif t is float:
        out += [b"f", _F64.pack(v)]
    elif t is complex:
        out += [b"c", _C128.pack(v.real, v.imag)]
    elif t is str:
        data = v.encode("utf-8", "surrogatepass")
        out += [b"s", _U64.pack(len(data)), data]
    elif t is bytes or t is bytearray:
        out += [b"b" if t is bytes else b"B", _U64.pack(len(v)), bytes(v)]
    elif (t is list or t is tuple) and len(v) > 8 and _put_vector(v, t, out):
        pass  # a list or tuple of floats, or of int64s, packed: a result of per-sample scores
    elif t in _SEQUENCES:
        items = list(v.items()) if t in (collections.OrderedDict, collections.Counter) else v
        for k in (v if t is set or t is frozenset else v.keys() if t in (collections.OrderedDict, collections.Counter)
                  else ()):
            _key(k)
        out += [_SEQUENCES[t], _U64.pack(len(items))]
        if t is collections.deque:
            _put(v.maxlen, out, depth + 1)
        for item in items:
            _put(item, out, depth + 1)
    elif t is dict:
        out += [b"d", _U64.pack(len(v))]
        for key, item in v.items():
            _key(key)
            _put(key, out, depth + 1)
            _put(item, out, depth + 1)
    elif t is datetime.datetime or t is datetime.date or t is datetime.time:
        text = v.isoformat().encode()
        out += [_DATES[t], _U64.pack(len(text)), text]
    elif t is datetime.timedelta:
        out.append(b"x")
        for part in (v.days, v.seconds, v.microseconds):
            _put(part, out, depth + 1)
    elif t is decimal.Decimal:
        text = str(v).encode()
        out += [b"m", _U64.pack(len(text)), text]
    elif t is fractions.Fraction:
        out.append(b"q")
        _put(v.numerator, out, depth + 1)
        _put(v.denominator, out, depth + 1)
    elif isinstance(v, BaseException) and getattr(builtins, t.__name__, None) is t:
        out.append(b"e")
        _put(t.__name__, out, depth + 1)
        out += [b"t", _U64.pack(len(v.args))]
        for a in v.args:  # each encoded once: as itself if plain data, else as its repr
            part: list[bytes] = []
            try:
                _put(a, part, depth + 2)
            except Unsupported:
                part = []
                _put(repr(a), part, depth + 2)
            out += part
    elif t.__module__ == "numpy" and _is_numpy(v):
        _put_array(v, out)
    else:
        raise Unsupported(_name(v))


def _put_vector(v: Any, t: type, out: list[bytes]) -> bool:
    """`v` as a packed vector if all its items are floats, or all ints of 64 bits."""
    first = type(v[0])
    if first is float and all(type(x) is float for x in v):
        code = b"d"
    elif first is int and all(type(x) is int for x in v):
        code = b"q"
    else:
        return False
    try:
        packed = array.array(code.decode(), v)
        if sys.byteorder != "little":
            packed.byteswap()
        data = packed.tobytes()
    except OverflowError:  # an int past 64 bits
        return False
    out += [b"v", code, b"t" if t is tuple else b"l", _U64.pack(len(data)), data]
    return True


def _is_numpy(v: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and (type(v) is np.ndarray or isinstance(v, np.generic))


def _put_array(v: Any, out: list[bytes]) -> None:
    import numpy as np
    scalar = isinstance(v, np.generic)
    a = np.asarray(v)  # (tobytes is in C order whatever the layout)
    dtype = a.dtype
    if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or dtype.hasobject or dtype.subdtype is not None:
        raise Unsupported(_name(v), f"a numpy dtype of objects or fields ({dtype.str}) cannot be sent")
    text = dtype.str.encode()
    data = a.tobytes()
    out += [b"g" if scalar else b"a", _U64.pack(len(text)), text, _U64.pack(a.ndim)]
    out += [_U64.pack(n) for n in a.shape]
    out += [_U64.pack(len(data)), data]


_SEQUENCES = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z", collections.OrderedDict: b"O",
              collections.Counter: b"C", collections.deque: b"Q"}
_DATES = {datetime.datetime: b"D", datetime.date: b"y", datetime.time: b"h"}


# ---------------------------------------------------------------------------- decode
def decode(data: bytes) -> Any:
    """The value `data` encodes; Malformed unless it is exactly one encoded value."""
    reader = _Reader(memoryview(data), _COST_FREE + _COST_PER_BYTE * len(data))
    value = reader.value(0)
    if reader.at != len(data):
        raise Malformed(f"{len(data) - reader.at} bytes after the value")
    return value


# What decoding may build: estimated bytes of the objects (CPython, 64-bit, rounded up).
_COST_FREE = 64 << 20
_COST_PER_BYTE = 8
_COST = {b"N": 8, b"T": 8, b"F": 8, b"i": 40, b"f": 32, b"c": 40, b"s": 56, b"b": 40, b"B": 64, b"d": 300,
         b"l": 64, b"t": 56, b"S": 300, b"Z": 300, b"O": 500, b"C": 400, b"Q": 800, b"D": 64, b"y": 40, b"h": 48,
         b"x": 48, b"m": 120, b"q": 120, b"e": 120, b"a": 128, b"g": 128, b"v": 64}


class _Reader:
    __slots__ = ("data", "at", "budget", "safe", "kept")

    def __init__(self, data: memoryview, budget: int) -> None:
        self.data, self.at, self.budget = data, 0, budget
        # The tuples and frozensets decoded so far that may be keys (by id: each checked
        # once, not again at every level it is nested in), kept alive so no id is reused.
        self.safe: set[int] = set()
        self.kept: list[Any] = []

    def key_ok(self, v: Any) -> bool:
        """safe_key, with a tuple's or frozenset's answer from when it was decoded."""
        return safe_key(v, lambda container: id(container) in self.safe)

    def made(self, v: Any, items: Any) -> Any:
        """A tuple or frozenset `v` of `items` just decoded: noted if it may be a key."""
        if all(self.key_ok(x) for x in items):
            self.safe.add(id(v))
            self.kept.append(v)
        return v

    def charge(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise Malformed(f"it decodes to more objects than its {len(self.data)} bytes could hold (an estimate "
                            f"past {_COST_FREE} + {_COST_PER_BYTE} per byte)")

    def take(self, n: int) -> memoryview:
        if n > len(self.data) - self.at:
            raise Malformed(f"truncated: {n} bytes wanted at offset {self.at}, {len(self.data) - self.at} left")
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return chunk

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def text(self) -> str:
        data = self.take(self.u64())
        self.charge(4 * len(data))  # one 4-byte character makes all of a str 4 bytes each
        try:
            return bytes(data).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise Malformed(f"a string that is not UTF-8: {e}") from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise Malformed(f"nested more than {MAX_DEPTH} deep")
        tag = bytes(self.take(1))
        self.charge(_COST.get(tag, 0))
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"i":
            data = self.take(self.u64())
            self.charge(len(data))
            return int.from_bytes(data, "little", signed=True)
        if tag == b"f":
            return _F64.unpack(self.take(8))[0]
        if tag == b"c":
            return complex(*_C128.unpack(self.take(16)))
        if tag == b"s":
            return self.text()
        if tag in (b"b", b"B"):
            data = self.take(self.u64())
            self.charge(len(data))
            return bytes(data) if tag == b"b" else bytearray(data)
        if tag == b"d":
            return self.mapping(dict, depth)
        if tag in _SEQUENCE_TYPES:
            return self.sequence(tag, depth)
        if tag in _DATE_TYPES:
            text = self.text()
            if len(text) > 64:
                raise Malformed("a date of more than 64 characters")
            try:
                return _DATE_TYPES[tag].fromisoformat(text)
            except ValueError as e:
                raise Malformed(f"a date that does not parse: {e}") from None
        if tag == b"x":
            days, seconds, micros = (self.integer(depth) for _ in range(3))
            try:
                return datetime.timedelta(days=days, seconds=seconds, microseconds=micros)
            except OverflowError as e:
                raise Malformed(f"a timedelta out of range: {e}") from None
        if tag == b"m":
            text = self.text()
            if len(text) > 1000:  # str(Decimal) of any value a program made is far shorter
                raise Malformed("a Decimal of more than 1000 characters")
            try:
                return decimal.Decimal(text)
            except decimal.InvalidOperation:
                raise Malformed(f"a Decimal that does not parse: {text[:40]!r}") from None
        if tag == b"q":
            numerator, denominator = self.integer(depth), self.integer(depth)
            # (its normalisation is a gcd, quadratic in the digits: any fraction a program
            # made has far fewer)
            if denominator <= 0 or max(numerator.bit_length(), denominator.bit_length()) > _FRACTION_BITS:
                raise Malformed("a Fraction with a denominator <= 0 or more than 65,536 bits")
            return fractions.Fraction(numerator, denominator)
        if tag == b"e":
            return self.exception(depth)
        if tag in (b"a", b"g"):
            return self.array(tag == b"g")
        if tag == b"v":
            code, kind = bytes(self.take(1)), bytes(self.take(1))
            data = self.take(self.u64())
            self.charge(5 * len(data))  # 8 bytes an item: a slot and a float or int object
            if code not in (b"d", b"q") or kind not in (b"l", b"t") or len(data) % 8:
                raise Malformed(f"a packed vector of {code!r}, {kind!r}, {len(data)} bytes")
            items = array.array(code.decode())
            items.frombytes(data)
            if sys.byteorder != "little":
                items.byteswap()
            if kind == b"l":
                return items.tolist()
            values = tuple(items.tolist())
            return self.made(values, values)
        raise Malformed(f"unknown tag {tag!r} at offset {self.at - 1}")

    def integer(self, depth: int) -> int:
        v = self.value(depth + 1)
        if type(v) is not int:
            raise Malformed(f"an int expected, got {type(v).__name__}")
        return v

    def mapping(self, make: Any, depth: int) -> Any:
        out = make()
        hashes: dict[int, int] = {}
        for _ in range(self.u64()):  # no allocation ahead: a false count runs out of bytes
            self.charge(32)
            key = self.value(depth + 1)
            self.check_key(key, hashes, "dict key")
            try:
                out[key] = self.value(depth + 1)
            except TypeError as e:  # an unhashable key
                raise Malformed(f"a dict key that cannot be one: {e}") from None
        return out

    def check_key(self, key: Any, hashes: dict[int, int], what: str) -> None:
        """Malformed unless `key` may be a key (key_ok) and fewer than MAX_SAME_HASH keys of
        its container (`hashes`: each hash's count so far) share its hash."""
        if not self.key_ok(key):
            raise Malformed(f"a {what} of type {type(key).__name__} (or holding one, or an int of 2**61 - 1 or more)")
        h = hash(key)
        n = hashes[h] = hashes.get(h, 0) + 1  # (an int keyed dict: ints hash to themselves, no collisions)
        if n > MAX_SAME_HASH:
            raise Malformed(f"more than {MAX_SAME_HASH} {what}s of one hash in a container (crafted to collide)")

    def sequence(self, tag: bytes, depth: int) -> Any:
        count = self.u64()
        maxlen = self.value(depth + 1) if tag == b"Q" else None
        if maxlen is not None and (type(maxlen) is not int or not 0 <= maxlen < 1 << 62):
            raise Malformed(f"a deque's maxlen of {maxlen!r}")
        kind = _SEQUENCE_TYPES[tag]
        keyed = kind is set or kind is frozenset
        pairs = kind is collections.OrderedDict or kind is collections.Counter
        hashes: dict[int, int] = {}
        items = []
        for _ in range(count):
            self.charge(40 if keyed else 16)  # its slot, here and in the container made of them
            item = self.value(depth + 1)
            if keyed:
                self.check_key(item, hashes, "set member")
            elif pairs:
                if type(item) is not tuple or len(item) != 2:
                    raise Malformed(f"a {kind.__name__} item that is not a (key, value) pair")
                self.check_key(item[0], hashes, f"{kind.__name__} key")
            items.append(item)
        try:
            if kind is collections.deque:
                return collections.deque(items, maxlen)
            if pairs:
                out = kind()
                for k, v in items:
                    out[k] = v
                return out
            if kind is tuple or kind is frozenset:
                return self.made(kind(items), items)
            return kind(items)
        except (TypeError, ValueError, OverflowError) as e:  # an unhashable member of a set...
            raise Malformed(f"a {kind.__name__} of members that cannot be: {e}") from None

    def exception(self, depth: int) -> BaseException:
        name = self.value(depth + 1)
        args = self.value(depth + 1)
        cls = getattr(builtins, name, None) if type(name) is str else None
        if not (isinstance(cls, type) and issubclass(cls, BaseException)) or type(args) is not tuple:
            raise Malformed(f"an exception that is not the standard library's: {str(name)[:40]!r}")
        if issubclass(cls, _INDEXED) and not _indexed_args_fit(cls, args):
            # its str() reads its object at start without a check: out of bounds, a crash
            raise Malformed(f"a {name} whose start and end are not within its object")
        if issubclass(cls, SyntaxError) and not _syntax_args_fit(args):
            # a traceback of it draws end_offset - offset carets: gigabytes, for a huge one
            raise Malformed(f"a {name} whose location is not within its text")
        try:
            return cls(*args)
        except Exception as e:  # args its constructor refuses: not an exception's own
            raise Malformed(f"a {name} of arguments it refuses: {type(e).__name__}") from None

    def array(self, scalar: bool) -> Any:
        text = bytes(self.take(self.u64())).decode("ascii", "replace")
        if not _DTYPE.fullmatch(text):
            raise Malformed(f"a numpy dtype that cannot be sent: {text[:40]!r}")
        ndim = self.u64()
        if ndim > 32 or (scalar and ndim):
            raise Malformed(f"an array of {ndim} dimensions")
        shape = tuple(self.u64() for _ in range(ndim))
        data = self.take(self.u64())
        self.charge(len(data))
        import numpy as np
        try:
            dtype = np.dtype(text)
            if dtype.kind not in _ARRAY_KINDS or dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
                raise Malformed(f"a numpy dtype that cannot be sent: {text!r}")
            if math.prod(shape) * dtype.itemsize != len(data):
                raise Malformed(f"an array of shape {shape} and dtype {text} in {len(data)} bytes")
            if not data and (any(n > 1 << 20 for n in shape) or dtype.itemsize > 1 << 16):
                raise Malformed(f"an empty array of shape {shape} and dtype {text}: past what a program makes")
            a = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
            if dtype.kind == "b" and a.size and a.view(np.uint8).max() > 1:
                raise Malformed("a boolean array holding bytes other than 0 and 1")
            if dtype.kind == "U" and a.size and a.view(dtype.byteorder.replace("|", "=") + "u4").max() > 0x10FFFF:
                raise Malformed("a str array holding code points past U+10FFFF")
            return a[()] if scalar else a
        except (TypeError, ValueError, OverflowError, MemoryError, SystemError) as e:
            if isinstance(e, Malformed):
                raise
            raise Malformed(f"an array that numpy refuses: {type(e).__name__}: {e}") from None


# Exceptions whose message reads their own arguments by index (CPython checks nothing).
_INDEXED = (UnicodeDecodeError, UnicodeEncodeError, UnicodeTranslateError)


def _indexed_args_fit(cls: type, args: tuple) -> bool:
    """The arguments of one of _INDEXED as its constructor takes them, start and end within
    its object."""
    if issubclass(cls, UnicodeTranslateError):
        shape, at = (str, int, int, str), 0
    else:
        shape, at = (str, bytes if issubclass(cls, UnicodeDecodeError) else str, int, int, str), 1
    if len(args) != len(shape) or not all(type(a) is t for a, t in zip(args, shape)):
        return False
    start, end = args[at + 1], args[at + 2]
    return 0 <= start <= end <= len(args[at])


def _syntax_args_fit(args: tuple) -> bool:
    """SyntaxError's arguments: (msg,) or (msg, (filename, lineno, offset, text, end_lineno,
    end_offset)) of their types, offsets within the text."""
    if len(args) < 2:
        return True
    if len(args) != 2 or type(args[1]) is not tuple or len(args[1]) not in (4, 6):
        return False
    filename, lineno, offset, text, *ends = args[1]
    end_lineno, end_offset = ends if ends else (None, None)
    if not all(x is None or type(x) is str for x in (filename, text)):
        return False
    room = len(text or "") + 1
    return (all(x is None or (type(x) is int and 0 <= x < 1 << 31) for x in (lineno, end_lineno))
            and all(x is None or (type(x) is int and -1 <= x <= room) for x in (offset, end_offset)))


_SEQUENCE_TYPES = {tag: kind for kind, tag in _SEQUENCES.items()}
_DATE_TYPES = {tag: kind for kind, tag in _DATES.items()}

__all__ = ["MAX_DEPTH", "Malformed", "Unsupported", "decode", "encode"]
