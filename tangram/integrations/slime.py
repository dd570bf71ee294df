"""slime: a reward hook and a Sandbox whose commands are tangram actions.

Reward: `--custom-rm-path tangram.integrations.slime.custom_rm`. slime awaits
`custom_rm(args, sample)`; it runs the last fenced code block of `sample.response` once per
test case (`sample.label`, or `sample.metadata["tests"]`: {"inputs": [...], "outputs":
[...]}, or that as JSON), every case its own action and all of them one burst for the
core, and returns the share passed. Its language, timeout and memory limit come from
`sample.metadata` ("language", "timeout", "memory_limit_mb") when given.

Sandbox: `TangramSandbox` has the interface of slime's `slime.agent.sandbox.Sandbox`
protocol (structural: no slime import needed): `async with TangramSandbox() as sb:` gives
the episode a tangram trajectory (a sandbox directory that keeps its files), and

    await sb.exec(cmd, *, user="root", env=None, timeout=120, check=False, idempotent=True)
        -> (exit_code, stdout, stderr)     one command, one action
    await sb.write_file(path, content)     str, bytes or a local Path
    await sb.read_file(path) -> str        "" when it cannot be read, as slime's E2B one

`user` is accepted and ignored (a tangram sandbox runs as the server's user);
`check=True` raises RuntimeError on a non-zero exit; `idempotent=False` keeps the command
from being rerun elsewhere if its node is lost. Leaving the block ends the trajectory.
Both reach tangram through tangram.integrations.connect.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..runtime.call import Call
from . import common


async def custom_rm(args: Any, sample: Any, **kwargs: Any) -> float:
    """slime's custom reward hook (see the module docstring)."""
    metadata = getattr(sample, "metadata", None) or {}
    language = str(metadata.get("language", "python"))
    code = common.extract_code(getattr(sample, "response", "") or "", language)
    tests = metadata.get("tests", getattr(sample, "label", None))
    if code is None or tests is None:
        return 0.0
    score, _ = await common.score_tests(code, tests, language, timeout=float(metadata.get("timeout", 10.0)),
                                        memory_limit_mb=int(metadata.get("memory_limit_mb", 1024)))
    return score


def _write(path: str, content: bytes) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class TangramSandbox:
    """slime's Sandbox protocol on a tangram trajectory (see the module docstring)."""

    def __init__(self, orchestrator: Any = None) -> None:
        self._orchestrator = orchestrator
        self.trajectory = common.new_trajectory()
        self.sandbox_id = f"tangram-{self.trajectory}"

    async def _orch(self) -> Any:
        if self._orchestrator is None:
            self._orchestrator = await common.connect()
        return self._orchestrator

    async def __aenter__(self) -> "TangramSandbox":
        await self._orch()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await (await self._orch()).end_trajectory(self.trajectory)

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> tuple[int, str, str]:
        result = await (await self._orch()).run(Call(command=cmd, env=dict(env or {}), timeout=float(timeout),
                                                     trajectory=self.trajectory, idempotent=idempotent,
                                                     key="slime:exec"))
        out = result.stdout.decode("utf-8", errors="replace")
        err = result.stderr.decode("utf-8", errors="replace")
        if check and result.returncode != 0:
            raise RuntimeError(f"{cmd!r} exited with {result.returncode}: {err}")
        return result.returncode, out, err

    async def write_file(self, sandbox_path: str, content: str | bytes | Path, *, user: str = "root") -> None:
        if isinstance(content, Path):
            content = content.read_bytes()
        elif isinstance(content, str):
            content = content.encode("utf-8")
        await (await self._orch()).run(Call(fn=_write, args=(sandbox_path, content), trajectory=self.trajectory,
                                            key="slime:write_file"))

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        return await (await self._orch()).run(Call(fn=_read, args=(sandbox_path,),  # type: ignore[no-any-return]
                                                   trajectory=self.trajectory, key="slime:read_file"))
