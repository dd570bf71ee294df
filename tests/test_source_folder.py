"""Importing tangram from a source folder that has no compiled module (tangram/_compiled.py).

Each test builds a throwaway layout in tmp_path: `src/tangram` (the Python sources only, as
in a fresh clone) and, where needed, `installed/tangram` (the sources plus the compiled
module, as `pip install .` leaves them), and imports tangram in a fresh interpreter with
exactly those folders on its path (-S: no site hooks such as the editable install's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tangram

PACKAGE = Path(tangram.__file__).parent
CORE = Path(tangram._core.__file__)


def _copy_sources(root: Path, with_core: bool, version: str | None = None) -> Path:
    target = root / "tangram"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "_core.*.so", "_core*.pyd"))
    if with_core:
        shutil.copy2(CORE, target / CORE.name)
    if version is not None:
        init = target / "__init__.py"
        init.write_text(init.read_text().replace(f'__version__ = "{tangram.__version__}"', f'__version__ = "{version}"'))
    return target


def _import(path: list[Path], code: str = "import tangram", with_dependencies: bool = True
            ) -> subprocess.CompletedProcess[str]:
    # Dependencies (numpy...) come after the layout under test. Their folder may hold a
    # compiled tangram of its own (the editable install's), so a test of a source folder
    # alone leaves them out: the import fails before it needs any of them.
    deps = [p for p in sys.path if p.endswith("site-packages")] if with_dependencies else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), *deps])}
    return subprocess.run([sys.executable, "-S", "-P", "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_source_folder_borrows_the_installed_compiled_module(tmp_path: Path) -> None:
    # Invariant: with a plain install beside it, a source folder imports and schedules.
    _copy_sources(tmp_path / "src", with_core=False)
    installed = _copy_sources(tmp_path / "installed", with_core=True)
    done = _import([tmp_path / "src", tmp_path / "installed"],
                   "import tangram; print(tangram.__file__); print(tangram._core.__file__); "
                   "s = tangram.Scheduler(tangram.Inventory.uniform(1, {'cpu': 2}), 'fifo'); "
                   "print(len(list(s.submit([tangram.Action(1, {'cpu': 1}, 1.0)], now=0.0))))")
    assert done.returncode == 0, done.stderr
    package_file, core_file, decisions = done.stdout.split()
    assert Path(package_file).parent == (tmp_path / "src" / "tangram").resolve()
    assert Path(core_file).parent == installed.resolve()
    assert decisions == "1"  # the action started


def test_a_source_folder_alone_fails_with_one_line_saying_what_to_do(tmp_path: Path) -> None:
    source = _copy_sources(tmp_path / "src", with_core=False)
    done = _import([tmp_path / "src"], with_dependencies=False)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tangram: ")
    assert str(source.resolve()) in last and "pip install -e ." in last
    assert "circular import" not in done.stderr


def test_an_installed_build_of_another_version_is_not_borrowed(tmp_path: Path) -> None:
    _copy_sources(tmp_path / "src", with_core=False, version="99.0")
    _copy_sources(tmp_path / "installed", with_core=True)
    done = _import([tmp_path / "src", tmp_path / "installed"])
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "is version 99.0" in last and f"is {tangram.__version__}" in last
