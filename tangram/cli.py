"""The `tangram` command: `tangram demo`, `tangram sim`, `tangram bench`, `tangram serve`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tangram", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="a small agentic rollout on this machine, under trajectory and tangram")
    demo.add_argument("--trajectories", type=int, default=None,
                      help="trajectories in the step (default: twice the cores, 4 to 32)")
    demo.add_argument("--policies", default="trajectory,tangram",
                      help="comma-separated policies, baseline first (default trajectory,tangram)")
    demo.add_argument("--virtual", action="store_true",
                      help="instead: the core alone deciding a 2,000-action burst in virtual time")
    sub.add_parser("sim", help="simulate RL steps under each policy (tangram sim --help)", add_help=False)
    sub.add_parser("bench", help="decision-latency benchmarks (tangram bench --help)", add_help=False)
    sub.add_parser("serve", help="one scheduler for many rollout processes, over TCP (tangram serve --help)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "bench":
        from . import bench

        return bench.main(rest)
    if args.command == "serve":
        from .server import server

        return server.cli_main(rest)
    if args.command == "sim":
        from . import sim

        return sim.cli_main(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    if args.command in (None, "demo"):
        if getattr(args, "virtual", False):
            from .demo import virtual

            return virtual.main(2000, ("tangram", "fifo", "trajectory"))
        from . import demo as demo_module

        trajectories = getattr(args, "trajectories", None)
        if trajectories is not None and trajectories < 1:
            parser.error("--trajectories must be positive")
        policies = tuple(getattr(args, "policies", "trajectory,tangram").split(","))
        return demo_module.main(trajectories, policies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
