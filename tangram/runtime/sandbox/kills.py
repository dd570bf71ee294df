"""Finding and killing a sandbox's processes: a worker's descendants, and every process
that carries a sandbox's marker in its environment (MARKER), wherever it went."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from .isolation import alive as _alive
from .isolation import descendants

# The environment variable every process of a sandbox carries: its sandbox's directory.
MARKER = "TANGRAM_SANDBOX"


def kill_descendants(pid: int, rounds: int = 20) -> None:
    """SIGKILL every descendant of `pid` (not `pid` itself), until none is left."""
    _kill_until_none(lambda: [c for c in descendants(pid) if _alive(c)], rounds)


def _kill_until_none(find: Callable[[], list[int]], rounds: int) -> None:
    """SIGKILL what `find()` lists, again until it lists nothing (a process may fork as
    its siblings die), at most `rounds` times."""
    for _ in range(rounds):
        pids = find()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def marked_processes(prefix: str, exact: bool = False) -> list[int]:
    """Live processes whose environment has TANGRAM_SANDBOX starting with `prefix`: the
    sandboxes' processes, including any that escaped their session and were orphaned
    when a worker died. A /proc scan: for close() and tests, not for the hot path."""
    needle = f"{MARKER}={prefix}".encode()
    out: list[int] = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        entries = env.split(b"\0")
        if (needle in entries if exact else any(e.startswith(needle) for e in entries)) and _alive(int(name)):
            out.append(int(name))
    return out


def kill_marked(prefix: str, exact: bool = False, rounds: int = 20) -> None:
    """SIGKILL the processes `marked_processes` finds, until none is left."""
    _kill_until_none(lambda: marked_processes(prefix, exact), rounds)
