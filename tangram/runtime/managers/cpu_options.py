"""CpuManager's options, checked before anything starts (each bad one is a ManagerError
naming `managers.cpu.<option>` and why), and CpuPool, the cores it hands out."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..._arguments import int_ranges
from ..errors import ManagerError
from ..sandbox.containers import ENGINES
from ..sandbox.namespaces import ISOLATIONS, SANDBOX_OWN_PATHS

CPU_LIMITS = ("guarantee", "ceiling")
MILLI_PER_CORE = 1000  # a core in milli-cores, CpuPool's unit
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_options(*, root: Any, isolation: Any, output_limit: Any, cpus: Iterable[int] | None,
                  env: Mapping[str, str] | None, inherit_env: Sequence[str], cpu_limit: Any, warm_sandboxes: Any,
                  preload: Sequence[str], network: Any, visible_paths: Sequence[str], pids_limit: Any,
                  resource_control: Any, disk_limit: Any, image_cache: Any, containers: Any,
                  container_options: Sequence[str]) -> tuple[list[int], dict[str, str]]:
    """Checks every option; returns the CPUs the manager will use (its `cpus`, else every
    CPU this process may run on) and its extra environment."""
    f = "managers.cpu."
    if not isinstance(isolation, str) or isolation not in ISOLATIONS:
        raise ManagerError(f + "isolation", f"{isolation!r} is not one of {', '.join(ISOLATIONS)}" + (
            " (the cgroup mechanism is the option resource_control)" if isolation in
            ("cgroup-v2", "cgroup-v1", "affinity") else ""))
    if not isinstance(network, bool):
        raise ManagerError(f + "network", f"{network!r} is not true or false")
    if isinstance(visible_paths, str) or not all(isinstance(p, (str, os.PathLike)) for p in visible_paths):
        raise ManagerError(f + "visible_paths", f"{visible_paths!r} is not a list of paths")
    missing = [os.fspath(p) for p in visible_paths if not os.path.isabs(os.fspath(p)) or not os.path.exists(p)]
    if missing:
        raise ManagerError(f + "visible_paths", f"{missing[0]!r} is not an existing absolute path")
    hidden = [os.fspath(p) for p in visible_paths if any(
        os.path.realpath(p) == d or os.path.realpath(p).startswith(d + "/") for d in SANDBOX_OWN_PATHS)]
    if hidden:
        raise ManagerError(f + "visible_paths", f"{hidden[0]!r} is under a path a sandbox has of its own "
                           f"({', '.join(SANDBOX_OWN_PATHS)}): the sandbox would not see it")
    if pids_limit is not None and (isinstance(pids_limit, bool) or not isinstance(pids_limit, int)
                                   or not 16 <= pids_limit <= 4_194_304):
        raise ManagerError(f + "pids_limit", f"{pids_limit!r} is not a number of processes in [16, 4194304] "
                           "or None")
    if isinstance(preload, str) or not all(isinstance(m, str) and _MODULE_NAME.fullmatch(m) for m in preload):
        raise ManagerError(f + "preload", f"{preload!r} is not a list of module names")
    if root is not None and not (isinstance(root, (str, os.PathLike)) and os.path.isdir(root)):
        raise ManagerError(f + "root", f"{root!r} is not an existing directory")
    if disk_limit is not None and (isinstance(disk_limit, bool) or not isinstance(disk_limit, (int, float))
                                   or not 1 <= disk_limit <= 1 << 30):
        raise ManagerError(f + "disk_limit", f"{disk_limit!r} is not a number of MiB in [1, 2**30] or None")
    if image_cache is not None and not (isinstance(image_cache, (str, os.PathLike)) and os.path.isabs(image_cache)):
        raise ManagerError(f + "image_cache", f"{image_cache!r} is not an absolute path")
    if containers is not None and not (isinstance(containers, (str, os.PathLike)) and (
            os.path.basename(os.fspath(containers)) in ENGINES)):
        raise ManagerError(f + "containers", f"{containers!r} is not one of {', '.join(ENGINES)} (or a path to one)")
    if isinstance(container_options, str) or not all(isinstance(o, str) for o in container_options):
        raise ManagerError(f + "container_options", f"{container_options!r} is not a list of strings")
    if container_options and containers is None:
        raise ManagerError(f + "container_options", "given without containers (the engine to run them with)")
    if containers is not None and disk_limit is not None:
        raise ManagerError(f + "disk_limit", "not offered for containers (their storage is the engine's): set "
                           "one of containers and disk_limit")
    if not isinstance(resource_control, str) or resource_control not in ("auto", "cgroup-v2", "cgroup-v1", "affinity"):
        raise ManagerError(f + "resource_control", f"{resource_control!r} is not one of auto, cgroup-v2, cgroup-v1, "
                           "affinity")
    if not isinstance(cpu_limit, str) or cpu_limit not in CPU_LIMITS:
        raise ManagerError(f + "cpu_limit", f"{cpu_limit!r} is not one of {', '.join(CPU_LIMITS)}")
    if isinstance(warm_sandboxes, bool) or not isinstance(warm_sandboxes, int) or not 0 <= warm_sandboxes <= 1024:
        raise ManagerError(f + "warm_sandboxes", f"{warm_sandboxes!r} is not a number of workers in [0, 1024]")
    if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 0:
        raise ManagerError(f + "output_limit", f"{output_limit!r} is not a non-negative number of bytes")
    allowed = sorted(os.sched_getaffinity(0))
    if cpus is None:
        chosen = allowed
    else:
        try:
            chosen = sorted({int(c) for c in cpus})
        except (TypeError, ValueError):
            raise ManagerError(f + "cpus", f"{cpus!r} is not a list of CPU ids") from None
        if not chosen:
            raise ManagerError(f + "cpus", "no CPU given")
        bad = [c for c in chosen if c not in allowed]
        if bad:
            raise ManagerError(f + "cpus", f"CPU {bad} not available to this process (allowed: {int_ranges(allowed)})")
    env = dict(env or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ManagerError(f + "env", "keys and values must be strings")
    if isinstance(inherit_env, str) or not all(isinstance(k, str) for k in inherit_env):
        raise ManagerError(f + "inherit_env", f"{inherit_env!r} is not a list of variable names")
    return chosen, env


class CpuPool:
    """Per-CPU usage in milli-cores. `take` prefers exclusive whole CPUs and packs fractions
    onto CPUs already shared; when the free capacity is fragmented (or the inventory
    declares more cores than there are CPUs) it shares the least used ones. `release`
    gives back exactly what `take` charged."""

    def __init__(self, cpus: Sequence[int]) -> None:
        self.cpus = list(cpus)
        self.used = dict.fromkeys(self.cpus, 0)

    def take(self, cores: float) -> dict[int, int]:
        need = max(0, int(round(cores * MILLI_PER_CORE)))
        used = self.used
        whole, frac = divmod(need, MILLI_PER_CORE)
        charge: dict[int, int] = {}
        idle = [c for c in self.cpus if used[c] == 0]
        if need == 0:  # no cores asked: run on the least used CPU, charging nothing
            charge[min(self.cpus, key=lambda c: used[c])] = 0
            return charge
        if len(idle) >= whole:
            for c in idle[:whole]:
                charge[c] = MILLI_PER_CORE
            if frac:
                fits = [c for c in self.cpus if c not in charge and MILLI_PER_CORE - used[c] >= frac]
                if fits:  # best fit: the fullest CPU it fits on, keeping idle CPUs whole
                    c = min(fits, key=lambda c: (MILLI_PER_CORE - used[c], c))
                    charge[c] = frac
                else:
                    charge = {}
        if not charge:  # fragmented or oversubscribed: the most free capacity first
            left = need
            for c in sorted(self.cpus, key=lambda c: (used[c], c)):
                take = min(left, max(0, MILLI_PER_CORE - used[c]))
                if take > 0:
                    charge[c] = take
                    left -= take
                if left == 0:
                    break
            if left > 0:  # more than the pool holds: share the least used CPUs beyond capacity
                order = sorted(self.cpus, key=lambda c: (used[c] + charge.get(c, 0), c))
                i = 0
                while left > 0:
                    c = order[i % len(order)]
                    step = min(left, MILLI_PER_CORE)
                    charge[c] = charge.get(c, 0) + step
                    left -= step
                    i += 1
        for c, m in charge.items():
            used[c] += m
        return charge

    def release(self, charge: Mapping[int, int]) -> None:
        for c, m in charge.items():
            self.used[c] -= m

    @property
    def full(self) -> bool:
        """True when nothing is charged: the pool is exactly as it started."""
        return all(v == 0 for v in self.used.values())
