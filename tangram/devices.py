"""GPU discovery: the schedulable GPUs of this machine, from NVML or a declared fake inventory.

Devices come from NVML (nvidia-ml-py, imported as `pynvml`): every GPU, its UUID, name and
memory. A GPU in MIG mode is not schedulable itself: each of its MIG instances is one
schedulable device, with its own memory and its `MIG-...` UUID. Without a driver (NVML fails
to initialise, or nvidia-ml-py is missing) there are no devices.

A device's schedulable memory is what NVML reports free when it is discovered: its total
less what the driver reserves (NVML's v2 memory info reports that apart; v1 counts it as
used) and what other processes already hold, so tangram never plans with memory it cannot
have. Each process that uses CUDA also holds a context of a few hundred MiB on its device:
a service's `memory` and an action's `gpu_memory` should include it.

An inherited CUDA_VISIBLE_DEVICES limits NVML discovery as it limits CUDA, in its order:
comma-separated entries, each a GPU's NVML index (its PCI bus order, which is CUDA's order
on a machine whose GPUs are alike or with CUDA_DEVICE_ORDER=PCI_BUS_ID; a GPU in MIG mode
gives all its instances), a GPU or MIG UUID, or a unique UUID prefix. Set but empty: no
devices. An entry that names no device, or one named twice, is a ValidationError naming
CUDA_VISIBLE_DEVICES (CUDA would silently drop it and every entry after it).

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
from dataclasses import dataclass, replace
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
      UUID for a MIG instance. source: "nvml", "fake" or "given". total_mib and
      reserved_mib: NVML's total and driver-reserved memory, when NVML reported them.
    """

    index: int
    uuid: str
    name: str
    memory_mib: float  # schedulable: free when discovered
    nvml_index: int
    mig_index: int | None = None
    parent_uuid: str | None = None
    source: str = "given"
    total_mib: float | None = None  # NVML's total (None: not from NVML)
    reserved_mib: float | None = None  # what the driver reserves (NVML v2; None: not reported)

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
        if self.total_mib is not None:
            d["total_mib"] = self.total_mib
        if self.reserved_mib is not None:
            d["reserved_mib"] = self.reserved_mib
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


def _memory(pynvml: Any, handle: Any) -> tuple[float, float, float | None]:
    """(free, total, reserved) MiB of a device: NVML's v2 memory info where the driver has it
    (it reports the driver's reservation apart), else v1 (reserved counted as used)."""
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return m.free / 2**20, m.total / 2**20, m.reserved / 2**20
        except (pynvml.NVMLError, TypeError, AttributeError):
            pass  # an older driver or binding: v1
    m = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return m.free / 2**20, m.total / 2**20, None


VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def visible(devices: list[GpuDevice], spec: str | None) -> list[GpuDevice]:
    """`devices` limited and ordered by a CUDA_VISIBLE_DEVICES value (module docstring),
    re-indexed; all of them when `spec` is None."""
    if spec is None:
        return devices
    chosen: list[GpuDevice] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            if spec.strip():
                raise ValidationError(VISIBLE_ENV, f"an empty entry in {spec!r}")
            continue
        if entry.isdigit():
            found = [d for d in devices if d.nvml_index == int(entry)]
        else:
            found = [d for d in devices if d.uuid == entry] or [d for d in devices if d.uuid.startswith(entry)]
            if len(found) > 1:
                raise ValidationError(VISIBLE_ENV, f"{entry!r} is the prefix of more than one device's UUID")
            if not found:  # a GPU in MIG mode, by its UUID: its instances
                found = [d for d in devices if d.parent_uuid is not None and d.parent_uuid.startswith(entry)]
                if len({d.parent_uuid for d in found}) > 1:
                    raise ValidationError(VISIBLE_ENV, f"{entry!r} is the prefix of more than one GPU's UUID")
        if not found:
            names = ", ".join(f"{d.nvml_index}: {d.uuid}" for d in devices) or "none"
            raise ValidationError(VISIBLE_ENV, f"{entry!r} names no GPU of this machine (NVML sees {names})")
        for d in found:
            if d in chosen:
                raise ValidationError(VISIBLE_ENV, f"{entry!r} names {d.uuid} again")
            chosen.append(d)
    return [replace(d, index=i) for i, d in enumerate(chosen)]


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
                    free, total, reserved = _memory(pynvml, handle)
                    devices.append(GpuDevice(len(devices), uuid, name, free, i, source="nvml", total_mib=total,
                                             reserved_mib=reserved))
                    continue
                found: list[GpuDevice] = []
                for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                    try:
                        mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
                    except pynvml.NVMLError:
                        continue  # no MIG instance in this slot
                    free, total, reserved = _memory(pynvml, mh)
                    found.append(GpuDevice(len(devices) + len(found), _text(pynvml.nvmlDeviceGetUUID(mh)),
                                           _text(pynvml.nvmlDeviceGetName(mh)), free, i, j, uuid, "nvml",
                                           total_mib=total, reserved_mib=reserved))
                if not found:
                    log.warning("GPU %d (%s) is in MIG mode with no MIG instance: not schedulable", i, uuid)
                devices.extend(found)
            except pynvml.NVMLError as e:
                log.warning("GPU %d skipped: NVML error %s", i, e)
    finally:
        pynvml.nvmlShutdown()
    return visible(devices, os.environ.get(VISIBLE_ENV))


def discover(source: str = "auto") -> list[GpuDevice]:
    """The schedulable GPUs of this machine, in index order.

    source "auto": the fake inventory of TANGRAM_FAKE_GPUS when that variable is set (it is
    an explicit choice and wins over real GPUs), else NVML, else none. "fake": only
    TANGRAM_FAKE_GPUS (none when unset). "nvml": only NVML (none without a driver).

    TANGRAM_FAKE_GPUS is a comma-separated list of physical GPUs, each "<MiB>" (a whole
    GPU) or "mig:<MiB>+<MiB>+..." (a GPU in MIG mode, one MIG instance per <MiB>); e.g.
    "81920,mig:40960+40960" is three devices: GPU-fake-0, MIG-fake-1-0, MIG-fake-1-1. A
    malformed value raises ValidationError naming TANGRAM_FAKE_GPUS.

    NVML: every GPU; a GPU in MIG mode contributes its MIG instances instead of itself;
    each with the memory free at discovery; limited and ordered by an inherited
    CUDA_VISIBLE_DEVICES (module docstring). NVML is always shut down again; a GPU whose
    queries fail is skipped with a warning.
    """
    if source not in ("auto", "fake", "nvml"):
        raise ValidationError("source", f"expected 'auto', 'fake' or 'nvml', got {source!r}")
    fake = os.environ.get(FAKE_ENV, "").strip()
    if source == "fake" or (source == "auto" and fake):
        return parse_fake(fake)
    return _discover_nvml()


__all__ = ["FAKE_ENV", "VISIBLE_ENV", "GpuDevice", "discover", "parse_fake", "visible"]
