"""Runtime configuration: an object, or a TOML/JSON file with the same fields.

Everything is optional; the embedded default schedules this machine (its cores, memory
and GPUs) with the `tangram` policy and the built-in managers. A file, for instance:

    policy = "tangram"
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
    restore_seconds = 4     # the core's estimate of a restore
    max_batch = 64
    hooks = "mypackage.reward:RewardModel"   # a ServiceHooks class or instance

    [managers.cpu]          # keyword options of a manager's constructor
    output_limit = 1048576

    [inventory]             # optional; default: this machine
    nodes = [{ name = "n0", resources = { cpu = 16, memory = 65536 }, gpus = [81920] }]
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .._errors import ValidationError
from .._model import Gpu, Inventory, Node, Quota, Service


@dataclass
class RuntimeConfig:
    policy: str = "tangram"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    inventory: Inventory | None = None  # None: this machine (Inventory.local)
    quotas: list[Quota] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    service_hooks: Mapping[str, Any] = field(default_factory=dict)  # service name -> ServiceHooks
    managers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> constructor options
    max_records: int = 100_000
    metrics_port: int | None = None  # serve Prometheus /metrics on 127.0.0.1:port when set

    def resolved_inventory(self) -> Inventory:
        if self.inventory is None:
            return Inventory.local(quotas=self.quotas, services=self.services)
        if self.quotas or self.services:
            raise ValidationError("quotas", "give quotas and services inside `inventory` when it is set explicitly")
        return self.inventory

    @staticmethod
    def from_file(path: str | os.PathLike[str]) -> "RuntimeConfig":
        """Reads a .toml or .json file (see the module docstring)."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            import tomllib

            data = tomllib.loads(raw.decode())
        return RuntimeConfig.from_mapping(data)

    @staticmethod
    def from_mapping(data: Mapping[str, Any]) -> "RuntimeConfig":
        known = {f.name for f in fields(RuntimeConfig)}
        for key in data:
            if key not in known:
                raise ValidationError(key, f"unknown setting (known: {', '.join(sorted(known))})")
        config = RuntimeConfig()
        config.policy = _typed(data, "policy", str, config.policy)
        config.policy_options = dict(_typed(data, "policy_options", dict, {}))
        config.quotas = [_make(Quota, q, f"quotas[{i}]") for i, q in enumerate(data.get("quotas", []))]
        hooks: dict[str, Any] = {}
        services = []
        for i, s in enumerate(data.get("services", [])):
            s = dict(s)
            target = s.pop("hooks", None)
            service = _make(Service, s, f"services[{i}]")
            services.append(service)
            if target is not None:
                hooks[service.name] = _import(target, f"services[{i}].hooks")
        config.services = services
        config.service_hooks = hooks
        config.managers = {str(k): dict(v) for k, v in _typed(data, "managers", dict, {}).items()}
        config.max_records = _typed(data, "max_records", int, config.max_records)
        config.metrics_port = _typed(data, "metrics_port", int, None)
        if "inventory" in data:
            inv = data["inventory"]
            nodes = [Node(str(n["name"]), dict(n["resources"]), [Gpu(float(m)) for m in n.get("gpus", [])])
                     for n in inv.get("nodes", [])]
            config.inventory = Inventory(nodes=nodes, quotas=config.quotas, services=config.services)
            config.quotas, config.services = [], []
        return config


def _typed(data: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    if key not in data:
        return default
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValidationError(key, f"must be a {kind.__name__}, got {value!r}")
    return value


def _make(cls: type, values: Mapping[str, Any], where: str) -> Any:
    allowed = {f.name for f in fields(cls)}
    for key in values:
        if key not in allowed:
            raise ValidationError(f"{where}.{key}", f"unknown setting (known: {', '.join(sorted(allowed))})")
    try:
        return cls(**values)
    except TypeError as e:
        raise ValidationError(where, str(e)) from None


def _import(target: Any, where: str) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValidationError(where, f"cannot import {target!r}: {e}") from None
    return obj() if isinstance(obj, type) else obj
