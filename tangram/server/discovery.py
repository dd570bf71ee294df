"""Where a `tangram.Client` made without an address finds its server.

In this order:

1. `TANGRAM_ADDRESS`: set in the shell, or by a Ray job's runtime environment
   (`runtime_env={"env_vars": {"TANGRAM_ADDRESS": ...}}`), which sets it on every worker
   of the job;
2. the server advertised on the Ray cluster this process is connected to (a Ray worker,
   or a driver after `ray.init`): `tangram serve --ray` publishes its address in the
   cluster's claim (tangram.ray.claim), so the frameworks' Ray workers find it with no
   setting at all. Looked up only when `ray` is already imported and initialised here;
3. `127.0.0.1:7450`, a server on this host at the default port.

An explicit `Client(address)` (an adapter's config key passes one) comes before all three.
`found_by` says which one gave the address, for the error that names it when nothing
answers there.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .protocol import DEFAULT_PORT

# The named actor that claims a Ray cluster for one tangram scheduler (tangram.ray.claim).
CLAIM_NAME = "tangram-scheduler"
CLAIM_NAMESPACE = "tangram"
LOOKUP_TIMEOUT = 5.0  # seconds to wait for the claim's answer


def find_address() -> tuple[str, str]:
    """(address, how it was found): see the module docstring for the order."""
    address = os.environ.get("TANGRAM_ADDRESS")
    if address:
        return address, "$TANGRAM_ADDRESS"
    holder = advertised_server()
    if holder is not None and holder.get("address") and _reachable_from_here(holder):
        return str(holder["address"]), f"advertised on the Ray cluster by {describe_holder(holder)}"
    return f"127.0.0.1:{DEFAULT_PORT}", "the default (no address given, no $TANGRAM_ADDRESS, no server advertised " \
                                        "on a Ray cluster)"


def advertised_server() -> dict[str, Any] | None:
    """The claim's holder on the Ray cluster this process is connected to (its `address`
    once its server listens), or None: ray not imported or not initialised here, or no
    scheduler on the cluster."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return None
    try:
        claim = ray.get_actor(CLAIM_NAME, namespace=CLAIM_NAMESPACE)
        return dict(ray.get(claim.holder.remote(), timeout=LOOKUP_TIMEOUT))
    except Exception:  # no claim (ValueError), or its holder is going away
        return None


def _reachable_from_here(holder: dict[str, Any]) -> bool:
    """A server advertised at a loopback address is for processes on its own node only."""
    host = str(holder["address"]).rsplit(":", 1)[0].strip("[]")
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        return True
    ray = sys.modules.get("ray")
    try:
        return ray is not None and ray.util.get_node_ip_address() == holder.get("node_ip")
    except Exception:
        return False


def describe_holder(holder: dict[str, Any]) -> str:
    what = holder.get("serves") or "a RayOrchestrator"
    return f"{what} (pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')})"
