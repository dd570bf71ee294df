"""What the orchestrator shows of itself: its status snapshot (`tangram top`, the server's
STATUS) and the utilisation of the nodes.

Contract.
  Owns       nothing: it reads, and keeps nothing between calls.
  Calls      the Scheduler's queries (free capacity, quota snapshots), the record log's
             recent ACTs, the quota backoffs, the GPU managers' service states (DeviceOps).
  Invariant  a snapshot is plain data (dicts, lists, numbers, strings, None): it travels
             to a Client as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from .._model import Inventory, Quota
from ..scheduler import Scheduler
from .live import ActionState

if TYPE_CHECKING:
    from .dispatch import Dispatcher
    from .orchestrator import Orchestrator


def utilisation(scheduler: Scheduler | None, inventory: Inventory) -> dict[tuple[str, str], float]:
    """(node, resource) -> share of its capacity held by running actions ({} before start)."""
    out: dict[tuple[str, str], float] = {}
    if scheduler is None:
        return out
    for n, node in enumerate(inventory.nodes):
        for kind, cap in node.resources.items():
            if cap > 0:
                out[(node.name, kind)] = 1.0 - scheduler.free(n, kind) / cap
    return out


def snapshot(orch: Orchestrator, live: Iterable[ActionState], run: Dispatcher | None,
             running_limit: int) -> dict[str, Any]:
    """Orchestrator.status_now: what is happening now in `orch` (its `live` actions, its
    event loop `run`, None before start), as plain data:

      time, policy, objective   the clock (seconds since start) and the policy
      queues       kind -> [waiting, running]
      quotas       quota -> [waiting, running] (actions admitted under it)
      quota_limits quota -> its limits as configured ("rate" per second, "burst",
                   "max_concurrency", "tokens_per_minute"; 0: none), what it would admit
                   now ("requests_now" back to back by its rate, "tokens_now" of its
                   budget; None: no such limit) and "paused_for", the seconds left of a
                   backoff (back_off_quota; 0: none)
      running      the `running_limit` longest-running actions: [id, kind, quota, node,
                   elastic grant (0: not elastic), seconds running], longest first
      services     service instance -> [state, device]: "resident", "restoring",
                   "evicting", "offloaded" or "not loaded" (the GPU managers' view)
      utilisation  [node, resource, share held]
      last_minute  actions ended in the last 60 s: count, per second, ACT p50 and p99
    """
    now = run.now() if run is not None else 0.0
    quotas: dict[str, list[int]] = {q.name: [0, 0] for q in orch.inventory.quotas}
    running: list[list[Any]] = []
    for lv in live:
        quota = lv.call.quota
        if quota is not None and quota in quotas:
            quotas[quota][1 if lv.running else 0] += 1
        if lv.running and lv.record.start is not None:
            running.append([lv.id, lv.call.kind, quota or "", lv.record.node, lv.record.grant, now - lv.record.start])
    running.sort(key=lambda r: -r[5])
    acts = sorted(orch.records.recent_acts(now - 60.0))
    pick = lambda q: acts[min(len(acts) - 1, int(q * len(acts)))] if acts else None  # noqa: E731
    scheduler = orch.scheduler
    return {
        "time": now,
        "policy": orch.policy,
        "objective": scheduler.policy.objective if scheduler is not None else None,
        "queues": {k: list(v) for k, v in orch.queue_lengths_now().items()},
        "quotas": quotas,
        "quota_limits": {q.name: _quota_limits(orch, q, now) for q in orch.inventory.quotas},
        "running": running[:running_limit],
        "running_total": len(running),
        "services": run.devices.service_states() if run is not None else {},
        "utilisation": [[node, kind, share] for (node, kind), share in sorted(orch.utilisation_now().items())],
        "last_minute": {"ended": len(acts), "per_second": len(acts) / 60.0, "act_p50": pick(0.5),
                        "act_p99": pick(0.99)},
    }


def _quota_limits(orch: Orchestrator, quota: Quota, now: float) -> dict[str, Any]:
    snapshot = orch.scheduler.quota_snapshot(quota.name, now) if orch.scheduler is not None else {}
    return {"rate": quota.rate, "burst": quota.burst, "max_concurrency": quota.max_concurrency,
            "tokens_per_minute": quota.tokens_per_minute, "requests_now": snapshot.get("requests"),
            "tokens_now": snapshot.get("tokens"), "paused_for": orch.quota_backoffs.paused_for(quota.name, now)}
