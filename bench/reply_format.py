"""What a sandbox's reply costs in tangram's plain-data format against pickle.

A worker's reply is encoded with tangram.runtime.sandbox.inside_values in the sandbox and
decoded (load_reply) in the orchestrator: never a pickle, since unpickling runs what the
stream names (docs/sandbox.md, "What comes back is data"). This times encode + decode of
typical replies against pickle.dumps + pickle.loads of the same values, in this one
process, samples interleaved; medians of --repeat rounds.

Run:  python bench/reply_format.py [--repeat 30] [--json bench/results/reply_format.json]
(under a minute).
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import time
from typing import Any, Callable

import numpy as np

from tangram.runtime.sandbox.inside_values import encode
from tangram.runtime.sandbox.replies import load_reply

REPLIES: dict[str, Any] = {
    "a reward (a small dict)": ("ok", {"score": 1.0, "passed": 7, "total": 10, "log": "x" * 200}),
    "a command's result (100 kB of output)": ("result", 0, b"o" * 100_000, b"", False),
    "100,000 floats in a list": ("ok", [i / 7 for i in range(100_000)]),
    "1,000 small dicts": ("ok", [{"case": i, "passed": i % 2 == 0, "ms": i * 0.5} for i in range(1_000)]),
    "a float64 array of 1,000,000": ("ok", np.arange(1_000_000, dtype=np.float64)),
}


def _seconds(fn: Callable[[], Any], times: int) -> float:
    start = time.perf_counter()
    for _ in range(times):
        fn()
    return (time.perf_counter() - start) / times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'reply':40s} {'plain data':>12s} {'pickle':>12s} {'ratio':>7s}")
    for name, reply in REPLIES.items():
        assert load_reply(encode(reply))[0] == reply[0]
        once = _seconds(lambda: load_reply(encode(reply)), 1)
        times = max(1, int(0.01 / max(once, 1e-7)))  # each sample about 10 ms
        ours, theirs = [], []
        for _ in range(args.repeat):  # interleaved
            ours.append(_seconds(lambda: load_reply(encode(reply)), times))
            theirs.append(_seconds(lambda: pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)),
                                   times))
        plain, pickled = statistics.median(ours), statistics.median(theirs)
        rows.append({"reply": name, "plain_data_us": plain * 1e6, "pickle_us": pickled * 1e6,
                     "ratio": plain / pickled})
        print(f"{name:40s} {plain * 1e6:10.1f}us {pickled * 1e6:10.1f}us {plain / pickled:6.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.platform(), "python": platform.python_version(), "repeat": args.repeat,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
