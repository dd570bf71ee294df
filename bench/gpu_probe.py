"""What this machine's NVIDIA GPU is, read without changing it, for bench/gpu_check.py:
the CUDA driver API through ctypes on libcuda.so.1 (devices, contexts, allocations in the
process that calls it), NVML's memory readings (read-only), and the probe that describes
the machine (or says why there is nothing to check)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from typing import Any, Callable, Mapping

MIB = 1 << 20
FAKE_ENV = "TANGRAM_FAKE_GPUS"  # tangram.devices.FAKE_ENV; not imported: the supervisor imports no tangram


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
        from tangram.runtime.managers.gpu import mps_active, mps_pipe_directory
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
