"""One tangram scheduler per Ray cluster.

Two schedulers on one cluster would each think every core is theirs and book the same
cores twice. So a `RayManager` (every `RayOrchestrator`, and `tangram serve --ray`) claims
the cluster as it starts: it creates the named actor `tangram-scheduler` in namespace
`tangram`, which Ray lets exist only once per cluster. A second one finds the name taken
and stops with `ClusterClaimed`, naming who holds it. The actor is owned by the claiming
driver (not detached), so Ray removes it when that driver exits, even killed; `close()`
removes it at once. `RayOrchestrator(exclusive=False)` skips the claim, for an operator
who has split the cluster's resources between schedulers by other means.

The claim also advertises the server: `tangram serve --ray` stores its address there once
it listens, and a `tangram.Client` made without an address on any of the cluster's
workers finds it (tangram.server.discovery).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Mapping

from .._errors import TangramError
from ..server.discovery import CLAIM_NAME, CLAIM_NAMESPACE, describe_holder

FREED_WAIT = 10.0  # seconds to wait for the name of a holder that is dying to be freed


class ClusterClaimed(TangramError):
    """Another tangram scheduler already schedules this Ray cluster (field "ray"): the
    reason names it (host, pid, what it serves)."""


class _Claim:
    """The claim's actor: holds who claimed the cluster."""

    def __init__(self, holder: Mapping[str, Any]) -> None:
        self._holder = dict(holder)

    def holder(self) -> dict[str, Any]:
        return self._holder

    def advertise(self, address: str) -> None:
        self._holder["address"] = address


def claim_cluster(ray: Any, serves: str = "") -> Any:
    """Claims the connected cluster for this process's scheduler; returns the claim (an
    actor handle for release_claim). Raises ClusterClaimed when another process holds it.
    The claim lives on this process's node (its loss is the scheduler's loss too, not a
    worker node's), and is read back once made: Ray's check of a name is not atomic
    between two drivers, so the one whose nonce the actor holds has it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nonce = os.urandom(8).hex()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "serves": serves, "nonce": nonce,
              "node_ip": ray.util.get_node_ip_address(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0)(_Claim)
    deadline = time.monotonic() + FREED_WAIT
    while True:
        try:
            claim = actor.options(name=CLAIM_NAME, namespace=CLAIM_NAMESPACE, max_restarts=0,
                                  enable_task_events=False, scheduling_strategy=here).remote(holder)
            other = ray.get(claim.holder.remote(), timeout=30)
            if other.get("nonce") == nonce:
                return claim
        except ValueError:  # the name is taken
            other = None
        try:
            if other is None:
                other = ray.get(ray.get_actor(CLAIM_NAME, namespace=CLAIM_NAMESPACE).holder.remote(), timeout=10)
        except Exception:  # it is dying or died between the two calls: its name is being freed
            if time.monotonic() > deadline:
                raise ClusterClaimed("ray", f"the cluster's claim '{CLAIM_NAME}' is held by a scheduler that does "
                                            f"not answer; retry once it has exited") from None
            time.sleep(0.2)
            continue
        raise ClusterClaimed("ray", f"this Ray cluster is already scheduled by {describe_holder(other)}: one "
                                    "tangram scheduler per cluster, so that no core is booked twice; send its "
                                    "clients there (tangram serve's address), or stop it first")


def advertise(ray: Any, claim: Any, host: str, port: int) -> str:
    """Publishes where clients reach this scheduler's server; a server bound to every
    interface is advertised at this node's IP, one bound to loopback as such (discovery
    offers it only to processes on this node: `node_ip`). Returns the address advertised."""
    if host in ("", "0.0.0.0", "::"):
        host = ray.util.get_node_ip_address()
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    ray.get(claim.advertise.remote(address), timeout=10)
    return address


def release_claim(ray: Any, claim: Any) -> None:
    """Gives the cluster back (idempotent), and waits (a few seconds at most) until Ray has
    freed the name, so that a scheduler started next in this process can claim it."""
    try:
        ray.kill(claim, no_restart=True)
    except Exception:  # already gone
        pass
    deadline = time.monotonic() + FREED_WAIT
    while time.monotonic() < deadline:
        try:
            ray.get_actor(CLAIM_NAME, namespace=CLAIM_NAMESPACE)
        except ValueError:  # no such actor: the name is free
            return
        except Exception:
            return  # Ray is going away; nothing to wait for
        time.sleep(0.05)
