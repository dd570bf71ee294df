"""bench/gpu_check.py on a machine without a GPU: the script run as a command (every check
SKIP with its reason, exit status 0, a valid --json document; with TANGRAM_FAKE_GPUS set
too), its child-process limit, its judging functions on hand-made measurements (a mismatch
must FAIL), and the runtime half of two checks with fake devices (no CUDA: the grant's
environment and the evict-then-start order are real, the CUDA calls fail)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tangram.devices import FAKE_ENV, parse_fake

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
# The script's GPU actions pickle by reference as `bench.gpu_check`: the sandboxes import it
# from this process's sys.path, so the repository's root must be on it (pytest puts it there
# when it collects bench/, not for this file alone).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import gpu_check, gpu_check_cases, gpu_probe  # noqa: E402

CHECK_NAMES = [name for name, _, _ in gpu_check.CHECKS]
H200_UUID = "GPU-5a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"


def has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def run_script(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    return proc, json.loads(out.read_text()) if out.exists() else None


def env_without(*names: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update(extra)
    return env


# ------------------------------------------------------------------ the command


def test_without_a_gpu_every_check_is_skipped_and_the_exit_status_is_0(tmp_path: Path) -> None:
    if has_libcuda():
        pytest.skip("this machine has libcuda.so.1: the checks would run here")
    proc, doc = run_script(tmp_path, env_without(FAKE_ENV, "CUDA_VISIBLE_DEVICES"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c["name"] for c in doc["checks"]] == CHECK_NAMES
    for check in doc["checks"]:
        assert check["status"] == "SKIP"
        assert check["headline"].startswith("no NVIDIA GPU (") and "libcuda.so.1 cannot be loaded" in check["headline"]
        assert check["title"] and check["figures"] == {} and check["problems"] == []
    assert doc["summary"] == {"text": "no NVIDIA GPU: nothing checked", "exit_code": 0, "pass": 0, "fail": 0,
                              "skip": len(CHECK_NAMES), "unfinished": []}
    machine = doc["machine"]
    assert "load_error" in machine["cuda"] and machine["tangram"]["version"] and machine["python"]
    assert doc["timeout_s"] == gpu_check.DEFAULT_TIMEOUT_S and doc["elapsed_s"] < gpu_check.DEFAULT_TIMEOUT_S
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tangram GPU check: no NVIDIA GPU")
    assert lines[-1] == "summary: no NVIDIA GPU: nothing checked"
    table = lines[lines.index(next(x for x in lines if x.startswith("check "))):]
    for name in CHECK_NAMES:
        assert any(row.split()[:2] == [name, "SKIP"] for row in table)


def test_fake_gpus_are_not_cuda_devices(tmp_path: Path) -> None:
    """Whether or not this machine has a GPU: tangram's devices would be the fake ones."""
    proc, doc = run_script(tmp_path, env_without("CUDA_VISIBLE_DEVICES", **{FAKE_ENV: "81920,mig:40960+40960"}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c["status"] for c in doc["checks"]] == ["SKIP"] * len(CHECK_NAMES)
    for check in doc["checks"]:
        assert f"{FAKE_ENV}='81920,mig:40960+40960' is set" in check["headline"]
        assert "which are not CUDA devices" in check["headline"]
    assert doc["summary"]["exit_code"] == 0 and doc["summary"]["skip"] == len(CHECK_NAMES)
    assert doc["summary"]["text"] in (f"no NVIDIA GPU; {FAKE_ENV} is set and fake GPUs are not CUDA devices: "
                                      f"nothing checked",
                                      f"{FAKE_ENV} is set and fake GPUs are not CUDA devices: nothing checked")
    assert doc["machine"]["environment"][FAKE_ENV] == "81920,mig:40960+40960"
    assert "which are not CUDA devices" in " ".join(proc.stdout.split())  # the table wraps it
    assert proc.stdout.splitlines()[-1] == f"summary: {doc['summary']['text']}"


@pytest.mark.parametrize("args, words", [
    (["--timeout-s", "0"], "--timeout-s"),
    (["--timeout-s", "soon"], "--timeout-s"),
    (["--json", "/no/such/folder/report.json"], "--json"),
])
def test_bad_command_lines_exit_2(args: list[str], words: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr


def test_the_fake_inventory_variable_is_tangrams() -> None:
    assert gpu_check.FAKE_ENV == FAKE_ENV


def test_a_child_past_its_limit_is_killed_with_what_it_started(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    script = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); "
              "time.sleep(60)")
    started = time.monotonic()
    returncode, seconds = gpu_check.run_isolated([sys.executable, "-c", script], 1.0, str(log))
    assert returncode is None and 1.0 <= seconds < 10 and time.monotonic() - started < 10
    grandchild = int(log.read_text().split()[0])
    for _ in range(200):  # killed with its session; reaped by whoever inherited it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.01)
    else:
        pytest.fail(f"pid {grandchild} outlived the child's kill")
    returncode, _ = gpu_check.run_isolated([sys.executable, "-c", "raise SystemExit(3)"], 30.0, str(log))
    assert returncode == 3


# ------------------------------------------------------------------ the CUDA wrapper's pure parts


def test_cu_result_names() -> None:
    assert gpu_probe.cu_result_name(2) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert gpu_probe.cu_result_name(2, lambda code: "FROM_THE_DRIVER") == "FROM_THE_DRIVER"
    assert gpu_probe.cu_result_name(100, lambda code: None) == "CUDA_ERROR_NO_DEVICE"  # the driver cannot name it

    def broken(code: int) -> str:
        raise OSError("no cuGetErrorName")

    assert gpu_probe.cu_result_name(805, broken) == "CUDA_ERROR_MPS_CONNECTION_FAILED"
    assert gpu_probe.cu_result_name(12345) == "CUresult 12345"
    error = gpu_probe.CudaError("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert str(error) == "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)" and error.code == 2


def test_cuda_driver_errors_say_what_is_missing() -> None:
    with pytest.raises(gpu_probe.CudaUnavailable, match="/no/such/libcuda.so.1 cannot be loaded"):
        gpu_probe.CudaDriver("/no/such/libcuda.so.1")
    libc = gpu_probe.CudaDriver("libc.so.6")  # a library without the driver API
    with pytest.raises(gpu_probe.CudaUnavailable, match="has no cuInit"):
        libc.init()
    if not has_libcuda():
        with pytest.raises(gpu_probe.CudaUnavailable, match="cannot be loaded"):
            gpu_probe.CudaDriver.open("/no/such/libcuda.so.1")


def test_uuid_formatting() -> None:
    raw = bytes(range(16))
    assert gpu_probe.format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert gpu_probe.format_uuid(raw, "MIG-") == "MIG-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert gpu_probe.format_uuid(bytes.fromhex("5a1b2c3d4e5f60718293a4b5c6d7e8f9")) == H200_UUID
    with pytest.raises(ValueError, match="16 bytes"):
        gpu_probe.format_uuid(raw[:15])
    key = "000102030405060708090a0b0c0d0e0f"
    assert gpu_probe.uuid_key("GPU-00010203-0405-0607-0809-0A0B0C0D0E0F") == key
    assert gpu_probe.uuid_key(gpu_probe.format_uuid(raw, "MIG-")) == key
    assert gpu_probe.uuid_prefix("MIG-0001") == "MIG-" and gpu_probe.uuid_prefix(H200_UUID) == "GPU-"
    assert gpu_probe.uuid_prefix(None) == "GPU-"
    assert gpu_probe.format_cuda_version(13000) == "13.0" and gpu_probe.format_cuda_version(12040) == "12.4"


def test_no_gpu_reason() -> None:
    missing = {"cuda": {"load_error": "libcuda.so.1 cannot be loaded: nope"}, "nvml": {"error": "nvmlInit failed"}}
    assert gpu_probe.no_gpu_reason(missing).startswith("libcuda.so.1 cannot be loaded")
    # NVML sees a GPU that CUDA cannot reach: the checks run and fail, saying why.
    assert gpu_probe.no_gpu_reason({**missing, "nvml": {"devices": [{"name": "NVIDIA H200"}]}}) is None
    no_device = {"cuda": {"error": "cuInit failed: CUDA_ERROR_NO_DEVICE (100)", "error_call": "cuInit",
                          "error_name": "CUDA_ERROR_NO_DEVICE"}, "nvml": {"devices": [{}]}}
    assert "CUDA_ERROR_NO_DEVICE" in gpu_probe.no_gpu_reason(no_device)
    mismatch = {"cuda": {"error": "cuInit failed: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (803)", "error_call": "cuInit",
                         "error_name": "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"}, "nvml": {"devices": [{}]}}
    assert gpu_probe.no_gpu_reason(mismatch) is None  # a broken driver is a FAIL, not "no GPU"
    hidden = {"cuda": {"device_count": 0}, "nvml": {"devices": [{}]}, "environment": {"CUDA_VISIBLE_DEVICES": ""}}
    assert gpu_probe.no_gpu_reason(hidden).startswith("CUDA finds no device (CUDA_VISIBLE_DEVICES='')")
    assert gpu_probe.no_gpu_reason({"cuda": {"device_count": 1}, "nvml": {"devices": [{}]}}) is None


# ------------------------------------------------------------------ judging, by hand-made measurements


def tangram_device(uuid: str = H200_UUID, memory: float = 143210.0, **more: Any) -> dict[str, Any]:
    return {"index": 0, "uuid": uuid, "name": "NVIDIA H200", "memory_mib": memory, "mig": False,
            "total_mib": 143771.0, "reserved_mib": 561.0, **more}


def cuda_device(uuid: str = H200_UUID, total: float = 143210.0, ordinal: int = 0) -> dict[str, Any]:
    return {"ordinal": ordinal, "name": "NVIDIA H200", "uuid": uuid, "total_mib": total, "compute_capability": "9.0",
            "free_in_context_mib": 142690.0}


def nvml_reading(total: float = 143771.0, reserved: float = 561.0, used: float = 0.0,
                 free: float | None = None) -> dict[str, Any]:
    free = total - reserved - used if free is None else free
    return {"version": 2, "total_mib": total, "reserved_mib": reserved, "used_mib": used, "free_mib": free}


def test_discovery_that_matches_passes() -> None:
    for cuda_total in (143210.0, 143771.0):  # CUDA's total with or without the driver's reservation
        result = gpu_check_cases.judge_discovery([tangram_device()], [cuda_device(total=cuda_total)],
                                           {H200_UUID: nvml_reading()})
        assert result["status"] == "PASS", result["problems"]
        assert "the same UUIDs" in result["headline"] and "compute capability 9.0" in result["headline"]
        row = result["figures"]["devices"][0]
        assert row["compute_capability"] == "9.0" and row["nvml_reserved_mib"] == 561.0
    # A MIG instance: tangram writes MIG-..., CUDA's bytes carry no prefix.
    mig = "MIG-" + H200_UUID[4:]
    result = gpu_check_cases.judge_discovery([tangram_device(mig, mig=True)], [cuda_device(H200_UUID)],
                                       {mig: nvml_reading()})
    assert result["status"] == "PASS", result["problems"]


@pytest.mark.parametrize("tangram, cuda, nvml, words", [
    ([tangram_device()], [cuda_device("GPU-00000000-0000-0000-0000-000000000001")], {H200_UUID: nvml_reading()},
     "different UUIDs"),
    ([tangram_device()], [cuda_device(), cuda_device("GPU-00000000-0000-0000-0000-000000000001", ordinal=1)],
     {H200_UUID: nvml_reading()}, "tangram discovers 1 device(s), CUDA enumerates 2"),
    ([tangram_device(memory=143300.0)], [cuda_device()], {H200_UUID: nvml_reading()},
     "tangram plans with 143300 MiB but NVML reports 143210 MiB free"),
    ([tangram_device()], [cuda_device(total=81559.0)], {H200_UUID: nvml_reading()},
     "CUDA's total 81559 MiB is neither NVML's total"),
    ([tangram_device()], [cuda_device()], {H200_UUID: nvml_reading(free=100000.0)},
     "reserved + used + free"),
    ([tangram_device()], [cuda_device()], {}, "NVML has no memory reading"),
    ([], [], {}, "neither tangram nor CUDA sees a device"),
])
def test_discovery_that_disagrees_fails(tangram: list[dict[str, Any]], cuda: list[dict[str, Any]],
                                        nvml: dict[str, Any], words: str) -> None:
    result = gpu_check_cases.judge_discovery(tangram, cuda, nvml)
    assert result["status"] == "FAIL"
    assert any(words in p for p in result["problems"]), result["problems"]
    assert words in result["headline"] or result["headline"].startswith(result["problems"][0][:20])


def test_discovery_order_matters_only_where_pci_order_is_promised() -> None:
    other = "GPU-00000000-0000-0000-0000-000000000001"
    tangram = [tangram_device(), tangram_device(other)]
    cuda = [cuda_device(other), cuda_device(ordinal=1)]
    nvml = {H200_UUID: nvml_reading(), other: nvml_reading()}
    relaxed = gpu_check_cases.judge_discovery(tangram, cuda, nvml)
    assert relaxed["status"] == "PASS" and "grants name UUIDs" in relaxed["notes"][0]
    strict = gpu_check_cases.judge_discovery(tangram, cuda, nvml, pci_order=True)
    assert strict["status"] == "FAIL" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in strict["headline"]


def test_context_cost() -> None:
    before, during, after = nvml_reading(used=0.0), nvml_reading(used=520.0), nvml_reading(used=0.0)
    result = gpu_check_cases.judge_context_cost(before, during, after, free_in_context_mib=142690.0, create_seconds=0.4)
    assert result["status"] == "PASS" and result["figures"]["context_mib_nvml_used"] == 520.0
    assert result["figures"]["context_mib_cuda_free"] == 520.0 and result["notes"] == []
    big = gpu_check_cases.judge_context_cost(before, nvml_reading(used=1500.0), after, 141710.0, 0.4)
    assert big["status"] == "PASS" and "more than the 1024 MiB" in big["notes"][0]
    unseen = gpu_check_cases.judge_context_cost(before, before, before, 143210.0, 0.4)
    assert unseen["status"] == "FAIL" and "no memory taken by a CUDA context" in unseen["headline"]


def grant_run(**changes: Any) -> dict[str, Any]:
    """Two GPU actions of one trajectory, as measure_grants returns them, all well."""
    def action(grant: float, pid: int) -> dict[str, Any]:
        report = {"started": 1.0, "pid": pid, "ppid": 100, "visible": H200_UUID, "memory_env": f"{grant:g}",
                  "pinned_env": None, "mps_pipe_env": None, "libcuda_by_name": True, "cuda_count": 1,
                  "cuda_uuid": H200_UUID, "cuda_name": "NVIDIA H200"}
        return {"grant_mib": grant, "device": 0, "device_uuid": H200_UUID, "device_memory_mib": 143210.0,
                "device_mig": False, "report": report}

    run = {"worker_pid": 100, "mps": False, "isolation": "cgroup-v2", "actions": [action(4096.0, 101),
                                                                                    action(8192.0, 102)]}
    for key, value in changes.items():
        index, field = key.split("__")
        run["actions"][int(index)]["report"][field] = value
    return run


def namespaced_grant_run(**changes: Any) -> dict[str, Any]:
    """grant_run in namespaced sandboxes: the CPU action's worker (pid 2 in its PID
    namespace) saw no device node; the GPU actions' worker, another one, has them."""
    run = grant_run(**changes)
    run.update(isolation="namespaces", worker_pid=2, worker_devices=[])
    for action in run["actions"]:
        action["report"].setdefault("devices", ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"])
    return run


def test_namespaced_grants_pass_with_the_devices_in_gpu_sandboxes_only() -> None:
    result = gpu_check_cases.judge_grants(namespaced_grant_run())
    assert result["status"] == "PASS", result["problems"]
    assert "/dev/nvidia* in the GPU actions' only" in result["headline"]


@pytest.mark.parametrize("changes, words", [
    ({"worker_devices": ["/dev/nvidia0"]}, "the CPU action's sandbox sees NVIDIA device nodes ['/dev/nvidia0']"),
    ({"1__devices": []}, "action 2 (grant 8192 MiB): its sandbox shows no NVIDIA device node"),
    ({"1__ppid": 7}, "the GPU actions' parents are ['100', '7'], not one worker"),
])
def test_namespaced_grants_wrong_fail(changes: dict[str, Any], words: str) -> None:
    run = namespaced_grant_run(**{k: v for k, v in changes.items() if "__" in k})
    run.update({k: v for k, v in changes.items() if "__" not in k})
    result = gpu_check_cases.judge_grants(run)
    assert result["status"] == "FAIL" and any(words in p for p in result["problems"]), result["problems"]


def test_grants_seen_right_pass() -> None:
    result = gpu_check_cases.judge_grants(grant_run())
    assert result["status"] == "PASS", result["problems"]
    assert "4096 and 8192 MiB" in result["headline"]
    assert [a["TANGRAM_GPU_MEMORY_MIB"] for a in result["figures"]["actions"]] == ["4096", "8192"]
    under_mps = grant_run(**{"0__pinned_env": "0=4096M", "1__pinned_env": "0=8192M"})
    assert gpu_check_cases.judge_grants({**under_mps, "mps": True})["status"] == "PASS"


@pytest.mark.parametrize("changes, words", [
    ({"1__memory_env": "4096"}, "action 2 (grant 8192 MiB): TANGRAM_GPU_MEMORY_MIB='4096', not its own grant"),
    ({"1__pid": 101}, "GPU actions shared a process"),
    ({"0__pid": 100}, "ran in the trajectory's worker"),
    ({"1__ppid": 1}, "its parent is pid 1, not the trajectory's worker 100"),
    ({"1__cuda_uuid": "GPU-00000000-0000-0000-0000-000000000001"}, "CUDA's device 0 is GPU-00000000"),
    ({"0__visible": "GPU-00000000-0000-0000-0000-000000000001"}, "CUDA_VISIBLE_DEVICES='GPU-00000000"),
    ({"0__cuda_count": 2}, "CUDA sees 2 devices"),
    ({"0__cuda_error": "cuInit failed: CUDA_ERROR_UNKNOWN (999)"}, "CUDA_ERROR_UNKNOWN"),
    ({"0__pinned_env": "0=4096M"}, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='0=4096M', expected None"),
])
def test_grants_seen_wrong_fail(changes: dict[str, Any], words: str) -> None:
    result = gpu_check_cases.judge_grants(grant_run(**changes))
    assert result["status"] == "FAIL" and any(words in p for p in result["problems"]), result["problems"]


def test_grant_sizes_and_the_mps_limit_they_carry() -> None:
    assert gpu_check_cases.grant_sizes(143210.0) == (4096.0, 8192.0)
    assert gpu_check_cases.grant_sizes(10000.0) == (2500.0, 5000.0)
    assert gpu_check_cases.expected_pinned_limit(2048.0, 143210.0, mig=False, mps=True) == "0=2048M"
    assert gpu_check_cases.expected_pinned_limit(2048.5, 143210.0, mig=False, mps=True) == "0=2048M"
    assert gpu_check_cases.expected_pinned_limit(2048.0, 143210.0, mig=False, mps=False) is None
    assert gpu_check_cases.expected_pinned_limit(2048.0, 143210.0, mig=True, mps=True) is None
    assert gpu_check_cases.expected_pinned_limit(143210.0, 143210.0, mig=False, mps=True) is None  # the whole device


@pytest.mark.parametrize("free", [16384.0, 81920.0, 143210.0])
def test_eviction_plan_forces_an_eviction_that_a_premature_start_would_feel(free: float) -> None:
    plan = gpu_check_cases.eviction_plan(free)
    assert plan is not None
    allowance = gpu_check_cases.CONTEXT_ALLOWANCE_MIB
    assert plan["service_memory_mib"] + gpu_check_cases.SERVICE_CALL_GPU_MIB <= free  # the service fits alone
    assert plan["service_memory_mib"] + plan["action_grant_mib"] > free  # not with the action: an eviction
    assert plan["asleep_memory_mib"] + plan["action_grant_mib"] <= free  # the action fits once it is evicted
    assert plan["action_alloc_mib"] + allowance <= plan["action_grant_mib"]  # its allocation and context in its grant
    # Both allocations and two contexts of a few hundred MiB cannot share the device.
    assert plan["service_alloc_mib"] + plan["action_alloc_mib"] + 2 * 300 > free
    assert gpu_check_cases.eviction_plan(8192.0) is None


def eviction_run(**changes: Any) -> dict[str, Any]:
    plan = gpu_check_cases.eviction_plan(143210.0)
    run = {"plan": plan, "device": H200_UUID, "free_seen_by_service_mib": 56764.0, "resident_before": [0, 0],
           "resident_after": None, "timeline": [("load_start", 10.0), ("load_end", 10.5), ("offload_start", 11.0),
                                                ("offload_end", 12.0), ("closed", 14.0)],
           "action": {"started": 12.05, "pid": 7, "free_at_start_mib": 142170.0, "ended": 13.0,
                      "allocation": {"mib": float(plan["action_alloc_mib"]), "ok": True, "error": None}},
           "action_device": 0, "action_wait_reason": ""}
    run.update(changes)
    return run


def test_eviction_in_order_passes() -> None:
    result = gpu_check_cases.judge_eviction(eviction_run())
    assert result["status"] == "PASS", result["problems"]
    assert result["figures"]["action_start_after_offload_end_ms"] == pytest.approx(50.0)
    assert result["figures"]["offload_seconds"] == 1.0 and result["figures"]["load_seconds"] == 0.5


@pytest.mark.parametrize("changes, words", [
    ({"action": {"started": 11.5, "allocation": {"mib": 70581.0, "ok": False, "error": "CUDA_ERROR_OUT_OF_MEMORY"}}},
     "the action's allocation of 70581 MiB failed: CUDA_ERROR_OUT_OF_MEMORY"),
    ({"action": {"started": 11.5, "allocation": {"mib": 70581.0, "ok": True, "error": None}}},
     "the action started 500 ms before the offload had freed the service's memory"),
    ({"timeline": [("load_start", 10.0), ("load_end", 10.5)]}, "never offloaded"),
    ({"resident_after": [0, 0]}, "still resident"),
    ({"resident_before": None}, "not resident before the action"),
    ({"action": {"started": 12.1, "cuda_error": "cuCtxCreate_v2 failed: CUDA_ERROR_DEVICE_UNAVAILABLE (46)"}},
     "CUDA_ERROR_DEVICE_UNAVAILABLE"),
])
def test_eviction_out_of_order_or_short_of_memory_fails(changes: dict[str, Any], words: str) -> None:
    result = gpu_check_cases.judge_eviction(eviction_run(**changes))
    assert result["status"] == "FAIL" and any(words in p for p in result["problems"]), result["problems"]


def mps_run(over: dict[str, Any], under: dict[str, Any], pinned: str | None = "0=2048M") -> dict[str, Any]:
    return {"mps": True, "pipe": "/tmp/nvidia-mps", "slice_mib": 2048, "device": H200_UUID,
            "action": {"pinned_env": pinned, "over": over, "under": under, "free_at_start_mib": 142000.0}}


REFUSED = {"mib": 4096.0, "ok": False, "error": "CUDA_ERROR_OUT_OF_MEMORY"}
ALLOCATED = {"mib": 1024.0, "ok": True, "error": None}


def test_mps_limits() -> None:
    result = gpu_check_cases.judge_mps(mps_run(REFUSED, ALLOCATED))
    assert result["status"] == "PASS" and "4096 MiB refused" in result["headline"]
    unenforced = gpu_check_cases.judge_mps(mps_run({"mib": 4096.0, "ok": True, "error": None}, ALLOCATED))
    assert unenforced["status"] == "FAIL" and "MPS did not enforce the limit" in unenforced["headline"]
    other = gpu_check_cases.judge_mps(mps_run({**REFUSED, "error": "CUDA_ERROR_MPS_CONNECTION_FAILED"}, ALLOCATED))
    assert other["status"] == "FAIL" and "not CUDA_ERROR_OUT_OF_MEMORY" in other["headline"]
    starved = gpu_check_cases.judge_mps(mps_run(REFUSED, {"mib": 1024.0, "ok": False, "error": "CUDA_ERROR_OUT_OF_MEMORY"}))
    assert starved["status"] == "FAIL" and "within the limit failed" in starved["headline"]
    uncapped = gpu_check_cases.judge_mps(mps_run(REFUSED, ALLOCATED, pinned=None))
    assert uncapped["status"] == "FAIL" and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=None" in uncapped["headline"]


def test_summary_and_exit_status() -> None:
    def check(name: str, status: str, **more: Any) -> dict[str, Any]:
        return {"name": name, "title": name, "status": status, "headline": f"{name} {status}", "seconds": 1.0,
                "figures": {"mib": 1.5}, "problems": [], "notes": [], **more}

    fine = [check("a", "PASS"), check("b", "SKIP")]
    assert gpu_check.summarize(fine) == ("1 passed, 0 failed, 1 skipped", 0)
    assert gpu_check.summarize([check("a", "SKIP")], "no NVIDIA GPU: nothing checked") == \
        ("no NVIDIA GPU: nothing checked", 0)
    text, status = gpu_check.summarize([*fine, check("c", "FAIL", finished=False)])
    assert status == 1 and "FAILED: c" in text and "did not finish: c" in text
    report = {"machine": {"python": "3.12"}, "checks": [*fine, check("c", "FAIL")], "summary": {"text": text}}
    out = gpu_check.format_report(report)
    assert out.splitlines()[-1] == f"summary: {text}" and "c (c): FAIL" in out and "mib: 1.5" in out


# ------------------------------------------------------------------ the runtime half, with fake devices


def test_each_gpu_action_gets_its_own_grant_through_the_runtime() -> None:
    """measure_grants on a fake device: the actions' CUDA calls fail (no libcuda here), but
    what tangram gave each one (environment, process) is real, and the functions reached
    the sandbox by reference."""
    devices = parse_fake("20000")
    run = asyncio.run(asyncio.wait_for(gpu_check_cases.measure_grants(devices, (4096.0, 8192.0), None), 60))
    reports = [a["report"] for a in run["actions"]]
    assert [r["visible"] for r in reports] == ["GPU-fake-0", "GPU-fake-0"]
    assert [r["memory_env"] for r in reports] == ["4096", "8192"]
    if run["isolation"] == "namespaces":  # the GPU actions' worker is started with the device nodes: another one
        assert run["worker_devices"] == [] and len({r["ppid"] for r in reports}) == 1
    else:
        assert all(r["ppid"] == run["worker_pid"] != r["pid"] for r in reports)
    assert reports[0]["pid"] != reports[1]["pid"]
    result = gpu_check_cases.judge_grants(run)
    if has_libcuda():
        return  # libcuda with no device behind the fake UUID: CUDA's answers differ, the grants do not
    assert result["status"] == "FAIL"
    # (and, in namespaced sandboxes, no /dev/nvidia* node: this machine has none to bind in)
    assert result["problems"] and all("cannot be loaded" in p or "shows no NVIDIA device node" in p
                                      for p in result["problems"])


class SimulatedDriver:
    """CudaDriver's calls made by DeviceMemoryService, over a device of `total` bytes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.allocations: dict[int, int] = {}

    def init(self) -> None:
        pass

    def device_by_uuid(self, uuid: str) -> int:
        assert uuid == "GPU-fake-0"
        return 0

    def create_context(self, device: int) -> int:
        return 1

    def set_current(self, context: int) -> None:
        pass

    def destroy_context(self, context: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mem_alloc(self, nbytes: int) -> int:
        if self.used + nbytes > self.total:
            raise gpu_probe.CudaError("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        pointer = len(self.allocations) + 1
        self.allocations[pointer] = nbytes
        self.used += nbytes
        return pointer

    def memset(self, pointer: int, value: int, nbytes: int) -> None:
        assert self.allocations[pointer] >= nbytes

    def mem_free(self, pointer: int) -> None:
        self.used -= self.allocations.pop(pointer)

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total


def test_the_core_evicts_the_service_and_the_action_starts_after_the_offload() -> None:
    """measure_eviction on a fake device, the service's memory simulated in process: the
    core evicts the resident service for the action, and the action's process starts only
    after the offload hook has returned (its CUDA calls fail here)."""
    device = parse_fake("20000")[0]
    plan = gpu_check_cases.eviction_plan(device.memory_mib)
    assert plan is not None
    driver = SimulatedDriver(int(device.memory_mib) * gpu_probe.MIB)
    model = gpu_check_cases.DeviceMemoryService(plan["service_alloc_mib"] * gpu_probe.MIB, hold_s=0.3,
                                          driver_factory=lambda: driver)
    run = asyncio.run(asyncio.wait_for(gpu_check_cases.measure_eviction(device, plan, None, model), 60))
    events = [event for event, _ in run["timeline"]]
    assert events == ["load_start", "load_end", "offload_start", "offload_end", "closed"]
    assert run["resident_before"] == (0, 0) and run["resident_after"] is None
    free_while_resident = run["free_seen_by_service_mib"]
    assert free_while_resident == pytest.approx(device.memory_mib - plan["service_alloc_mib"])
    offload_end = dict(run["timeline"])["offload_end"]
    assert run["action"]["started"] >= offload_end
    assert driver.used == 0 and driver.allocations == {}
    result = gpu_check_cases.judge_eviction(run)
    assert result["figures"]["action_start_after_offload_end_ms"] >= 0
    assert result["figures"]["offload_seconds"] >= 0.3
    if not has_libcuda():
        assert result["status"] == "FAIL" and len(result["problems"]) == 1
        assert "cannot be loaded" in result["problems"][0]
