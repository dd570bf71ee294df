"""Decision cost of a replicated GPU service with a long queue (tangram.Scheduler).

A reward model of 4 copies (one minimum, three surplus; one 80 GB GPU each, max_batch 8)
gets W calls at once; then the earliest-started running call completes, one per event,
and the time per completion (the scheduler call, its pass and the starts it makes) is
taken over 2,000 events (1,000 when W is 1,000). The baseline, run in the same process:
the same service with one copy (no routing across copies). Every pass routes again only
the front of a replicated service's queue (the next two batches of each copy,
docs/scheduling.md "Replicas"), so the cost should not grow with W.

Run:  python bench/replica_queue.py [--json bench/results/replica_queue.json]
(under a minute).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from tangram import Action, Gpu, Inventory, Node, Scheduler, Service

QUEUES = (1_000, 10_000, 40_000)
EVENTS = 2_000


class Queue:
    """A service of `copies` copies with `waiting` calls submitted at once, every copy restored."""

    def __init__(self, waiting: int, copies: int, seed: int = 0) -> None:
        inventory = Inventory([Node("n0", {"cpu": 64}, [Gpu(80_000)] * 4)],
                              services=[Service("rm", 20_000, 1.0, max_batch=8, replicas=1, max_replicas=copies)])
        self.sched = Scheduler(inventory)
        rng = np.random.default_rng(seed)
        self.submitted = waiting
        calls = [Action(i, {"cpu": 0.01}, runtime=float(rng.lognormal(0.0, 0.3)), service="rm") for i in range(waiting)]
        self.started: dict[int, float] = {}  # running call -> its start
        self.copies_used: set[str] = set()
        self.completed = 0
        self.note(self.sched.submit(calls, 0.0))
        self.now = 10.0  # every copy restored
        self.note(self.sched.submit([], self.now))

    def note(self, decisions) -> None:  # type: ignore[no-untyped-def]
        for d in decisions:
            if d.kind == "start":
                if d.action in self.started:
                    raise RuntimeError(f"call {d.action} started twice")
                self.started[d.action] = d.time
                self.copies_used.add(d.service)
            elif d.kind == "reject":
                raise RuntimeError(f"call {d.action} rejected: {d.reason}")

    def complete_first(self) -> float:
        """Completes the earliest-started running call; the seconds the scheduler call took."""
        first = min(self.started, key=self.started.__getitem__)
        del self.started[first]
        self.now += 0.01
        t = time.perf_counter()
        decisions = self.sched.complete(first, self.now)
        elapsed = time.perf_counter() - t
        self.completed += 1
        self.note(decisions)
        return elapsed


def per_completion_us(waiting: int, copies: int, seed: int = 0) -> float:
    """Microseconds per completion event, `waiting` calls queued at a service of `copies` copies."""
    queue = Queue(waiting, copies, seed)
    events = min(EVENTS, waiting)
    elapsed = sum(queue.complete_first() for _ in range(events))
    queue.sched.check_invariants()
    return elapsed / events * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'waiting':>8} {'1 copy us':>10} {'4 copies us':>12} {'ratio':>6}")
    for waiting in QUEUES:
        one = per_completion_us(waiting, 1)
        four = per_completion_us(waiting, 4)
        rows.append({"waiting": waiting, "one_copy_us": round(one, 2), "four_copies_us": round(four, 2),
                     "ratio": round(four / one, 2)})
        print(f"{waiting:>8,} {one:>10.1f} {four:>12.1f} {four / one:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": {"python": sys.version.split()[0], "platform": platform.platform(),
                                  "events": EVENTS}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
