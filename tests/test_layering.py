"""tangram's Python layers point one way: a module imports only from its own layer or the
layers below it, and a private (underscore) name stays in the module that defines it.

The layers, lowest first:

  base       tangram._compiled, tangram._core (the compiled core), tangram._errors,
             tangram._records, tangram._arguments (the command lines' argument types),
             tangram._lazy (a package's names imported on first use), and what runs inside
             a sandbox: tangram.worker (the API sandboxed code imports) and the
             tangram.runtime.sandbox.inside_* modules
  devices    tangram.devices: GPU discovery (NVML, or the TANGRAM_FAKE_GPUS inventory)
  model      tangram._model: inventory, elasticity models, actions
  scheduler  tangram.scheduler
  estimates  tangram.estimates: run times learned for calls that declare none (the runtime
             plans with it, the simulator learns with it)
  face       the package itself (tangram/__init__.py): it imports base..scheduler; the
             names it exports from higher layers are imported on first use (its
             `_LAZY` table, mirrored by an `if TYPE_CHECKING:` block for type checkers,
             the one place where a module may name a higher layer)
  runtime    tangram.runtime.*: the orchestrator, its resource managers (runtime.managers)
             and the sandboxes CPU actions run in (runtime.sandbox)
  server     tangram.server.*: `tangram serve` and its client
  integrations  tangram.integrations.*: the RL frameworks' adapters (they use the client)
  ray        tangram.ray.*: the Ray backend
  sim        tangram.sim.*: the virtual-time simulator
  demo       tangram.demo.*: `tangram demo`
  tools      tangram.cli, tangram.top, tangram.__main__: the `tangram` command; tangram.bench.*:
             `tangram bench`, with the test oracle (bench.reference) and the NumPy scan it is
             measured against

Every import counts, at module level and inside functions, relative ones resolved;
`from tangram import Name` counts as an import of the module `Name` lives in (the
package's table of names it imports on first use). A private name is one that starts with
an underscore and is not a dunder: `from module import _name` is refused, and so is
`anything._name` in a module that never defines `_name` itself (a module reaching into
another's internals, an instance's or a base class's). That check goes by name, not by
type: a module that defines `_name` itself may still read another object's `_name`
unnoticed. Importing a private *module* (tangram._model) for its public names is how the
package is built, and is allowed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import tangram

PACKAGE = Path(tangram.__file__).resolve().parent

# Lowest first. A name ending in "." covers a package and every module under it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("tangram._compiled", "tangram._core", "tangram._errors", "tangram._records", "tangram._arguments",
              "tangram._lazy", "tangram.worker", "tangram.runtime.sandbox.inside_worker",
              "tangram.runtime.sandbox.inside_run_code")),
    ("devices", ("tangram.devices",)),
    ("model", ("tangram._model",)),
    ("scheduler", ("tangram.scheduler",)),
    ("estimates", ("tangram.estimates",)),
    ("face", ("tangram",)),
    ("runtime", ("tangram.runtime.",)),
    ("server", ("tangram.server.",)),
    ("integrations", ("tangram.integrations.",)),
    ("ray", ("tangram.ray.",)),
    ("sim", ("tangram.sim.",)),
    ("demo", ("tangram.demo.",)),
    ("tools", ("tangram.cli", "tangram.bench.", "tangram.top", "tangram.__main__")),
]
FACE = next(i for i, (name, _) in enumerate(LAYERS) if name == "face")

# (module, attribute): private attributes a module may read from another module's
# objects, each with its reason. An entry that matches nothing any more fails the test.
PRIVATE_ACCESS_ALLOWED: set[tuple[str, str]] = set()

# Modules `import tangram` may not load: everything above the face, and the third-party
# modules only those layers need.
HEAVY_THIRD_PARTY = ("cloudpickle", "ray", "prometheus_client", "matplotlib", "asyncio", "concurrent.futures")


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".") and (module == member[:-1] or module.startswith(member))):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__} (and to docs/development.md)")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES = {*SOURCES, "tangram._core"}  # the compiled core has no source here


def lazy_table() -> dict[str, str]:
    """tangram/__init__.py's names imported on first use: name -> the module holding it."""
    tree = ast.parse(SOURCES["tangram"].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return {name: f"tangram.{module}" for name, module in ast.literal_eval(node.value).items()}
    raise AssertionError("tangram/__init__.py has no _LAZY table")


LAZY = lazy_table()


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the tangram module imported (for `from tangram import X`: where X lives)
    name: str | None  # the name taken from it, for `from ... import name`

    def __str__(self) -> str:
        what = f"from {self.target} import {self.name}" if self.name else f"import {self.target}"
        return f"{SOURCES[self.module].relative_to(PACKAGE.parent)}:{self.line}: {what}"


def is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks (never executed)."""
    return {id(inner) for node in ast.walk(tree) if is_type_checking(node)
            for stmt in node.body for inner in ast.walk(stmt)}  # type: ignore[attr-defined]


def imports_of(module: str, tree: ast.Module, type_only: bool = False) -> list[Import]:
    """The module's imports of tangram modules. The face's `if TYPE_CHECKING:` block is
    left out (or, with `type_only`, is all that is kept): it mirrors the lazy table."""
    package = module if SOURCES[module].name == "__init__.py" else module.rpartition(".")[0]
    typing_only = type_checking_nodes(tree) if module == "tangram" else set()
    found = []
    for node in ast.walk(tree):
        if (id(node) in typing_only) != type_only:
            continue
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "tangram"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != "tangram":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append(Import(module, node.lineno, submodule, None))
                elif source == "tangram" and alias.name in LAZY:
                    found.append(Import(module, node.lineno, LAZY[alias.name], alias.name))
                else:
                    found.append(Import(module, node.lineno, source, alias.name))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(tree: ast.Module) -> set[str]:
    """Private names the module defines: functions, classes, assignments (to a name or
    to an attribute: `self._x = ...`) and __slots__ entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            if isinstance(node.value, (ast.Tuple, ast.List)):
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return {n for n in names if is_private(n)}


def outside_modules(tree: ast.Module) -> set[str]:
    """Local names bound to modules that are not tangram's (`import os`): their private
    attributes (os._exit) are theirs to document."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "tangram":
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def private_accesses(module: str, tree: ast.Module) -> list[tuple[int, str]]:
    own = own_private_names(tree)
    outside = outside_modules(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
            if isinstance(node.value, ast.Name) and node.value.id in outside:
                continue
            found.append((node.lineno, node.attr))
    return found


def parsed() -> dict[str, ast.Module]:
    return {module: ast.parse(path.read_text(), str(path)) for module, path in SOURCES.items()}


def layering_violations(trees: dict[str, ast.Module]) -> list[str]:
    out = []
    for module, tree in trees.items():
        mine = layer_of(module)
        for imp in imports_of(module, tree):
            theirs = layer_of(imp.target)
            if theirs > mine:
                out.append(f"{imp}  ({LAYERS[mine][0]} imports {LAYERS[theirs][0]}, a higher layer)")
    return out


def private_name_violations(trees: dict[str, ast.Module]) -> tuple[list[str], set[tuple[str, str]]]:
    out, allowed_seen = [], set()
    for module, tree in trees.items():
        where = SOURCES[module].relative_to(PACKAGE.parent)
        for imp in imports_of(module, tree):
            if imp.name is not None and is_private(imp.name):
                out.append(f"{imp}  (a private name of another module)")
        for line, attr in private_accesses(module, tree):
            if (module, attr) in PRIVATE_ACCESS_ALLOWED:
                allowed_seen.add((module, attr))
            else:
                out.append(f"{where}:{line}: .{attr}  (private to the module that defines it)")
    return out, allowed_seen


# Invariant: every module of the package is in exactly one layer, the face is its own
# layer, and every lazily exported name points at a module that exists above it.
def test_every_module_has_a_layer() -> None:
    assert "tangram.runtime.orchestrator" in SOURCES and "tangram.cli" in SOURCES  # the walk finds what it should
    for module in MODULES:
        layer_of(module)
    assert layer_of("tangram") == FACE
    for name, module in LAZY.items():
        assert module in MODULES, f"tangram.{name} is imported on first use from {module}, which does not exist"


# Invariant: what type checkers see of the face's lazy names is what it imports on first
# use: the same names, from the same modules.
def test_the_face_types_its_lazy_names_as_it_imports_them() -> None:
    typed = {imp.name: imp.target for imp in imports_of("tangram", parsed()["tangram"], type_only=True)}
    assert typed == LAZY


# Invariant: no module imports from a layer above its own.
def test_imports_point_down() -> None:
    violations = layering_violations(parsed())
    assert not violations, "imports from a higher layer:\n" + "\n".join(violations)


# Invariant: no module takes another module's private names.
def test_private_names_stay_in_their_module() -> None:
    violations, allowed_seen = private_name_violations(parsed())
    assert not violations, "private names used outside their module:\n" + "\n".join(violations)
    stale = PRIVATE_ACCESS_ALLOWED - allowed_seen
    assert not stale, f"PRIVATE_ACCESS_ALLOWED lists accesses that are gone; remove them: {sorted(stale)}"


# The checks above must be able to fail: each kind of bad import, planted into a copy of
# a real module's tree, is reported with the module, line and name.
@pytest.mark.parametrize("module, planted, expected", [
    ("tangram._model", "from .runtime.managers.gpu import discover", "model imports runtime"),
    ("tangram._model", "def f():\n    from tangram.server import client", "model imports server"),
    ("tangram.scheduler", "import tangram.sim.engine", "scheduler imports sim"),
    ("tangram", "from .runtime import Orchestrator", "face imports runtime"),
    ("tangram.runtime.orchestrator", "from tangram import Client", "runtime imports server"),
    ("tangram.server.client", "from ..cli import ArgumentParser", "server imports tools"),
])
def test_an_upward_import_is_reported(module: str, planted: str, expected: str) -> None:
    trees = parsed()
    trees[module].body.extend(ast.parse(planted).body)
    violations = layering_violations(trees)
    assert any(expected in v and SOURCES[module].name in v for v in violations), violations


@pytest.mark.parametrize("module, planted, expected", [
    ("tangram.runtime.encode", "from ..scheduler import _ids", "from tangram.scheduler import _ids"),
    ("tangram.server.client", "from tangram.runtime import orchestrator\norchestrator._Live", "._Live"),
    ("tangram.ray.manager", "def f(orch):\n    return orch._pending_submit", "._pending_submit"),
])
def test_a_private_name_from_another_module_is_reported(module: str, planted: str, expected: str) -> None:
    trees = parsed()
    trees[module].body.extend(ast.parse(planted).body)
    violations, _ = private_name_violations(trees)
    assert any(expected in v for v in violations), violations


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)


# Invariant: `import tangram` loads the compiled core and the errors, nothing else of the
# package and none of its third-party dependencies (not even NumPy); every other name loads
# its layer on first use (a sandbox's `tangram.worker` stays light).
def test_import_tangram_loads_only_the_core() -> None:
    done = _fresh("import sys, tangram; print('\\n'.join(sys.modules))")
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"tangram._core", "tangram._errors"} <= loaded  # the probe sees what it should
    assert not loaded & {"numpy", "tangram.scheduler", "tangram._model"}, sorted(loaded)
    used = _fresh("import sys, tangram; tangram.Scheduler; print('\\n'.join(sys.modules))")
    assert used.returncode == 0, used.stderr
    loaded = set(used.stdout.split())
    assert {"tangram.scheduler", "tangram._model", "numpy"} <= loaded  # on first use
    higher = sorted(m for m in loaded if m.split(".")[0] == "tangram" and layer_of(m) > FACE)
    assert not higher, f"`tangram.Scheduler` loads modules above the face: {higher}"
    third_party = sorted(loaded & set(HEAVY_THIRD_PARTY))
    assert not third_party, f"`tangram.Scheduler` loads {third_party}"


# Invariant: every name of tangram.__all__ resolves in a fresh interpreter, each to an
# object of the module the lazy table names.
def test_every_public_name_resolves_from_a_fresh_import() -> None:
    code = ("import tangram\n"
            "for name in tangram.__all__:\n"
            "    getattr(tangram, name)\n"
            "print(len(tangram.__all__))")
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(tangram.__all__)
    for name, module in LAZY.items():
        assert name in tangram.__all__, f"tangram.{name} is imported on first use but not in __all__"
        assert getattr(tangram, name) is getattr(__import__(module, fromlist=[name]), name)


# Invariant: what runs inside a sandbox (its worker's main, a Sandbox Fusion run, and
# tangram.worker, which sandboxed code imports) loads neither the orchestrator nor the
# compiled core's Python side: a sandbox starts fast, and a generated file in its working
# directory cannot shadow what those modules would import.
def test_sandbox_code_loads_no_runtime() -> None:
    done = _fresh("import sys, tangram.worker, tangram.runtime.sandbox.inside_worker, "
                  "tangram.runtime.sandbox.inside_run_code; print('\\n'.join(sys.modules))")
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "tangram.runtime.sandbox.inside_run_code" in loaded  # the probe sees what it should
    heavy = sorted(loaded & {"asyncio", "numpy", "tangram.scheduler", "tangram.runtime.orchestrator",
                             "tangram.runtime.managers.cpu"})
    assert not heavy, f"code that runs inside a sandbox loads {heavy}"


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def import_graph() -> dict[str, set[str]]:
    """Module -> the tangram modules it imports when it runs (`if TYPE_CHECKING:` left out)."""
    graph = {}
    for module, path in SOURCES.items():
        tree = ast.parse(path.read_text())
        typing_only = type_checking_nodes(tree)
        typing_lines = {node.lineno for node in ast.walk(tree) if id(node) in typing_only and hasattr(node, "lineno")}
        graph[module] = {i.target for i in imports_of(module, tree)
                         if i.target != module and i.target in SOURCES and i.line not in typing_lines}
    return graph


# Invariant: no two modules import each other, directly or through others (a loop makes
# the import order matter and hides which one is the lower layer).
def test_no_import_cycles() -> None:
    assert import_cycles(import_graph()) == []


def test_an_import_cycle_is_reported() -> None:
    graph = import_graph()
    graph["tangram.scheduler"] = graph["tangram.scheduler"] | {"tangram._model"}
    graph["tangram._model"] = graph["tangram._model"] | {"tangram.scheduler"}  # planted
    assert ["tangram._model", "tangram.scheduler"] in import_cycles(graph)
