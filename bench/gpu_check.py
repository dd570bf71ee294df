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
  mps_limits        only where an MPS control daemon answers (tangram.runtime.gpu.mps_active):
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
carry the marker tangram.runtime.sandbox.kill_marked finds), and its check is FAIL, saying
that it did not finish. The children import this file as the module `bench.gpu_check`, so
that the functions they hand to tangram as GPU actions pickle by reference and are imported,
not copied, in the sandbox. The service hooks run in the check's own process, as a reward
model's do.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
FAKE_ENV = "TANGRAM_FAKE_GPUS"  # tangram.devices.FAKE_ENV; not imported: the supervisor imports no tangram

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
CHILD_GRACE_S = 6.0  # a check stops its own work this long before its limit, closing its runtime itself
MIN_CHECK_S = 8.0  # less than this left: a check is not started

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

# ---------------------------------------------------------------- the CUDA driver API

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
# CUresult names (cuda.h), for when cuGetErrorName cannot be asked: the library failed to
# load that far, or it does not know the code.
CU_RESULT_NAMES = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
    102: "CUDA_ERROR_DEVICE_NOT_LICENSED", 201: "CUDA_ERROR_INVALID_CONTEXT", 216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
    304: "CUDA_ERROR_OPERATING_SYSTEM", 500: "CUDA_ERROR_NOT_FOUND", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED", 802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    805: "CUDA_ERROR_MPS_CONNECTION_FAILED", 806: "CUDA_ERROR_MPS_RPC_FAILURE", 807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
    808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", 809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
    810: "CUDA_ERROR_MPS_CLIENT_TERMINATED", 999: "CUDA_ERROR_UNKNOWN",
}
# cuInit answers meaning "this machine has no usable NVIDIA GPU" rather than "CUDA is broken".
NO_DEVICE_ERRORS = frozenset({"CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_STUB_LIBRARY"})

_c = ctypes
# Argument types of the driver API functions used, by symbol (CUdevice is an int, CUcontext
# a pointer, CUdeviceptr a 64-bit integer, a CUuuid 16 bytes); every one returns a CUresult.
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (_c.c_uint,),
    "cuDriverGetVersion": (_c.POINTER(_c.c_int),),
    "cuDeviceGetCount": (_c.POINTER(_c.c_int),),
    "cuDeviceGet": (_c.POINTER(_c.c_int), _c.c_int),
    "cuDeviceGetName": (_c.c_char_p, _c.c_int, _c.c_int),
    "cuDeviceGetUuid": (_c.c_char_p, _c.c_int),
    "cuDeviceGetUuid_v2": (_c.c_char_p, _c.c_int),
    "cuDeviceTotalMem_v2": (_c.POINTER(_c.c_size_t), _c.c_int),
    "cuDeviceGetAttribute": (_c.POINTER(_c.c_int), _c.c_int, _c.c_int),
    "cuCtxCreate_v2": (_c.POINTER(_c.c_void_p), _c.c_uint, _c.c_int),
    "cuCtxDestroy_v2": (_c.c_void_p,),
    "cuDevicePrimaryCtxRetain": (_c.POINTER(_c.c_void_p), _c.c_int),
    "cuDevicePrimaryCtxRelease_v2": (_c.c_int,),
    "cuCtxSetCurrent": (_c.c_void_p,),
    "cuCtxSynchronize": (),
    "cuMemGetInfo_v2": (_c.POINTER(_c.c_size_t), _c.POINTER(_c.c_size_t)),
    "cuMemAlloc_v2": (_c.POINTER(_c.c_uint64), _c.c_size_t),
    "cuMemFree_v2": (_c.c_uint64,),
    "cuMemsetD8_v2": (_c.c_uint64, _c.c_ubyte, _c.c_size_t),
    "cuGetErrorName": (_c.c_int, _c.POINTER(_c.c_char_p)),
}


class CudaUnavailable(RuntimeError):
    """libcuda cannot be loaded, or lacks a function these checks need."""


class CudaError(RuntimeError):
    """A driver API call returned an error: `call`, the CUresult `code` and its `name`."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


def cu_result_name(code: int, lookup: Callable[[int], str | None] | None = None) -> str:
    """The name of a CUresult: what `lookup` (the driver's cuGetErrorName) says, else this
    file's table of cuda.h, else "CUresult <code>"."""
    if lookup is not None:
        try:
            name = lookup(code)
        except Exception:  # a driver that cannot name it is no reason to lose the code
            name = None
        if name:
            return name
    return CU_RESULT_NAMES.get(code, f"CUresult {code}")


def format_uuid(raw: bytes, prefix: str = "GPU-") -> str:
    """A 16-byte CUuuid as NVML and CUDA_VISIBLE_DEVICES write it:
    "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (prefix "MIG-" for a MIG instance)."""
    if len(raw) != 16:
        raise ValueError(f"a CUuuid has 16 bytes, got {len(raw)}")
    h = bytes(raw).hex()
    return f"{prefix}{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def uuid_key(uuid: str) -> str:
    """A GPU or MIG UUID's hex digits, lowercase, without its "GPU-"/"MIG-" prefix and dashes:
    what identifies the device whoever wrote the UUID."""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return text.replace("-", "")


def uuid_prefix(visible: str | None) -> str:
    """The prefix a CUDA device's UUID is written with in a process whose
    CUDA_VISIBLE_DEVICES is `visible`: "MIG-" when it names a MIG instance."""
    return "MIG-" if visible and visible.strip().upper().startswith("MIG-") else "GPU-"


def format_cuda_version(version: int) -> str:
    """A CUDA version as the driver encodes it (1000 * major + 10 * minor) -> "13.0"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def loaded_library_path(fragment: str) -> str | None:
    """The file of a shared library this process has mapped whose name starts with
    `fragment` (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:  # address perms offset dev inode [path]
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith(fragment):
                    return path
    except OSError:
        pass
    return None


class CudaDriver:
    """The few CUDA driver API calls these checks make, through ctypes on libcuda.so.1.

    Every call raises CudaError naming the function and the CUresult (by cuGetErrorName)
    when it fails; CudaUnavailable when the library cannot be loaded or lacks the function.
    Contexts made here are current on the calling thread; a process that makes none holds
    no device memory.
    """

    LIBRARY = "libcuda.so.1"

    def __init__(self, library: str | None = None) -> None:
        self.library = library or self.LIBRARY
        try:
            self._lib = ctypes.CDLL(self.library)
        except OSError as e:
            raise CudaUnavailable(f"{self.library} cannot be loaded: {e}") from None
        self.path = loaded_library_path("libcuda.so") or self.library
        self.found_by_name = library is None or "/" not in library
        self._functions: dict[str, Any] = {}
        self._primary: dict[int, int] = {}  # context -> device, for contexts that are a primary one

    @classmethod
    def open(cls, fallback: str | None = None) -> "CudaDriver":
        """libcuda.so.1 by name, as a CUDA program finds it; else the file `fallback` (the
        path the probe found). A sandbox's environment is scrubbed: where the driver's
        folder is only on LD_LIBRARY_PATH, only the path finds it (`found_by_name` False)."""
        try:
            return cls()
        except CudaUnavailable:
            if not fallback or fallback == cls.LIBRARY:
                raise
            return cls(fallback)

    # -------------------------------------------------------------- calls
    def _function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                raise CudaUnavailable(f"{self.path} has no {name}") from None
            fn.restype = ctypes.c_int
            fn.argtypes = list(_SIGNATURES[name])
            self._functions[name] = fn
        return fn

    def has(self, name: str) -> bool:
        return hasattr(self._lib, name)

    def call(self, name: str, *args: Any) -> None:
        """Calls the driver function `name`; raises CudaError unless it returns CUDA_SUCCESS."""
        code = self._function(name)(*args)
        if code != CUDA_SUCCESS:
            raise CudaError(name, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        return cu_result_name(code, self._driver_error_name)

    def _driver_error_name(self, code: int) -> str | None:
        text = ctypes.c_char_p()
        if self._function("cuGetErrorName")(code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return None
        return text.value.decode(errors="replace")

    # -------------------------------------------------------------- devices
    def init(self) -> None:
        self.call("cuInit", 0)

    def driver_version(self) -> int:
        version = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(version))
        return version.value

    def device_count(self) -> int:
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def device(self, ordinal: int) -> int:
        device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        return device.value

    def name(self, device: int) -> str:
        buffer = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buffer, len(buffer), device)
        return buffer.value.decode(errors="replace")

    def uuid(self, device: int, prefix: str = "GPU-") -> str:
        """The device's UUID; cuDeviceGetUuid_v2 gives a MIG instance's own, where it exists."""
        buffer = ctypes.create_string_buffer(16)
        self.call("cuDeviceGetUuid_v2" if self.has("cuDeviceGetUuid_v2") else "cuDeviceGetUuid", buffer, device)
        return format_uuid(buffer.raw, prefix)

    def total_memory(self, device: int) -> int:
        total = ctypes.c_size_t()
        self.call("cuDeviceTotalMem_v2", ctypes.byref(total), device)
        return total.value

    def attribute(self, device: int, attribute: int) -> int:
        value = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
        return value.value

    def compute_capability(self, device: int) -> str:
        return (f"{self.attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)}."
                f"{self.attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)}")

    def describe(self, ordinal: int, prefix: str = "GPU-") -> dict[str, Any]:
        device = self.device(ordinal)
        return {"ordinal": ordinal, "name": self.name(device), "uuid": self.uuid(device, prefix),
                "total_mib": self.total_memory(device) / MIB, "compute_capability": self.compute_capability(device)}

    def device_by_uuid(self, uuid: str) -> int:
        """The device whose UUID is `uuid` (GPU-... or MIG-...), among those this process sees."""
        seen = []
        for ordinal in range(self.device_count()):
            device = self.device(ordinal)
            found = self.uuid(device, uuid_prefix(uuid))
            if uuid_key(found) == uuid_key(uuid):
                return device
            seen.append(found)
        raise LookupError(f"CUDA enumerates no device {uuid} (it sees: {', '.join(seen) or 'none'})")

    # -------------------------------------------------------------- contexts and memory
    def create_context(self, device: int) -> int:
        """A new context on `device`, current on this thread (cuCtxCreate_v2; the device's
        primary context where the library lacks that symbol)."""
        context = ctypes.c_void_p()
        if self.has("cuCtxCreate_v2"):
            self.call("cuCtxCreate_v2", ctypes.byref(context), 0, device)
            return int(context.value or 0)
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        self.call("cuCtxSetCurrent", context)
        self._primary[int(context.value or 0)] = device
        return int(context.value or 0)

    def destroy_context(self, context: int) -> None:
        device = self._primary.pop(context, None)
        if device is None:
            self.call("cuCtxDestroy_v2", ctypes.c_void_p(context))
        else:
            self.call("cuCtxSetCurrent", None)
            self.call("cuDevicePrimaryCtxRelease_v2", device)

    def set_current(self, context: int) -> None:
        self.call("cuCtxSetCurrent", ctypes.c_void_p(context))

    def synchronize(self) -> None:
        self.call("cuCtxSynchronize")

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current context's device, as CUDA sees them."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def mem_alloc(self, nbytes: int) -> int:
        pointer = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(pointer), nbytes)
        return pointer.value

    def mem_free(self, pointer: int) -> None:
        self.call("cuMemFree_v2", pointer)

    def memset(self, pointer: int, value: int, nbytes: int) -> None:
        self.call("cuMemsetD8_v2", pointer, value, nbytes)


# ---------------------------------------------------------------- NVML (read-only)


@contextlib.contextmanager
def nvml_session() -> Any:
    """pynvml, initialised for the block and shut down after it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def nvml_memory(pynvml: Any, handle: Any) -> dict[str, Any]:
    """A device's memory in MiB: NVML's v2 reading (reserved apart from used) where the
    driver and binding have it, else v1 (reserved None: counted in used)."""
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return {"version": 2, "total_mib": m.total / MIB, "reserved_mib": m.reserved / MIB,
                    "used_mib": m.used / MIB, "free_mib": m.free / MIB}
        except (pynvml.NVMLError, TypeError, AttributeError):
            pass
    m = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"version": 1, "total_mib": m.total / MIB, "reserved_mib": None, "used_mib": m.used / MIB,
            "free_mib": m.free / MIB}


def nvml_handle(pynvml: Any, uuid: str) -> Any:
    """NVML's handle of the device (or MIG instance) with that UUID; a UUID read from CUDA
    bytes may carry the other prefix than NVML's, so both are tried."""
    key = uuid_key(uuid)
    dashed = "-".join((key[:8], key[8:12], key[12:16], key[16:20], key[20:]))
    candidates = [uuid, "GPU-" + dashed, "MIG-" + dashed]
    error: Exception | None = None
    for candidate in dict.fromkeys(candidates):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(candidate)
        except pynvml.NVMLError as e:
            error = e
    raise LookupError(f"NVML has no device {uuid}: {error}")


def nvml_process_memory(pynvml: Any, handle: Any, pid: int) -> float | None:
    """MiB NVML attributes to process `pid` on the device, when it reports it (not in every
    container: the driver sees the host's pids)."""
    try:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                return p.usedGpuMemory / MIB
    except Exception:  # missing in the binding, or not supported here: a figure less
        return None
    return None


COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


def _reading(fn: Callable[[], Any]) -> Any:
    """fn()'s value, or "unavailable: <why>": one reading that fails does not lose the others."""
    try:
        return fn()
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


# ---------------------------------------------------------------- the probe: what this machine is


def probe_machine(library: str | None = None) -> dict[str, Any]:
    """The machine description: host, tangram, NVML (driver, CUDA driver version, devices)
    and CUDA's own view (libcuda's path and version, cuInit's answer, devices). Initialises
    CUDA but makes no context, so it holds no device memory."""
    environment = {k: os.environ.get(k) for k in (FAKE_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
                                                 "CUDA_MPS_PIPE_DIRECTORY") if k in os.environ}
    return {"host": platform.node(), "python": platform.python_version(), "platform": platform.platform(),
            "environment": environment, "tangram": _tangram_description(), "nvml": nvml_description(),
            "cuda": cuda_description(library)}


def _tangram_description() -> dict[str, Any]:
    try:
        import tangram
        from tangram.runtime.gpu import mps_active, mps_pipe_directory
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"version": tangram.__version__, "mps_active": mps_active(), "mps_pipe_directory": mps_pipe_directory()}


def nvml_description() -> dict[str, Any]:
    """NVML's view, read only: driver and CUDA driver versions; each GPU's name, UUID,
    memory, compute mode and MIG mode."""
    try:
        import pynvml
    except ImportError as e:
        return {"error": f"nvidia-ml-py (pynvml) is not installed: {e}"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"error": f"nvmlInit failed: {e}"}
    try:
        out: dict[str, Any] = {"driver_version": _reading(lambda: _text(pynvml.nvmlSystemGetDriverVersion()))}
        cuda_version = getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", pynvml.nvmlSystemGetCudaDriverVersion)
        out["cuda_driver_version"] = _reading(lambda: format_cuda_version(cuda_version()))
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            devices.append({
                "index": i,
                "name": _reading(lambda: _text(pynvml.nvmlDeviceGetName(handle))),
                "uuid": _reading(lambda: _text(pynvml.nvmlDeviceGetUUID(handle))),
                "memory": _reading(lambda: nvml_memory(pynvml, handle)),
                "compute_mode": _reading(lambda: COMPUTE_MODES.get(pynvml.nvmlDeviceGetComputeMode(handle), "?")),
                "mig_mode": _reading(lambda: "enabled" if pynvml.nvmlDeviceGetMigMode(handle)[0] else "disabled"),
            })
        out["devices"] = devices
        return out
    except pynvml.NVMLError as e:
        return {"error": f"NVML: {e}"}
    finally:
        pynvml.nvmlShutdown()


def cuda_description(library: str | None = None) -> dict[str, Any]:
    """CUDA's view without a context: libcuda's path and version, cuInit's answer, devices."""
    try:
        driver = CudaDriver(library)
    except CudaUnavailable as e:
        return {"load_error": str(e)}
    out: dict[str, Any] = {"library": driver.path}
    try:
        out["driver_version"] = format_cuda_version(driver.driver_version())
        driver.init()
        count = driver.device_count()
        out["device_count"] = count
        out["devices"] = [driver.describe(i) for i in range(count)]
    except CudaError as e:
        out["error"] = str(e)
        out["error_call"] = e.call
        out["error_name"] = e.name
    except CudaUnavailable as e:
        out["error"] = str(e)
    return out


def no_gpu_reason(machine: Mapping[str, Any]) -> str | None:
    """Why there is no NVIDIA GPU to check here, from the probe's description; None when
    there is one (even a broken one: the checks then say what is wrong)."""
    cuda = machine.get("cuda") or {}
    nvml = machine.get("nvml") or {}
    nvml_gpus = len(nvml.get("devices") or [])
    nvml_says = f"NVML: {nvml['error']}" if nvml.get("error") else f"NVML finds {nvml_gpus} GPU(s)"
    if cuda.get("load_error"):
        return None if nvml_gpus else f"{cuda['load_error']}; {nvml_says}"
    if cuda.get("error"):
        if cuda.get("error_call") == "cuInit" and (cuda.get("error_name") in NO_DEVICE_ERRORS or not nvml_gpus):
            return f"{cuda['error']}; {nvml_says}"
        return None
    if cuda.get("device_count", 0) == 0:
        visible = (machine.get("environment") or {}).get("CUDA_VISIBLE_DEVICES")
        return "CUDA finds no device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "") + \
            f"; {nvml_says}"
    return None


def fake_gpus_reason(fake: str) -> str:
    return (f"{FAKE_ENV}={fake!r} is set: tangram schedules its fake GPUs (GPU-fake-0, ...), which are not CUDA "
            f"devices; unset it to check this machine's GPU")


def describe_machine(machine: Mapping[str, Any]) -> str:
    """One line: the GPUs, driver and CUDA versions, MPS, tangram."""
    if machine.get("error"):
        return f"machine probe failed: {machine['error']}"
    nvml = machine.get("nvml") or {}
    cuda = machine.get("cuda") or {}
    names = [d.get("name") for d in nvml.get("devices") or []] or [d.get("name") for d in cuda.get("devices") or []]
    parts = []
    if names:
        counts: dict[str, int] = {}
        for n in names:
            counts[str(n)] = counts.get(str(n), 0) + 1
        parts.append(", ".join(f"{c} x {n}" for n, c in counts.items()))
    else:
        parts.append("no NVIDIA GPU")
    if nvml.get("driver_version"):
        parts.append(f"driver {nvml['driver_version']}")
    parts.append(f"NVML: {nvml['error']}" if nvml.get("error") else
                 f"CUDA driver {nvml.get('cuda_driver_version', '?')} (NVML)")
    if cuda.get("load_error"):
        parts.append(cuda["load_error"])
    elif cuda.get("driver_version"):
        parts.append(f"libcuda {cuda['driver_version']}" + (f": {cuda['error']}" if cuda.get("error") else ""))
    t = machine.get("tangram") or {}
    if "version" in t:
        parts.append(f"MPS {'on' if t.get('mps_active') else 'off'}, tangram {t['version']}")
    parts.append(f"Python {machine.get('python', '?')}")
    return "; ".join(parts)


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
    from tangram.runtime.gpu import GpuManager

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
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT a grant must carry (tangram.runtime.gpu.
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
    gets the device nodes at its start: tangram.runtime.namespaces), so there the CPU action
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
    from tangram.runtime.gpu import ServiceHooks

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
    from tangram.runtime.gpu import mps_active, mps_pipe_directory

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
        from tangram.runtime.isolation import detect, remove_stale
        from tangram.runtime.sandbox import kill_marked
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
