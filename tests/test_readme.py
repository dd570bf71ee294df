"""The README's Python example runs as written (and says what it prints)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs() -> None:
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    printed = out.getvalue()
    # The comments in the example describe these lines.
    assert "kind='restore'" in printed and "service='reward-7b'" in printed
    assert "action=1, node=2" in printed and "grant=8.0" in printed
    assert "waiting for service 'reward-7b' to finish restoring at 4.000000 s" in printed
    assert "kind='start', action=2, node=0, device=0, service='reward-7b'" in printed


def test_readme_orchestrator_example_runs() -> None:
    """The second Python example: the orchestrator on this machine, a real sandbox."""
    import os

    text = README.read_text()
    first = text.index("```python\n")
    start = text.index("```python\n", first + 1) + len("```python\n")
    code = text[start:text.index("```", start)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    cores = min(8, len(os.sched_getaffinity(0)))
    assert out.getvalue().splitlines() == [f"0 b'{cores}\\n'", "42", f"{float(cores)}"]
