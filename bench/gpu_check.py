"""Does what tangram believes about a GPU hold on a real one? Five checks on this machine's
NVIDIA GPU, each PASS, FAIL or SKIP with the figures it measured.

    python bench/gpu_check.py [--json OUT] [--timeout-s 280]

  discovery         tangram.devices.discover() against CUDA's own view (the driver API
                    through ctypes on libcuda.so.1): the same devices by count and UUID;
                    NVML's v2 reading adds up (reserved + used + free = total) and CUDA's
                    total is NVML's, or NVML's less what the driver reserves; the memory
                    tangram plans with is at most what NVML reports free, and at most CUDA's
                    total. Compute capability reported.
  context_cost      what one CUDA context takes on the device: NVML's used memory before,
                    with and after a context made in a fresh process (and CUDA's own free
                    memory inside it); the context's memory must be visible.
  grant_per_action  a tangram runtime (Orchestrator, CPU manager, GPU manager over the
                    discovered devices) runs two GPU function actions of one trajectory, one
                    after the other, with different gpu_memory grants. Each reports its pid,
                    CUDA_VISIBLE_DEVICES, TANGRAM_GPU_MEMORY_MIB and the UUID CUDA shows it as
                    device 0. Passes when each sees its own grant on the granted device, in a
                    process of its own forked by the trajectory's sandbox worker.
  evict_then_start  a GPU service whose load hook allocates 60% of the device's free memory
                    (cuMemAlloc, written with cuMemsetD8) and whose offload hook holds it 1 s
                    more before freeing it; then a plain GPU action that needs half the device,
                    which fits only once the service is evicted, and which allocates that for
                    real in its own process. The core decides the eviction. Passes when the
                    action's allocation succeeds and it started after the offload had ended.
  mps_limits        only where an MPS control daemon answers (tangram.runtime.managers.gpu.mps_active):
                    an action granted a 2,048 MiB slice must fail to allocate 4,096 MiB
                    (CUDA_ERROR_OUT_OF_MEMORY) and succeed with 1,024 MiB. Otherwise SKIP.

It never changes the GPU's settings: no MIG or compute-mode change, no MPS daemon started or
stopped; NVML is only read. Its CUDA use is contexts and allocations in processes it starts,
which free them when they end.

Without an NVIDIA GPU (no libcuda.so.1, CUDA finds no device, or NVML finds none), every
check is SKIP with the reason and the summary says "no NVIDIA GPU: nothing checked". With
TANGRAM_FAKE_GPUS set, tangram schedules fake GPUs, which are not CUDA devices: every check
is SKIP, saying so. Exit status: 1 when a check failed, else 0 (2: a bad command line).

How it runs. This process (the supervisor) loads neither NVML nor CUDA. A probe and then each
check run in a child process of their own, in a new session, within the check's own limit
and what is left of the global timeout (--timeout-s, 280 s by default, so that the whole run
ends within 5 minutes). A child still running at its limit is killed with its process group
and with the sandbox processes its runtime started (they run in sessions of their own and
carry the marker tangram.runtime.sandbox.kills.kill_marked finds), and its check is FAIL, saying
that it did not finish. The children import this file as the module `bench.gpu_check`, and the checks from
bench/gpu_check_cases.py, so that the functions they hand to tangram as GPU actions pickle
by reference and are imported, not copied, in the sandbox (bench/gpu_probe.py: the CUDA
driver API and NVML they read the GPU through). The service hooks run in the check's own process, as a reward
model's do.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script (`python bench/gpu_check.py`): bench is the checkout's
    sys.path.insert(1, ROOT)

from bench.gpu_check_cases import (  # noqa: E402  (the checkout's bench package, found through ROOT)
    FAIL,
    PASS,
    SKIP,
    check_context_cost,
    check_discovery,
    check_evict_then_start,
    check_grant_per_action,
    check_mps_limits,
    verdict,
)
from bench.gpu_probe import FAKE_ENV, describe_machine, fake_gpus_reason, no_gpu_reason, probe_machine  # noqa: E402


DEFAULT_TIMEOUT_S = 280.0
# (name, what it proves, its own time limit in seconds): run in this order.
CHECKS: tuple[tuple[str, str, float], ...] = (
    ("discovery", "tangram's discovery against CUDA's own view", 60.0),
    ("context_cost", "what a CUDA context takes on the device", 60.0),
    ("grant_per_action", "each GPU action of a sandbox sees its own grant", 120.0),
    ("evict_then_start", "evict-then-start under a real offload", 150.0),
    ("mps_limits", "MPS memory limits, where MPS runs", 90.0),
)
PROBE_LIMIT_S = 45.0  # cuInit and NVML's first init can take seconds on a large machine
REPORT_RESERVE_S = 2.0  # kept back from the global timeout for the report
MIN_CHECK_S = 8.0  # less than this left: a check is not started

# ---------------------------------------------------------------- child processes

CHILD_TASKS: dict[str, Callable[[float, Mapping[str, Any]], dict[str, Any]]] = {
    "probe": lambda budget, context: {"machine": probe_machine(context.get("library"))},
    "discovery": check_discovery,
    "context_cost": check_context_cost,
    "grant_per_action": check_grant_per_action,
    "evict_then_start": check_evict_then_start,
    "mps_limits": check_mps_limits,
}
# How the supervisor starts a child: this file imported as `bench.gpu_check` from the
# repository's root (argv: root, task, result file, budget, context as JSON).
CHILD_BOOT = ("import sys; sys.path[0] = sys.argv[1]; from bench import gpu_check; "
              "sys.exit(gpu_check.child_main(sys.argv[2:]))")


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)


def write_json(path: str, document: Any) -> None:
    """Written whole or not at all (a file renamed into place)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def child_main(argv: Sequence[str]) -> int:
    """A child's work: the task named in argv, its result written as JSON to the file named
    there; an exception is the check's FAIL, with its traceback."""
    task, result_path, budget, context = argv[0], argv[1], float(argv[2]), json.loads(argv[3])
    try:
        result = CHILD_TASKS[task](budget, context)
    except Exception as e:
        result = verdict(FAIL, f"{type(e).__name__}: {e}", problems=[f"{type(e).__name__}: {e}"],
                         traceback=traceback.format_exc())
    write_json(result_path, result)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Not a normal exit: that joins every thread, and a hook stuck in a CUDA call (which a
    # Python thread cannot be made to leave) would hold the written result back until the kill.
    os._exit(0)


def kill_check_processes(pid: int) -> None:
    """Kills a check's child (its process group) and the sandbox processes its runtime
    started: those run in sessions of their own, marked with the CPU manager's id, which
    begins with the pid of the process that made it. Then removes the cgroups of runtimes
    whose process is gone (`tangram-<pid>-<n>`), as the next CPU manager would."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    try:
        from tangram.runtime.sandbox.isolation import detect, remove_stale
        from tangram.runtime.sandbox.kills import kill_marked
    except ImportError:
        return
    kill_marked(f"{pid}.")
    with contextlib.suppress(Exception):  # no cgroups here, or not ours to remove: nothing left behind then
        for base in dict.fromkeys(detect().dirs.values()):
            remove_stale(base)


def run_isolated(command: Sequence[str], limit_s: float, log_path: str) -> tuple[int | None, float]:
    """Runs `command` in a new session, its output to `log_path`, for at most `limit_s`
    seconds: (its exit status, or None when it was killed at the limit; seconds it took).
    Whatever ends the wait (the limit, a KeyboardInterrupt), nothing it started outlives it."""
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        returncode: int | None = None
        try:
            returncode = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                kill_check_processes(proc.pid)
                proc.wait()
    return returncode, time.monotonic() - started


def run_child(task: str, limit_s: float, context: Mapping[str, Any], workdir: str) -> dict[str, Any]:
    """Runs `task` in a child process within `limit_s` seconds; returns its result, or a FAIL
    saying that it did not finish (it was killed) or ended without one."""
    result_path = os.path.join(workdir, f"{task}.json")
    log_path = os.path.join(workdir, f"{task}.log")
    command = [sys.executable, "-c", CHILD_BOOT, ROOT, task, result_path, f"{limit_s:.3f}", json.dumps(context)]
    returncode, elapsed = run_isolated(command, limit_s, log_path)
    with open(log_path, "rb") as f:
        log_tail = f.read()[-4000:].decode(errors="replace")
    result: dict[str, Any] | None = None
    if returncode is None:
        result = verdict(FAIL, f"did not finish within {limit_s:.0f} s: killed with every process it started",
                         problems=["did not finish"], finished=False)
    elif os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    else:
        how = f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
        result = verdict(FAIL, f"its process ended ({how}) without a result", problems=[f"the process ended ({how})"])
    if result.get("status") == FAIL and log_tail.strip():
        result["log_tail"] = log_tail
    result["seconds"] = round(elapsed, 2)
    return result


# ---------------------------------------------------------------- the report


def summarize(checks: Sequence[Mapping[str, Any]], nothing_checked: str | None = None) -> tuple[str, int]:
    """The summary line and the exit status: 1 when a check failed, else 0."""
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in (PASS, FAIL, SKIP)}
    failed = [c["name"] for c in checks if c["status"] == FAIL]
    unfinished = [c["name"] for c in checks if c.get("finished") is False]
    if nothing_checked is not None and not failed:
        return nothing_checked, 0
    text = f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"
    if failed:
        text += f"; FAILED: {', '.join(failed)}"
    if unfinished:
        text += f"; did not finish: {', '.join(unfinished)}"
    return text, 1 if failed else 0


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e6 else f"{value:.0f}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=_json_default, separators=(", ", ": "))
    return str(value)


def format_report(report: Mapping[str, Any], width: int = 110) -> str:
    """The stdout form: the machine, a table of the checks (name, status, seconds, headline),
    then each check's problems, notes and figures, then the summary."""
    lines = [f"tangram GPU check: {describe_machine(report['machine'])}", ""]
    checks = report["checks"]
    name_w = max(len("check"), *(len(c["name"]) for c in checks))
    head = f"{'check':<{name_w}}  status  seconds  "
    lines.append(head + "result")
    wrap = max(30, width - len(head))
    previous = None
    for c in checks:
        # One reason shared by every check (no GPU here) is written out once.
        headline = "the same reason as above" if c["headline"] == previous else c["headline"]
        previous = c["headline"]
        text = textwrap.wrap(headline, wrap) or [""]
        lines.append(f"{c['name']:<{name_w}}  {c['status']:<6}  {c.get('seconds', 0.0):7.1f}  {text[0]}")
        lines.extend(" " * len(head) + t for t in text[1:])
    for c in checks:
        details = ([f"problem: {p}" for p in c.get("problems", [])] + [f"note: {n}" for n in c.get("notes", [])] +
                   [f"{k}: {_value(v)}" for k, v in c.get("figures", {}).items()])
        if not details:
            continue
        lines += ["", f"{c['name']} ({c['title']}): {c['status']}"]
        for d in details:
            lines.extend(textwrap.wrap(d, width, initial_indent="  ", subsequent_indent="      "))
    lines += ["", f"summary: {report['summary']['text']}"]
    return "\n".join(lines)


def run_checks(timeout_s: float) -> dict[str, Any]:
    """The whole run: the probe, then each check unless there is nothing to check; the
    report document (the --json form)."""
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    started = time.monotonic()
    deadline = started + timeout_s

    def left() -> float:
        return deadline - time.monotonic() - REPORT_RESERVE_S

    fake = os.environ.get(FAKE_ENV, "").strip()
    checks: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tangram-gpu-check-") as workdir:
        probe = run_child("probe", max(1.0, min(PROBE_LIMIT_S, left())), {}, workdir)
        machine = probe.get("machine") or {"error": probe["headline"]}
        no_gpu = None if "error" in machine else no_gpu_reason(machine)
        skip_all = []
        if no_gpu is not None:
            skip_all.append(f"no NVIDIA GPU ({no_gpu})")
        if fake:
            skip_all.append(fake_gpus_reason(fake))
        context = {"library": (machine.get("cuda") or {}).get("library")}
        for name, title, limit in CHECKS:
            if "error" in machine:
                result = verdict(FAIL, f"not run: the machine probe failed: {probe['headline']}", finished=False)
            elif skip_all:
                result = verdict(SKIP, "; ".join(skip_all))
            elif left() < MIN_CHECK_S:
                result = verdict(FAIL, f"not run: the global timeout of {timeout_s:g} s was spent", finished=False)
            else:
                result = run_child(name, min(limit, left()), context, workdir)
            checks.append({"name": name, "title": title, "seconds": 0.0, **result})
    reasons = (["no NVIDIA GPU"] if no_gpu is not None else []) + \
        ([f"{FAKE_ENV} is set and fake GPUs are not CUDA devices"] if fake else [])
    nothing_checked = f"{'; '.join(reasons)}: nothing checked" if reasons else None
    text, exit_code = summarize(checks, nothing_checked)
    if "error" in machine:
        text = f"the machine probe failed ({probe['headline']}): " + text
    counts = {s.lower(): sum(1 for c in checks if c["status"] == s) for s in (PASS, FAIL, SKIP)}
    return {"tool": "bench/gpu_check.py", "started": started_at, "timeout_s": timeout_s,
            "elapsed_s": round(time.monotonic() - started, 2), "machine": machine, "checks": checks,
            "summary": {"text": text, "exit_code": exit_code, **counts,
                        "unfinished": [c["name"] for c in checks if c.get("finished") is False]}}


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="OUT", help="also write the report as a JSON document to OUT")
    parser.add_argument("--timeout-s", type=_positive_seconds, default=DEFAULT_TIMEOUT_S,
                        help=f"the whole run's limit in seconds (default {DEFAULT_TIMEOUT_S:g}); what runs past it "
                             f"is killed and reported as not finished")
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: no folder {os.path.dirname(os.path.abspath(args.json))!r}")
    report = run_checks(args.timeout_s)
    print(format_report(report), flush=True)
    if args.json:
        write_json(args.json, report)
    return int(report["summary"]["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
