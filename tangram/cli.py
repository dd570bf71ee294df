"""The `tangram` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("tangram: placeholder", file=sys.stderr)
    return 0
