"""The programs of bench/rollout_vs_pool.py and the functions that run them in a worker.

A module of its own, light to import (no tangram at import time), because every worker
process (the pool's and each sandbox's) imports it to unpickle `run_program` and
`run_suite`: what a user's tool module would be.
"""

from __future__ import annotations

import os
import time
from typing import Any

TIMELINE = "ROLLOUT_TIMELINE"  # a file each program appends "start end cpu" to, when set

# Each program sets `result` after asserting it against an independent computation.
PROGRAMS = {
    "primes": (
        "def is_prime(k):\n    if k < 2:\n        return False\n    d = 2\n    while d * d <= k:\n"
        "        if k % d == 0:\n            return False\n        d += 1\n    return True\n"
        "n = {n}\ncount = sum(1 for k in range(n) if is_prime(k))\n"
        "marks = bytearray([1]) * n\nmarks[0:2] = b'\\x00\\x00'\n"
        "for p in range(2, int(n ** 0.5) + 1):\n    if marks[p]:\n        marks[p*p::p] = bytes(len(range(p*p, n, p)))\n"
        "assert count == sum(marks), (count, sum(marks))\nresult = count\n", (8_000, 16_000, 30_000, 50_000)),
    "mergesort": (
        "def msort(a):\n    if len(a) < 2:\n        return a\n    m = len(a) // 2\n    l, r = msort(a[:m]), msort(a[m:])\n"
        "    out, i, j = [], 0, 0\n    while i < len(l) and j < len(r):\n        if l[i] <= r[j]:\n"
        "            out.append(l[i]); i += 1\n        else:\n            out.append(r[j]); j += 1\n"
        "    return out + l[i:] + r[j:]\n"
        "x, data = {n}, []\nfor _ in range({n}):\n    x = (x * 1103515245 + 12345) % 2147483648\n    data.append(x)\n"
        "got = msort(data)\nassert got == sorted(data)\nresult = got[len(got) // 2]\n", (5_000, 10_000, 18_000, 28_000)),
    "matmul": (
        "n = {n}\nA = [[(i * 7 + j * 3) % 11 for j in range(n)] for i in range(n)]\n"
        "B = [[(i * 5 + j) % 13 for j in range(n)] for i in range(n)]\n"
        "C = [[sum(A[i][k] * B[k][j] for k in range(n)) for j in range(n)] for i in range(n)]\n"
        "Bv = [sum(row) for row in B]\n"
        "assert [sum(row) for row in C] == [sum(A[i][k] * Bv[k] for k in range(n)) for i in range(n)]\n"
        "result = sum(C[i][i] for i in range(n))\n", (30, 40, 50, 60)),
    "collatz": (
        "def steps(k):\n    s = 0\n    while k != 1:\n        k = k // 2 if k % 2 == 0 else 3 * k + 1\n        s += 1\n"
        "    return s\nn = {n}\nbest = max(range(1, n), key=steps)\nmemo = {{1: 0}}\n"
        "def steps2(k):\n    path = []\n    while k not in memo:\n        path.append(k)\n"
        "        k = k // 2 if k % 2 == 0 else 3 * k + 1\n    s = memo[k]\n    for v in reversed(path):\n"
        "        s += 1\n        memo[v] = s\n    return s\n"
        "assert steps(best) == max(steps2(k) for k in range(1, n))\nresult = best\n", (2_000, 4_000, 7_000, 10_000)),
    "queens": (
        "def solve(n, row=0, cols=0, d1=0, d2=0):\n    if row == n:\n        return 1\n    total = 0\n"
        "    for c in range(n):\n        if not (cols >> c) & 1 and not (d1 >> (row + c)) & 1 and not (d2 >> (row - c + n)) & 1:\n"
        "            total += solve(n, row + 1, cols | 1 << c, d1 | 1 << (row + c), d2 | 1 << (row - c + n))\n"
        "    return total\nn = {n}\nresult = solve(n)\n"
        "assert result == [1, 1, 0, 0, 2, 10, 4, 40, 92, 352, 724, 2680][n]\n", (10, 11)),
    "editdist": (
        "def dist(a, b):\n    prev = list(range(len(b) + 1))\n    for i, ca in enumerate(a, 1):\n        cur = [i]\n"
        "        for j, cb in enumerate(b, 1):\n            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))\n"
        "        prev = cur\n    return prev[-1]\n"
        "n = {n}\na = ''.join('acgt'[(i * i + 3) % 4] for i in range(n))\n"
        "b = ''.join('acgt'[(i * 7 + 1) % 4] for i in range(n))\nd = dist(a, b)\n"
        "assert d == dist(b, a) and abs(len(a) - len(b)) <= d <= max(len(a), len(b))\nresult = d\n", (120, 200, 280, 350)),
}


def run_program(source: str) -> Any:
    """Runs one program in a fresh namespace and returns its checked `result`. With
    ROLLOUT_TIMELINE set, appends its wall-clock start and end and its CPU seconds there
    (one write of one line: whole lines from many processes); a relative path is in the
    sandbox's directory, which a namespaced sandbox can write."""
    start, cpu = time.time(), time.process_time()
    namespace: dict[str, Any] = {"__name__": "__program__"}
    exec(compile(source, "<program>", "exec"), namespace)
    timeline = os.environ.get(TIMELINE)
    if timeline:
        fd = os.open(timeline, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{start!r} {time.time()!r} {time.process_time() - cpu!r}\n".encode())
        finally:
            os.close(fd)
    return namespace["result"]


def run_suite(sources: list[str]) -> list[Any]:
    """A test suite inside a tangram sandbox: its programs on the sandbox's process pool,
    which runs as many at once as the action's live grant."""
    from tangram.worker import shared_executor
    return list(shared_executor().map(run_program, sources))
