"""Every snippet of the README runs as written and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _block_with(language: str, marker: str) -> str:
    found = [b for b in _blocks(language) if marker in b]
    assert len(found) == 1, f"expected one {language} block with {marker!r}, found {len(found)}"
    return found[0]


def _exec(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    return out.getvalue()


def _run_python(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter (-P: the installed package, whatever the working directory).
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=timeout)


def test_the_readme_starts_with_the_two_commands() -> None:
    first = _blocks("bash")[0].splitlines()
    assert first[0].split("#")[0].strip() == "pip install . && tangram demo"
    assert first[1].split("#")[0].strip() == "pip install -e '.[test]' && pytest"


def test_core_example() -> None:
    printed = _exec(_block_with("python", "tangram.Scheduler(inv"))
    # The comments in the example describe these lines.
    assert "kind='restore'" in printed and "service='reward-7b'" in printed
    assert "action=1, node=2" in printed and "grant=8.0" in printed
    assert "waiting for service 'reward-7b' to finish restoring at 4.000000 s" in printed
    assert "kind='start', action=2, node=0, device=0, service='reward-7b'" in printed


def test_orchestrator_example() -> None:
    """The orchestrator on this machine, a real sandbox."""
    printed = _exec(_block_with("python", "tangram.Orchestrator() as orch"))
    cores = min(8, len(os.sched_getaffinity(0)))
    assert printed.splitlines() == [f"0 b'{cores}\\n'", "42", f"{float(cores)}"]


def test_server_example() -> None:
    """`tangram serve` started by the README's own command line, then its client example."""
    command = _block_with("bash", "tangram serve").split("#")[0].strip()
    assert command.endswith("&")
    argv = shlex.split(command.rstrip("& "))
    port = int(argv[argv.index("--port") + 1])
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"port {port} is taken on this machine")
    server = subprocess.Popen([sys.executable, "-P", "-m", "tangram", *argv[1:]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None, server.communicate()
            assert time.monotonic() < deadline, "tangram serve did not listen within 60 s"
            time.sleep(0.1)
        done = _run_python(_block_with("python", "tangram.Client("), timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["1024"]
    finally:
        server.terminate()
        server.communicate(timeout=60)
    assert server.returncode == 0


def test_ray_example() -> None:
    """The Ray example starts a local Ray instance of its own (a fresh interpreter)."""
    pytest.importorskip("ray")
    done = _run_python(_block_with("python", "RayOrchestrator() as orch"), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "b'42\\n'"
