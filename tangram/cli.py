"""The `tangram` command: `tangram demo`, `tangram sim`, `tangram bench`, `tangram serve`.

Every subcommand answers bad input the same way: one line on stderr, `tangram CMD: what is
wrong`, and exit status 2. Argument errors come from `ArgumentParser`; errors found later
(a workload file, a config file, an output path) are raised as typed errors
(`tangram.ValidationError` and kin) and turned into that line by the subcommand.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from ._errors import ValidationError
from .scheduler import POLICIES

DEMO_DESCRIPTION = (
    "Runs a small agentic RL rollout step on this machine once per policy (by default under a "
    "trajectory-bound baseline and under tangram), with real sandboxed programs, a rate-limited "
    "search API and a batched reward service, and prints each policy's action completion time "
    "(ACT = wait + run) and step duration.")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line on stderr (`PROG: message`, no usage
    block) and exit status 2; `--help` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    return _int_at_least(text, 0, "a non-negative integer")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def name_list(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    """argparse type (through a lambda binding `known`): a comma-separated list of distinct
    names out of `known`."""
    names = tuple(n.strip() for n in text.split(","))
    for n in names:
        if not n:
            raise argparse.ArgumentTypeError(f"empty entry in {text!r}; expected comma-separated names out of "
                                             f"{', '.join(known)}")
        if n not in known:
            raise argparse.ArgumentTypeError(f"unknown {what} {n!r} (one of {', '.join(known)})")
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise argparse.ArgumentTypeError(f"{what} {dup!r} given twice")
    return names


def writable_file(path: str, option: str) -> None:
    """Raises ValidationError(option, ...) unless `path` can be created or overwritten as a
    file. Checked before a long run so that its results are not lost to a typo; the file
    itself is written afterwards."""
    p = Path(path)
    if p.is_dir():
        raise ValidationError(option, f"{path!r} is a directory")
    parent = p.parent
    if not parent.is_dir():
        raise ValidationError(option, f"cannot write {path!r}: no directory {str(parent)!r}")
    target = p if p.exists() else parent
    if not os.access(target, os.W_OK):
        raise ValidationError(option, f"cannot write {path!r}: permission denied")


def writable_dir(path: str, option: str) -> Path:
    """Creates directory `path` (and its parents) now, before a long run writes into it;
    raises ValidationError(option, ...) when that is not possible or it is not writable."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValidationError(option, f"cannot create directory {path!r}: {e.strerror or e}") from None
    if not os.access(d, os.W_OK):
        raise ValidationError(option, f"cannot write into {path!r}: permission denied")
    return d


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


if __name__ == "__main__":
    sys.exit(main())
