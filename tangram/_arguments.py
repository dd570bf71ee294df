"""Argument types shared by the command lines (`tangram`, `tangram sim`, `tangram bench`,
`tangram serve`): a usage error is one line on stderr, `PROG: message`, and exit status 2.

It sits in the lowest layer, beside the typed errors, so that every subcommand's module can
use it without importing the `tangram` command itself.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Iterable, NoReturn, Sequence

from ._errors import ValidationError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line on stderr (`PROG: message`, no usage
    block) and exit status 2; `--help` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def int_ranges(ids: Iterable[int]) -> str:
    """Integers as the kernel's cpusets and `tangram sim --seeds` write them: "0-3,6"."""
    ids = sorted(set(ids))
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


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


def positive_number(text: str) -> float:
    """argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
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
