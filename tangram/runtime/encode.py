"""Calls to the core's bulk action records, fast enough for tens of thousands per second.

Calls of one shape (same resources, elasticity, model, service, quota...) share one
encoded template record; a batch is built with one fancy-indexing copy of the templates
plus one assignment per varying column (id, trajectory). Validation happens once per
shape, when the template is made, through the same RecordEncoder the Scheduler uses.
"""

from __future__ import annotations

import bisect
import struct
from typing import Any

import numpy as np

from .._errors import TangramError
from .._model import Action
from ..scheduler import RecordEncoder, action_field_names
from .call import Call

# Past this many shapes the templates are dropped, at the orchestrator's next safe point
# (`collect`, once its pending submissions are with the core): memory stays bounded, and a
# template is never reused while an action waiting to be submitted refers to it.
_MAX_TEMPLATES = 4096
_ID_AND_TRAJECTORY = struct.Struct("<QQ")  # the first two fields of an action record


def shape_of(call: Call, runtime: Any) -> tuple[Any, ...]:
    """The fields of a call that its record depends on, except its id and trajectory, with
    the run-time model it is planned with (declared or estimated)."""
    return (tuple(call.resources.items()), call.elastic, call.max_units, runtime, call.priority,
            call.gpu_memory, call.service, call.quota, call.tokens, call.affinity)


class CallEncoder:
    """`process_gpu_memory`: MiB the core adds to the gpu_memory of a GPU call that runs in
    a process of its own (no service): its CUDA context, which it does not allocate itself
    (GpuManager.context_mib); never past the smallest GPU (`set_gpus`) that holds what the
    call asks for, so that every GPU that could hold the call still can (one asking for
    nearly a whole GPU gets the whole GPU)."""

    def __init__(self, encoder: RecordEncoder, process_gpu_memory: float = 0.0) -> None:
        self._encoder = encoder
        self.process_gpu_memory = process_gpu_memory
        self.gpus: list[float] = []  # every GPU's memory, ascending
        self._index: dict[tuple[Any, ...], int] = {}
        self._slots = 0  # templates made since the last collect
        self.generation = 0  # bumped when collect drops the templates: older indices are stale
        self._templates = np.zeros(16, dtype=encoder.dtype)
        self._template_bytes: list[bytes] = []  # the same records as bytes, for one-action batches
        assert encoder.dtype.names[:2] == ("id", "trajectory") and encoder.dtype.fields["trajectory"][1] == 8

    def template(self, call: Call, runtime: Any) -> int:
        """The template index of the call's shape, planned with `runtime` (its declared
        model or an estimate); raises a typed error naming the call's field when the shape
        is invalid."""
        key = shape_of(call, runtime)
        try:
            return self._index[key]
        except KeyError:
            pass
        except Exception:  # an unhashable model (or one whose hash fails): encode it every time
            key = None  # type: ignore[assignment]
        gpu_memory = call.gpu_memory
        if self.process_gpu_memory and call.service is None and isinstance(gpu_memory, (int, float)) and gpu_memory > 0:
            fitting = bisect.bisect_left(self.gpus, gpu_memory)
            if fitting < len(self.gpus):  # else the core refuses the call as it is
                gpu_memory = min(gpu_memory + self.process_gpu_memory, self.gpus[fitting])
        action = Action(0, dict(call.resources), runtime, elastic=call.elastic, max_units=call.max_units,
                        priority=call.priority, gpu_memory=gpu_memory, service=call.service,
                        quota=call.quota, tokens=call.tokens, affinity=call.affinity)
        try:
            record = self._encoder.encode([action])
        except TangramError as e:
            raise call_field_names(e) from None
        slot = self._slots
        self._slots += 1
        if slot >= len(self._templates):
            grown = np.zeros(2 * len(self._templates), dtype=self._templates.dtype)
            grown[: len(self._templates)] = self._templates
            self._templates = grown
        self._templates[slot] = record[0]
        if slot < len(self._template_bytes):  # slots restart at 0 after a clear
            self._template_bytes[slot] = record[0].tobytes()
        else:
            self._template_bytes.append(record[0].tobytes())
        if key is not None:
            self._index[key] = slot
        return slot

    def collect(self) -> bool:
        """Drops every template once there are more than _MAX_TEMPLATES, starting a new
        generation; call it only when no action waiting to be submitted holds a template
        index (each holds its generation: an older one is encoded again). Whether it did."""
        if self._slots < _MAX_TEMPLATES:
            return False
        self._index.clear()
        self._slots = 0
        self.generation += 1
        return True

    def set_gpus(self, memories: Any) -> None:
        """The GPUs' memories (MiB), which cap what a call's CUDA context adds. Templates
        made before keep theirs (live actions refer to them): more GPUs only lower a cap,
        and every GPU a template fitted is still there."""
        self.gpus = sorted(float(m) for m in memories)

    def records(self, templates: list[int], ids: list[int], trajectories: list[int]) -> np.ndarray:
        if len(templates) == 1:
            # One action (a caller awaiting one at a time): a copy of its template's bytes
            # with the id and trajectory written in, a fifth of the fancy-indexed path's cost.
            record = bytearray(self._template_bytes[templates[0]])
            _ID_AND_TRAJECTORY.pack_into(record, 0, ids[0], trajectories[0])
            return np.frombuffer(record, dtype=self._templates.dtype)
        rec = self._templates[np.asarray(templates, dtype=np.intp)]
        rec["id"] = ids
        rec["trajectory"] = trajectories
        return rec


_ACTION_TO_CALL_FIELD = {".demand": ".resources", ".max_units": ".max_units", ".runtime": ".runtime"}


def call_field_names(error: TangramError) -> TangramError:
    """The core's error about actions[0] (a record), named by the Call's fields."""
    error = action_field_names(error)
    field = error.field.replace("actions[0]", "call", 1)
    for action_name, call_name in _ACTION_TO_CALL_FIELD.items():
        field = field.replace(action_name, call_name)
    return type(error)(field, error.reason)
