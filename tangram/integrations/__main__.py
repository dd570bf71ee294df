"""`python -m tangram.integrations path verl|slime|skyrl`: the installed adapter's file, for
configuration keys that take a path (veRL's `custom_reward_function.path`)."""

from __future__ import annotations

import argparse
import importlib
import sys

FRAMEWORKS = ("verl", "slime", "skyrl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tangram.integrations",
                                     description="Where the installed framework adapters are.")
    sub = parser.add_subparsers(dest="command", required=True)
    path = sub.add_parser("path", help="print the file of a framework's adapter module")
    path.add_argument("framework", choices=FRAMEWORKS)
    args = parser.parse_args(argv)
    module = importlib.import_module(f"tangram.integrations.{args.framework}")
    print(module.__file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
