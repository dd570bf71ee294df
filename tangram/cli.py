"""The `tangram` command: `tangram demo`, `tangram sim`, `tangram bench`, `tangram serve`,
`tangram estimates`.

Every subcommand answers bad input the same way: one line on stderr, `tangram CMD: what is
wrong`, and exit status 2. Argument errors come from `ArgumentParser`; errors found later
(a workload file, a config file, an output path) are raised as typed errors
(`tangram.ValidationError` and kin) and turned into that line by the subcommand.
"""

from __future__ import annotations

import sys

from ._arguments import ArgumentParser, name_list, positive_int
from .scheduler import POLICIES

DEMO_DESCRIPTION = (
    "Runs a small agentic RL rollout step on this machine once per policy (by default under a "
    "trajectory-bound baseline and under tangram), with real sandboxed programs, a rate-limited "
    "search API and a batched reward service, and prints each policy's action completion time "
    "(ACT = wait + run) and step duration.")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str] | None) -> int:
    parser = ArgumentParser(prog="tangram", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="a small agentic rollout on this machine, under trajectory and tangram",
                          description=DEMO_DESCRIPTION)
    demo.add_argument("--trajectories", type=positive_int, default=None,
                      help="trajectories in the step (default: twice the cores, 4 to 32)")
    demo.add_argument("--policies", default=("trajectory", "tangram"),
                      type=lambda s: name_list(s, POLICIES, "policy"),
                      help=f"comma-separated, distinct, of {', '.join(POLICIES)}: one run each, in this order; "
                           "with two or more, the last is compared with the first (the baseline) "
                           "(default trajectory,tangram)")
    demo.add_argument("--verbose", action="store_true",
                      help="also print this machine's isolation details (cgroup directories)")
    demo.add_argument("--virtual", action="store_true",
                      help="instead: the core alone deciding a 2,000-action burst in virtual time")
    sub.add_parser("sim", help="simulate RL steps under each policy (tangram sim --help)", add_help=False)
    sub.add_parser("bench", help="decision-latency benchmarks (tangram bench --help)", add_help=False)
    sub.add_parser("serve", help="one scheduler for many rollout processes, over TCP (tangram serve --help)",
                   add_help=False)
    sub.add_parser("estimates", help="show, import and export learned run times (tangram estimates --help)",
                   add_help=False)
    sub.add_parser("top", help="a live view of a running tangram serve (tangram top --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "bench":
        from . import bench

        return bench.main(rest)
    if args.command == "serve":
        from .server import command

        return command.cli_main(rest, ray_orchestrator=_ray_orchestrator)
    if args.command == "top":
        from . import top

        return top.cli_main(rest)
    if args.command == "estimates":
        from . import estimates

        return estimates.cli_main(rest)
    if args.command == "sim":
        from . import sim

        return sim.cli_main(rest)
    if rest:
        (demo if args.command == "demo" else parser).error(f"unrecognised arguments: {' '.join(rest)}")
    if args.command in (None, "demo"):
        if getattr(args, "virtual", False):
            from .demo import virtual

            return virtual.main(2000, ("tangram", "fifo", "trajectory"))
        from . import demo as demo_module

        return demo_module.main(getattr(args, "trajectories", None),
                                getattr(args, "policies", ("trajectory", "tangram")),
                                verbose=getattr(args, "verbose", False))
    return 0



def _ray_orchestrator(address: str, config: object, policy: str | None, serves: str) -> object:
    """`tangram serve --ray`: imported only then (the Ray backend is a layer above the server's)."""
    from .ray import connect_orchestrator

    return connect_orchestrator(address, config, policy, serves)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
