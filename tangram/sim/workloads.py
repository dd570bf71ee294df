"""Workloads: what one RL step of a rollout asks of the external resources.

A workload is plain JSON (docs/workloads.md documents every field and where each number
comes from). The built-in ones live beside this file (`workloads/<name>.json`) in the same
format, so a user models their own by copying one and editing it.

Sampling is separate from policies: `Workload.sample(seed)` draws one step's trajectories
(turns, action kinds, run times, think times, noise) from the seed alone, so every policy
simulated with that seed sees exactly the same step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .._errors import ValidationError
from .._model import check_keys

BUILTIN_DIR = Path(__file__).with_name("workloads")

# The saturation batch gain S of a GPU device's compute (docs/workloads.md, "GPU compute"):
# with n reward actions running on one device, each runs at 1 / (1 + (n - 1) / S) of its
# speed alone there. An assumption, derived there from the roofline of a reward model's
# prefill-only scoring; infinity turns the compute model off (no contention).
DEFAULT_GPU_BATCH_GAIN = 8.0
NO_CONTENTION = ("inf", "infinity")  # the JSON spellings of an infinite gain

# ------------------------------------------------------------------ distributions


@dataclass(frozen=True)
class Dist:
    """A distribution of a non-negative number.

    fixed: always `value`; lognormal: median `median`, log-space sd `sigma` (heavy tailed
    for sigma around 1); uniform: real in [low, high]; uniform_int: integer in [low, high];
    exponential: mean `mean`.
    """

    dist: str
    params: Mapping[str, float]

    @staticmethod
    def parse(obj: Any, where: str) -> "Dist":
        if obj is None:
            raise ValidationError(where, "is required")
        if _is_number(obj):
            obj = {"dist": "fixed", "value": obj}
        if not isinstance(obj, Mapping) or "dist" not in obj:
            raise ValidationError(where, f"expected a number or {{'dist': ...}}, got {obj!r}")
        kind = obj["dist"]
        need = {"fixed": ("value",), "lognormal": ("median", "sigma"), "uniform": ("low", "high"),
                "uniform_int": ("low", "high"), "exponential": ("mean",)}
        if not isinstance(kind, str) or kind not in need:
            raise ValidationError(f"{where}.dist", f"unknown distribution {kind!r} (one of {', '.join(need)})")
        _object(obj, where, ("dist", *need[kind]), required=need[kind])
        params = {p: _number(obj, p, where) for p in need[kind]}
        if kind in ("uniform", "uniform_int") and params["low"] > params["high"]:
            raise ValidationError(where, "low must not exceed high")
        if kind == "lognormal" and params["median"] <= 0:
            raise ValidationError(f"{where}.median", "must be positive")
        return Dist(kind, params)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = self.params
        if self.dist == "fixed":
            return np.full(n, p["value"])
        if self.dist == "lognormal":
            return rng.lognormal(math.log(p["median"]), p["sigma"], n)
        if self.dist == "uniform":
            return rng.uniform(p["low"], p["high"], n)
        if self.dist == "uniform_int":
            return rng.integers(int(p["low"]), int(p["high"]) + 1, n).astype(float)
        return rng.exponential(p["mean"], n)

    def to_json(self) -> dict[str, Any]:
        return {"dist": self.dist, **self.params}


# ------------------------------------------------------------------ validation
# A workload file is user input: every field is checked for its type and range, unknown
# fields are errors (a misspelt field would otherwise silently take its default), and each
# error names the field's path, e.g. `workload.actions[2].seconds.median`.


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _object(o: Any, where: str, known: Sequence[str], required: Sequence[str] = ()) -> Mapping[str, Any]:
    """`o` as a JSON object with only `known` fields and every `required` one."""
    return check_keys(o, where, known, required, what="a JSON object")


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number" if _is_number(v) else type(v).__name__)


def _list(o: Mapping[str, Any], key: str, where: str, required: bool = False) -> list[Any]:
    v = o.get(key)
    if v is None and not required:
        return []
    if not isinstance(v, (list, tuple)):
        raise ValidationError(f"{where}.{key}", f"must be a list, got {_type_name(v)}")
    if required and not v:
        raise ValidationError(f"{where}.{key}", "must not be empty")
    return list(v)


def _string(o: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = o.get(key, default)
    if v is None:
        raise ValidationError(f"{where}.{key}", "is required")
    if not isinstance(v, str):
        raise ValidationError(f"{where}.{key}", f"must be a string, got {_type_name(v)}")
    return v


def _number(o: Mapping[str, Any], key: str, where: str, default: float | None = None,
            integer: bool = False, positive: bool = False) -> float:
    v = o.get(key, default)
    if v is None:
        raise ValidationError(f"{where}.{key}", "is required")
    if not _is_number(v):
        raise ValidationError(f"{where}.{key}", f"must be a number, got {_type_name(v)} {v!r}")
    if not math.isfinite(v) or v < 0:
        raise ValidationError(f"{where}.{key}", f"must be a finite non-negative number, got {v!r}")
    if integer and v != int(v):
        raise ValidationError(f"{where}.{key}", f"must be an integer, got {v!r}")
    if positive and v <= 0:
        raise ValidationError(f"{where}.{key}", "must be positive")
    return float(v)


def parse_gpu_batch_gain(v: Any, where: str) -> float:
    """A saturation batch gain S: a number >= 1 (1: the device's compute is shared with no
    gain from running together), or "inf" / math.inf: no compute contention."""
    if isinstance(v, str) and v.strip().lower() in NO_CONTENTION:
        return math.inf
    if not _is_number(v) or math.isnan(v):
        raise ValidationError(where, f"must be a number >= 1 or \"inf\" (no GPU compute contention), "
                                     f"got {_type_name(v)} {v!r}")
    if v < 1:
        raise ValidationError(where, f"must be at least 1 (a device's aggregate throughput never falls "
                                     f"below one action's), got {v!r}")
    return float(v)


# ------------------------------------------------------------------ workload


@dataclass(frozen=True)
class ActionKind:
    """One kind of environment action. Elastic on "cpu" (Amdahl) when parallel_fraction > 0
    and max_units > cpu."""

    name: str
    weight: float
    cpu: float  # minimum cores
    memory: float  # MiB
    seconds: Dist  # run time at the minimum grant, before noise
    parallel_fraction: float = 0.0
    max_units: float = 0.0  # elastic upper bound in cores; 0: not elastic
    quota: str | None = None  # a named API quota (workload.quotas) each action of this kind uses
    tokens: Dist | None = None  # tokens each action spends of its quota's tokens_per_minute

    @property
    def elastic(self) -> bool:
        return self.parallel_fraction > 0 and self.max_units > self.cpu


@dataclass(frozen=True)
class QuotaSpec:
    """A named API quota (a core `Quota`): GCRA `rate` requests/s with `burst`, at most
    `max_concurrency` in flight, `tokens_per_minute`; 0 disables a limit."""

    name: str
    rate: float = 0.0
    burst: int = 1
    max_concurrency: int = 0
    tokens_per_minute: int = 0


def _copies(obj: dict, where: str) -> tuple[int, int]:
    """(replicas, max_replicas) of a reward service: max_replicas defaults to replicas and
    may not be below it."""
    replicas = int(_number(obj, "replicas", where, 1, integer=True, positive=True))
    max_replicas = int(_number(obj, "max_replicas", where, replicas, integer=True, positive=True))
    if max_replicas < replicas:
        raise ValidationError(f"{where}.max_replicas", f"must be at least replicas ({replicas}), got {max_replicas}")
    return replicas, max_replicas


@dataclass(frozen=True)
class RewardService:
    """One GPU reward service (a core `Service`)."""

    name: str
    gpu_memory: float  # MiB while resident
    restore_seconds: float
    max_batch: int
    weight: float = 1.0  # popularity (routing "popularity")
    seconds: Dist | None = None  # run time of one of its reward actions; None: the reward's
    offload_seconds: float | None = None  # its offload when evicted; None: as long as its restore
    replicas: int = 1  # copies (a core Service(replicas, max_replicas)): the core routes each reward
    max_replicas: int | None = None  # to the copy that serves it soonest, bringing copies up to this

    @property
    def copies(self) -> int:
        """As tangram.Service.copies: max_replicas, else replicas."""
        return self.replicas if self.max_replicas is None else self.max_replicas


@dataclass(frozen=True)
class Reward:
    """GPU reward services, each a tangram Service. Either `replicas` identical copies of
    one model, trajectory i scoring on replica i % replicas (routing "round_robin": each
    copy a service of its own, routed statically), or, with `max_replicas`, one replicated
    service whose copies the core routes to (routing "core"), or an explicit list of
    `services`, each trajectory scoring on one drawn by the services' weights (routing
    "popularity"), each of which may have copies too."""

    services: tuple[RewardService, ...]
    routing: str  # "round_robin", "core" or "popularity"
    cpu: float  # host cores each reward action holds (the request's client side)
    memory: float  # host MiB each reward action holds
    seconds: Dist  # run time of one reward action alone on an idle device, before noise
    # S: reward actions on one device share its compute, each at 1 / (1 + (n - 1) / S) of
    # its speed alone with n running there; math.inf: no contention (each at full speed).
    gpu_batch_gain: float = DEFAULT_GPU_BATCH_GAIN
    # The factor Workload.with_restore_scale applied to every service's restore and offload
    # seconds (1: as the workload states them), recorded in the rows.
    restore_scale: float = 1.0

    @property
    def replicas(self) -> int:
        return len(self.services)


@dataclass(frozen=True)
class NodeShape:
    cpu: float
    memory: float
    gpus: tuple[float, ...] = ()


@dataclass(frozen=True)
class InventorySpec:
    cpu_nodes: int
    cpu_node: NodeShape
    gpu_nodes: int = 0
    gpu_node: NodeShape | None = None


# ------------------------------------------------------------------ a workload's parts, from JSON


def _quotas(obj: Mapping[str, Any]) -> tuple[QuotaSpec, ...]:
    """workload.quotas, their names unique."""
    quotas: list[QuotaSpec] = []
    for i, q in enumerate(_list(obj, "quotas", "workload")):
        w = f"workload.quotas[{i}]"
        _object(q, w, ("name", "rate", "burst", "max_concurrency", "tokens_per_minute"), required=("name",))
        quotas.append(QuotaSpec(
            name=_string(q, "name", w),
            rate=_number(q, "rate", w, 0.0),
            burst=int(_number(q, "burst", w, 1, integer=True, positive=True)),
            max_concurrency=int(_number(q, "max_concurrency", w, 0, integer=True)),
            tokens_per_minute=int(_number(q, "tokens_per_minute", w, 0, integer=True)),
        ))
    if len({q.name for q in quotas}) != len(quotas):
        raise ValidationError("workload.quotas", "quota names must be unique")
    return tuple(quotas)


def _action_kind(a: Any, i: int, quota_names: list[str]) -> ActionKind:
    """workload.actions[i]; its quota one of `quota_names`."""
    w = f"workload.actions[{i}]"
    _object(a, w, ("name", "weight", "cpu", "memory", "seconds", "parallel_fraction", "max_units", "quota",
                   "tokens"), required=("seconds",))
    kind = ActionKind(
        name=_string(a, "name", w, f"action{i}"),
        weight=_number(a, "weight", w, 1.0),
        cpu=_number(a, "cpu", w, 1.0, positive=True),
        memory=_number(a, "memory", w, 0.0),
        seconds=Dist.parse(a["seconds"], f"{w}.seconds"),
        parallel_fraction=_number(a, "parallel_fraction", w, 0.0),
        max_units=_number(a, "max_units", w, 0.0),
        quota=_string(a, "quota", w) if "quota" in a else None,
        tokens=Dist.parse(a["tokens"], f"{w}.tokens") if "tokens" in a else None,
    )
    if kind.quota is not None and kind.quota not in quota_names:
        raise ValidationError(f"{w}.quota", f"no quota named {kind.quota!r} in workload.quotas")
    if kind.tokens is not None and kind.quota is None:
        raise ValidationError(f"{w}.tokens", "tokens count against a quota: name one")
    if kind.parallel_fraction > 1:
        raise ValidationError(f"{w}.parallel_fraction", "must be in [0, 1]")
    return kind


def _node_shape(o: Any, where: str) -> NodeShape:
    """One node of the inventory: its cores, memory and GPUs (the memory of each)."""
    _object(o, where, ("cpu", "memory", "gpus"), required=("cpu", "memory"))
    gpus = _list(o, "gpus", where)
    return NodeShape(_number(o, "cpu", where), _number(o, "memory", where),
                     tuple(_number({f"gpus[{i}]": g}, f"gpus[{i}]", where) for i, g in enumerate(gpus)))


def _inventory(inv: Any) -> InventorySpec:
    """workload.inventory."""
    where = "workload.inventory"
    _object(inv, where, ("cpu_nodes", "cpu_node", "gpu_nodes", "gpu_node"), required=("cpu_nodes", "cpu_node"))
    gpu_nodes = int(_number(inv, "gpu_nodes", where, 0, integer=True))
    if gpu_nodes and "gpu_node" not in inv:
        raise ValidationError(f"{where}.gpu_node", "is required when gpu_nodes is not 0")
    return InventorySpec(
        cpu_nodes=int(_number(inv, "cpu_nodes", where, integer=True, positive=True)),
        cpu_node=_node_shape(inv["cpu_node"], f"{where}.cpu_node"),
        gpu_nodes=gpu_nodes,
        gpu_node=_node_shape(inv["gpu_node"], f"{where}.gpu_node") if gpu_nodes else None,
    )


_REWARD_MODEL_KEYS = ("replicas", "max_replicas", "gpu_memory", "restore_seconds", "offload_seconds", "max_batch")


def _reward(r: Any, inventory: InventorySpec) -> Reward:
    """workload.reward: an explicit list of services, or copies of one model; the inventory
    must have GPUs for them."""
    w = "workload.reward"
    shared = ("cpu", "memory", "seconds", "gpu_batch_gain")
    _object(r, w, (*shared, "services", *_REWARD_MODEL_KEYS), required=("seconds",))
    if "services" in r:
        services, routing = _listed_services(r, w), "popularity"
    else:
        _object(r, w, (*shared, *_REWARD_MODEL_KEYS), required=("gpu_memory",))
        services, routing = _model_copies(r, w)
    reward = Reward(
        services=tuple(services),
        routing=routing,
        cpu=_number(r, "cpu", w, 0.0),
        memory=_number(r, "memory", w, 0.0),
        seconds=Dist.parse(r["seconds"], f"{w}.seconds"),
        gpu_batch_gain=parse_gpu_batch_gain(r.get("gpu_batch_gain", DEFAULT_GPU_BATCH_GAIN), f"{w}.gpu_batch_gain"),
    )
    if not inventory.gpu_nodes or not inventory.gpu_node or not inventory.gpu_node.gpus:
        raise ValidationError("workload.inventory.gpu_nodes", "a reward service needs GPU nodes with GPUs")
    return reward


def _listed_services(r: Any, w: str) -> list[RewardService]:
    """reward.services: each with its own model, names unique, weights not all zero."""
    for key in _REWARD_MODEL_KEYS:
        if key in r:  # it would be ignored: each service has its own
            raise ValidationError(f"{w}.{key}", "not with reward.services: give it per service")
    services = []
    for i, sv in enumerate(_list(r, "services", w, required=True)):
        ws = f"{w}.services[{i}]"
        _object(sv, ws, ("name", "gpu_memory", "restore_seconds", "offload_seconds", "max_batch",
                         "weight", "seconds", "replicas", "max_replicas"), required=("gpu_memory",))
        copies = _copies(sv, ws)
        services.append(RewardService(
            name=_string(sv, "name", ws, f"reward-{i}"),
            gpu_memory=_number(sv, "gpu_memory", ws),
            restore_seconds=_number(sv, "restore_seconds", ws, 0.0),
            max_batch=int(_number(sv, "max_batch", ws, 1, integer=True, positive=True)),
            weight=_number(sv, "weight", ws, 1.0),
            seconds=Dist.parse(sv["seconds"], f"{ws}.seconds") if "seconds" in sv else None,
            offload_seconds=_number(sv, "offload_seconds", ws) if "offload_seconds" in sv else None,
            replicas=copies[0], max_replicas=copies[1],
        ))
    if len({sv.name for sv in services}) != len(services):
        raise ValidationError(f"{w}.services", "service names must be unique")
    if sum(sv.weight for sv in services) <= 0:
        raise ValidationError(f"{w}.services", "weights must not all be zero")
    return services


def _model_copies(r: Any, w: str) -> tuple[list[RewardService], str]:
    """(services, routing) of one reward model in copies: with max_replicas one replicated
    service whose copies the core routes to, else `replicas` services of their own, round
    robin."""
    replicas, max_replicas = _copies(r, w)
    mem, restore = _number(r, "gpu_memory", w), _number(r, "restore_seconds", w, 0.0)
    offload = _number(r, "offload_seconds", w) if "offload_seconds" in r else None
    batch = int(_number(r, "max_batch", w, 1, integer=True, positive=True))
    if "max_replicas" in r:
        return [RewardService("reward", mem, restore, batch, offload_seconds=offload,
                              replicas=replicas, max_replicas=max_replicas)], "core"
    return [RewardService(f"reward-{i}", mem, restore, batch, offload_seconds=offload)
            for i in range(replicas)], "round_robin"


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # trajectories per RL step, all started together
    turns: Dist  # environment actions per trajectory (rounded, at least 0)
    think: Dist  # LLM generation before each action (and before the reward)
    noise_sigma: float  # actual run time = model time x lognormal(-sigma^2/2, sigma): mean 1
    actions: tuple[ActionKind, ...]
    inventory: InventorySpec
    reward: Reward | None = None
    quotas: tuple[QuotaSpec, ...] = ()
    description: str = ""
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------- loading
    @staticmethod
    def from_dict(obj: Mapping[str, Any]) -> "Workload":
        """Validates a workload (the JSON format of docs/workloads.md); a ValidationError
        names the offending field's path."""
        _object(obj, "workload", ("name", "description", "batch", "turns", "think", "noise_sigma", "actions",
                                  "quotas", "reward", "inventory"),
                required=("batch", "turns", "actions", "inventory"))
        quotas = _quotas(obj)
        quota_names = [q.name for q in quotas]
        actions = _list(obj, "actions", "workload", required=True)
        kinds = [_action_kind(a, i, quota_names) for i, a in enumerate(actions)]
        if sum(k.weight for k in kinds) <= 0:
            raise ValidationError("workload.actions", "weights must not all be zero")
        inventory = _inventory(obj["inventory"])
        reward = _reward(obj["reward"], inventory) if obj.get("reward") is not None else None
        return Workload(
            name=_string(obj, "name", "workload", "custom"),
            batch=int(_number(obj, "batch", "workload", integer=True, positive=True)),
            turns=Dist.parse(obj["turns"], "workload.turns"),
            think=Dist.parse(obj.get("think", 0.0), "workload.think"),
            noise_sigma=_number(obj, "noise_sigma", "workload", 0.0),
            actions=tuple(kinds),
            inventory=inventory,
            reward=reward,
            quotas=quotas,
            description=_string(obj, "description", "workload", ""),
            source=dict(obj),
        )

    @staticmethod
    def load(name_or_path: str | Path) -> "Workload":
        """A built-in workload by name (`coding`, `deepsearch`, `multireward`), or a JSON file.
        Every problem is a ValidationError: an unknown name, a missing or unreadable file,
        invalid JSON (with its line and column), or a field (its path, and the file)."""
        p = Path(name_or_path)
        if not p.suffix and (BUILTIN_DIR / f"{name_or_path}.json").exists():
            p = BUILTIN_DIR / f"{name_or_path}.json"
        if not p.exists():
            if not p.suffix and len(p.parts) == 1:
                known = ", ".join(builtin_names())
                raise ValidationError("workload", f"no built-in workload or file {str(name_or_path)!r} "
                                                  f"(built-in: {known})")
            raise ValidationError("workload", f"no such file {str(p)!r}")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValidationError("workload", f"cannot read {str(p)!r}: {reason}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValidationError("workload", f"{str(p)!r} is not valid JSON: {e.msg} at line {e.lineno}, "
                                              f"column {e.colno}") from None
        try:
            return Workload.from_dict(obj)
        except ValidationError as e:
            raise type(e)(e.field, f"{e.reason} (in {str(p)!r})") from None

    def with_batch(self, batch: int) -> "Workload":
        if batch < 1:
            raise ValidationError("batch", "must be positive")
        return replace(self, batch=int(batch))

    def with_gpu_batch_gain(self, gain: float | str) -> "Workload":
        """The same workload with the reward section's `gpu_batch_gain` S (a number >= 1, or
        math.inf / "inf": no GPU compute contention)."""
        if self.reward is None:
            raise ValidationError("gpu_batch_gain", f"workload {self.name!r} has no reward services")
        return replace(self, reward=replace(self.reward, gpu_batch_gain=parse_gpu_batch_gain(gain, "gpu_batch_gain")))

    def with_restore_scale(self, scale: float) -> "Workload":
        """The same workload with every reward service's restore seconds (and offload seconds,
        where stated) times `scale`, a finite number > 0: how the results depend on how fast
        a deployment brings a model back onto a GPU (from pinned host memory, from disk)."""
        if self.reward is None:
            raise ValidationError("restore_scale", f"workload {self.name!r} has no reward services")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValidationError("restore_scale", f"must be a finite number > 0, got {scale!r}")
        services = tuple(replace(s, restore_seconds=s.restore_seconds * scale,
                                 offload_seconds=None if s.offload_seconds is None else s.offload_seconds * scale)
                         for s in self.reward.services)
        return replace(self, reward=replace(self.reward, services=services,
                                            restore_scale=self.reward.restore_scale * scale))

    def with_gpus(self, gpus: int) -> "Workload":
        """The same workload with `gpus` devices on each GPU node (every device the size of
        the node's first one). The built-in workloads have one GPU node, so this is their
        total GPU count."""
        g = self.inventory.gpu_node
        if gpus < 1 or int(gpus) != gpus:
            raise ValidationError("gpus", "must be a positive integer")
        if not self.inventory.gpu_nodes or g is None or not g.gpus:
            raise ValidationError("gpus", f"workload {self.name!r} has no GPU node to scale")
        return replace(self, inventory=replace(self.inventory, gpu_node=replace(g, gpus=(g.gpus[0],) * int(gpus))))

    def with_cores(self, cores: int) -> "Workload":
        """The same workload with `cores` cores on each CPU (sandbox) node; the number of
        nodes, their memory and the trajectories' placement on them stay the same."""
        if cores < 1 or int(cores) != cores:
            raise ValidationError("cores", "must be a positive integer")
        inv = self.inventory
        return replace(self, inventory=replace(inv, cpu_node=replace(inv.cpu_node, cpu=float(cores))))

    def with_value(self, key: str, value: int) -> "Workload":
        """`batch`, `gpus` (per GPU node) or `cores` (per CPU node) set to `value`."""
        if key == "batch":
            return self.with_batch(value)
        if key == "gpus":
            return self.with_gpus(value)
        if key == "cores":
            return self.with_cores(value)
        raise ValidationError("key", f"expected batch, gpus or cores, got {key!r}")

    def value(self, key: str) -> int:
        """The current `batch`, `gpus` (per GPU node) or `cores` (per CPU node)."""
        inv = self.inventory
        if key == "batch":
            return self.batch
        if key == "gpus":
            return len(inv.gpu_node.gpus) if inv.gpu_nodes and inv.gpu_node is not None else 0
        if key == "cores":
            return int(inv.cpu_node.cpu)
        raise ValidationError("key", f"expected batch, gpus or cores, got {key!r}")

    def total(self, key: str) -> int:
        """Total GPUs (`gpus`) or sandbox cores (`cores`) over all nodes; `batch` as is."""
        inv = self.inventory
        if key == "gpus":
            return inv.gpu_nodes * self.value("gpus")
        if key == "cores":
            return inv.cpu_nodes * self.value("cores")
        return self.value(key)

    # ---------------------------------------------------------------- sampling
    def sample(self, seed: int) -> "Step":
        """One RL step drawn from `seed` alone (the same for every policy)."""
        rng = np.random.default_rng(seed)
        n = self.batch
        turns = np.maximum(np.rint(self.turns.draw(rng, n)), 0).astype(np.int64)
        total = int(turns.sum())
        weights = np.array([k.weight for k in self.actions], dtype=float)
        kind = rng.choice(len(self.actions), size=total, p=weights / weights.sum())
        seconds = np.zeros(total)
        for i, k in enumerate(self.actions):
            sel = kind == i
            seconds[sel] = k.seconds.draw(rng, int(sel.sum()))
        think = self.think.draw(rng, total + n)  # one before every action, the reward included
        s = self.noise_sigma
        noise = rng.lognormal(-s * s / 2, s, total + n) if s > 0 else np.ones(total + n)
        reward_seconds = self.reward.seconds.draw(rng, n) if self.reward else np.zeros(0)
        # Draws added after the first format only come after the draws above, and only for
        # workloads that use them, so a workload without them samples exactly as before.
        reward_service = np.zeros(n, dtype=np.int64)
        if self.reward is not None:
            svcs = self.reward.services
            if self.reward.routing == "round_robin":
                reward_service = np.arange(n, dtype=np.int64) % len(svcs)
            else:
                pw = np.array([sv.weight for sv in svcs], dtype=float)
                reward_service = rng.choice(len(svcs), size=n, p=pw / pw.sum()).astype(np.int64)
                for i, sv in enumerate(svcs):
                    sel = reward_service == i
                    if sv.seconds is not None and sel.any():
                        reward_seconds[sel] = sv.seconds.draw(rng, int(sel.sum()))
        tokens = np.zeros(total, dtype=np.int64)
        for i, k in enumerate(self.actions):
            sel = kind == i
            if k.tokens is not None and sel.any():
                tokens[sel] = np.maximum(np.rint(k.tokens.draw(rng, int(sel.sum()))), 0).astype(np.int64)
        return Step(turns=turns, kind=kind, seconds=seconds, think=think, noise=noise,
                    reward_seconds=reward_seconds, reward_service=reward_service, tokens=tokens)


@dataclass(frozen=True)
class Step:
    """One sampled RL step. Environment actions of trajectory t are the slice
    offsets[t]:offsets[t+1] of kind/seconds; think and noise hold, per trajectory, one entry
    per environment action and then one for its reward (index offsets[t] + t + j)."""

    turns: np.ndarray  # environment actions per trajectory
    kind: np.ndarray  # action kind index per environment action
    seconds: np.ndarray  # model run time at the minimum grant
    think: np.ndarray
    noise: np.ndarray
    reward_seconds: np.ndarray  # per trajectory
    reward_service: np.ndarray  # per trajectory: index into reward.services
    tokens: np.ndarray  # per environment action: tokens of its quota (0: none)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.turns)])


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def builtin(name: str) -> Workload:
    return Workload.load(BUILTIN_DIR / f"{name}.json")
