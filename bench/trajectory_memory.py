"""Memory per trajectory over a long run: does the core forget ended trajectories?

    python bench/trajectory_memory.py [--policy trajectory] [--steps 800] [--batch 256]

Runs `--steps` rounds of `--batch` new trajectories through one scheduler (4 nodes of 64
cores): each trajectory submits one action, which completes, then the trajectory ends.
Reports the growth of the process's resident memory per trajectory after a warm-up of
40 rounds. Under `trajectory` the core keys a class per trajectory; ending a trajectory
frees its classes, so the growth should be 0.
"""

from __future__ import annotations

import argparse
import os


from tangram import Inventory
from tangram.scheduler import Policy, Scheduler


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="trajectory")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    options = {"trajectory_slot_cpu": 1.0} if args.policy == "trajectory" else {}
    scheduler = Scheduler(Inventory.uniform(4, {"cpu": 64, "memory": 65536}), Policy(args.policy, **options))
    now, next_id, warm = 0.0, 1, None
    for step in range(args.steps):
        ids = list(range(next_id, next_id + args.batch))
        records = scheduler.new_actions(args.batch)
        records["id"] = ids
        records["trajectory"] = ids  # one action per trajectory, trajectory id = action id
        records["demand"][:, 0] = 1.0
        records["seconds"] = 1.0
        scheduler.submit(records, now)
        scheduler.complete(ids, now + 0.001)
        scheduler.end_trajectories(ids, now + 0.002)
        now += 0.003
        next_id += args.batch
        if step == 40:
            warm = (resident_bytes(), next_id)
    assert warm is not None, "--steps must be over 40"
    trajectories = next_id - warm[1]
    growth = (resident_bytes() - warm[0]) / trajectories
    print(f"{args.policy}: {growth:.0f} bytes of resident memory per trajectory over {trajectories:,} trajectories")


if __name__ == "__main__":
    main()
