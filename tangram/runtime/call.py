"""What a caller describes for one live action (one tool call), and where the core put it."""

from __future__ import annotations

import collections.abc
import copyreg
import os
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Callable, Mapping, Sequence

from .._errors import ValidationError
from .._model import Model, given
from ..scheduler import record_limits


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
    with (seconds, or a model: tangram.Amdahl, Table, cost_model...); left None, the
    orchestrator plans with a run time learned from earlier actions with the same `key`
    (tangram.estimates; by default the kind and the function or command). `memory` in
    `resources` is also the action's memory limit in the CPU manager.

    `timeout` (seconds of running, not of waiting) kills the action's process group and
    ends it with ActionTimeout. `trajectory` selects the sandbox (state persists across a
    trajectory's actions). `service` runs the call on a GPU service's resident instance;
    `quota` draws one request (and `tokens`) from a named API quota. `kind` labels the
    action in records and metrics ("env", "reward", "search", ...). `manager` overrides
    the resource manager chosen by default (see `manager_for`). `affinity` names the node
    the action must run on (a multi-node inventory: where its trajectory's sandbox lives);
    None lets the core choose. `idempotent` says whether the call may run more than once:
    False keeps it from being rerun elsewhere when its node is lost (docs/ray.md).
    `pooled` runs it in any idle sandbox of a pool the CPU manager keeps, taken when the
    action starts, instead of its trajectory's: for calls that leave the sandbox as they
    found it (tangram.runtime.sandbox.run_code's scrub), so that many concurrent stateless calls
    need only as many sandboxes as run at once. `network` opens the network to a
    namespaced CPU sandbox for this call (False: loopback only, its own; None: the
    manager's `network` option); a sandbox's worker keeps the network it was started with,
    so a call asking for more than its worker has gets a new worker in the same directory
    (docs/sandbox.md). `image` runs its sandbox on a task image's root filesystem (an OCI
    layout directory, a `docker save`/`podman save` archive, "podman:NAME" or "docker:NAME"
    of a local store, or an unpacked root directory; tangram.runtime.sandbox.images): a trajectory's
    sandbox keeps the image of its first call, and a later call of it with image=None runs
    there too (docs/sandbox.md, "Task images").
    """

    fn: Callable[..., Any] | None = None
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    command: str | Sequence[str] | None = None
    resources: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0})
    elastic: str | None = None
    max_units: float | None = None
    runtime: Model | None = None  # None: learned from earlier runs of `key`
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
    idempotent: bool = True  # may run twice: a lost node's requeue reruns it (docs/ray.md)
    key: str | None = None  # what run-time estimates are learned under (None: derived, see estimates.key_of)
    pooled: bool = False  # any idle pooled sandbox, taken as it starts, not the trajectory's (see above)
    network: bool | None = None  # a namespaced sandbox's network for this call (None: the manager's default)
    image: str | None = None  # the task image its sandbox runs in (see above; None: its sandbox's, or the host's)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Pickled as the class and its field values in order, not a dict of field names:
        # less than half the bytes, and faster to load and dump (bench/server_costs.py
        # compares the two; every call crosses the wire this way). New fields go last, so
        # that the order of the others stays as it was.
        if type(self) is Call and len(self.__dict__) == len(_CALL_FIELDS):
            return Call, _call_values(self)
        return copyreg.__newobj__, (type(self),), self.__dict__  # what pickle does by default


_CALL_FIELDS = tuple(f.name for f in fields(Call))
_call_values = attrgetter(*_CALL_FIELDS)


_TRAJECTORY_MAX = record_limits("trajectory")[1]


def validate_call(call: Any) -> None:
    """The checks a call passes before any inventory is consulted (the orchestrator and the
    server's client both run them at submit): the types of its fields, and the range of
    its trajectory in the core's record. Raises ValidationError naming the field. What
    makes its record for the core (resources, model, bounds, priority, tokens, the names of
    kinds, services and quotas) is checked as the orchestrator encodes it, at submit too.

    Cheap on purpose (every submit runs it): type tests on the fields, and a walk over
    kwargs, env and an argv only when they are not empty."""
    if not isinstance(call, Call):
        raise ValidationError("call", f"expected a tangram.Call, got {type(call).__name__}")
    fn, command = call.fn, call.command
    if fn is not None:
        if command is not None:
            raise ValidationError("call.command", "give either fn or command, not both")
        if not callable(fn):
            raise ValidationError("call.fn", f"must be callable, got {type(fn).__name__}")
    elif command is not None:
        _check_command(command)
    if type(call.args) is not tuple and not isinstance(call.args, (tuple, list)):
        raise ValidationError("call.args", f"must be a tuple or list of positional arguments, got "
                                           f"{type(call.args).__name__}")
    if type(call.kwargs) is not dict or call.kwargs:  # an empty dict has nothing to check
        _check_strings("call.kwargs", call.kwargs, keys_only=True)
    if type(call.env) is not dict or call.env:
        _check_strings("call.env", call.env, keys_only=False)
    if type(call.resources) is not dict and not isinstance(call.resources, collections.abc.Mapping):
        raise ValidationError("call.resources", f"must be a mapping of resource kind to units, got "
                                                f"{type(call.resources).__name__}")
    t = call.timeout
    if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e9):
        raise ValidationError("call.timeout", f"must be a positive number of seconds, got {given(t)}")
    t = call.trajectory
    if not (type(t) is int or isinstance(t, int) and not isinstance(t, bool)) or not 0 <= t <= _TRAJECTORY_MAX:
        raise ValidationError("call.trajectory", f"must be an integer in [0, {_TRAJECTORY_MAX}], got {given(t)}")
    if not isinstance(call.kind, str):
        raise ValidationError("call.kind", f"must be a string, got {given(call.kind)}")
    if call.manager is not None and not isinstance(call.manager, str):
        raise ValidationError("call.manager", f"must be a manager's name, got {given(call.manager)}")
    if call.key is not None and not isinstance(call.key, str):
        raise ValidationError("call.key", f"must be a string or None, got {given(call.key)}")
    if call.idempotent is not True and call.idempotent is not False:
        raise ValidationError("call.idempotent", f"must be True or False, got {given(call.idempotent)}")
    if call.pooled is not True and call.pooled is not False:
        raise ValidationError("call.pooled", f"must be True or False, got {given(call.pooled)}")
    if call.network is not None and call.network is not True and call.network is not False:
        raise ValidationError("call.network", f"must be True, False or None, got {given(call.network)}")
    if call.image is not None and (not isinstance(call.image, str) or not call.image or "\0" in call.image):
        raise ValidationError("call.image", f"must be an image reference (a non-empty string) or None, got "
                                            f"{given(call.image)}")


def _check_command(command: Any) -> None:
    """A command line, or an argv of what exec takes: strings, bytes or paths, without NUL."""
    if isinstance(command, str):
        if "\0" in command:
            raise ValidationError("call.command", "must not contain a NUL character")
        return
    if not isinstance(command, (list, tuple)) or not command:
        raise ValidationError("call.command", f"must be a command line (a string) or a non-empty argv (a list of "
                                              f"strings), got {given(command)}")
    for i, arg in enumerate(command):
        try:
            arg = os.fspath(arg)
        except TypeError:
            raise ValidationError(f"call.command[{i}]",
                                  f"must be a string or a path, got {type(arg).__name__}") from None
        if ("\0" if isinstance(arg, str) else b"\0") in arg:
            raise ValidationError(f"call.command[{i}]", "must not contain a NUL character")


def _check_strings(name: str, mapping: Any, keys_only: bool) -> None:
    """kwargs (string keys) or env (string keys and values that an environment can hold)."""
    if type(mapping) is not dict and not isinstance(mapping, collections.abc.Mapping):
        raise ValidationError(name, f"must be a mapping, got {type(mapping).__name__}")
    if not mapping:
        return
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ValidationError(name, f"keys must be strings, got {given(key)}")
        if keys_only:
            continue
        if not key or "=" in key or "\0" in key:
            raise ValidationError(name, f"{given(key)} is not an environment variable name")
        if not isinstance(value, str):
            raise ValidationError(f"{name}.{key}", f"must be a string, got {type(value).__name__}")
        if "\0" in value:
            raise ValidationError(f"{name}.{key}", "must not contain a NUL character")


def require_fn_or_command(call: Call) -> None:
    """A call run in a sandbox (the cpu manager, a Ray node's) needs fn or command."""
    if call.fn is None and call.command is None:
        raise ValidationError("call.fn", "nothing to run: give fn (a function) or command (a command line)")


def require_service_input(call: Call) -> None:
    """A call to a GPU service runs the service's batch hook: its input is its one
    positional argument, with neither fn nor command."""
    if call.service is None:
        raise ValidationError("call.service", "names no service; other GPU work runs in the cpu manager, with its "
                                              "grant in Placement.env")
    if call.fn is not None or call.command is not None:
        raise ValidationError("call.fn" if call.fn is not None else "call.command",
                              f"a call to service {call.service!r} runs the service's batch hook: give its input "
                              "as the one positional argument, without fn or command")
    if len(call.args) != 1 or call.kwargs:
        raise ValidationError("call.args", f"a call to service {call.service!r} takes exactly one positional argument "
                                           f"(its input) and no keyword arguments; got {len(call.args)} and "
                                           f"{len(call.kwargs)}")


SERVICES_MANAGER = "gpu"  # the manager of service calls by default, which also restores and evicts services


def manager_for(call: Call) -> str:
    """The default manager of a call: "gpu" for a service, "api" for a quota, else "cpu"."""
    if call.manager is not None:
        return call.manager
    if call.service is not None:
        return SERVICES_MANAGER
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
