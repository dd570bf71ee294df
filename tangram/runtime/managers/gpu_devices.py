"""What the GPU manager does to a device outside any service: the environment a grant
runs with (CUDA_VISIBLE_DEVICES, TANGRAM_GPU_MEMORY_MIB, MPS's pinned-memory limit) and the
watch for Xid errors after which a GPU needs a reset."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import stat
import threading
from typing import Callable, Sequence

from ..._errors import ValidationError
from ...devices import GpuDevice

log = logging.getLogger("tangram.gpu")

MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_pipe_directory(pipe_directory: str | None = None) -> str:
    """Where MPS clients find the daemon: `pipe_directory`, else CUDA_MPS_PIPE_DIRECTORY,
    else the default /tmp/nvidia-mps."""
    return pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIRECTORY


def mps_active(pipe_directory: str | None = None) -> bool:
    """Whether an MPS control daemon answers in `mps_pipe_directory(pipe_directory)`: its
    control socket accepts a connection. A socket file that a crashed daemon left behind
    refuses it. (A control endpoint that is not a socket, as older daemons made, counts
    when it exists.)"""
    path = os.path.join(mps_pipe_directory(pipe_directory), "control")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not stat.S_ISSOCK(mode):
        return True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:  # refused: nobody listens there any more
            return False
    return True


def mib_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def grant_environment(device: GpuDevice, gpu_memory_mib: float, mps: bool,
                      mps_pipe: str | None = None) -> dict[str, str]:
    """The environment that carries a grant of `gpu_memory_mib` MiB on `device` to a process.

    - CUDA_VISIBLE_DEVICES: the device's UUID, GPU-... for a whole GPU or MIG-... for a MIG
      instance (UUIDs stay right whatever the numbering of the process and of an MPS
      server).
    - TANGRAM_GPU_MEMORY_MIB: the MiB granted (the device's memory when the grant covers
      it; 0 when nothing was asked for).
    - Under MPS (`mps` true), CUDA_MPS_PIPE_DIRECTORY: where the daemon is
      (`mps_pipe_directory(mps_pipe)`), since a sandbox's environment is scrubbed and a
      client that cannot find the daemon runs outside MPS, unlimited.
    - A memory slice (0 < gpu_memory_mib < the device's memory) of a shared, non-MIG GPU
      under MPS is also capped: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=<MiB>M" (ordinal 0: the
      one device CUDA_VISIBLE_DEVICES leaves visible). Its compute is not capped
      (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is a ceiling, and memory says nothing of how many
      SMs an action needs: 16 GiB of an H200 would be about 11% of them): MPS shares the
      SMs among the running clients. Without MPS a slice is only a scheduling share: the
      core never over-commits the device, but nothing enforces the limit. A MIG instance
      is isolated by the hardware; a slice of it is a scheduling share too.
    """
    gpu_memory_mib = float(gpu_memory_mib)
    if math.isnan(gpu_memory_mib) or gpu_memory_mib < 0:
        raise ValidationError("gpu_memory", f"must be a non-negative number of MiB, got {gpu_memory_mib!r}")
    granted = min(gpu_memory_mib, device.memory_mib)
    env = {"CUDA_VISIBLE_DEVICES": device.uuid, "TANGRAM_GPU_MEMORY_MIB": mib_text(granted)}
    if mps:
        env["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe_directory(mps_pipe)
        if not device.mig and 0 < gpu_memory_mib < device.memory_mib:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, math.floor(gpu_memory_mib))}M"
    return env


# Xid errors after which a GPU needs a reset (NVIDIA's Xid catalogue): 48 double-bit ECC
# error, 62 internal micro-controller halt, 64 ECC page retirement or row-remapping failure,
# 74 NVLink error, 79 fallen off the bus, 95 uncontained ECC error, 119 and 120 GSP errors,
# 140 unrecovered ECC error. Others (13, 31, 43: one process's fault) leave the device usable.
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})


class XidWatch:
    """Waits for NVML's critical Xid events on the physical GPUs behind `devices` (those
    discovered through NVML), in a thread of its own, and hands each to `report(device,
    xid)` in the event loop, for every device on that GPU (a MIG instance's Xid marks its
    siblings too). A driver without event support is logged once and not watched."""

    WAIT_MS = 500  # how often the thread looks at its stop flag

    def __init__(self, devices: Sequence[GpuDevice], report: Callable[[int, int], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.by_gpu: dict[int, list[int]] = {}
        for d in devices:
            if d.source == "nvml":
                self.by_gpu.setdefault(d.nvml_index, []).append(d.index)
        self.report = report
        self.loop = loop
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.watching: list[int] = []  # the NVML indices whose events are registered

    def start(self) -> None:
        if self.by_gpu:
            self.thread = threading.Thread(target=self._run, name="tangram-gpu-xid", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        if self.thread is not None:
            self.thread.join(timeout=2 * self.WAIT_MS / 1000)

    def _run(self) -> None:
        try:
            import pynvml  # nvidia-ml-py
            pynvml.nvmlInit()
        except Exception as e:  # no driver now: nothing to watch
            log.warning("Xid events not watched: NVML did not start: %s: %s", type(e).__name__, e)
            return
        events = None
        try:
            events = pynvml.nvmlEventSetCreate()
            handles = {}
            for index in sorted(self.by_gpu):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
                except pynvml.NVMLError as e:
                    log.warning("Xid events of GPU %d not watched: %s", index, e)
                    continue
                handles[index] = handle
                self.watching.append(index)
            wait = getattr(pynvml, "nvmlEventSetWait_v2", None) or pynvml.nvmlEventSetWait
            while handles and not self.stopping:
                try:
                    data = wait(events, self.WAIT_MS)
                except pynvml.NVMLError as e:
                    if getattr(e, "value", None) == getattr(pynvml, "NVML_ERROR_TIMEOUT", 10):
                        continue
                    log.warning("Xid events no longer watched: %s", e)
                    return
                index = pynvml.nvmlDeviceGetIndex(data.device)
                for device in self.by_gpu.get(index, ()):
                    self.loop.call_soon_threadsafe(self.report, device, int(data.eventData))
        except Exception as e:
            log.warning("Xid events not watched: %s: %s", type(e).__name__, e)
        finally:
            try:
                if events is not None:
                    pynvml.nvmlEventSetFree(events)
                pynvml.nvmlShutdown()
            except Exception:
                pass
