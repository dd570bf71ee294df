"""A sandbox's reply, loaded in the orchestrator as untrusted data.

A function action's result comes back pickled, and the code that made it ran in the
sandbox: model-written code can return (or write to its worker's channel) a pickle whose
`__reduce__` names `os.system`, and a plain `pickle.loads` would run that in the
orchestrator, outside every boundary. So a reply is loaded by an unpickler that resolves
only the types below (plain data: what a reward or a test result is made of) and those
the CPU manager's `result_types` option names; any other global in the stream ends the
action with an `UntrustedResult` error naming it, before anything of it is called.

Every allowed callable only builds a value from data: a container, a number, a date, an
exception of the standard library, a numpy array or scalar. None of them calls back into a
global the stream chose except through this same unpickler.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import io
import pickle
import re
from collections.abc import Iterable
from typing import Any

from ..errors import ManagerError

# Plain data that a result may hold, as (module, name) pairs the pickle stream names.
_PLAIN = frozenset({
    *(("builtins", n) for n in ("int", "float", "complex", "str", "bytes", "bytearray", "bool", "list", "tuple",
                                "dict", "set", "frozenset", "slice", "range")),
    # protocols 0 to 2 rebuild objects through copyreg (the classes it is given still come
    # through find_class) and bytes through codecs.encode(text, "latin1")
    ("copyreg", "_reconstructor"), ("builtins", "object"), ("_codecs", "encode"),
    *(("collections", n) for n in ("OrderedDict", "deque", "Counter", "defaultdict")),
    *(("datetime", n) for n in ("datetime", "date", "time", "timedelta", "timezone")),
    ("decimal", "Decimal"),
    ("fractions", "Fraction"),
    # numpy 1.x and 2.x: arrays, dtypes and scalars (an object array's items are loaded by
    # this unpickler too)
    ("numpy", "ndarray"), ("numpy", "dtype"),
    *((m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")),
    *((m, "_frombuffer") for m in ("numpy.core.numeric", "numpy._core.numeric")),
})
# numpy's dtype classes (numpy.dtypes.Float64DType...) are data too.
_PLAIN_MODULE_PATTERNS = (re.compile(r"numpy\.dtypes\.[A-Za-z0-9_]+DType"),)
_TYPE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class UntrustedResult(pickle.UnpicklingError):
    """A reply names a global that the orchestrator does not load from a sandbox."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


def _builtin_exception(module: str, name: str) -> bool:
    value = getattr(builtins, name, None) if module == "builtins" else None
    return isinstance(value, type) and issubclass(value, BaseException)


def check_result_types(names: Iterable[Any], field: str) -> frozenset[tuple[str, str]]:
    """`result_types` as (module, qualified name) pairs; a ManagerError naming `field`
    unless each is a "module:qualname" string."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ManagerError(field, f"{names!r} is not a list of \"module:qualname\" strings")
    out = set()
    for n in names:
        if not isinstance(n, str) or not _TYPE_NAME.fullmatch(n):
            raise ManagerError(field, f"{n!r} is not a \"module:qualname\" string (e.g. \"mypackage.rewards:Score\")")
        module, name = n.split(":")
        out.add((module, name))
    return frozenset(out)


class _ReplyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, trusted: frozenset[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self._trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        # protocols 0 to 2 name Python 2's modules (__builtin__, copy_reg): checked under
        # the names they load as
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = (module, name)
        if (key in _PLAIN or key in self._trusted or _builtin_exception(module, name)
                or any(p.fullmatch(f"{module}.{name}") for p in _PLAIN_MODULE_PATTERNS)):
            return super().find_class(module, name)
        raise UntrustedResult(module, name)


def load_reply(data: bytes, trusted: frozenset[tuple[str, str]] = frozenset()) -> Any:
    """The reply unpickled, resolving only plain data and the `trusted` types; raises
    UntrustedResult for any other global it names, pickle errors for a malformed stream."""
    return _ReplyUnpickler(data, trusted).load()


__all__ = ["UntrustedResult", "check_result_types", "load_reply"]
