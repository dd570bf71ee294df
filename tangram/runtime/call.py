"""What a caller describes for one live action (one tool call), and where the core put it."""

from __future__ import annotations

import copyreg
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Callable, Mapping, Sequence

from .._errors import ValidationError
from .._model import Model


@dataclass
class Call:
    """One tool call: what to run, what it needs, how it scales.

    Exactly one of `fn` and `command`:
      fn       a Python function called as fn(*args, **kwargs). In a CPU sandbox it must be
               picklable by cloudpickle (lambdas and closures are); for the API manager it
               may be a coroutine function, awaited on the orchestrator's loop.
      command  a command line, run in the trajectory's sandbox: a string runs through
               /bin/sh, a sequence is an argv. The result is a `CommandResult`; a non-zero
               exit status is a result, not an error (a failing test suite is a reward signal).

    Resources: `resources` is the minimum demand per kind (cores for "cpu", MiB for
    "memory"); `elastic` names the one kind that may be granted beyond it, up to
    `max_units`; `runtime` is the run-time estimate and elasticity model the core plans
    with (seconds, or a model: tangram.Amdahl, Table, cost_model...). `memory` in
    `resources` is also the action's memory limit in the CPU manager.

    `timeout` (seconds of running, not of waiting) kills the action's process group and
    ends it with ActionTimeout. `trajectory` selects the sandbox (state persists across a
    trajectory's actions). `service` runs the call on a GPU service's resident instance;
    `quota` draws one request (and `tokens`) from a named API quota. `kind` labels the
    action in records and metrics ("env", "reward", "search", ...). `manager` overrides
    the resource manager chosen by default (see `manager_for`). `affinity` names the node
    the action must run on (a multi-node inventory: where its trajectory's sandbox lives);
    None lets the core choose.
    """

    fn: Callable[..., Any] | None = None
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    command: str | Sequence[str] | None = None
    resources: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0})
    elastic: str | None = None
    max_units: float | None = None
    runtime: Model = 1.0
    timeout: float | None = None
    trajectory: int = 0
    priority: int = 0
    gpu_memory: float = 0.0
    service: str | None = None
    quota: str | None = None
    tokens: int = 0
    kind: str = "env"
    manager: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for commands and sandboxes
    affinity: str | None = None  # node name the action must run on (its trajectory's sandbox node)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Pickled as the class and its field values in order, not a dict of field names:
        # 114 bytes instead of 295 for a small call, twice as fast to load and a quarter
        # faster to dump (bench/server_costs.py; every call crosses the wire this way).
        if type(self) is Call and len(self.__dict__) == len(_CALL_FIELDS):
            return Call, _call_values(self)
        return copyreg.__newobj__, (type(self),), self.__dict__  # what pickle does by default


_CALL_FIELDS = tuple(f.name for f in fields(Call))
_call_values = attrgetter(*_CALL_FIELDS)


def validate_call(call: Any) -> None:
    """The checks a call passes before any inventory is consulted (the orchestrator and the
    server's client both run them at submit); raises ValidationError naming the field."""
    if not isinstance(call, Call):
        raise ValidationError("call", f"expected a tangram.Call, got {type(call).__name__}")
    if call.fn is not None and call.command is not None:
        raise ValidationError("call.command", "give either fn or command, not both")
    if call.timeout is not None and not (isinstance(call.timeout, (int, float)) and 0 < call.timeout < 1e9):
        raise ValidationError("call.timeout", f"must be a positive number of seconds, got {call.timeout!r}")
    if not isinstance(call.trajectory, int) or call.trajectory < 0:
        raise ValidationError("call.trajectory", f"must be a non-negative integer, got {call.trajectory!r}")


def manager_for(call: Call) -> str:
    """The default manager of a call: "gpu" for a service, "api" for a quota, else "cpu"."""
    if call.manager is not None:
        return call.manager
    if call.service is not None:
        return "gpu"
    if call.quota is not None:
        return "api"
    return "cpu"


@dataclass(frozen=True)
class CommandResult:
    """What a command left behind. `stdout`/`stderr` are capped at the manager's output
    limit (`truncated` says whether anything was cut)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False


@dataclass(frozen=True)
class Placement:
    """A start decision of the core, as a manager carries it out.

    node/node_name: where; device: the GPU device index on that node, or None; grant: the
    units of the elastic kind (its minimum when not elastic); cores: CPU cores granted
    (fractional allowed); memory: MiB granted (0 when not asked for); gpu_memory: MiB of
    GPU memory granted on `device`; env: environment variables that carry the grant to the
    action's process (CUDA_VISIBLE_DEVICES and MPS limits for a GPU grant), set by the
    orchestrator from the GPU manager's device table.
    """

    action_id: int
    node: int
    node_name: str
    device: int | None
    grant: float
    cores: float
    memory: float
    gpu_memory: float
    env: Mapping[str, str] = field(default_factory=dict)
