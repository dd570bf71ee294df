"""Finds the compiled module `tangram._core`, wherever this package was imported from.

`tangram/` sits at the top of the repository, so a program started from the root of a
checkout (`python script.py`, `python -c ...`, a Ray worker inheriting such a driver's
`sys.path`) imports the source folder before the installed package, and the source folder
holds no compiled module after a plain `pip install .`. Rather than fail there, the
source folder borrows the compiled module of the installed copy when one exists and was
built for the same version; otherwise the import fails with one line saying what to do.

Editable installs (`pip install -e .`) need none of this: their import hook maps
`tangram._core` to the build. Subprocesses the project starts itself run with `-P` or
`-I`, so they never depend on the caller's working directory in the first place.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from types import ModuleType

_HOW_TO_FIX = "run `pip install .` (or `pip install -e .` to develop) in the folder above it"


def import_core(package_path: list[str], version: str) -> ModuleType:
    """Import `tangram._core`; `package_path` is the package's `__path__` (may be extended)."""
    try:
        return importlib.import_module("tangram._core")
    except ModuleNotFoundError as error:
        if error.name != "tangram._core":
            raise
    here = os.path.realpath(package_path[0])
    installed = _installed_copy(here)
    if installed is None:
        raise ImportError(f"tangram: {here} is a source folder without the compiled module tangram._core, "
                          f"and no installed build is on sys.path: {_HOW_TO_FIX}") from None
    package_path.append(installed)
    core = importlib.import_module("tangram._core")
    built_for = getattr(core, "__version__", None)
    if built_for != version:
        package_path.remove(installed)
        sys.modules.pop("tangram._core", None)
        raise ImportError(f"tangram: the source folder {here} is version {version}, but the installed compiled "
                          f"module in {installed} is {built_for}: {_HOW_TO_FIX}") from None
    return core


def _installed_copy(source: str) -> str | None:
    """The first other `tangram` folder on `sys.path` that holds a compiled `_core`."""
    names = [f"_core{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    for entry in sys.path:
        candidate = os.path.realpath(os.path.join(entry or os.getcwd(), "tangram"))
        if candidate != source and any(os.path.isfile(os.path.join(candidate, name)) for name in names):
            return candidate
    return None
