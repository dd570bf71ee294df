"""GPU discovery: the schedulable GPUs of this machine, from NVML or a declared fake inventory.

Devices come from NVML (nvidia-ml-py, imported as `pynvml`): every GPU, its UUID, name and
memory. A GPU in MIG mode is not schedulable itself: each of its MIG instances is one
schedulable device, with its own memory and its `MIG-...` UUID. Without a driver (NVML fails
to initialise, or nvidia-ml-py is missing) there are no devices.

A fake inventory is selected explicitly with the environment variable TANGRAM_FAKE_GPUS,
which then wins over NVML, so that every GPU path runs on a machine without one. Its syntax
is a comma-separated list of physical GPUs, each either

    <MiB>                  a whole GPU with that much memory, e.g. 81920
    mig:<MiB>+<MiB>+...    a GPU in MIG mode with one MIG instance per <MiB>

"81920,81920" is two 80 GiB GPUs; "81920,mig:40960+20480+20480" is one whole GPU (uuid
GPU-fake-0) and three MIG instances of a second one (MIG-fake-1-0, -1, -2).

Both `Inventory.local()` (its GPU list) and the GPU manager (its devices) use `discover`, so
they see the same devices. This module sits below both: it imports only the typed errors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ._errors import ValidationError

FAKE_ENV = "TANGRAM_FAKE_GPUS"


@dataclass(frozen=True)
class GpuDevice:
    """One schedulable GPU: a whole GPU, or one MIG instance of a GPU in MIG mode.

    index: its position in the schedulable list (the inventory's GPU index on the node).
    uuid: "GPU-..." for a whole GPU, "MIG-..." for a MIG instance ("GPU-fake-0" and
      "MIG-fake-1-0" for fake ones). memory_mib: its memory. nvml_index: the NVML index of
      the physical GPU holding it (for a MIG instance, its parent's). mig_index: the MIG
      device index under that parent, None for a whole GPU. parent_uuid: the parent GPU's
      UUID for a MIG instance. source: "nvml", "fake" or "given".
    """

    index: int
    uuid: str
    name: str
    memory_mib: float
    nvml_index: int
    mig_index: int | None = None
    parent_uuid: str | None = None
    source: str = "given"

    @property
    def mig(self) -> bool:
        """Whether this device is a MIG instance."""
        return self.mig_index is not None

    @property
    def parent_index(self) -> int | None:
        """The NVML index of the parent GPU of a MIG instance; None for a whole GPU."""
        return self.nvml_index if self.mig else None

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "uuid": self.uuid, "name": self.name,
                             "memory_mib": self.memory_mib, "mig": self.mig}
        if self.mig:
            d["parent_index"] = self.parent_index
            d["parent_uuid"] = self.parent_uuid
        return d


def parse_fake(spec: str, where: str = FAKE_ENV) -> list[GpuDevice]:
    """Fake devices from a TANGRAM_FAKE_GPUS spec (syntax in the module docstring).
    A malformed spec raises ValidationError naming `where`."""
    spec = spec.strip()
    if not spec:
        return []
    devices: list[GpuDevice] = []

    def mib(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValidationError(where, f"expected comma-separated MiB values (or mig:<MiB>+<MiB>...), "
                                         f"got {spec!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValidationError(where, f"GPU memory must be a positive number of MiB, got {text.strip()!r}")
        return value

    for physical, item in enumerate(spec.split(",")):
        item = item.strip()
        if item.lower().startswith("mig:"):
            parent = f"GPU-fake-{physical}"
            parts = item[4:].split("+")
            for j, part in enumerate(parts):
                memory = mib(part)
                devices.append(GpuDevice(len(devices), f"MIG-fake-{physical}-{j}", f"Fake GPU MIG {memory:g}MiB",
                                         memory, physical, j, parent, "fake"))
        else:
            devices.append(GpuDevice(len(devices), f"GPU-fake-{physical}", "Fake GPU", mib(item), physical,
                                     source="fake"))
    return devices


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _discover_nvml() -> list[GpuDevice]:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return []
    import logging  # here: `import tangram` does not need it

    log = logging.getLogger("tangram.gpu")  # the GPU manager's logger: one name for everything GPU
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []  # no driver: no GPUs
    mig_enabled = getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)
    devices: list[GpuDevice] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                name = _text(pynvml.nvmlDeviceGetName(handle))
                try:
                    mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == mig_enabled
                except pynvml.NVMLError:
                    mig = False  # MIG not supported by this GPU
                if not mig:
                    memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**20
                    devices.append(GpuDevice(len(devices), uuid, name, memory, i, source="nvml"))
                    continue
                found: list[GpuDevice] = []
                for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                    try:
                        mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
                    except pynvml.NVMLError:
                        continue  # no MIG instance in this slot
                    found.append(GpuDevice(len(devices) + len(found), _text(pynvml.nvmlDeviceGetUUID(mh)),
                                           _text(pynvml.nvmlDeviceGetName(mh)),
                                           pynvml.nvmlDeviceGetMemoryInfo(mh).total / 2**20, i, j, uuid, "nvml"))
                if not found:
                    log.warning("GPU %d (%s) is in MIG mode with no MIG instance: not schedulable", i, uuid)
                devices.extend(found)
            except pynvml.NVMLError as e:
                log.warning("GPU %d skipped: NVML error %s", i, e)
    finally:
        pynvml.nvmlShutdown()
    return devices


def discover(source: str = "auto") -> list[GpuDevice]:
    """The schedulable GPUs of this machine, in index order.

    source "auto": the fake inventory of TANGRAM_FAKE_GPUS when that variable is set (it is
    an explicit choice and wins over real GPUs), else NVML, else none. "fake": only
    TANGRAM_FAKE_GPUS (none when unset). "nvml": only NVML (none without a driver).

    TANGRAM_FAKE_GPUS is a comma-separated list of physical GPUs, each "<MiB>" (a whole
    GPU) or "mig:<MiB>+<MiB>+..." (a GPU in MIG mode, one MIG instance per <MiB>); e.g.
    "81920,mig:40960+40960" is three devices: GPU-fake-0, MIG-fake-1-0, MIG-fake-1-1. A
    malformed value raises ValidationError naming TANGRAM_FAKE_GPUS.

    NVML: every GPU; a GPU in MIG mode contributes its MIG instances instead of itself.
    NVML is always shut down again; a GPU whose queries fail is skipped with a warning.
    """
    if source not in ("auto", "fake", "nvml"):
        raise ValidationError("source", f"expected 'auto', 'fake' or 'nvml', got {source!r}")
    fake = os.environ.get(FAKE_ENV, "").strip()
    if source == "fake" or (source == "auto" and fake):
        return parse_fake(fake)
    return _discover_nvml()


__all__ = ["FAKE_ENV", "GpuDevice", "discover", "parse_fake"]
