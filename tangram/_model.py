"""What a user describes: the inventory, elasticity models and actions.

Units: cores for "cpu", MiB for "memory" and GPU memory, plain counts for any other kind
and for tokens; seconds for time. The core stores them as integer milli-units.
"""

from __future__ import annotations

import math
import numbers
import os
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

from ._errors import UnknownNameError, ValidationError
from .devices import discover

# ------------------------------------------------------------------ inventory


@dataclass(frozen=True)
class Gpu:
    """One GPU device (or MIG instance) and its memory in MiB."""

    memory: float

    def __post_init__(self) -> None:
        check_number(self.memory, "gpu.memory")


@dataclass(frozen=True)
class Node:
    """A machine: its capacity per resource kind, and its GPUs."""

    name: str
    resources: Mapping[str, float]
    gpus: Sequence[Gpu] = ()
    # MiB of host RAM for the state of services offloaded from its GPUs (Service.host_memory:
    # a sleeping server's weights backed up in pinned memory); None: not limited.
    offload_memory: float | None = None

    def __post_init__(self) -> None:
        check_string(self.name, "node.name")
        check_mapping(self.resources, "node.resources", "resource kind to capacity")
        for kind, capacity in self.resources.items():
            check_string(kind, "node.resources", "keyed by resource kind names (strings)")
            check_number(capacity, f"node.resources.{kind}")
        check_items(self.gpus, "node.gpus", Gpu)
        if self.offload_memory is not None:
            check_number(self.offload_memory, "node.offload_memory")


@dataclass(frozen=True)
class Quota:
    """A named API quota. Zero disables a limit."""

    name: str
    rate: float = 0.0  # requests per second
    burst: int = 1  # requests admitted back to back before the rate applies
    max_concurrency: int = 0  # requests in flight
    tokens_per_minute: int = 0  # token budget, refilled continuously

    def __post_init__(self) -> None:
        check_string(self.name, "quota.name")
        check_number(self.rate, "quota.rate")
        check_integer(self.burst, "quota.burst")
        check_integer(self.max_concurrency, "quota.max_concurrency")
        check_integer(self.tokens_per_minute, "quota.tokens_per_minute")


@dataclass(frozen=True)
class Service:
    """A GPU service (a reward model) kept in host memory and restored onto a GPU."""

    name: str
    memory: float  # MiB of GPU memory while resident
    # Its restore's own time (host -> device): the core's estimate until the runtime has
    # measured restores of it, then theirs (tangram.runtime learns them).
    restore_seconds: float = 0.0
    max_batch: int = 1  # actions it runs at once
    # Its offload's time when evicted (device -> host); None: as long as its restore (the
    # same bytes over the same link). A device's restores and offloads run one after
    # another, so a restore into an evicted service's memory is ready after both.
    offload_seconds: float | None = None
    # MiB it keeps on its device while offloaded (a sleeping inference server keeps its
    # CUDA context and allocator pool); at most `memory`, and non-zero only if not movable.
    asleep_memory: float = 0.0
    # Whether a restore may go to another device than the one it first loaded on. A server
    # process cannot move its CUDA context (tangram.runtime.managers.inference): False pins it to
    # its first device, until that device's node goes offline (then it loads afresh).
    movable: bool = True
    # Identical copies (each its own residency, e.g. its own server process): the core
    # schedules "name#0" .. "name#{copies-1}" (`instances`), and a call naming the service
    # goes to the copy that serves it soonest (the core routes it at submit, and its waiting
    # calls again at every pass: docs/scheduling.md, Replicas). `replicas` is
    # the minimum; up to `max_replicas` (None: `replicas`) copies are brought in when a
    # queue's wait exceeds a restore, and copies beyond `replicas` are evicted first when
    # GPU memory is needed.
    replicas: int = 1
    # MiB of host RAM its offloaded state takes on the node it was evicted from (vLLM's
    # sleep level 1 keeps the weights in pinned host memory): an eviction needs that much
    # of the node's offload_memory, and its next restore gives it back.
    host_memory: float = 0.0
    max_replicas: int | None = None

    def __post_init__(self) -> None:
        check_string(self.name, "service.name")
        check_number(self.memory, "service.memory")
        check_number(self.restore_seconds, "service.restore_seconds")
        check_integer(self.max_batch, "service.max_batch", bits=32)
        if self.offload_seconds is not None:
            check_number(self.offload_seconds, "service.offload_seconds")
        check_number(self.asleep_memory, "service.asleep_memory")
        if not isinstance(self.movable, bool):
            raise ValidationError("service.movable", f"must be True or False, got {self.movable!r}")
        check_number(self.host_memory, "service.host_memory")
        check_integer(self.replicas, "service.replicas", bits=16)
        if self.replicas < 1:
            raise ValidationError("service.replicas", f"must be at least 1, got {self.replicas}")
        if self.max_replicas is not None:
            check_integer(self.max_replicas, "service.max_replicas", bits=16)
            if self.max_replicas < self.replicas:
                raise ValidationError("service.max_replicas",
                                      f"must be at least replicas ({self.replicas}), got {self.max_replicas}")

    @property
    def copies(self) -> int:
        """How many copies the core schedules: max_replicas, else replicas."""
        return self.replicas if self.max_replicas is None else self.max_replicas

    @property
    def instances(self) -> list[str]:
        """The names the core schedules: its own name, or name#0, name#1, ... for replicas."""
        return [self.name] if self.copies == 1 else [f"{self.name}#{r}" for r in range(self.copies)]

    @property
    def offload(self) -> float:
        """Seconds its offload takes: offload_seconds, else restore_seconds."""
        return self.restore_seconds if self.offload_seconds is None else self.offload_seconds


@dataclass(frozen=True)
class Inventory:
    """Nodes, quotas and services. Kinds are taken from the nodes in order of appearance,
    "cpu" and "memory" first when present."""

    nodes: Sequence[Node]
    quotas: Sequence[Quota] = ()
    services: Sequence[Service] = ()

    def __post_init__(self) -> None:
        check_items(self.nodes, "inventory.nodes", Node)
        check_items(self.quotas, "inventory.quotas", Quota)
        check_items(self.services, "inventory.services", Service)
        seen: set[str] = set()
        for i, service in enumerate(self.services):
            for name in service.instances:
                if name in seen:
                    raise ValidationError(f"inventory.services[{i}].name", f"duplicate service {name!r}")
                seen.add(name)

    @property
    def service_instances(self) -> list[tuple[str, "Service"]]:
        """(name, service) for each instance the core schedules, in order: a service, or
        each of its replicas."""
        return [(name, s) for s in self.services for name in s.instances]

    @property
    def kinds(self) -> list[str]:
        seen: list[str] = []
        for base in ("cpu", "memory"):
            if any(base in n.resources for n in self.nodes):
                seen.append(base)
        for n in self.nodes:
            for k in n.resources:
                if k not in seen:
                    seen.append(k)
        return seen

    @staticmethod
    def uniform(nodes: int, resources: Mapping[str, float], gpus: Sequence[float] = (),
                quotas: Sequence[Quota] = (), services: Sequence[Service] = ()) -> "Inventory":
        """`nodes` identical nodes named node0, node1, ..."""
        return Inventory(
            nodes=[Node(f"node{i}", dict(resources), [Gpu(m) for m in gpus]) for i in range(nodes)],
            quotas=list(quotas),
            services=list(services),
        )

    @staticmethod
    def local(quotas: Sequence[Quota] = (), services: Sequence[Service] = ()) -> "Inventory":
        """This machine: the CPUs this process may use, its memory, its GPUs.

        GPUs come from NVML (nvidia-ml-py) when a driver is present. Without one, the
        environment variable TANGRAM_FAKE_GPUS="81920,81920" declares a fake inventory of
        GPUs with those memories in MiB, so GPU paths can be exercised on any machine.
        """
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
        return Inventory(
            nodes=[Node(os.uname().nodename, {"cpu": cpus, "memory": math.floor(memory)}, discover_gpus())],
            quotas=list(quotas),
            services=list(services),
        )


def discover_gpus() -> list[Gpu]:
    """GPUs of this machine: TANGRAM_FAKE_GPUS when set, else NVML, else none. One Gpu per
    schedulable device (a MIG instance counts as one); see `tangram.devices` for the
    TANGRAM_FAKE_GPUS syntax (MIG instances included)."""
    return [Gpu(d.memory_mib) for d in discover()]


# ------------------------------------------------------------------ elasticity


@dataclass(frozen=True)
class Constant:
    """Run time does not depend on the grant."""

    seconds: float


@dataclass(frozen=True)
class Amdahl:
    """t(u) = seconds * ((1 - p) + p * minimum / u): `seconds` at the minimum grant.

    Both figures are relative to the call's minimum grant. A run known by its time on one
    unit and its parallel fraction there is `Amdahl.from_one_unit` (keeping those figures
    with a fractional minimum would make its serial part 1 / minimum times too long)."""

    seconds: float
    parallel_fraction: float

    @classmethod
    def from_one_unit(cls, seconds: float, parallel_fraction: float, minimum: float) -> "Amdahl":
        """The run that takes `seconds` on one unit, `parallel_fraction` of it parallel
        (t(u) = seconds * ((1 - p) + p / u)), as the model of a call whose minimum grant is
        `minimum` units: the same curve, with its seconds and fraction taken at the minimum."""
        check_number(seconds, "amdahl.seconds")
        check_number(parallel_fraction, "amdahl.parallel_fraction")
        check_number(minimum, "amdahl.minimum")
        if not 0 <= parallel_fraction <= 1:
            raise ValidationError("amdahl.parallel_fraction", f"must be in [0, 1], got {given(parallel_fraction)}")
        if not (math.isfinite(minimum) and minimum > 0):
            raise ValidationError("amdahl.minimum", f"must be a positive finite number of units, got {given(minimum)}")
        if minimum == 1:  # the same figures, exactly
            return cls(seconds, parallel_fraction)
        serial, parallel = seconds * (1 - parallel_fraction), seconds * parallel_fraction / minimum
        at_minimum = serial + parallel
        return cls(at_minimum, parallel / at_minimum if at_minimum > 0 else parallel_fraction)


@dataclass(frozen=True)
class Table:
    """Piecewise linear through (units, seconds) points, flat outside them."""

    points: tuple[tuple[float, float], ...]

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        # Any iterable of pairs (a NumPy array of rows too); the core checks the values
        # under the same field names.
        try:
            rows = list(points)
        except TypeError:
            raise ValidationError("table", f"must be a list of (units, seconds) pairs, got {given(points)}") from None
        pairs = []
        for i, row in enumerate(rows):
            try:
                u, s = row
            except (TypeError, ValueError):
                raise ValidationError(f"table[{i}]", f"must be a (units, seconds) pair, got {given(row)}") from None
            check_number(u, f"table[{i}].units")
            check_number(s, f"table[{i}].seconds")
            pairs.append((float(u), float(s)))
        object.__setattr__(self, "points", tuple(pairs))


@dataclass(frozen=True)
class Native:
    """A native `double seconds(double units)` function the core calls directly: build it
    with `tangram.cost_model` (numba), or pass the address of any C function."""

    address: int
    keepalive: object = field(default=None, compare=False, repr=False)


def cost_model(fn: Callable[[float], float]) -> Native:
    """Compile `fn(units) -> seconds` with numba into a native callback for the core.

    The function must be numba-compilable in nopython mode. A plain Python callable given
    as an action's runtime also works, by a slower path: it is sampled at every grant the
    core can choose (whole units from the minimum to the bound) into a Table at submit.
    """
    import numba

    compiled = numba.cfunc("float64(float64)", nopython=True)(fn)
    return Native(compiled.address, keepalive=compiled)


Model = Union[float, int, Constant, Amdahl, Table, Native, Callable[[float], float]]


# ------------------------------------------------------------------ actions


@dataclass
class Action:
    """One tool call: a minimum demand per kind, at most one elastic kind with an upper
    bound, and a run-time model (seconds, or a model of seconds against the grant)."""

    id: int
    demand: Mapping[str, float]
    runtime: Model = 1.0
    elastic: str | None = None  # the kind that may be granted beyond the minimum
    max_units: float | None = None  # the elastic upper bound
    trajectory: int = 0
    task: int = 0
    priority: int = 0
    gpu_memory: float = 0.0
    affinity: int | str | None = None  # node index or name
    service: str | None = None
    quota: str | None = None
    tokens: int = 0


# ------------------------------------------------------------------ validation
# The inventory's objects check their types when built (a wrong one would otherwise
# crash the core's binding, or be coerced); values and ranges are the core's to check when
# a scheduler is built from them, under the names the scheduler gives (inventory.nodes[0]
# ...). A bool is never a number here; an int is a fine float. Actions are checked whole
# at submit instead (tangram.scheduler.RecordEncoder): they are built per tool call.


def given(value: Any) -> str:
    """A value as an error shows it: its type and a short repr."""
    if value is None:
        return "None"
    try:
        return f"{type(value).__name__} {reprlib.repr(value)}"
    except Exception:  # an int of thousands of digits has no repr
        return f"{type(value).__name__} (too large to show)"


def check_string(value: Any, field: str, what: str = "a string") -> None:
    if not isinstance(value, str):
        raise ValidationError(field, f"must be {what}, got {given(value)}")


def check_number(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(field, f"must be a number, got {given(value)}")


def check_integer(value: Any, field: str, bits: int = 64) -> None:
    """An integer the core's `bits`-bit signed field holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValidationError(field, f"must be an integer, got {given(value)}")
    if not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
        raise ValidationError(field, f"must be a {bits}-bit integer, got {given(value)}")


def check_keys(values: Any, where: str, known: Sequence[str], required: Sequence[str] = (),
               what: str = "a table of settings (a TOML table, a JSON object)") -> Mapping[str, Any]:
    """A mapping read from a file (a config, a workload) with only `known` keys and every
    `required` one; returned as given."""
    if not isinstance(values, Mapping):
        raise ValidationError(where, f"must be {what}, got {given(values)}")
    for key in values:
        if key not in known:
            raise UnknownNameError(f"{where}.{key}", f"unknown field (known here: {', '.join(known)})")
    for key in required:
        if key not in values:
            raise ValidationError(f"{where}.{key}", "is required")
    return values


def check_mapping(value: Any, field: str, what: str) -> None:
    if not isinstance(value, Mapping):
        raise ValidationError(field, f"must be a mapping of {what}, got {given(value)}")


def check_items(value: Any, field: str, cls: type) -> None:
    """A list or tuple (any sequence but a string) of `cls` instances."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValidationError(field, f"must be a list of tangram.{cls.__name__}, got {given(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, cls):
            raise ValidationError(f"{field}[{i}]", f"must be a tangram.{cls.__name__}, got {given(item)}")
