"""Names a package exports from its modules, each imported on first use (PEP 562)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_names(package: str, table: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], object]:
    """The package's module `__getattr__`: `table` maps a name to its module (relative to
    `package`); the first use imports it and keeps it in `namespace`, the package's globals."""

    def getattr_(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return getattr_
