"""Runtime configuration: an object, or a TOML/JSON file with the same fields.

Everything is optional; the embedded default schedules this machine (its cores, memory
and GPUs) with the `tangram` policy and the built-in managers. A file, for instance:

    policy = "tangram"
    objective = "step"           # or "act" (docs/scheduling.md, Objectives)
    estimates = "estimates.db"   # learned run times persist here (SQLite); default: in memory
    [policy_options]
    starvation_seconds = 30

    [[quotas]]
    name = "search"
    rate = 20               # requests per second
    burst = 5
    max_concurrency = 8
    tokens_per_minute = 0   # 0: no token budget

    [[services]]
    name = "reward-7b"
    memory = 16000          # MiB of GPU memory while resident
    restore_seconds = 4     # the core's first estimate of a restore (then: the measured ones)
    offload_seconds = 4     # and of an offload when evicted (default: as long as a restore)
    max_batch = 64
    replicas = 1            # identical copies, each with its own residency
    asleep_memory = 0       # MiB it keeps on its device while offloaded (then movable = false)
    movable = true          # false: a server process, restored on the device it sleeps on
    host_memory = 0         # MiB of host RAM its offloaded state takes (Node offload_memory caps it)
    hooks = "mypackage.reward:RewardModel"   # a ServiceHooks class or instance

    [managers.cpu]          # keyword options of a manager's constructor
    output_limit = 1048576

    [inventory]             # optional; default: this machine
    nodes = [{ name = "n0", resources = { cpu = 16, memory = 65536 }, gpus = [81920] }]

A setting of the wrong shape (an unknown key, a missing one, a value of the wrong type)
is a ValidationError whose field is its path, e.g. `config.quotas[0].rate` or
`config.inventory.nodes[1].resources`; an unknown key or policy is an UnknownNameError.
Values are range-checked when the scheduler is built from them.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

from .._errors import UnknownNameError, ValidationError
from .._model import (
    Gpu,
    Inventory,
    Node,
    Quota,
    Service,
    check_integer,
    check_items,
    check_keys,
    check_mapping,
    check_number,
    check_string,
    given,
)
from ..scheduler import OBJECTIVES, POLICIES, Policy
from .managers.hooks import ServiceHooks


@dataclass
class RuntimeConfig:
    policy: str = "tangram"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    # What the policy's order serves: "step" (a synchronous trainer's step) or "act" (mean
    # ACT, for asynchronous trainers); tangram.Policy documents both. None: policy_options'
    # "objective", else "step".
    objective: str | None = None
    inventory: Inventory | None = None  # None: this machine (Inventory.local)
    quotas: list[Quota] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    service_hooks: Mapping[str, Any] = field(default_factory=dict)  # service name -> ServiceHooks
    managers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> constructor options
    max_records: int = 100_000
    metrics_port: int | None = None  # serve Prometheus /metrics on 127.0.0.1:port when set
    estimates: str | None = None  # SQLite file of learned run times (tangram.estimates); None: in memory

    def __post_init__(self) -> None:
        check_string(self.policy, "config.policy", "a policy name (a string)")
        if self.policy not in POLICIES:
            raise UnknownNameError("config.policy", f"unknown policy {self.policy!r} (one of {', '.join(POLICIES)})")
        check_mapping(self.policy_options, "config.policy_options", "policy option to value")
        for key, value in self.policy_options.items():
            _check_policy_option(key, value, f"config.policy_options.{key}")
        if self.objective is not None:
            if self.objective not in OBJECTIVES:
                raise ValidationError("config.objective", f"must be one of {', '.join(map(repr, OBJECTIVES))}, "
                                                          f"got {given(self.objective)}")
            other = self.policy_options.get("objective", self.objective)
            if other != self.objective:
                raise ValidationError("config.objective", f"{self.objective!r} conflicts with "
                                                          f"policy_options.objective {other!r}")
        if self.inventory is not None and not isinstance(self.inventory, Inventory):
            raise ValidationError("config.inventory",
                                  f"must be a tangram.Inventory or None, got {given(self.inventory)}")
        check_items(self.quotas, "config.quotas", Quota)
        check_items(self.services, "config.services", Service)
        check_mapping(self.service_hooks, "config.service_hooks", "service name to hooks")
        for name in self.service_hooks:
            check_string(name, "config.service_hooks", "keyed by service names (strings)")
        check_mapping(self.managers, "config.managers", "manager name to options")
        for name, options in self.managers.items():
            check_string(name, "config.managers", "keyed by manager names (strings)")
            check_mapping(options, f"config.managers.{name}", "option name to value")
        check_integer(self.max_records, "config.max_records")
        if self.max_records < 0:
            raise ValidationError("config.max_records", f"must not be negative, got {self.max_records}")
        if self.metrics_port is not None:
            check_integer(self.metrics_port, "config.metrics_port")
            if not 0 <= self.metrics_port <= 65535:
                raise ValidationError("config.metrics_port", f"must be a TCP port, 0 to 65535, got {self.metrics_port}")
        if self.estimates is not None and not isinstance(self.estimates, (str, os.PathLike)):
            raise ValidationError("config.estimates", f"must be a file path or None, got {given(self.estimates)}")

    def scheduler_options(self) -> dict[str, Any]:
        """The policy options the scheduler is built with: policy_options and the objective."""
        options = dict(self.policy_options)
        if self.objective is not None:
            options["objective"] = self.objective
        return options

    def resolved_inventory(self) -> Inventory:
        if self.inventory is None:
            return Inventory.local(quotas=self.quotas, services=self.services)
        if self.quotas or self.services:
            raise ValidationError("config.quotas",
                                  "give quotas and services inside `inventory` when it is set explicitly")
        return self.inventory

    @staticmethod
    def from_file(path: str | os.PathLike[str]) -> "RuntimeConfig":
        """Reads a .toml or .json file (see the module docstring); a setting of the wrong
        shape is a ValidationError naming its path, and the file in its reason."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            import tomllib

            data = tomllib.loads(raw.decode())
        try:
            return RuntimeConfig.from_mapping(data)
        except ValidationError as e:
            raise type(e)(e.field, f"{e.reason} (in {path})") from None

    @staticmethod
    def from_mapping(data: Mapping[str, Any]) -> "RuntimeConfig":
        """The config a parsed file describes (see the module docstring)."""
        check_keys(data, "config", _FILE_SETTINGS)
        settings = {key: data[key] for key in ("policy", "policy_options", "objective", "managers", "max_records",
                                                "metrics_port", "estimates")
                    if key in data}
        quotas = [_build(Quota, q, f"config.quotas[{i}]")
                  for i, q in enumerate(_list(data.get("quotas", []), "config.quotas", "tables ([[quotas]])"))]
        services: list[Service] = []
        hooks: dict[str, Any] = {}
        for i, values in enumerate(_list(data.get("services", []), "config.services", "tables ([[services]])")):
            where = f"config.services[{i}]"
            check_keys(values, where, [*_names(Service), "hooks"], _required(Service))
            values = dict(values)
            target = values.pop("hooks", None)
            service = _build(Service, values, where)
            services.append(service)
            if target is not None:
                hooks[service.name] = _hooks(target, f"{where}.hooks")
        if "inventory" in data:
            # Quotas and services are top-level settings; the inventory takes them.
            inventory = data["inventory"]
            check_keys(inventory, "config.inventory", ["nodes"], ["nodes"])
            nodes = [_node(n, f"config.inventory.nodes[{i}]")
                     for i, n in enumerate(_list(inventory["nodes"], "config.inventory.nodes", "tables"))]
            settings["inventory"] = Inventory(nodes=nodes, quotas=quotas, services=services)
        else:
            settings.update(quotas=quotas, services=services)
        return RuntimeConfig(service_hooks=hooks, **settings)


# A file sets every field but service_hooks, which it gives per service (`hooks`).
_FILE_SETTINGS = [f.name for f in fields(RuntimeConfig) if f.name != "service_hooks"]
# Policy options by the type their field declares; the scheduler checks the rest (pools).
_POLICY_OPTIONS = {f.name: f.type for f in fields(Policy) if f.name != "name"}
_OPTION_CHECKS = {"float": check_number, "int": check_integer}


def _check_policy_option(key: Any, value: Any, where: str) -> None:
    if key not in _POLICY_OPTIONS:
        raise UnknownNameError(where, f"no such policy option (options: {', '.join(_POLICY_OPTIONS)})")
    check = _OPTION_CHECKS.get(_POLICY_OPTIONS[key])
    if check is not None:
        check(value, where)


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _required(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


def _list(value: Any, where: str, what: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValidationError(where, f"must be a list of {what}, got {given(value)}")
    return value


def _build(cls: type, values: Any, where: str) -> Any:
    """A model object from a table; its own type errors are renamed to the table's path
    (a Quota's `quota.rate` becomes `config.quotas[0].rate`)."""
    check_keys(values, where, _names(cls), _required(cls))
    try:
        return cls(**values)
    except ValidationError as e:
        own = cls.__name__.lower()
        if not e.field.startswith(own + "."):
            raise
        raise type(e)(where + e.field[len(own):], e.reason) from None


def _node(values: Any, where: str) -> Node:
    """A node table; its `gpus` are GPU memories in MiB."""
    check_keys(values, where, _names(Node), _required(Node))
    gpus = [_build(Gpu, {"memory": m}, f"{where}.gpus[{i}]")
            for i, m in enumerate(_list(values.get("gpus", []), f"{where}.gpus", "GPU memories in MiB"))]
    return _build(Node, {**values, "gpus": gpus}, where)


def _hooks(target: Any, where: str) -> Any:
    """A service's hooks: a ServiceHooks instance, or 'module:attribute' naming a
    ServiceHooks class (constructed with no arguments) or instance."""

    hooks = target
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not (module and sep and attr):
            raise ValidationError(where, f"must be 'module:attribute', got {target!r}")
        # The user's module and constructor may raise anything: still one error (and one
        # line) naming the setting.
        try:
            hooks = getattr(importlib.import_module(module), attr)
        except Exception as e:
            raise ValidationError(where, f"cannot import {target!r}: {_one_line(e)}") from None
        if isinstance(hooks, type) and issubclass(hooks, ServiceHooks):
            try:
                hooks = hooks()
            except Exception as e:
                raise ValidationError(where, f"{target}() raised {_one_line(e)}") from None
    if not isinstance(hooks, ServiceHooks):
        named = f" (it names {given(hooks)})" if hooks is not target else ""
        raise ValidationError(where, f"must be a ServiceHooks class or instance, or 'module:attribute' naming one; "
                                     f"got {given(target)}{named}")
    return hooks


def _one_line(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())
