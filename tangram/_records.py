"""NumPy record layouts shared with the compiled core (bindings/records.h)."""

from __future__ import annotations

import enum
import functools
import struct
from typing import Iterable, NamedTuple

import numpy as np

MODEL_CONSTANT, MODEL_AMDAHL, MODEL_TABLE, MODEL_CALLBACK = 0, 1, 2, 3

_ACTION_HEADER = [
    ("id", "<u8"),
    ("trajectory", "<u8"),
    ("task", "<u4"),
    ("priority", "<i4"),
    ("elastic_kind", "<i4"),
    ("model", "<u4"),
    ("gpu_memory", "<f8"),
    ("elastic_max", "<f8"),
    ("seconds", "<f8"),
    ("parallel_fraction", "<f8"),
    ("table", "<i4"),
    ("affinity", "<i4"),
    ("service", "<i4"),
    ("quota", "<i4"),
    ("tokens", "<i8"),
    ("callback", "<u8"),
    ("any_replica", "<i4"),  # 1: `service` is a replicated service's first copy; the core picks the copy
    ("reserved", "<i4"),
]
ACTION_HEADER_SIZE = 104

DECISION_DTYPE = np.dtype(
    [
        ("action", "<u8"),
        ("grant_milli", "<i8"),
        ("grant", "<f8"),
        ("time", "<f8"),
        ("kind", "<i4"),
        ("node", "<i4"),
        ("device", "<i4"),
        ("service", "<i4"),
        ("elastic_kind", "<i4"),
        ("reason", "<i4"),
    ]
)


class DecisionKind(enum.IntEnum):
    """A decision record's `kind` (csrc/tangram/model.h DecisionKind)."""

    START = 0
    RESTORE = 1
    EVICT = 2
    REJECT = 3
    # A running action's new total grant of its elastic kind (policies whose `resize`
    # rule is "malleable", tangram's among them).
    RESIZE = 4


# The kinds as plain ints, for NumPy: `array == START` with an enum member is a slow
# object comparison (several times a plain int's), and the benchmarks and the simulator
# compare whole decision arrays.
START, RESTORE, EVICT, REJECT, RESIZE = (int(kind) for kind in DecisionKind)
# An EVICT decision's `reason` when the service's state is given up, not offloaded (its
# process closed; its next restore is a fresh load): csrc/tangram/model.h kDiscard.
DISCARD = 1
DECISION_KINDS = tuple(kind.name.lower() for kind in DecisionKind)


class Decision(NamedTuple):
    """One DECISION_DTYPE record, field by field (the fields in the record's order).

    The raw view the runtime and the simulator act on; tangram.Decision is the Scheduler's
    readable one (kind and service by name). Indexes are -1 for "none".
    """

    action: int  # START, REJECT, RESIZE: the action's id
    grant_milli: int  # `grant` in thousandths of a unit, as the core counts it
    grant: float  # START, RESIZE: units of the elastic kind granted (0.0: not elastic)
    time: float  # when it starts, is resized, or (RESTORE) when the service is ready
    kind: int  # a DecisionKind, as a plain int (its members compare equal; no enum per record)
    node: int
    device: int  # a GPU of `node`
    service: int  # the core's service index (a replicated service's copy)
    elastic_kind: int  # the resource kind index `grant` is of
    reason: int  # REJECT: the core's message index; EVICT: DISCARD or -1


assert tuple(Decision.__annotations__) == DECISION_DTYPE.names

# One record as `struct` reads it: DECISION_DTYPE's fields in order (u8, i8, f8, f8, six
# i4), little-endian, unpadded. Unpacking the array's buffer with it is about twice as fast
# as ndarray.tolist, and the runtime reads every decision of a burst.
_DECISION_RECORD = struct.Struct("<Qqdd6i")
assert _DECISION_RECORD.size == DECISION_DTYPE.itemsize
# A record's tuple becomes a Decision in C, without a Python-level call per record: what
# Decision._make does, less its length check (the asserts above hold).
_decision_of_row = functools.partial(tuple.__new__, Decision)


def decisions(records: np.ndarray) -> Iterable[Decision]:
    """The DECISION_DTYPE records as Decisions, in order, with plain Python numbers."""
    if len(records) == 1:  # one action's start, the live runtime's common case: no iterator to set up
        return (_decision_of_row(_DECISION_RECORD.unpack_from(records)),)
    try:
        rows = _DECISION_RECORD.iter_unpack(records)
    except ValueError:  # a strided view (a slice with a step): its records copied together
        rows = _DECISION_RECORD.iter_unpack(np.ascontiguousarray(records))
    return map(_decision_of_row, rows)


def action_dtype(kinds: int) -> np.dtype:
    """The bulk action record for a scheduler with `kinds` resource kinds.

    Quantities are in base units (cores, MiB, tokens); `demand` holds the minimum demand
    per kind in the inventory's kind order; -1 means "none" in the integer index fields.
    """
    dt = np.dtype(_ACTION_HEADER + [("demand", "<f8", (kinds,))])
    assert dt.itemsize == ACTION_HEADER_SIZE + 8 * kinds
    return dt


def empty_actions(kinds: int, count: int, dtype: np.dtype | None = None) -> np.ndarray:
    """Zeroed records with every optional index field set to -1 and the model constant."""
    arr = np.zeros(count, dtype=dtype if dtype is not None else action_dtype(kinds))
    for name in ("elastic_kind", "table", "affinity", "service", "quota"):
        arr[name] = -1
    return arr
