"""`tangram top [ADDRESS]`: a live view of a running `tangram serve`, refreshed about once a
second: queues by kind and by quota, the longest-running actions with their grants, GPU
services with their state, each node's utilisation, and the actions ended in the last
minute (per second, ACT p50 and p99). `--once` prints one frame and exits (for scripts and
logs). The address as `tangram.Client` takes it (default $TANGRAM_ADDRESS, then
127.0.0.1:7450); the token from --token or $TANGRAM_TOKEN. Drawn with rich.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ._errors import TangramError


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _limits(limits: dict[str, Any] | None) -> str:
    """A quota's limits in a few words: rate and burst, concurrency, tokens, a backoff."""
    if not limits:
        return ""
    parts = []
    if limits["rate"]:
        now = limits.get("requests_now")
        parts.append(f"{limits['rate']:g}/s burst {limits['burst']}" + (f" ({now} now)" if now is not None else ""))
    if limits["max_concurrency"]:
        parts.append(f"{limits['max_concurrency']} at once")
    if limits["tokens_per_minute"]:
        now = limits.get("tokens_now")
        parts.append(f"{limits['tokens_per_minute']} tokens/min" + (f" ({now} left)" if now is not None else ""))
    if limits["paused_for"] > 0:
        parts.append(f"paused {limits['paused_for']:.1f} s (429)")
    return ", ".join(parts) or "no limit"


def render(status: dict[str, Any], address: str) -> Any:
    """One frame: a rich renderable of a status snapshot (Orchestrator.status_now; tangram.runtime.status documents it)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    minute = status["last_minute"]
    head = Text.assemble(
        ("tangram ", "bold"), f"{address}  policy {status['policy']}",
        f" ({status['objective']})" if status.get("objective") else "",
        f"  up {status['time']:.0f} s  |  last minute: {minute['ended']} ended, {minute['per_second']:.1f}/s, "
        f"ACT p50 {_seconds(minute['act_p50'])}, p99 {_seconds(minute['act_p99'])}")

    queues = Table(title="queues", title_justify="left", expand=False)
    for column in ("kind", "waiting", "running", "limits"):
        queues.add_column(column, justify="right" if column in ("waiting", "running") else "left")
    for kind, (waiting, running) in sorted(status["queues"].items()):
        queues.add_row(kind, str(waiting), str(running), "")
    limits = status.get("quota_limits", {})
    for quota, (waiting, running) in sorted(status["quotas"].items()):
        queues.add_row(f"quota {quota}", str(waiting), str(running), _limits(limits.get(quota)))

    running = Table(title=f"running ({status['running_total']}; longest first)", title_justify="left")
    for column in ("id", "kind", "quota", "node", "grant", "for"):
        running.add_column(column, justify="right" if column in ("id", "grant", "for") else "left")
    for aid, kind, quota, node, grant, elapsed in status["running"]:
        running.add_row(str(aid), kind, quota, str(node), f"{grant:g}" if grant else "-", _seconds(elapsed))

    parts: list[Any] = [head, queues, running]
    if status["services"]:
        services = Table(title="GPU services", title_justify="left")
        for column in ("service", "state", "device"):
            services.add_column(column)
        for name, (state, device) in sorted(status["services"].items()):
            services.add_row(name, state, "-" if device is None else str(device))
        parts.append(services)
    util = Table(title="utilisation", title_justify="left")
    for column in ("node", "resource", "held"):
        util.add_column(column, justify="right" if column == "held" else "left")
    for node, kind, share in status["utilisation"]:
        util.add_row(node, kind, f"{share:.0%}")
    parts.append(util)
    return Group(*parts)


async def _run(address: str | None, token: str | None, interval: float, once: bool) -> int:
    from rich.console import Console
    from rich.live import Live

    from .server.client import Client
    from .server.protocol import format_address

    console = Console()
    async with Client(address, token=token, records=False) as client:
        where = format_address(client.host, client.port)
        if once:
            console.print(render(await client.status(), where))
            return 0
        with Live(render(await client.status(), where), console=console, auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(render(await client.status(), where), refresh=True)


def cli_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tangram top", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default=None,
                        help="the server's host:port (default $TANGRAM_ADDRESS, then 127.0.0.1:7450)")
    parser.add_argument("--token", default=None, help="the server's token (default $TANGRAM_TOKEN)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.error("--interval must be positive")
    try:
        return asyncio.run(_run(args.address, args.token, args.interval, args.once))
    except TangramError as e:
        print(f"tangram top: {e}", flush=True)
        return 2
    except KeyboardInterrupt:
        return 0
