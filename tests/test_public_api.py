"""One public API: every name `tangram.__all__` lists resolves, and every tangram name the
user documentation (README.md, docs/*.md) uses is importable from `tangram`, or from the
submodule the documentation names for it."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tangram

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `tangram.<word>` in the docs that is not Python: a file name and an entry-point group.
NOT_PYTHON = {"tangram.toml", "tangram.managers"}

# Names the docs mention bare (in backticks) that are API of a submodule, documented there
# rather than at the top level: where each lives.
SUBMODULE_API = {
    "RayOrchestrator": "tangram.ray",
    "RayManager": "tangram.ray",
    "NodeLost": "tangram.ray",
    "NodeAgent": "tangram.ray.agent",
    "ImageError": "tangram.runtime.sandbox.images",
    "ScrubError": "tangram.runtime.sandbox.inside_run_code",
    "CpuManager": "tangram.runtime.managers.cpu",
    "GpuManager": "tangram.runtime.managers.gpu",
    "InferenceServer": "tangram.runtime.managers.inference",
    "InferenceServerError": "tangram.runtime.managers.inference",
    "VllmServer": "tangram.runtime.managers.inference",
    "SglangServer": "tangram.runtime.managers.inference",
    "ApiManager": "tangram.runtime.managers.api",
    "GrantedExecutor": "tangram.worker",
    "TaskCrashed": "tangram.worker",
    "Server": "tangram.server",
    "PolicyRules": "tangram.bench.reference",
    "ReferenceScheduler": "tangram.bench.reference",
    "TangramCodeTool": "tangram.integrations.verl",
    "TangramSandbox": "tangram.integrations.slime",
    "TangramCodeEnv": "tangram.integrations.skyrl",
}

# Bare names in the docs that are not tangram's: where they come from.
NOT_TANGRAM = {
    "ActionSpec": "the C++ core's action struct (csrc/tangram/model.h)",
    "PolicyKind": "the C++ core's built-in policies (csrc/tangram/policy.h)",
    "BufferedProtocol": "asyncio",
    "CancelledError": "asyncio",
    "ProcessPoolExecutor": "concurrent.futures",
    "OrderedDict": "collections", "Counter": "collections", "deque": "collections",
    "Decimal": "decimal", "Fraction": "fractions", "timedelta": "datetime", "date": "datetime",
    "time": "datetime", "datetime": "datetime",
    "Protocol": "typing",
    "RayActorError": "ray.exceptions",
    "ActorUnavailableError": "ray.exceptions",
    "BaseTool": "veRL's tool interface (verl.tools.base_tool)",
    "ToolResponse": "veRL's tool answer (verl.tools.schemas)",
    "Sandbox": "slime's sandbox protocol (slime.agent.sandbox)",
    "Sample": "slime's rollout sample (slime.utils.types)",
    "BaseTextEnv": "skyrl-gym's environment class (skyrl_gym.envs.base_text_env)",
    # Sandbox Fusion's status values (tangram.runtime.sandbox.run_code)
    "Success": "Sandbox Fusion", "Failed": "Sandbox Fusion", "SandboxError": "Sandbox Fusion",
    "Finished": "Sandbox Fusion", "TimeLimitExceeded": "Sandbox Fusion", "Error": "Sandbox Fusion",
}


def _text() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _resolve(dotted: str) -> object:
    """`tangram.a.b.C.d`: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        if _is_module(module_name):
            value: object = importlib.import_module(module_name)
            for attr in parts[cut:]:
                value = getattr(value, attr)
            return value
    raise AssertionError(f"{dotted}: no importable module prefix")


# Invariant: __all__ is the public API, each name in it resolves (including the ones
# imported on first use), and a star import gives exactly those names.
def test_every_name_in_all_resolves() -> None:
    assert len(tangram.__all__) == len(set(tangram.__all__))
    missing = [name for name in tangram.__all__ if getattr(tangram, name, None) is None]
    assert not missing, f"tangram.__all__ lists names that do not resolve: {missing}"
    namespace: dict[str, object] = {}
    exec("from tangram import *", namespace)
    assert set(tangram.__all__) <= set(namespace)


# Invariant: `import tangram` stays light: the server's client (and cloudpickle, which
# it needs) load on first use of a server name, not with the package.
def test_import_tangram_does_not_load_the_server_client() -> None:
    code = ("import sys, tangram; assert 'cloudpickle' not in sys.modules, 'cloudpickle'; "
            "assert 'tangram.server.client' not in sys.modules, 'client'; "
            "assert tangram.Client.__module__ == 'tangram.server.client'")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# Invariant: every `tangram.<Name>` the docs write is in tangram.__all__ (with any
# attribute after it resolving); a path into a submodule (`tangram.ray.RayOrchestrator`)
# resolves there.
def test_names_the_docs_write_as_tangram_dot_name_are_public() -> None:
    references = sorted(set(re.findall(r"\btangram(?:\.[A-Za-z_][A-Za-z0-9_]*)+", _text())))
    assert "tangram.Orchestrator" in references  # the parse finds what it should
    for dotted in references:
        dotted = dotted.rstrip(".")
        if dotted in NOT_PYTHON:
            continue
        head = dotted.split(".")[1]
        if not _is_module(f"tangram.{head}"):
            assert head in tangram.__all__, f"the docs use {dotted}, but {head} is not in tangram.__all__"
        _resolve(dotted)


# Invariant: every name the docs' snippets import from tangram is public.
def test_names_the_docs_import_from_tangram_are_public() -> None:
    imported = set()
    for names in re.findall(r"^\s*from tangram import \(?([^)\n]*)", _text(), flags=re.M):
        imported |= {n.strip().split(" as ")[0] for n in names.split(",") if n.strip()}
    assert imported, "the parse found no `from tangram import`"
    assert not imported - set(tangram.__all__), f"imported in the docs, not public: {imported - set(tangram.__all__)}"


# Invariant: a class-like name the docs mention bare (`ConnectionLost`, `ServiceHooks`) is
# importable from tangram, unless the docs place it in a submodule (SUBMODULE_API, checked
# to resolve there) or it is not tangram's (NOT_TANGRAM: builtins, asyncio, ray, C++).
def test_names_the_docs_mention_bare_are_public() -> None:
    mentioned = set(re.findall(r"`([A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*)`", _text()))
    assert "ConnectionLost" in mentioned  # the parse finds what it should
    import builtins

    for name in sorted(mentioned):
        if name in tangram.__all__ or name in NOT_TANGRAM or hasattr(builtins, name):
            continue
        assert name in SUBMODULE_API, (f"the docs mention `{name}`: export it from tangram (tangram/__init__.py and "
                                       f"__all__), or list it in SUBMODULE_API / NOT_TANGRAM here")
        _resolve(f"{SUBMODULE_API[name]}.{name}")


# Invariant: the submodule API listed above still resolves where the docs say it lives,
# whether or not the current docs mention it.
@pytest.mark.parametrize("name", sorted(SUBMODULE_API))
def test_submodule_api_resolves(name: str) -> None:
    _resolve(f"{SUBMODULE_API[name]}.{name}")
