"""Instructions per decision of the core, counted by callgrind: the 1,024-node burst, or
with --churn the steady-state churn of `tangram bench`.

Wall-clock figures on a shared machine move by up to 2x from run to run; instruction counts do
not. Run:  python bench/count_instructions.py [NODES] [--cache] [--churn]   (needs valgrind;
takes ~1 minute, a few with --cache)

--cache adds callgrind's cache and branch simulation: L1 data misses and mispredicted
branches per decision, what the instruction count leaves out of the time.

The burst: its event sequence is recorded once and replayed under callgrind, with
collection on only inside Scheduler::submit and Scheduler::complete (the C++ core, binding
excluded), divided by the number of start decisions. The churn (tangram.bench.run_churn,
4,096 nodes by default): run with 1 timed step and with 1,000, both under callgrind with the
same collection; the difference over the difference in start decisions leaves the warm-up
out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

REPLAY = """
import gc, sys
from tangram import bench as b
nodes = int(sys.argv[1])
inv = b.make_inventory(nodes, 0)
events = b.record_burst("core", inv, b.make_actions(10000, nodes, 0))
gc.disable()
print(b.replay(b.make_scheduler("core", inv), events))
"""

CHURN = """
import sys
from tangram import bench as b
r = b.run_churn("core", int(sys.argv[1]), 5000, int(sys.argv[2]), step=8, seed=0, check=False)
print(r.actions)  # start decisions in the timed steps
"""


def callgrind(python: str, script: str, args: list[str], cache: bool) -> tuple[int, dict[str, int]]:
    """Runs `script` under callgrind; returns what it printed last (an int) and the totals."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "run.py"), os.path.join(tmp, "callgrind.out")
        with open(path, "w") as f:
            f.write(script)
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no",
             *(["--cache-sim=yes", "--branch-sim=yes"] if cache else []),
             "--toggle-collect=tangram::Scheduler::submit*", "--toggle-collect=tangram::Scheduler::complete*",
             python, path, *args],
            capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, check=True)
        text = open(out).read()
    events = re.search(r"^events:\s+(.+)$", text, re.M).group(1).split()
    totals = dict(zip(events, map(int, re.search(r"^summary:\s+(.+)$", text, re.M).group(1).split())))
    return int(run.stdout.split()[-1]), totals


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cache = "--cache" in sys.argv[1:]
    churn = "--churn" in sys.argv[1:]
    nodes = args[0] if args else ("4096" if churn else "1024")
    # The interpreter as this process was started (in a virtual environment, its symlink:
    # resolving it would lose the environment's packages); valgrind must run a binary.
    python = sys.executable
    with open(os.path.realpath(python), "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise SystemExit(f"count_instructions: {python} is not an ELF binary (a shim script?): run it with "
                             "the interpreter itself")
    if churn:
        starts_1, totals_1 = callgrind(python, CHURN, [nodes, "1"], cache)
        starts_n, totals_n = callgrind(python, CHURN, [nodes, "1000"], cache)
        decisions = starts_n - starts_1
        per = lambda event: (totals_n[event] - totals_1[event]) / decisions  # noqa: E731
        print(f"{nodes}-node churn: {per('Ir'):,.0f} instructions per decision "
              f"({decisions} decisions in 999 steps, core only)")
    else:
        decisions, totals = callgrind(python, REPLAY, [nodes], cache)
        # The recording run and the replay run are both counted: two bursts.
        per = lambda event: totals[event] / (2 * decisions)  # noqa: E731
        print(f"{nodes} nodes: {per('Ir'):,.0f} instructions per decision "
              f"({decisions} decisions per burst, core only)")
    if cache:
        print(f"  per decision: {per('D1mr') + per('D1mw'):,.0f} L1 data misses, "
              f"{per('Bcm') + per('Bim'):,.0f} mispredicted branches (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
