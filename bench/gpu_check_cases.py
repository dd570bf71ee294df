"""The five checks of bench/gpu_check.py, each run in a child process of its own: what it
measures on the GPU (through a tangram runtime where the check is about tangram) and the
judge that turns those figures into PASS, FAIL or SKIP. The judges are pure functions of
the figures (tests/test_gpu_check.py feeds them recorded and made-up ones). The functions
handed to tangram as GPU actions live here too and pickle by reference as
`bench.gpu_check_cases`: the sandboxes import them from the checkout, as the child does."""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from bench.gpu_probe import (
    CU_RESULT_NAMES,
    CUDA_ERROR_OUT_OF_MEMORY,
    MIB,
    CudaDriver,
    CudaError,
    CudaUnavailable,
    nvml_handle,
    nvml_memory,
    nvml_process_memory,
    nvml_session,
    uuid_key,
    uuid_prefix,
)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
CHILD_GRACE_S = 6.0  # a check stops its own work this long before its limit, closing its runtime itself

# What a plan sets aside for one process's CUDA context (context_cost measures it: a few
# hundred MiB on a Hopper GPU), so that planned grants hold real allocations.
CONTEXT_ALLOWANCE_MIB = 1024
SERVICE_SHARE = 0.6  # of the device's free memory, allocated by the service's load hook
ACTION_SHARE = 0.5  # of it granted to the action that needs the service evicted
OFFLOAD_HOLD_S = 1.0  # the offload hook holds the device memory this much longer before freeing it
MIN_EVICTION_DEVICE_MIB = 16384  # below this the margins of the eviction plan prove nothing
SERVICE_NAME = "resident"
SERVICE_CALL_GPU_MIB = 64  # a service call's own gpu_memory (as tests/runtime/test_live.py's)
GRANTS_MIB = (4096, 8192)  # the two actions' grants in grant_per_action (halved down on a small device)
MPS_SLICE_MIB, MPS_OVER_MIB, MPS_UNDER_MIB = 2048, 4096, 1024
TRAJECTORY = 1
ACTION_TIMEOUT_S = 60.0  # a GPU action's own timeout: tangram kills its sandbox past it
# A service hook past this fails what waited for it and leaves the service out of use, so a
# stuck CUDA call in a hook ends the check with that message while time is left to close the
# runtime (loading 60% of an H200 is an allocation and a memset: well under a second).
HOOK_TIMEOUT_S = 30.0

# ---------------------------------------------------------------- results


def verdict(status: str, headline: str, figures: Mapping[str, Any] | None = None,
            problems: Iterable[str] = (), notes: Iterable[str] = (), **extra: Any) -> dict[str, Any]:
    """One check's result: PASS/FAIL/SKIP, a one-line headline (the reason, for FAIL and
    SKIP), its measured figures, what failed and what is worth knowing."""
    return {"status": status, "headline": headline, "figures": dict(figures or {}), "problems": list(problems),
            "notes": list(notes), **extra}


def _round(value: Any, digits: int = 1) -> Any:
    return round(value, digits) if isinstance(value, float) else value


# ---------------------------------------------------------------- 1. discovery vs CUDA


def judge_discovery(tangram: Sequence[Mapping[str, Any]], cuda: Sequence[Mapping[str, Any]],
                    nvml: Mapping[str, Mapping[str, Any]], pci_order: bool = False) -> dict[str, Any]:
    """Compares tangram's devices (GpuDevice.describe() dicts) with CUDA's (CudaDriver.
    describe() plus "free_in_context_mib") and NVML's memory by tangram UUID (nvml_memory).

    FAIL on: another device count or another set of UUIDs; another order where
    CUDA_DEVICE_ORDER=PCI_BUS_ID promises NVML's (`pci_order`); CUDA's total outside
    [NVML's total less its reserved, NVML's total] (the driver's reservation is not CUDA's
    to allocate, so CUDA may leave it out), with a tolerance of 0.1% or 64 MiB; a v2 reading
    whose reserved + used + free is not its total (beyond 16 MiB); tangram planning with
    more than NVML reports free or CUDA's total; tangram's own total not NVML's."""
    problems: list[str] = []
    notes: list[str] = []
    if not tangram and not cuda:
        problems.append("neither tangram nor CUDA sees a device")
    if len(tangram) != len(cuda):
        problems.append(f"tangram discovers {len(tangram)} device(s), CUDA enumerates {len(cuda)}")
    tangram_keys = [uuid_key(str(d["uuid"])) for d in tangram]
    cuda_keys = [uuid_key(str(c["uuid"])) for c in cuda]
    if set(tangram_keys) != set(cuda_keys):
        problems.append(f"different UUIDs: tangram {[d['uuid'] for d in tangram]}, CUDA {[c['uuid'] for c in cuda]}")
    elif tangram_keys != cuda_keys:
        message = "tangram's order (NVML's, PCI bus order) is not CUDA's ordinal order"
        (problems if pci_order else notes).append(message + (" although CUDA_DEVICE_ORDER=PCI_BUS_ID" if pci_order else
                                                             ": grants name UUIDs, so they stay right"))
    by_key = {uuid_key(str(c["uuid"])): c for c in cuda}
    rows = []
    for d in tangram:
        uuid = str(d["uuid"])
        c = by_key.get(uuid_key(uuid))
        n = nvml.get(uuid)
        memory = float(d["memory_mib"])
        row: dict[str, Any] = {"uuid": uuid, "name": d.get("name"), "tangram_memory_mib": _round(memory)}
        if c is not None:
            row.update(cuda_ordinal=c.get("ordinal"), cuda_name=c.get("name"),
                       compute_capability=c.get("compute_capability"), cuda_total_mib=_round(c.get("total_mib")),
                       cuda_free_in_context_mib=_round(c.get("free_in_context_mib")))
            if c.get("name") != d.get("name"):
                notes.append(f"{uuid}: NVML names it {d.get('name')!r}, CUDA {c.get('name')!r}")
            if memory > float(c["total_mib"]):
                problems.append(f"{uuid}: tangram plans with {memory:.0f} MiB, more than CUDA's total "
                                f"{float(c['total_mib']):.0f} MiB")
        if n is None:
            problems.append(f"{uuid}: NVML has no memory reading for it")
        else:
            total = float(n["total_mib"])
            tolerance = max(64.0, 0.001 * total)
            # v1 counts the reservation in used: then all of used may be what CUDA leaves out.
            reserved = float(n["reserved_mib"] if n.get("reserved_mib") is not None else n.get("used_mib") or 0.0)
            row.update(nvml_memory_version=n.get("version"), nvml_total_mib=_round(total),
                       nvml_reserved_mib=_round(n.get("reserved_mib")), nvml_used_mib=_round(n.get("used_mib")),
                       nvml_free_mib=_round(n.get("free_mib")))
            if c is not None:
                cuda_total = float(c["total_mib"])
                row["cuda_total_minus_nvml_total_mib"] = _round(cuda_total - total)
                if not total - reserved - tolerance <= cuda_total <= total + tolerance:
                    problems.append(f"{uuid}: CUDA's total {cuda_total:.0f} MiB is neither NVML's total {total:.0f} "
                                    f"MiB nor that less the driver's reserved {reserved:.0f} MiB")
            if n.get("reserved_mib") is not None:
                parts = float(n["reserved_mib"]) + float(n["used_mib"]) + float(n["free_mib"])
                if abs(parts - total) > 16.0:
                    problems.append(f"{uuid}: NVML v2 reserved + used + free = {parts:.0f} MiB, not its total "
                                    f"{total:.0f} MiB")
            if memory > float(n["free_mib"]) + 1.0:  # 1 MiB: float rounding, not another process
                problems.append(f"{uuid}: tangram plans with {memory:.0f} MiB but NVML reports "
                                f"{float(n['free_mib']):.0f} MiB free")
            if d.get("total_mib") is not None and abs(float(d["total_mib"]) - total) > tolerance:
                problems.append(f"{uuid}: tangram read a total of {float(d['total_mib']):.0f} MiB, NVML now "
                                f"{total:.0f} MiB")
        rows.append(row)
    figures = {"tangram_devices": len(tangram), "cuda_devices": len(cuda), "devices": rows}
    if problems:
        return verdict(FAIL, problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                       figures, problems, notes)
    first = rows[0]
    headline = (f"{len(rows)} device(s), the same UUIDs; {first.get('name')} (compute capability "
                f"{first.get('compute_capability')}): tangram plans with {first['tangram_memory_mib']:.0f} of "
                f"{first.get('nvml_total_mib', 0):.0f} MiB (NVML free {first.get('nvml_free_mib', 0):.0f}, "
                f"reserved {first.get('nvml_reserved_mib')})")
    return verdict(PASS, headline, figures, problems, notes)


def check_discovery(budget: float, context: Mapping[str, Any]) -> dict[str, Any]:
    from tangram.devices import discover

    devices = discover()  # first: what is free before this process makes any context
    tangram_view = [d.describe() for d in devices]
    nvml_view: dict[str, dict[str, Any]] = {}
    with nvml_session() as pynvml:
        for d in devices:
            with contextlib.suppress(LookupError):
                nvml_view[d.uuid] = nvml_memory(pynvml, nvml_handle(pynvml, d.uuid))
    driver = CudaDriver.open(context.get("library"))
    driver.init()
    cuda_view = []
    prefixes = {uuid_key(d.uuid): uuid_prefix(d.uuid) for d in devices}
    for ordinal in range(driver.device_count()):
        info = driver.describe(ordinal)
        info["uuid"] = prefixes.get(uuid_key(info["uuid"]), "GPU-") + info["uuid"][4:]
        ctx = driver.create_context(driver.device(ordinal))
        try:
            free, total = driver.mem_get_info()
            info["free_in_context_mib"] = free / MIB
            info["total_in_context_mib"] = total / MIB
        finally:
            driver.destroy_context(ctx)
        cuda_view.append(info)
    return judge_discovery(tangram_view, cuda_view, nvml_view, os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID")


# ---------------------------------------------------------------- 2. a context's cost


def judge_context_cost(before: Mapping[str, Any], during: Mapping[str, Any], after: Mapping[str, Any],
                       free_in_context_mib: float, create_seconds: float,
                       process_mib: float | None = None) -> dict[str, Any]:
    """A context's cost from NVML's device readings before, with and after it, and CUDA's
    free memory inside it. FAIL when neither NVML nor CUDA shows any memory taken."""
    by_nvml = float(during["used_mib"]) - float(before["used_mib"])
    by_cuda = float(before["free_mib"]) - free_in_context_mib
    released = float(during["used_mib"]) - float(after["used_mib"])
    figures = {"context_mib_nvml_used": _round(by_nvml), "context_mib_cuda_free": _round(by_cuda),
               "released_on_destroy_mib": _round(released), "nvml_process_mib": _round(process_mib),
               "create_seconds": round(create_seconds, 3), "nvml_used_before_mib": _round(before["used_mib"]),
               "nvml_used_with_context_mib": _round(during["used_mib"]),
               "nvml_used_after_destroy_mib": _round(after["used_mib"]), "allowance_mib": CONTEXT_ALLOWANCE_MIB}
    notes = []
    cost = by_nvml if by_nvml > 0 else by_cuda
    if cost <= 0:
        return verdict(FAIL, "no memory taken by a CUDA context is visible (NVML used and CUDA free unchanged)",
                       figures, ["no memory taken by a CUDA context is visible"])
    if cost > CONTEXT_ALLOWANCE_MIB:
        notes.append(f"a context takes {cost:.0f} MiB, more than the {CONTEXT_ALLOWANCE_MIB} MiB these checks allow "
                     f"for one: give services and GPU actions more for it")
    if released < 0.9 * by_nvml:
        notes.append(f"destroying the context gave back {released:.0f} of {by_nvml:.0f} MiB (another process may have "
                     f"allocated meanwhile)")
    headline = (f"a context takes {cost:.0f} MiB (NVML used +{by_nvml:.0f}, CUDA free -{by_cuda:.0f}); made in "
                f"{create_seconds:.2f} s; {released:.0f} MiB back on destroy")
    return verdict(PASS, headline, figures, notes=notes)


def check_context_cost(budget: float, context: Mapping[str, Any]) -> dict[str, Any]:
    driver = CudaDriver.open(context.get("library"))
    driver.init()
    device = driver.device(0)
    uuid = driver.uuid(device, uuid_prefix(os.environ.get("CUDA_VISIBLE_DEVICES")))
    with nvml_session() as pynvml:
        handle = nvml_handle(pynvml, uuid)
        before = nvml_memory(pynvml, handle)
        started = time.monotonic()
        ctx = driver.create_context(device)
        create_seconds = time.monotonic() - started
        try:
            free, _ = driver.mem_get_info()
            during = nvml_memory(pynvml, handle)
            process_mib = nvml_process_memory(pynvml, handle, os.getpid())
        finally:
            driver.destroy_context(ctx)
        after = nvml_memory(pynvml, handle)
    result = judge_context_cost(before, during, after, free / MIB, create_seconds, process_mib)
    result["figures"]["device"] = uuid
    return result


# ---------------------------------------------------------------- GPU actions (run in sandboxes)


def nvidia_device_nodes() -> list[str]:
    """The NVIDIA device nodes this process can see (/dev/nvidia*)."""
    import glob

    return sorted(glob.glob("/dev/nvidia*"))


def worker_view() -> dict[str, Any]:
    """A CPU action: the trajectory's worker's pid and the NVIDIA device nodes it sees (none
    in a namespaced sandbox started without a GPU placement)."""
    return {"pid": os.getpid(), "devices": nvidia_device_nodes()}


def grant_seen_here() -> dict[str, Any]:
    """What this process was given: its pid and parent, the grant's environment, the NVIDIA
    device nodes it sees, and when it started (time.monotonic: CLOCK_MONOTONIC, one clock for
    every process of the machine)."""
    return {"started": time.monotonic(), "pid": os.getpid(), "ppid": os.getppid(), "devices": nvidia_device_nodes(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "memory_env": os.environ.get("TANGRAM_GPU_MEMORY_MIB"),
            "pinned_env": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            "mps_pipe_env": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}


def action_cuda_grant(library: str | None) -> dict[str, Any]:
    """A GPU function action: its grant (grant_seen_here) and the device CUDA shows it as
    ordinal 0 (UUID, name), with how many devices CUDA sees. Makes no context."""
    report = grant_seen_here()
    try:
        driver = CudaDriver.open(library)
        report["libcuda_by_name"] = driver.found_by_name
        driver.init()
        report["cuda_count"] = driver.device_count()
        device = driver.device(0)
        report["cuda_uuid"] = driver.uuid(device, uuid_prefix(report["visible"]))
        report["cuda_name"] = driver.name(device)
    except (CudaError, CudaUnavailable) as e:
        report["cuda_error"] = str(e)
    return report


def try_allocation(driver: CudaDriver, nbytes: int) -> dict[str, Any]:
    """Allocates `nbytes` on the current context, writes them, frees them: {"mib", "ok",
    "error"} (the CUresult name of what failed)."""
    out: dict[str, Any] = {"mib": nbytes / MIB, "ok": False, "error": None}
    try:
        pointer = driver.mem_alloc(nbytes)
    except CudaError as e:
        out["error"] = e.name
        return out
    try:
        driver.memset(pointer, 0xA5, nbytes)  # touched, not only reserved
        driver.synchronize()
        out["ok"] = True
    except CudaError as e:
        out["error"] = e.name
    finally:
        with contextlib.suppress(CudaError):
            driver.mem_free(pointer)
    return out


def _on_device_zero(report: dict[str, Any], library: str | None,
                    work: Callable[[CudaDriver], None]) -> dict[str, Any]:
    """Runs `work` in a context on CUDA's device 0 (the granted one), recording CUDA's free
    memory at the start and any CUDA failure in `report`."""
    driver: CudaDriver | None = None
    ctx = None
    try:
        driver = CudaDriver.open(library)
        report["libcuda_by_name"] = driver.found_by_name
        driver.init()
        ctx = driver.create_context(driver.device(0))
        report["free_at_start_mib"] = driver.mem_get_info()[0] / MIB
        work(driver)
    except (CudaError, CudaUnavailable) as e:
        report["cuda_error"] = str(e)
    finally:
        if driver is not None and ctx is not None:
            with contextlib.suppress(CudaError):
                driver.destroy_context(ctx)
    report["ended"] = time.monotonic()
    return report


def action_allocate(nbytes: int, library: str | None) -> dict[str, Any]:
    """A GPU function action that allocates (and writes) `nbytes` of device memory in its
    own process: {"allocation": try_allocation(...), ...} with its start time."""
    report = grant_seen_here()

    def work(driver: CudaDriver) -> None:
        report["allocation"] = try_allocation(driver, nbytes)

    return _on_device_zero(report, library, work)


def action_mps_limit(over_bytes: int, under_bytes: int, library: str | None) -> dict[str, Any]:
    """A GPU function action under an MPS memory limit: allocates more than its slice
    ("over", must fail), then less ("under", must succeed)."""
    report = grant_seen_here()

    def work(driver: CudaDriver) -> None:
        report["over"] = try_allocation(driver, over_bytes)
        report["under"] = try_allocation(driver, under_bytes)

    return _on_device_zero(report, library, work)


# ---------------------------------------------------------------- the runtime


def host_inventory(devices: Sequence[Any], services: Sequence[Any] = ()) -> Any:
    """This machine as one node: its CPUs and memory, and exactly `devices` as its GPUs (the
    list the GPU manager gets too, so that both hold the same memories)."""
    from tangram import Inventory

    memory = math.floor(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MIB)
    return Inventory.uniform(1, {"cpu": len(os.sched_getaffinity(0)), "memory": memory},
                             gpus=[d.memory_mib for d in devices], services=list(services))


def orchestrator(devices: Sequence[Any], services: Sequence[Any] = (),
                 hooks: Mapping[str, Any] | None = None) -> Any:
    """A tangram runtime over `devices`: the CPU manager (sandboxes, default options) and the
    GPU manager with that device table (MPS detected as it always is)."""
    from tangram import Orchestrator, RuntimeConfig
    from tangram.runtime.managers.gpu import GpuManager

    gpu = GpuManager(services=dict(hooks or {}), devices=list(devices), hook_timeout=HOOK_TIMEOUT_S)
    return Orchestrator(inventory=host_inventory(devices, services), default_managers=False, managers={"gpu": gpu},
                        config=RuntimeConfig(managers={"cpu": {}}))


def _record(orch: Any, action_id: int) -> Any:
    return next(r for r in orch.records if r.id == action_id)


def gpu_call(fn: Callable[..., Any], args: tuple[Any, ...], gpu_memory: float) -> Any:
    """A GPU function action of the checks' trajectory, one core, a declared run time."""
    from tangram import Call

    return Call(fn=fn, args=args, resources={"cpu": 1}, gpu_memory=gpu_memory, trajectory=TRAJECTORY,
                runtime=1.0, timeout=ACTION_TIMEOUT_S, kind="gpu-check")


def run_async(make: Callable[[], Any], budget: float) -> Any:
    """Runs the coroutine `make()` within the check's budget less its grace: past it the
    task is cancelled, which closes the runtime (its sandboxes are killed) before the
    supervisor would have to."""
    import asyncio

    limit = max(1.0, budget - CHILD_GRACE_S)

    async def bounded() -> Any:
        try:
            return await asyncio.wait_for(make(), limit)
        except asyncio.TimeoutError:
            raise TimeoutError(f"did not finish within its {limit:.0f} s (the runtime was closed)") from None

    return asyncio.run(bounded())


# ---------------------------------------------------------------- 3. each action sees its own grant


def grant_sizes(memory_mib: float) -> tuple[float, float]:
    """Two different grants below the device's memory (so that under MPS both are capped
    slices): 4,096 and 8,192 MiB, or a quarter and a half of a smaller device."""
    if memory_mib >= 2 * GRANTS_MIB[1]:
        return float(GRANTS_MIB[0]), float(GRANTS_MIB[1])
    return float(math.floor(memory_mib / 4)), float(math.floor(memory_mib / 2))


def expected_pinned_limit(grant_mib: float, device_mib: float, mig: bool, mps: bool) -> str | None:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT a grant must carry (tangram.runtime.managers.gpu.
    grant_environment's rule, stated again): a slice of a whole GPU under MPS only."""
    if mps and not mig and 0 < grant_mib < device_mib:
        return f"0={max(1, math.floor(grant_mib))}M"
    return None


async def measure_grants(devices: Sequence[Any], grants_mib: Sequence[float], library: str | None) -> dict[str, Any]:
    """Runs a CPU action (the trajectory's worker pid) and then one GPU function action per
    grant, one after another, in one trajectory; returns what each saw and where the core
    placed it."""
    from tangram import Call

    async with orchestrator(devices) as orch:
        gpu = orch.managers["gpu"]
        worker = await orch.run(Call(fn=worker_view, resources={"cpu": 1}, trajectory=TRAJECTORY, runtime=1.0,
                                     timeout=ACTION_TIMEOUT_S, kind="gpu-check"))
        actions = []
        for grant in grants_mib:
            handle = orch.submit(gpu_call(action_cuda_grant, (library,), grant))
            report = await handle
            device = _record(orch, handle.id).device
            actions.append({"grant_mib": grant, "device": device, "device_uuid": devices[device].uuid,
                            "device_memory_mib": devices[device].memory_mib, "device_mig": devices[device].mig,
                            "report": report})
        return {"worker_pid": worker["pid"], "worker_devices": worker["devices"], "mps": gpu.mps,
                "isolation": orch.managers["cpu"].describe()["isolation"], "actions": actions}


def judge_grants(run: Mapping[str, Any]) -> dict[str, Any]:
    """PASS when every GPU action ran on its granted device as CUDA sees it (ordinal 0 is
    the granted UUID, the only device), saw its own TANGRAM_GPU_MEMORY_MIB (and MPS limit),
    and ran in a process of its own forked by the trajectory's worker. Under
    isolation="namespaces" the GPU actions' worker is another than the CPU action's (a worker
    gets the device nodes at its start: tangram.runtime.sandbox.namespaces), so there the CPU action
    must have seen no /dev/nvidia* node, the GPU actions must have seen them, and the two must
    share one parent."""
    problems: list[str] = []
    notes: list[str] = []
    namespaced = run.get("isolation") == "namespaces"
    worker = run["worker_pid"]
    if namespaced:
        if run.get("worker_devices"):
            problems.append(f"the CPU action's sandbox sees NVIDIA device nodes {run['worker_devices']} without a GPU "
                            "placement")
        parents = {a["report"].get("ppid") for a in run["actions"]}
        if len(parents) != 1:
            problems.append(f"the GPU actions' parents are {sorted(map(str, parents))}, not one worker")
        worker = next(iter(parents)) if len(parents) == 1 else worker
    rows = []
    scrubbed_library = False  # noted once
    for i, action in enumerate(run["actions"], 1):
        r = action["report"]
        grant = float(action["grant_mib"])
        label = f"action {i} (grant {grant:.0f} MiB)"
        if r.get("cuda_error"):
            problems.append(f"{label}: {r['cuda_error']}")
        if r.get("visible") != action["device_uuid"]:
            problems.append(f"{label}: CUDA_VISIBLE_DEVICES={r.get('visible')!r}, the grant is {action['device_uuid']}")
        if r.get("cuda_uuid") is not None and uuid_key(r["cuda_uuid"]) != uuid_key(action["device_uuid"]):
            problems.append(f"{label}: CUDA's device 0 is {r['cuda_uuid']}, the grant is {action['device_uuid']}")
        if r.get("cuda_count") not in (None, 1):
            problems.append(f"{label}: CUDA sees {r['cuda_count']} devices, not only the granted one")
        try:
            seen = float(r.get("memory_env") or "nan")
        except ValueError:
            seen = math.nan
        if seen != grant:
            problems.append(f"{label}: TANGRAM_GPU_MEMORY_MIB={r.get('memory_env')!r}, not its own grant")
        pinned = expected_pinned_limit(grant, float(action["device_memory_mib"]), bool(action.get("device_mig")),
                                       bool(run.get("mps")))
        if r.get("pinned_env") != pinned:
            problems.append(f"{label}: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={r.get('pinned_env')!r}, expected {pinned!r}")
        if namespaced and not r.get("devices"):
            problems.append(f"{label}: its sandbox shows no NVIDIA device node")
        if r.get("pid") == worker:
            problems.append(f"{label}: ran in the trajectory's worker (pid {worker}), not in a process of its own")
        elif r.get("ppid") != worker:
            problems.append(f"{label}: its parent is pid {r.get('ppid')}, not the trajectory's worker {worker}")
        if r.get("libcuda_by_name") is False and not scrubbed_library:
            scrubbed_library = True
            notes.append("libcuda.so.1 is not found by name in the sandbox's scrubbed environment (the actions loaded "
                         "it by its path): CUDA programs there need the driver's folder in the loader's cache "
                         "(ldconfig), or CpuManager(inherit_env=['LD_LIBRARY_PATH'])")
        rows.append({"grant_mib": grant, "device": action["device"], "pid": r.get("pid"), "ppid": r.get("ppid"),
                     "CUDA_VISIBLE_DEVICES": r.get("visible"), "TANGRAM_GPU_MEMORY_MIB": r.get("memory_env"),
                     "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": r.get("pinned_env"), "cuda_device_0": r.get("cuda_uuid"),
                     "cuda_devices": r.get("cuda_count")})
    pids = [a["report"].get("pid") for a in run["actions"]]
    if len(set(pids)) != len(pids):
        problems.append(f"GPU actions shared a process (pids {pids})")
    figures = {"worker_pid": worker, "mps": run.get("mps"), "isolation": run.get("isolation"),
               "cpu_action_devices": run.get("worker_devices"), "actions": rows}
    if problems:
        return verdict(FAIL, problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                       figures, problems, notes)
    grants = " and ".join(f"{float(a['grant_mib']):.0f}" for a in run["actions"])
    headline = (f"{len(pids)} GPU actions of one trajectory ({grants} MiB) each saw its own grant and CUDA device "
                f"{run['actions'][0]['device_uuid']}, each in its own process forked by the worker (pid {worker})")
    if namespaced:
        headline += "; namespaced sandboxes: /dev/nvidia* in the GPU actions' only, none in the CPU action's"
    return verdict(PASS, headline, figures, notes=notes)


def check_grant_per_action(budget: float, context: Mapping[str, Any]) -> dict[str, Any]:
    from tangram.devices import discover

    devices = discover()
    if not devices:
        return verdict(FAIL, "tangram discovers no device")
    grants = grant_sizes(min(d.memory_mib for d in devices))
    return judge_grants(run_async(lambda: measure_grants(devices, grants, context.get("library")), budget))


# ---------------------------------------------------------------- 4. evict, then start


class DeviceMemoryService:
    """A GPU service's model whose weights are real device memory: `load` makes a context on
    the device (found by UUID) and allocates and writes `nbytes`; `offload` holds them
    `hold_s` longer (the copy to host, stretched) and then frees them; `restore` allocates
    them again; `batch` answers with the device's free MiB as its context sees it; `close`
    frees everything. `timeline` records (event, time.monotonic()) of each hook."""

    def __init__(self, nbytes: int, library: str | None = None, hold_s: float = OFFLOAD_HOLD_S,
                 driver_factory: Callable[[], Any] | None = None) -> None:
        self.nbytes = nbytes
        self.hold_s = hold_s
        self.driver_factory = driver_factory or (lambda: CudaDriver.open(library))
        self.timeline: list[tuple[str, float]] = []
        self.driver: Any = None
        self.context: int | None = None
        self.pointer: int | None = None

    def mark(self, event: str) -> None:
        self.timeline.append((event, time.monotonic()))

    def _allocate(self) -> None:
        self.driver.set_current(self.context)
        pointer = self.driver.mem_alloc(self.nbytes)
        self.driver.memset(pointer, 0x5A, self.nbytes)
        self.driver.synchronize()
        self.pointer = pointer

    def load(self, device_uuid: str) -> None:
        self.mark("load_start")
        self.driver = self.driver_factory()
        self.driver.init()
        self.context = self.driver.create_context(self.driver.device_by_uuid(device_uuid))
        self._allocate()
        self.mark("load_end")

    def offload(self) -> None:
        self.mark("offload_start")
        time.sleep(self.hold_s)  # still holding the device memory: an action started now would not get it
        self.driver.set_current(self.context)
        self.driver.mem_free(self.pointer)
        self.pointer = None
        self.driver.synchronize()
        self.mark("offload_end")

    def restore(self, device_uuid: str) -> None:
        self.mark("restore_start")
        self._allocate()
        self.mark("restore_end")

    def batch(self, inputs: list[Any]) -> list[Any]:
        self.driver.set_current(self.context)
        free = self.driver.mem_get_info()[0] / MIB
        return [free for _ in inputs]

    def close(self) -> None:
        if self.driver is None or self.context is None:
            return
        self.driver.set_current(self.context)
        if self.pointer is not None:
            self.driver.mem_free(self.pointer)
            self.pointer = None
        self.driver.destroy_context(self.context)
        self.context = None
        self.mark("closed")


def service_hooks(model: DeviceMemoryService) -> Any:
    """`model` as tangram ServiceHooks (the GPU manager runs them in the service's thread)."""
    from tangram.runtime.managers.gpu import ServiceHooks

    class Hooks(ServiceHooks):
        def load(self, device: Any) -> Any:
            model.load(device.uuid)
            return model

        def offload(self, handle: Any) -> None:
            handle.offload()

        def restore(self, handle: Any, device: Any) -> None:
            handle.restore(device.uuid)

        def batch(self, handle: Any, inputs: list[Any]) -> list[Any]:
            return handle.batch(inputs)

        def close(self, handle: Any) -> None:
            handle.close()

    return Hooks()


def eviction_plan(free_mib: float) -> dict[str, int] | None:
    """The eviction check's sizes for a device with `free_mib` free, or None below
    MIN_EVICTION_DEVICE_MIB. The service allocates 60% of it and is declared with that plus
    a context (which it keeps while offloaded: asleep_memory); the action is granted half
    and allocates that less its own context. So the core cannot place the action beside the
    resident service but can once it is offloaded, and the two allocations together would
    exceed the device: an action started before the offload's end runs out of memory."""
    if free_mib < MIN_EVICTION_DEVICE_MIB:
        return None
    service_alloc = math.floor(free_mib * SERVICE_SHARE)
    action_grant = math.floor(free_mib * ACTION_SHARE)
    return {"free_mib": math.floor(free_mib), "service_alloc_mib": service_alloc,
            "service_memory_mib": service_alloc + CONTEXT_ALLOWANCE_MIB, "asleep_memory_mib": CONTEXT_ALLOWANCE_MIB,
            "action_grant_mib": action_grant, "action_alloc_mib": action_grant - CONTEXT_ALLOWANCE_MIB}


async def measure_eviction(device: Any, plan: Mapping[str, int], library: str | None,
                           model: DeviceMemoryService) -> dict[str, Any]:
    """The runtime on `device` alone: the service made resident by one service call, then
    the GPU action that needs its memory. Returns the hooks' timeline, the action's report
    and the service's residency before and after."""
    from dataclasses import replace

    from tangram import Call, Service

    only = replace(device, index=0)  # one device: the action cannot go elsewhere
    service = Service(SERVICE_NAME, memory=plan["service_memory_mib"], restore_seconds=1.0,
                      offload_seconds=model.hold_s, asleep_memory=plan["asleep_memory_mib"], movable=False)
    async with orchestrator([only], [service], {SERVICE_NAME: service_hooks(model)}) as orch:
        free_seen_by_service = await orch.run(Call(args=("resident?",), service=SERVICE_NAME, resources={},
                                                   gpu_memory=SERVICE_CALL_GPU_MIB, kind="reward", runtime=0.1,
                                                   timeout=ACTION_TIMEOUT_S))
        resident_before = orch.scheduler.service_location(SERVICE_NAME)
        handle = orch.submit(gpu_call(action_allocate, (plan["action_alloc_mib"] * MIB, library),
                                      plan["action_grant_mib"]))
        report = await handle
        resident_after = orch.scheduler.service_location(SERVICE_NAME)
        record = _record(orch, handle.id)
    return {"plan": dict(plan), "device": device.uuid, "free_seen_by_service_mib": free_seen_by_service,
            "resident_before": resident_before, "resident_after": resident_after, "timeline": list(model.timeline),
            "action": report, "action_device": record.device, "action_wait_reason": record.wait_reason}


def judge_eviction(run: Mapping[str, Any]) -> dict[str, Any]:
    """PASS when the core evicted the resident service for the action (one offload, the
    service no longer resident), the action's own allocation succeeded, and the action
    started after the offload hook had freed the service's memory."""
    plan = run["plan"]
    report = run["action"]
    events: dict[str, list[float]] = {}
    for event, at in run["timeline"]:
        events.setdefault(event, []).append(at)
    problems: list[str] = []
    notes: list[str] = []
    offload_end = (events.get("offload_end") or [None])[-1]
    if run.get("resident_before") is None:
        problems.append("the service was not resident before the action: nothing was there to evict")
    if not events.get("offload_end"):
        problems.append("the service was never offloaded: the core placed the action without evicting it")
    elif len(events["offload_end"]) > 1:
        problems.append(f"the service was offloaded {len(events['offload_end'])} times")
    if run.get("resident_after") is not None:
        problems.append(f"the service is still resident at {run['resident_after']} after the action")
    if report.get("cuda_error"):
        problems.append(f"the action: {report['cuda_error']}")
        if "CUDA_ERROR_DEVICE_UNAVAILABLE" in report["cuda_error"]:
            notes.append("the device admits one process at a time (compute mode EXCLUSIVE_PROCESS?): a service beside "
                         "GPU actions needs the DEFAULT compute mode or MPS")
    allocation = report.get("allocation") or {}
    if allocation and not allocation.get("ok"):
        problems.append(f"the action's allocation of {allocation.get('mib', 0):.0f} MiB failed: "
                        f"{allocation.get('error')}")
    started = report.get("started")
    gap_ms = None
    if offload_end is not None and started is not None:
        gap_ms = (started - offload_end) * 1000
        if gap_ms < 0:
            problems.append(f"the action started {-gap_ms:.0f} ms before the offload had freed the service's memory")

    def seconds_between(start: str, end: str) -> float | None:
        if not events.get(start) or not events.get(end):
            return None
        return round(events[end][-1] - events[start][-1], 3)

    figures = {**plan, "offload_hold_s": OFFLOAD_HOLD_S,
               "free_seen_by_service_mib": _round(run.get("free_seen_by_service_mib")),
               "load_seconds": seconds_between("load_start", "load_end"),
               "offload_seconds": seconds_between("offload_start", "offload_end"),
               "action_start_after_offload_end_ms": None if gap_ms is None else round(gap_ms, 1),
               "action_free_at_start_mib": _round(report.get("free_at_start_mib")),
               "action_allocation": allocation, "action_device": run.get("action_device"),
               "action_wait_reason": run.get("action_wait_reason")}
    if problems:
        return verdict(FAIL, problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                       figures, problems, notes)
    headline = (f"service of {plan['service_alloc_mib']} MiB evicted for a {plan['action_grant_mib']} MiB action; the "
                f"action started {gap_ms:.0f} ms after the offload freed it and allocated "
                f"{allocation.get('mib', 0):.0f} MiB")
    return verdict(PASS, headline, figures)


def check_evict_then_start(budget: float, context: Mapping[str, Any]) -> dict[str, Any]:
    from tangram.devices import discover

    devices = discover()
    if not devices:
        return verdict(FAIL, "tangram discovers no device")
    device = devices[0]
    plan = eviction_plan(device.memory_mib)
    if plan is None:
        return verdict(SKIP, f"{device.uuid} has {device.memory_mib:.0f} MiB free, below the "
                             f"{MIN_EVICTION_DEVICE_MIB} MiB this check needs for its margins")
    library = context.get("library")
    model = DeviceMemoryService(plan["service_alloc_mib"] * MIB, library)
    return judge_eviction(run_async(lambda: measure_eviction(device, plan, library, model), budget))


# ---------------------------------------------------------------- 5. MPS limits


async def measure_mps(device: Any, library: str | None) -> dict[str, Any]:
    from dataclasses import replace

    only = replace(device, index=0)
    async with orchestrator([only]) as orch:
        gpu = orch.managers["gpu"]
        report = await orch.run(gpu_call(action_mps_limit, (MPS_OVER_MIB * MIB, MPS_UNDER_MIB * MIB, library),
                                          MPS_SLICE_MIB))
        return {"mps": gpu.mps, "pipe": gpu.mps_pipe, "slice_mib": MPS_SLICE_MIB, "device": device.uuid,
                "action": report}


def judge_mps(run: Mapping[str, Any]) -> dict[str, Any]:
    """PASS when the action carried the slice's MPS limit, its allocation beyond the slice
    failed with CUDA_ERROR_OUT_OF_MEMORY and the one within it succeeded."""
    report = run["action"]
    expected = f"0={run['slice_mib']}M"
    over, under = report.get("over") or {}, report.get("under") or {}
    problems = []
    if not run.get("mps"):
        problems.append("the GPU manager did not detect MPS, although its daemon answers")
    if report.get("pinned_env") != expected:
        problems.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={report.get('pinned_env')!r}, expected {expected!r}")
    if report.get("cuda_error"):
        problems.append(f"the action: {report['cuda_error']}")
    if over.get("ok"):
        problems.append(f"allocating {over['mib']:.0f} MiB under a {run['slice_mib']} MiB limit succeeded: MPS did not "
                        f"enforce the limit")
    elif over and over.get("error") != CU_RESULT_NAMES[CUDA_ERROR_OUT_OF_MEMORY]:
        problems.append(f"allocating {over['mib']:.0f} MiB failed with {over.get('error')}, not "
                        f"{CU_RESULT_NAMES[CUDA_ERROR_OUT_OF_MEMORY]}")
    if under and not under.get("ok"):
        problems.append(f"allocating {under['mib']:.0f} MiB within the limit failed: {under.get('error')}")
    figures = {"pipe": run.get("pipe"), "slice_mib": run["slice_mib"], "pinned_env": report.get("pinned_env"),
               "over": over, "under": under, "free_at_start_mib": _round(report.get("free_at_start_mib"))}
    if problems:
        return verdict(FAIL, problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                       figures, problems)
    return verdict(PASS, f"a {run['slice_mib']} MiB slice under MPS: {over['mib']:.0f} MiB refused "
                         f"({over.get('error')}), {under['mib']:.0f} MiB allocated", figures)


def check_mps_limits(budget: float, context: Mapping[str, Any]) -> dict[str, Any]:
    from tangram.devices import discover
    from tangram.runtime.managers.gpu import mps_active, mps_pipe_directory

    if not mps_active():
        return verdict(SKIP, f"no MPS control daemon answers in {mps_pipe_directory()} (CUDA_MPS_PIPE_DIRECTORY): "
                             f"slices are scheduling shares only here; this check never starts MPS")
    devices = discover()
    if not devices:
        return verdict(FAIL, "tangram discovers no device")
    device = devices[0]
    if device.mig:
        return verdict(SKIP, f"{device.uuid} is a MIG instance: its memory is isolated by the hardware, and tangram "
                             f"sets no MPS limit on it")
    if device.memory_mib <= MPS_OVER_MIB:
        return verdict(SKIP, f"{device.uuid} has only {device.memory_mib:.0f} MiB free")
    return judge_mps(run_async(lambda: measure_mps(device, context.get("library")), budget))
