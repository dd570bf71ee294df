"""The `tangram` command: `tangram demo`, `tangram sim`, `tangram bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tangram", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="the core deciding a burst on this machine's inventory")
    demo.add_argument("--actions", type=int, default=2000, help="actions in the burst (default 2000)")
    demo.add_argument("--policies", default="tangram,fifo,trajectory",
                      help="comma-separated policies (default tangram,fifo,trajectory)")
    sub.add_parser("sim", help="simulate RL steps under each policy (tangram sim --help)", add_help=False)
    sub.add_parser("bench", help="decision-latency benchmarks (tangram bench --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "bench":
        from . import bench

        return bench.main(rest)
    if args.command == "sim":
        from . import sim

        return sim.cli_main(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    if args.command in (None, "demo"):
        from . import demo as demo_module

        count = getattr(args, "actions", 2000)
        policies = tuple(getattr(args, "policies", "tangram,fifo,trajectory").split(","))
        if count < 1:
            parser.error("--actions must be positive")
        return demo_module.main(count, policies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
