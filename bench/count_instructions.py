"""Instructions per decision of the core on the 1,024-node burst, counted by callgrind.

Wall-clock figures on a shared machine move by up to 2x from run to run; instruction counts do
not. Run:  python bench/count_instructions.py [NODES] [--cache]   (needs valgrind; takes
~1 minute, a few with --cache)

--cache adds callgrind's cache and branch simulation: L1 data misses and mispredicted
branches per decision, what the instruction count leaves out of the time.

It records the burst's event sequence once, replays it under callgrind with collection on
only inside Scheduler::submit and Scheduler::complete (the C++ core, binding excluded), and
divides by the number of start decisions.
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


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--cache"]
    cache = "--cache" in sys.argv[1:]
    nodes = args[0] if args else "1024"
    # The interpreter as this process was started (in a virtual environment, its symlink:
    # resolving it would lose the environment's packages); valgrind must run a binary.
    python = sys.executable
    with open(os.path.realpath(python), "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise SystemExit(f"count_instructions: {python} is not an ELF binary (a shim script?): run it with "
                             "the interpreter itself")
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "replay.py"), os.path.join(tmp, "callgrind.out")
        with open(script, "w") as f:
            f.write(REPLAY)
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no",
             *(["--cache-sim=yes", "--branch-sim=yes"] if cache else []),
             "--toggle-collect=tangram::Scheduler::submit*", "--toggle-collect=tangram::Scheduler::complete*",
             python, script, nodes],
            capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, check=True)
        decisions = int(run.stdout.split()[-1])
        text = open(out).read()
    events = re.search(r"^events:\s+(.+)$", text, re.M).group(1).split()
    totals = dict(zip(events, map(int, re.search(r"^summary:\s+(.+)$", text, re.M).group(1).split())))
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
