"""An SWE-like task end to end: trajectories edit a real project in its task image and run its tests.

    python bench/swe_task.py [--trajectories 8] [--repeat 3] [--image DIR] [--json PATH]
                             [--containers podman [--container-option OPT ...]]

The task image is a Debian root (debootstrap --variant=minbase with python3, from the
Debian mirror) holding a real Python project from PyPI with its own test suite: the sdist
of more-itertools 11.2.1, unpacked at /testbed, and two small scripts at /opt/swe
(an editor and a suite runner). It is built once into ~/.cache/tangram/bench (or given
with --image, a root directory). Needs root (image sandboxes mount an overlay),
bubblewrap, debootstrap and pip, and the network for the first build only.

Each trajectory does what a coding agent's episode does, with a seeded "generation" pause
(0.1-0.4 s, the policy model) before each call:
  1. edit    break one function of the project in its copy (`python3 /opt/swe/edit.py
             break K`: a wrong redefinition appended to the module, one of four per
             trajectory number)
  2. suite   run the project's tests (`python3 /opt/swe/run_suite.py`): unittest, the test
             classes split across as many processes as the grant's whole cores
             (TANGRAM_CORES, 1 where unset); the project's suite but its five slowest
             classes (about 19 s of its 22 s on one core), so that a step takes a minute
  3. edit    revert the edit
  4. suite   run the tests again
Every suite's failures must be exactly the ones its trajectory's edit causes, as a
calibration run found them on a copy of its own (none after the revert): an edit seen by
another trajectory, or lost, fails the run. At the end the image's file is checked
unchanged.

Two ways, both isolated, interleaved in every repetition:
  plain    what a user writes without tangram: a copy of /testbed per trajectory (cp -a,
           at its first call), and each call one `bwrap` over the image's root (read-only,
           the copy bound at /testbed; its own PID, network, IPC and UTS namespaces, no
           capabilities), run through a pool of one slot per core (an asyncio semaphore),
           each suite on one process.
  tangram  the orchestrator (policy `tangram`, CPU manager defaults: namespaced sandboxes
           on the image, Call.image; each trajectory's sandbox its own overlay; warm
           workers of the image started before the step), an edit a rigid action of
           cores/trajectories, a suite an elastic action from one core (--suite-cpu; a
           test process wants one) up to every core with an Amdahl model of its
           calibrated one-core time.

With --containers ENGINE (podman or docker), the image is also imported into that engine's
store (once, as localhost/tangram-bench-swe:<version>) and two more ways run, as a user
with an existing container image store would:
  engine   a container per trajectory (`ENGINE run -d IMAGE sleep infinity` at its first
           call, no network) and each call one `ENGINE exec` in it (as docker-py's
           containers.run and exec_run do), through the same pool of one slot per core
  tangram-engine  the orchestrator with the CPU manager's containers=ENGINE: the same
           container per trajectory, one exec per worker, grants in its cgroup
(--container-option passes options to both ways' `run`, e.g. a runtime.)

Reports per way, medians over repetitions: the step (from the first call to the last
result), mean, p50 and p99 ACT of the suites and of all calls, and the time of each
trajectory's first call (its start: the copy and a bwrap, or a sandbox started on the
image); once per run: one more no-op call in a live trajectory (`true`: a bwrap per call
against a live sandbox), and the disk each trajectory's files take (the copy, against the
sandbox's overlay upper directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tangram import Amdahl, Call, Orchestrator
from tangram.runtime.config import RuntimeConfig

PROJECT, VERSION = "more-itertools", "11.2.1"
SLOW_CLASSES = ("PrimeFunctionTests", "TestSerialize", "DiscreteFourierTransformTests", "TestConcurrentTee",
                "PolynomialFromRootsTests")
# (module, appended wrong definition): four ways to break the project, one per trajectory number
EDITS = (
    ("more_itertools/more.py", "def one(iterable, too_short=None, too_long=None):\n    return None\n"),
    ("more_itertools/more.py", "def chunked(iterable, n, strict=False):\n    return iter([list(iterable)])\n"),
    ("more_itertools/recipes.py", "def take(n, iterable):\n    return list(__import__('itertools').islice(iterable, n + 1))\n"),
    ("more_itertools/more.py", "def first(iterable, default=None):\n    return default\n"),
)
MARK = "# swe-task edit\n"

EDIT_PY = f'''import sys
EDITS = {EDITS!r}
MARK = {MARK!r}
action, k = sys.argv[1], int(sys.argv[2])
path = "/testbed/" + EDITS[k][0]
text = open(path).read()
if action == "break":
    text += MARK + EDITS[k][1]
else:
    text = text.split(MARK)[0]
open(path, "w").write(text)
'''

RUN_SUITE_PY = f'''import json, os, subprocess, sys, unittest
SLOW = {SLOW_CLASSES!r}
os.chdir("/testbed")
sys.path.insert(0, "/testbed")
suite = unittest.TestLoader().discover("tests", top_level_dir="/testbed")
def classes(s):
    for t in s:
        if isinstance(t, unittest.TestSuite):
            yield from classes(t)
        else:
            yield type(t).__module__ + "." + type(t).__name__
names = sorted(c for c in set(classes(suite)) if c.startswith("tests.") and c.rsplit(".", 1)[1] not in SLOW)
n = max(1, min(len(names), int(float(os.environ.get("TANGRAM_CORES", "1")))))
chunks = [names[i::n] for i in range(n)]
code = ("import json, sys, unittest\\n"
        "r = unittest.TextTestRunner(stream=open('/dev/null', 'w')).run(unittest.TestLoader().loadTestsFromNames(sys.argv[1:]))\\n"
        "print(json.dumps([r.testsRun, sorted(t.id() for t, _ in r.failures + r.errors)]))")
procs = [subprocess.Popen([sys.executable, "-c", code, *c], stdout=subprocess.PIPE) for c in chunks]
ran, failed = 0, []
for p in procs:
    out, _ = p.communicate()
    r, f = json.loads(out.decode().strip().splitlines()[-1])
    ran, failed = ran + r, failed + f
print(json.dumps({{"ran": ran, "failed": sorted(failed)}}))
'''


# ---------------------------------------------------------------- the image
def build_image(cache: str, mirror: str) -> str:
    root = os.path.join(cache, f"swe-{PROJECT}-{VERSION}", "rootfs")
    if os.path.exists(os.path.join(root, "testbed", "tests")):
        write_scripts(root)  # this version's
        return root
    if shutil.which("debootstrap") is None:
        sys.exit("debootstrap is not installed (apt-get install debootstrap), or give --image")
    building = root + ".building"
    shutil.rmtree(building, ignore_errors=True)
    os.makedirs(os.path.dirname(root), exist_ok=True)
    print(f"building the task image in {root} (debootstrap, about a minute) ...", flush=True)
    subprocess.run(["debootstrap", "--variant=minbase", "--include=python3", "bookworm", building, mirror],
                   check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", tmp,
                        f"{PROJECT}=={VERSION}"], check=True)
        (archive,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        shutil.move(os.path.join(tmp, f"{PROJECT.replace('-', '_')}-{VERSION}"), os.path.join(building, "testbed"))
    write_scripts(building)
    os.rename(building, root)
    return root


def write_scripts(root: str) -> None:
    os.makedirs(os.path.join(root, "opt", "swe"), exist_ok=True)
    for name, text in (("edit.py", EDIT_PY), ("run_suite.py", RUN_SUITE_PY)):
        with open(os.path.join(root, "opt", "swe", name), "w") as f:
            f.write(text)


# ---------------------------------------------------------------- the two ways
@dataclass
class Run:
    way: str
    acts: list[float] = field(default_factory=list)
    suites: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    step: float = 0.0
    wrong: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        def pct(v: list[float], q: float) -> float:
            s = sorted(v)
            return s[min(len(s) - 1, int(q * len(s)))]
        return {"step": self.step, "mean_act": statistics.fmean(self.acts), "p99_act": pct(self.acts, 0.99),
                "mean_suite": statistics.fmean(self.suites), "p50_suite": pct(self.suites, 0.5),
                "p99_suite": pct(self.suites, 0.99), "mean_start": statistics.fmean(self.starts)}


def plan(trajectories: int, seed: int) -> list[list[tuple[float, list[str], str]]]:
    """Per trajectory: (generation pause, argv, kind) of its four calls."""
    rng = random.Random(seed)
    out = []
    for t in range(trajectories):
        k = str(t % len(EDITS))
        calls = [(["python3", "/opt/swe/edit.py", "break", k], "edit"), (["python3", "/opt/swe/run_suite.py"], "suite"),
                 (["python3", "/opt/swe/edit.py", "revert", k], "edit"), (["python3", "/opt/swe/run_suite.py"], "suite")]
        out.append([(rng.uniform(0.1, 0.4), argv, kind) for argv, kind in calls])
    return out


def check(run: Run, t: int, turn: int, stdout: bytes, expected: dict[int, list[str]]) -> None:
    try:
        failed = json.loads(stdout.decode().strip().splitlines()[-1])["failed"]
    except (ValueError, IndexError, KeyError):
        run.wrong.append(f"trajectory {t}: no result ({stdout[-200:]!r})")
        return
    want = expected[t % len(EDITS)] if turn == 1 else []
    if failed != want:
        run.wrong.append(f"trajectory {t} call {turn}: {len(failed)} failures, expected {len(want)}")


async def rollout(plans: list[list[tuple[float, list[str], str]]], call: Any, run: Run,
                  expected: dict[int, list[str]]) -> None:
    async def trajectory(t: int) -> None:
        for turn, (pause, argv, kind) in enumerate(plans[t]):
            await asyncio.sleep(pause)
            t0 = time.perf_counter()
            out = await call(t, argv, kind, turn == 0)
            elapsed = time.perf_counter() - t0
            run.acts.append(elapsed)
            if turn == 0:
                run.starts.append(elapsed)
            if kind == "suite":
                run.suites.append(elapsed)
                check(run, t, turn, out, expected)
    t0 = time.perf_counter()
    await asyncio.gather(*(trajectory(t) for t in range(len(plans))))
    run.step = time.perf_counter() - t0


def bwrap_argv(image: str, copy: str) -> list[str]:
    return ["bwrap", "--ro-bind", image, "/", "--bind", copy, "/testbed", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--new-session",
            "--die-with-parent", "--cap-drop", "ALL", "--chdir", "/testbed", "--"]


async def sh(argv: list[str]) -> bytes:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out, _ = await proc.communicate()
    return out


async def with_plain(plans: list[Any], image: str, cores: int, expected: dict[int, list[str]], work: str) -> Run:
    run = Run("plain")
    pool = asyncio.Semaphore(cores)
    copies = [os.path.join(work, f"t{t}") for t in range(len(plans))]

    async def call(t: int, argv: list[str], kind: str, first: bool) -> bytes:
        async with pool:
            if first:
                await sh(["cp", "-a", os.path.join(image, "testbed"), copies[t]])
            return await sh([*bwrap_argv(image, copies[t]), *argv])

    await rollout(plans, call, run, expected)
    for copy in copies:
        shutil.rmtree(copy, ignore_errors=True)
    return run


async def with_engine(plans: list[Any], name: str, cores: int, expected: dict[int, list[str]], engine: str,
                      options: list[str]) -> Run:
    run = Run(os.path.basename(engine))
    pool = asyncio.Semaphore(cores)
    containers = [f"swe-task-{os.getpid()}-t{t}" for t in range(len(plans))]

    async def call(t: int, argv: list[str], kind: str, first: bool) -> bytes:
        async with pool:
            if first:
                await sh([engine, "run", "-d", "--name", containers[t], "--network", "none", *options, name,
                          "sleep", "infinity"])
            return await sh([engine, "exec", "-w", "/testbed", containers[t], *argv])

    try:
        await rollout(plans, call, run, expected)
    finally:
        await sh([engine, "rm", "-f", "-t", "0", *containers])
    return run


def engine_image(image: str, engine: str) -> str:
    """The image in the engine's store, imported from the root directory once."""
    name = f"localhost/tangram-bench-swe:{VERSION}"
    if subprocess.run([engine, "image", "inspect", name], capture_output=True).returncode != 0:
        tar = subprocess.Popen(["tar", "-C", image, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([engine, "import", "-", name], stdin=tar.stdout, check=True, capture_output=True)
        tar.wait()
    return name


async def with_tangram(plans: list[Any], image: str, cores: int, expected: dict[int, list[str]],
                       suite_seconds: float, suite_cpu: float, engine: str | None = None,
                       options: list[str] | None = None) -> Run:
    run = Run("tangram" if engine is None else f"tangram-{os.path.basename(engine)}")
    slot = int(cores * 1000 / len(plans)) / 1000
    cpu_options: dict[str, Any] = {"warm_sandboxes": len(plans)}
    if engine is not None:
        cpu_options.update(containers=engine, container_options=options or [], warm_sandboxes=0)
    config = RuntimeConfig(policy="tangram", managers={"cpu": cpu_options})
    async with Orchestrator(config) as orch:
        cpu = orch.managers["cpu"]
        if engine is None:
            await orch.run(Call(command="true", trajectory=len(plans), image=image))  # the image's warm pool starts
            await orch.end_trajectory(len(plans))
            deadline = time.monotonic() + 120
            while len(cpu.warm_processes()) < 2 * len(plans) and time.monotonic() < deadline:  # type: ignore[attr-defined]
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # their imports done

        async def call(t: int, argv: list[str], kind: str, first: bool) -> bytes:
            if kind == "edit":
                c = Call(command=argv, resources={"cpu": slot}, trajectory=t, image=image, kind="edit",
                         runtime=Amdahl.from_one_unit(0.05, 1.0, slot))
            else:
                least = suite_cpu or slot
                c = Call(command=argv, resources={"cpu": least}, elastic="cpu", max_units=float(cores), trajectory=t,
                         image=image, kind="suite", runtime=Amdahl.from_one_unit(suite_seconds, 0.9, least))
            result = await orch.run(c)
            return result.stdout

        await rollout(plans, call, run, expected)
        for t in range(len(plans)):
            await orch.end_trajectory(t)
    return run


# ---------------------------------------------------------------- calibration and the extras
async def calibrate(image: str, work: str) -> tuple[dict[int, list[str]], float]:
    """Each edit's failures, found on a copy of its own on one core, and a suite's time there."""
    expected: dict[int, list[str]] = {}
    seconds = []
    for k in range(len(EDITS)):
        copy = os.path.join(work, f"calibrate{k}")
        await sh(["cp", "-a", os.path.join(image, "testbed"), copy])
        await sh([*bwrap_argv(image, copy), "python3", "/opt/swe/edit.py", "break", str(k)])
        t0 = time.perf_counter()
        out = await sh([*bwrap_argv(image, copy), "python3", "/opt/swe/run_suite.py"])
        seconds.append(time.perf_counter() - t0)
        expected[k] = json.loads(out.decode().strip().splitlines()[-1])["failed"]
        if not expected[k]:
            sys.exit(f"edit {k} breaks no test: the calibration is wrong")
        shutil.rmtree(copy)
    return expected, statistics.median(seconds)


async def extras(image: str, work: str, trajectories: int) -> dict[str, Any]:
    """One more no-op call in a live trajectory, and each trajectory's files on disk."""
    copy = os.path.join(work, "extra")
    await sh(["cp", "-a", os.path.join(image, "testbed"), copy])
    plain = []
    for _ in range(30):
        t0 = time.perf_counter()
        await sh([*bwrap_argv(image, copy), "true"])
        plain.append(time.perf_counter() - t0)
    copy_bytes = int(subprocess.run(["du", "-sb", copy], capture_output=True, text=True).stdout.split()[0])
    shutil.rmtree(copy)
    live = []
    async with Orchestrator(RuntimeConfig(policy="tangram", managers={"cpu": {"warm_sandboxes": 0}})) as orch:
        for t in range(trajectories):
            await orch.run(Call(command=["python3", "/opt/swe/edit.py", "break", "0"], trajectory=t, image=image))
        for _ in range(30):
            t0 = time.perf_counter()
            await orch.run(Call(command="true", trajectory=0))
            live.append(time.perf_counter() - t0)
        cpu = orch.managers["cpu"]
        uppers = [int(subprocess.run(["du", "-sb", os.path.join(cpu._sandboxes[t].slot.root, "upper")],  # type: ignore[attr-defined]
                                     capture_output=True, text=True).stdout.split()[0]) for t in range(trajectories)]
    return {"noop_call_ms": {"plain": statistics.median(plain) * 1e3, "tangram": statistics.median(live) * 1e3},
            "disk_per_trajectory_kib": {"plain": copy_bytes / 1024, "tangram": statistics.median(uppers) / 1024}}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    image = args.image or build_image(os.path.join(os.path.expanduser("~"), ".cache", "tangram", "bench"), args.mirror)
    before = open(os.path.join(image, "testbed", EDITS[0][0])).read()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="swe-task-") as work:
        expected, suite_seconds = await calibrate(image, work)
        print(f"calibrated: a suite takes {suite_seconds:.2f} s on one process; edits break "
              f"{[len(v) for v in expected.values()]} tests", flush=True)
        engine = args.containers
        name = engine_image(image, engine) if engine else ""
        options = args.container_option or []
        ways = ["plain", "tangram", *((os.path.basename(engine), f"tangram-{os.path.basename(engine)}") if engine else ())]
        runs: dict[str, list[Run]] = {way: [] for way in ways}
        for rep in range(args.repeat):
            plans = plan(args.trajectories, seed=rep)
            for way in (ways if rep % 2 == 0 else ways[::-1]):
                if way == "plain":
                    r = await with_plain(plans, image, cores, expected, work)
                elif way == "tangram":
                    r = await with_tangram(plans, image, cores, expected, suite_seconds, args.suite_cpu)
                elif way.startswith("tangram-"):
                    r = await with_tangram(plans, name, cores, expected, suite_seconds, args.suite_cpu, engine, options)
                else:
                    r = await with_engine(plans, name, cores, expected, engine, options)
                if r.wrong:
                    sys.exit(f"{way}: wrong results: {r.wrong[:3]}")
                runs[way].append(r)
                print(f"  repetition {rep + 1} {way:8} step {r.step:6.2f} s", flush=True)
        more = await extras(image, work, args.trajectories)
    if open(os.path.join(image, "testbed", EDITS[0][0])).read() != before:
        sys.exit("the image's project changed: an edit escaped its trajectory")
    out: dict[str, Any] = {"trajectories": args.trajectories, "repeat": args.repeat, "cores": cores,
                           "suite_cpu": args.suite_cpu,
                           "suite_one_process_s": suite_seconds, **more}
    for way, rs in runs.items():
        summaries = [r.summary() for r in rs]
        out[way] = {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
    out["tangram_over_plain"] = {k: out["tangram"][k] / out["plain"][k] for k in out["plain"]}
    if args.containers:
        e = os.path.basename(args.containers)
        out["engine"] = e
        out[f"tangram-{e}_over_{e}"] = {k: out[f"tangram-{e}"][k] / out[e][k] for k in out[e]}
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"{r['trajectories']} trajectories on {r['cores']} cores, medians of {r['repeat']} repetitions "
             f"(a suite: {r['suite_one_process_s']:.2f} s on one process)",
             f"{'':26} {'step':>8} {'mean ACT':>9} {'p99 ACT':>8} {'suite mean':>11} {'suite p99':>10} {'start':>8}"]
    e = r.get("engine")
    for way in ("plain", "tangram", "tangram_over_plain", *((e, f"tangram-{e}", f"tangram-{e}_over_{e}") if e else ())):
        s = r[way]
        unit = "x" if "_over_" in way else "s"
        lines.append(f"{way:26} " + " ".join(f"{s[k]:{w}.2f}{unit}" for k, w in
                                              (("step", 7), ("mean_act", 8), ("p99_act", 7), ("mean_suite", 10),
                                               ("p99_suite", 9), ("mean_start", 7))))
    lines.append(f"one more no-op call: plain {r['noop_call_ms']['plain']:.2f} ms (a bwrap), tangram "
                 f"{r['noop_call_ms']['tangram']:.2f} ms (a live sandbox)")
    lines.append(f"disk per trajectory: plain {r['disk_per_trajectory_kib']['plain']:.0f} KiB (a copy), tangram "
                 f"{r['disk_per_trajectory_kib']['tangram']:.0f} KiB (its overlay's changes)")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--image", default=None, help="a root directory built as the docstring says")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian")
    parser.add_argument("--suite-cpu", type=float, default=1.0,
                        help="a suite's least grant under tangram, in cores (0: cores/trajectories, as an edit's)")
    parser.add_argument("--containers", default=None, help="also run the container ways with this engine (podman, "
                        "docker)")
    parser.add_argument("--container-option", action="append", help="an option for the engine's run (repeatable)")
    parser.add_argument("--json", default=None)
    arguments = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("image sandboxes need root (an overlay per sandbox)")
    result = asyncio.run(main(arguments))
    print(report(result))
    if arguments.json:
        with open(arguments.json, "w") as f:
            json.dump(result, f, indent=1)
