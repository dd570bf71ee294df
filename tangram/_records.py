"""NumPy record layouts shared with the compiled core (bindings/records.h)."""

from __future__ import annotations

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

START, RESTORE, EVICT, REJECT, RESIZE = 0, 1, 2, 3, 4
# An EVICT decision's `reason` when the service's state is given up, not offloaded (its
# process closed; its next restore is a fresh load): csrc/tangram/model.h kDiscard.
DISCARD = 1
# RESIZE: a running action's new total grant of its elastic kind (policies whose `resize`
# rule is "malleable", tangram's among them).
DECISION_KINDS = ("start", "restore", "evict", "reject", "resize")


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
