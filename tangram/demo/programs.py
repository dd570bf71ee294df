"""The programs the demo's trajectories write into their sandboxes and run.

A trajectory's "policy model" writes a solution to a small task (count the primes up to
n), then builds it, runs it, and runs its test suite. The test suite and the build use
as many processes as the action was granted cores (TANGRAM_CORES): that is what makes
them elastic. Some solutions carry an off-by-one bug, fixed on a second attempt, so
rewards differ between trajectories.
"""

from __future__ import annotations

import os

SOLUTION = '''\
import sys


def is_prime(k):
    if k < 2:
        return False
    d = 2
    while d * d {compare} k:
        if k % d == 0:
            return False
        d += 1
    return True


def count_primes(n):
    return sum(1 for k in range(n + 1) if is_prime(k))


if __name__ == "__main__":
    print(count_primes(int(sys.argv[1])))
'''

# Expected values come from a sieve in the test file itself, so the suite is self-contained.
TESTS = '''\
import json
import multiprocessing
import os
import sys

from solution import count_primes


def sieve_count(n):
    marks = bytearray([1]) * (n + 1)
    marks[0:2] = b"\\x00\\x00"
    for p in range(2, int(n ** 0.5) + 1):
        if marks[p]:
            marks[p * p::p] = bytes(len(range(p * p, n + 1, p)))
    return sum(marks)


CASES = {cases}


def check(n):
    return count_primes(n) == sieve_count(n)


if __name__ == "__main__":
    workers = int(os.environ.get("TANGRAM_CORES", "1"))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = pool.map(check, CASES, chunksize=1)
    print(json.dumps({{"passed": sum(results), "total": len(results), "workers": workers}}))
    sys.exit(0 if all(results) else 1)
'''

BUILD = '''\
import hashlib
import multiprocessing
import os
import py_compile


def optimise(unit):
    digest = str(unit).encode()
    for _ in range({rounds}):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()[:8]


if __name__ == "__main__":
    for name in ("solution.py", "run_tests.py"):
        py_compile.compile(name, doraise=True)
    # The serial part of the build: "linking".
    link = optimise("link")
    workers = int(os.environ.get("TANGRAM_CORES", "1"))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        units = pool.map(optimise, range(8), chunksize=1)
    with open("build.log", "w") as f:
        f.write(link + " " + " ".join(units) + "\\n")
    print("built", len(units), "units with", workers, "workers")
'''


def write_project(cases: list[int], buggy: bool, build_rounds: int = 60_000) -> list[str]:
    """Writes the project into the current directory (the sandbox's); returns the files."""
    files = {
        "solution.py": SOLUTION.format(compare="<" if buggy else "<="),
        "run_tests.py": TESTS.format(cases=cases),
        "build.py": BUILD.format(rounds=build_rounds),
    }
    for name, text in files.items():
        with open(name, "w") as f:
            f.write(text)
    return sorted(os.listdir("."))


def fix_solution() -> str:
    """The second attempt: the off-by-one fixed."""
    with open("solution.py") as f:
        text = f.read()
    with open("solution.py", "w") as f:
        f.write(text.replace("d * d < k", "d * d <= k"))
    return "fixed"
