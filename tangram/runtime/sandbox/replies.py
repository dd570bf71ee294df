"""A sandbox worker's reply, read in the orchestrator as untrusted data.

What made a reply ran in the sandbox: model-written code that a reward function runs can
shape the result, or write its own frame to the worker's channel. So a reply is not a
pickle (unpickling runs callables the stream names, and even a short list of allowed ones
let a review forge an object pointer through numpy and patch classes of the orchestrator)
but plain data in the format of inside_values, decoded with a fixed set of constructors;
and it must be one of the worker's four replies, each field of its type:

  ("ok", value)
  ("result", returncode, stdout, stderr, truncated)   a command's
  ("error", type_name, message, traceback)
  ("memory", message)

Anything else is Malformed. A reply frame longer than MAX_REPLY_BYTES is not read at all
(tangram.runtime.sandbox.workers): the worker is killed and the action fails.
"""

from __future__ import annotations

from typing import Any

from .inside_values import Malformed, decode

MAX_REPLY_BYTES = 256 << 20  # a reply (a function's result, a command's kept output) at most this long

_FIELDS = {"ok": (object,), "result": (int, bytes, bytes, bool), "error": (str, str, str), "memory": (str,)}


def load_reply(data: bytes) -> tuple[Any, ...]:
    """The worker's reply decoded and checked against its kind's fields; Malformed if it is
    not one of them."""
    reply = decode(data)
    if type(reply) is not tuple or not reply or reply[0] not in _FIELDS:
        raise Malformed(f"not a reply: a {type(reply).__name__}")  # (never its text: str() of a value runs its type's code)
    fields = _FIELDS[reply[0]]
    if len(reply) != 1 + len(fields) or not all(t is object or type(v) is t for v, t in zip(reply[1:], fields)):
        raise Malformed(f"a {reply[0]!r} reply of {len(reply) - 1} fields that are not "
                        f"({', '.join(t.__name__ for t in fields)})")
    return reply


__all__ = ["MAX_REPLY_BYTES", "Malformed", "load_reply"]
