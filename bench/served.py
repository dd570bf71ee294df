"""Servers a benchmark script starts as processes of their own: started, their address
read from what they print once ready, and stopped as an operator would (SIGTERM, then
SIGKILL past a grace)."""

from __future__ import annotations

import re
import select
import signal
import subprocess
import tempfile


def start(argv: list[str], pattern: str, timeout: float = 60.0, lines: int = 3) -> tuple[subprocess.Popen[str], str]:
    """Runs `argv` and returns it with the first group of `pattern` in one of the first
    `lines` lines it prints (read once it has printed: the lines after the first may
    already sit in the pipe's buffer, where select does not see them). A server that
    prints no match within `timeout` seconds is killed: RuntimeError with what it said."""
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server never blocks on it
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    said = []
    for _ in range(lines if ready else 0):
        said.append(proc.stdout.readline())
        match = re.search(pattern, said[-1])
        if match:
            return proc, match.group(1)
    proc.kill()
    proc.wait()
    errors.seek(0)
    raise RuntimeError(f"{' '.join(argv)} did not start: {''.join(said)!r} {errors.read()[-2000:]}")


def stop(proc: subprocess.Popen[str], grace: float = 30.0) -> None:
    """SIGTERM, and SIGKILL if it has not ended `grace` seconds later; its pipes drained."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
