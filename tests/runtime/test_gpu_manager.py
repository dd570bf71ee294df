"""The GPU manager, driven directly (no orchestrator): discovery (fake inventory, a
simulated NVML driver with a MIG GPU, no driver), grant environments, service residency
(hook order, readiness), dynamic batching, typed failures, cancellation, attach checks."""

from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import types
from typing import Any

import pytest

import tangram
from tangram import Call, Gpu, Inventory, Node, Service
from tangram.devices import GpuDevice, discover, parse_fake
from tangram.runtime.call import Placement
from tangram.runtime.errors import ActionFailed, ManagerError
from tangram.runtime.managers.gpu import FunctionService, GpuManager, ServiceHooks, grant_environment, mps_active
from tangram.runtime.managers.base import LiveAction, manager_class

WAIT = 5.0  # seconds a blocked hook waits at most: a broken test fails instead of hanging


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 10))


# ------------------------------------------------------------------ discovery


@pytest.fixture
def no_fake(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TANGRAM_FAKE_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # discovery follows it: tests set it themselves


def test_fake_inventory_whole_and_mig(monkeypatch):
    monkeypatch.setenv("TANGRAM_FAKE_GPUS", " 81920 , mig:40960+20480 ,1000.5")
    devs = discover()
    assert [(d.index, d.uuid, d.memory_mib, d.mig, d.parent_index, d.nvml_index) for d in devs] == [
        (0, "GPU-fake-0", 81920.0, False, None, 0),
        (1, "MIG-fake-1-0", 40960.0, True, 1, 1),
        (2, "MIG-fake-1-1", 20480.0, True, 1, 1),
        (3, "GPU-fake-2", 1000.5, False, None, 2),
    ]
    assert {d.source for d in devs} == {"fake"} and devs[1].parent_uuid == "GPU-fake-1"
    assert discover("fake") == devs
    # Inventory.local goes through the same discovery: one Gpu per schedulable device.
    assert list(Inventory.local().nodes[0].gpus) == [Gpu(81920.0), Gpu(40960.0), Gpu(20480.0), Gpu(1000.5)]


@pytest.mark.parametrize("spec", ["80GB", "1000,,2000", "mig:", "mig:100+x", "0", "-5", "nan", "inf"])
def test_fake_inventory_malformed(monkeypatch, spec):
    monkeypatch.setenv("TANGRAM_FAKE_GPUS", spec)
    with pytest.raises(tangram.ValidationError) as e:
        discover()
    assert e.value.field == "TANGRAM_FAKE_GPUS"
    with pytest.raises(tangram.ValidationError) as e:
        parse_fake(spec, "devices")
    assert e.value.field == "devices"


# Invariant: the GPU manager's module offers the discovery API of tangram.devices as is.
def test_gpu_module_offers_discovery() -> None:
    import tangram.devices
    import tangram.runtime.managers.gpu

    for name in tangram.devices.__all__:
        assert getattr(tangram.runtime.managers.gpu, name) is getattr(tangram.devices, name)
        assert name in tangram.runtime.managers.gpu.__all__


def test_discover_source(monkeypatch, no_fake):
    assert discover("fake") == []
    with pytest.raises(tangram.ValidationError) as e:
        discover("cuda")
    assert e.value.field == "source"


class FakeNvml:
    """A simulated NVML driver: GPU 0 a whole 80 GiB GPU without MIG support, with 512 MiB
    reserved by the driver and 1,024 MiB held by another process; GPU 1 an A100 in MIG mode
    with instances in slots 0 and 2 (slot 1 empty; 64 MiB of the second in use), whose
    handles report v1 memory info only. Installed as the `pynvml` module, so discovery
    runs its real NVML code path against it."""

    NVML_DEVICE_MIG_ENABLE = 1
    MEMORY_V2 = 0x2000028

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    def __init__(self, init_fails: bool = False) -> None:
        self.init_fails = init_fails
        self.calls: list[str] = []
        self.initialised = 0
        def mem(total: int, used: int = 0, reserved: int = 0) -> types.SimpleNamespace:  # MiB
            return types.SimpleNamespace(total=total * 2**20, used=(used + reserved) * 2**20,
                                         free=(total - used - reserved) * 2**20)

        def mem2(total: int, used: int, reserved: int) -> types.SimpleNamespace:  # v2: reserved apart
            return types.SimpleNamespace(total=total * 2**20, reserved=reserved * 2**20, used=used * 2**20,
                                         free=(total - used - reserved) * 2**20)

        self.gpus = {
            0: {"uuid": b"GPU-aaaa", "name": b"NVIDIA H100 80GB HBM3", "mem": mem(81559, 1024, 512),
                "mem2": mem2(81559, 1024, 512), "mig": None},
            1: {"uuid": "GPU-bbbb", "name": "NVIDIA A100-SXM4-40GB", "mem": mem(40960), "mig": [1, 1],
                "instances": {0: {"uuid": "MIG-1111", "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                                  "mem": mem(19968)},
                              2: {"uuid": b"MIG-2222", "name": "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                                  "mem": mem(4864, 64)}}},
        }

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.NVMLError = self.NVMLError  # type: ignore[attr-defined]
        m.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]
        m.nvmlMemory_v2 = self.MEMORY_V2  # type: ignore[attr-defined]
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMigMode",
                     "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex"):
            setattr(m, name, getattr(self, name))
        return m

    def _live(self) -> None:
        if not self.initialised:
            raise self.NVMLError(1)  # NVML_ERROR_UNINITIALIZED

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_fails:
            raise self.NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._live()
        self.calls.append("shutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        self._live()
        return ("gpu", i)

    def _info(self, handle: Any) -> dict[str, Any]:
        self._live()
        if handle[0] == "gpu":
            return self.gpus[handle[1]]
        return self.gpus[handle[1]]["instances"][handle[2]]

    def nvmlDeviceGetUUID(self, handle: Any) -> Any:
        return self._info(handle)["uuid"]

    def nvmlDeviceGetName(self, handle: Any) -> Any:
        return self._info(handle)["name"]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if version is None:
            return self._info(handle)["mem"]
        assert version == self.MEMORY_V2
        if "mem2" not in self._info(handle):
            raise self.NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
        return self._info(handle)["mem2"]

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = self._info(handle)["mig"]
        if mode is None:
            raise self.NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
        return mode

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._live()
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, j: int) -> Any:
        if j not in self._info(handle)["instances"]:
            raise self.NVMLError(6)  # NVML_ERROR_NOT_FOUND
        return ("mig", handle[1], j)


def test_nvml_discovery_with_mig(monkeypatch, no_fake):
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    devs = discover()
    # Schedulable: what is free, not NVML's total (the driver's reservation, reported apart
    # by v2 where the handle has it, and other processes' memory are not tangram's).
    assert devs == [
        GpuDevice(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 80023.0, 0, None, None, "nvml", 81559.0, 512.0),
        GpuDevice(1, "MIG-1111", "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 19968.0, 1, 0, "GPU-bbbb", "nvml", 19968.0),
        GpuDevice(2, "MIG-2222", "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4800.0, 1, 2, "GPU-bbbb", "nvml", 4864.0),
    ]
    assert devs[0].describe()["total_mib"] == 81559.0 and devs[0].describe()["reserved_mib"] == 512.0
    assert nvml.calls == ["init", "shutdown"] and nvml.initialised == 0
    assert discover("nvml") == devs
    assert list(Inventory.local().nodes[0].gpus) == [Gpu(80023.0), Gpu(19968.0), Gpu(4800.0)]
    # The fake inventory is an explicit choice: it wins over the driver.
    monkeypatch.setenv("TANGRAM_FAKE_GPUS", "1000")
    assert [d.uuid for d in discover()] == ["GPU-fake-0"]
    assert discover("nvml") == devs


@pytest.mark.parametrize("spec, uuids", [
    ("1", ["MIG-1111", "MIG-2222"]),  # an NVML index: the GPU, or all its MIG instances
    ("GPU-aaaa", ["GPU-aaaa"]),
    ("MIG-2222,0", ["MIG-2222", "GPU-aaaa"]),  # in its order
    ("GPU-a", ["GPU-aaaa"]),  # a unique prefix, as CUDA takes it
    ("GPU-bbbb", ["MIG-1111", "MIG-2222"]),  # a GPU in MIG mode by its UUID
    (" 0 , MIG-1111 ", ["GPU-aaaa", "MIG-1111"]),
    ("", []),  # set and empty: CUDA sees no device
])
def test_nvml_discovery_follows_cuda_visible_devices(monkeypatch, no_fake, spec, uuids):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    devs = discover()
    assert [d.uuid for d in devs] == uuids and [d.index for d in devs] == list(range(len(uuids)))
    assert [g.memory for g in Inventory.local().nodes[0].gpus] == [d.memory_mib for d in devs]


@pytest.mark.parametrize("spec, why", [("7", "names no GPU"), ("0,GPU-aaaa", "again"), ("MIG-", "more than one"),
                                       ("0,,1", "empty entry"), ("GPU-zz", "names no GPU")])
def test_cuda_visible_devices_that_name_no_device(monkeypatch, no_fake, spec, why):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    with pytest.raises(tangram.ValidationError) as e:
        discover()
    assert e.value.field == "CUDA_VISIBLE_DEVICES" and why in str(e.value)


def test_nvml_failing_gpu_is_skipped_and_nvml_shut_down(monkeypatch, no_fake, caplog):
    nvml = FakeNvml()
    del nvml.gpus[0]["mem"]  # GPU 0 fails its memory query (KeyError -> NVMLError below)
    original = nvml.nvmlDeviceGetMemoryInfo

    def memory(handle: Any) -> Any:
        try:
            return original(handle)
        except KeyError:
            raise nvml.NVMLError(15) from None  # NVML_ERROR_GPU_IS_LOST

    nvml.nvmlDeviceGetMemoryInfo = memory  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    assert [d.uuid for d in discover()] == ["MIG-1111", "MIG-2222"]
    assert "GPU 0 skipped" in caplog.text
    assert nvml.calls[-1] == "shutdown" and nvml.initialised == 0


def test_no_driver_no_gpus(monkeypatch, no_fake):
    nvml = FakeNvml(init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    assert discover() == [] and nvml.calls == ["init"]
    assert Inventory.local().nodes[0].gpus == []
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    assert discover() == []


def test_real_nvml_on_this_machine(no_fake):
    # The real nvidia-ml-py: on a machine without a driver nvmlInit fails and there are
    # no GPUs; with one, every device has a UUID and memory.
    pytest.importorskip("pynvml")
    for d in discover("nvml"):
        assert d.uuid.startswith(("GPU-", "MIG-")) and d.memory_mib > 0 and d.source == "nvml"


def test_mps_active(tmp_path, monkeypatch):
    import socket

    pipe = tmp_path / "mps"  # a short path: a UNIX socket's name is at most 107 bytes
    pipe.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    assert not mps_active()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as daemon:  # a daemon listening
        daemon.bind(str(pipe / "control"))
        daemon.listen()
        assert mps_active() and mps_active(str(pipe))
    assert (pipe / "control").exists()  # what a crashed daemon leaves behind: nobody answers
    assert not mps_active()
    (pipe / "control").unlink()
    (pipe / "control").touch()  # a control endpoint that is not a socket counts when it exists
    assert mps_active()
    assert not mps_active(str(tmp_path / "elsewhere"))


# ------------------------------------------------------------------ grants


WHOLE = GpuDevice(0, "GPU-aaaa", "H100", 81920.0, 0)
MIG = GpuDevice(1, "MIG-1111", "A100 MIG 3g.20gb", 20480.0, 1, 0, "GPU-bbbb")


PIPE = {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}  # where the daemon is, carried into the scrubbed sandbox


def test_grant_whole_device():
    for mps in (False, True):
        assert grant_environment(WHOLE, 81920, mps, "/run/mps") == {
            "CUDA_VISIBLE_DEVICES": "GPU-aaaa", "TANGRAM_GPU_MEMORY_MIB": "81920", **(PIPE if mps else {})}
        assert grant_environment(WHOLE, 1e6, mps)["TANGRAM_GPU_MEMORY_MIB"] == "81920"


def test_grant_mig_instance():
    for mps in (False, True):  # the hardware isolates a MIG instance; a slice of it is a share
        assert grant_environment(MIG, 20480, mps, "/run/mps") == {
            "CUDA_VISIBLE_DEVICES": "MIG-1111", "TANGRAM_GPU_MEMORY_MIB": "20480", **(PIPE if mps else {})}
        assert grant_environment(MIG, 5120, mps, "/run/mps") == {
            "CUDA_VISIBLE_DEVICES": "MIG-1111", "TANGRAM_GPU_MEMORY_MIB": "5120", **(PIPE if mps else {})}


def test_grant_slice_with_and_without_mps():
    assert grant_environment(WHOLE, 20480, mps=False) == {"CUDA_VISIBLE_DEVICES": "GPU-aaaa",
                                                          "TANGRAM_GPU_MEMORY_MIB": "20480"}
    # Memory capped; compute not (no thread percentage: memory is no measure of SMs).
    assert grant_environment(WHOLE, 20480, mps=True, mps_pipe="/run/mps") == {
        "CUDA_VISIBLE_DEVICES": "GPU-aaaa", "TANGRAM_GPU_MEMORY_MIB": "20480",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M", **PIPE}
    tiny = grant_environment(WHOLE, 100.5, mps=True)
    assert tiny["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=100M" and tiny["TANGRAM_GPU_MEMORY_MIB"] == "100.5"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in tiny
    assert grant_environment(WHOLE, 0, mps=True, mps_pipe="/run/mps") == {
        "CUDA_VISIBLE_DEVICES": "GPU-aaaa", "TANGRAM_GPU_MEMORY_MIB": "0", **PIPE}
    for bad in (-1.0, math.nan):
        with pytest.raises(tangram.ValidationError):
            grant_environment(WHOLE, bad, mps=True)


# ------------------------------------------------------------------ services


class Recorder(ServiceHooks):
    """Records every hook call; `gate` (when set) blocks batch until released; `hold`
    blocks load/restore until released."""

    def __init__(self, fail_batch: Exception | None = None, outputs: Any = None) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.batches: list[list[Any]] = []
        self.fail_batch = fail_batch
        self.outputs = outputs
        self.gate: threading.Event | None = None
        self.hold: threading.Event | None = None
        self.entered = threading.Event()
        self.threads: set[str] = set()
        self.running = 0
        self.overlap = False
        self.fail_restore: Exception | None = None

    def _enter(self, *event: Any) -> None:
        self.running += 1
        self.overlap |= self.running > 1
        self.threads.add(threading.current_thread().name)
        self.events.append(event)

    def load(self, device):  # type: ignore[no-untyped-def]
        self._enter("load", device.index)
        try:
            if self.hold is not None:
                self.entered.set()
                assert self.hold.wait(WAIT)
            if self.fail_restore is not None:
                raise self.fail_restore
            return {"on": device.index}
        finally:
            self.running -= 1

    def offload(self, handle):  # type: ignore[no-untyped-def]
        self._enter("offload", handle["on"])
        handle["on"] = None
        self.running -= 1

    def restore(self, handle, device):  # type: ignore[no-untyped-def]
        self._enter("restore", device.index)
        try:
            if self.hold is not None:
                self.entered.set()
                assert self.hold.wait(WAIT)
            if self.fail_restore is not None:
                raise self.fail_restore
            handle["on"] = device.index
        finally:
            self.running -= 1

    def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
        self._enter("batch", handle["on"], tuple(inputs))
        try:
            self.batches.append(list(inputs))
            if self.gate is not None:
                self.entered.set()
                assert self.gate.wait(WAIT)
            if self.fail_batch is not None:
                raise self.fail_batch
            if self.outputs is not None:
                return self.outputs
            return [(handle["on"], x * 10) for x in inputs]
        finally:
            self.running -= 1

    def close(self, handle):  # type: ignore[no-untyped-def]
        self._enter("close")
        self.running -= 1


def inv(gpus=(81920.0, 81920.0), services=(("rm", 1), ), nodes: int = 1) -> Inventory:  # type: ignore[no-untyped-def]
    return Inventory([Node(f"n{i}", {"cpu": 8}, [Gpu(m) for m in gpus]) for i in range(nodes)],
                     services=[Service(name, 10000, 1.0, max_batch=mb) for name, mb in services])


def manager(hooks: dict[str, ServiceHooks] | None = None, max_batch: int = 1, gpus=(81920.0, 81920.0),
            **kw: Any) -> GpuManager:  # type: ignore[no-untyped-def]
    hooks = {"rm": Recorder()} if hooks is None else hooks
    m = GpuManager(services=hooks, devices=[float(g) for g in gpus], **kw)
    m.attach(inv(gpus, [(name, max_batch) for name in hooks]))
    return m


def place(aid: int, device: int | None = 0, node: int = 0, gpu_memory: float = 0.0) -> Placement:
    return Placement(aid, node, f"n{node}", device, 0.0, 1.0, 0.0, gpu_memory)


def act(aid: int, x: Any, service: str = "rm") -> LiveAction:
    return LiveAction(aid, Call(args=(x,), service=service, kind="reward"))


async def ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


def test_registered_as_gpu():
    assert manager_class("gpu") is GpuManager


def test_restore_evict_hook_order():
    rec = Recorder()
    m = manager({"rm": rec})

    async def main() -> None:
        await m.restore("rm", 0, 0)
        assert m.resident("rm") == 0
        assert await m.execute(act(1, 1), place(1, 0)) == (0, 10)
        await m.evict("rm", 0, 0)
        assert m.resident("rm") is None
        await m.restore("rm", 0, 1)
        await m.restore("rm", 0, 1)  # already resident: nothing to do
        assert await m.execute(act(2, 2), place(2, 1)) == (1, 20)
        await m.evict("rm", 0, 1)
        await m.restore("rm", 0, 0)
        await m.close()

    run(main())
    assert rec.events == [("load", 0), ("batch", 0, (1,)), ("offload", 0), ("restore", 1), ("batch", 1, (2,)),
                          ("offload", 1), ("restore", 0), ("close",)]
    assert not rec.overlap and len(rec.threads) == 1  # one worker thread per service, one hook at a time


class SlowOffload(Recorder):
    """Its offload blocks until `released` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.offloading = threading.Event()
        self.released = threading.Event()

    def offload(self, handle):  # type: ignore[no-untyped-def]
        self.offloading.set()
        assert self.released.wait(WAIT)
        super().offload(handle)


# Invariant: service_states (what `tangram top` shows) follows a service through its life:
# not loaded, restoring, resident, evicting while its offload runs, offloaded.
def test_service_states_follow_restore_and_eviction():
    rec = SlowOffload()
    rec.hold = threading.Event()
    m = manager({"rm": rec})

    async def main() -> None:
        assert m.service_states() == {"rm": ("not loaded", None)}
        restore = asyncio.ensure_future(m.restore("rm", 0, 1))
        await asyncio.to_thread(rec.entered.wait, WAIT)
        assert m.service_states() == {"rm": ("restoring", 1)}
        rec.hold.set()
        await restore
        assert m.service_states() == {"rm": ("resident", 1)}
        evict = asyncio.ensure_future(m.evict("rm", 0, 1))
        await asyncio.to_thread(rec.offloading.wait, WAIT)
        assert m.service_states() == {"rm": ("evicting", 1)}
        rec.released.set()
        await evict
        assert m.service_states() == {"rm": ("offloaded", None)}
        await m.close()

    run(main())


def test_execute_waits_for_residency():
    rec = Recorder()
    rec.hold = threading.Event()
    m = manager({"rm": rec}, max_batch=4)

    async def main() -> None:
        # The orchestrator may start the action before the restore runs (restores queue per device).
        task = asyncio.create_task(m.execute(act(1, 3), place(1, 1)))
        other = asyncio.create_task(m.execute(act(2, 4), place(2, 1)))
        await ticks()
        assert not task.done() and rec.events == []
        restore = asyncio.create_task(m.restore("rm", 0, 1))
        await asyncio.to_thread(rec.entered.wait, WAIT)  # load is running...
        await ticks()
        assert not task.done() and m.resident("rm") is None  # ...and the action still waits
        rec.hold.set()
        await restore
        assert await task == (1, 30) and await other == (1, 40)
        await m.close()

    run(main())
    assert rec.events[:2] == [("load", 1), ("batch", 1, (3, 4))]  # the waiters join one batch


def test_restore_failure_fails_waiting_actions_then_retries():
    rec = Recorder()
    rec.fail_restore = RuntimeError("CUDA out of memory")
    m = manager({"rm": rec})

    async def main() -> None:
        waiting = asyncio.create_task(m.execute(act(1, 1), place(1, 0)))
        await ticks()
        with pytest.raises(ManagerError) as e:
            await m.restore("rm", 0, 0)
        assert e.value.field == "services.rm" and "load hook failed" in e.value.reason
        with pytest.raises(ActionFailed) as f:
            await waiting
        assert "could not be made resident" in f.value.reason and f.value.error_type == "RuntimeError"
        rec.fail_restore = None
        await m.restore("rm", 0, 0)  # the core retries: load again (it never returned a handle)
        assert await m.execute(act(2, 2), place(2, 0)) == (0, 20)
        await m.close()

    run(main())
    assert [e[0] for e in rec.events] == ["load", "load", "batch", "close"]


def test_a_hook_past_hook_timeout_fails_what_waits_and_takes_the_service_out_of_use():
    rec = Recorder()
    rec.hold = threading.Event()  # load blocks until released: a hung restore
    m = manager({"rm": rec}, hook_timeout=0.2)

    async def main() -> None:
        waiting = asyncio.create_task(m.execute(act(1, 1), place(1, 0)))
        await ticks()
        with pytest.raises(ManagerError) as e:
            await m.restore("rm", 0, 0)
        assert e.value.field == "services.rm" and "hook_timeout=0.2 s" in e.value.reason
        with pytest.raises(ActionFailed) as f:
            await waiting
        assert "could not be made resident" in f.value.reason and f.value.error_type == "HookTimeout"
        with pytest.raises(ManagerError) as e:  # out of use: at once, naming what did not return
            await asyncio.wait_for(m.restore("rm", 0, 0), 0.1)
        assert "its load hook ran past hook_timeout" in e.value.reason
        assert m.describe()["hook_timeout"] == 0.2
        rec.hold.set()  # the hook returns at last; what it returned is dropped
        await m.close()  # nothing was ever loaded: no close hook to run

    run(main())
    for bad in (0, -1, "soon", math.nan):
        with pytest.raises(ManagerError) as e:
            GpuManager(hook_timeout=bad)  # type: ignore[arg-type]
        assert e.value.field == "hook_timeout"


def test_move_restore_waits_for_eviction_elsewhere():
    # The orchestrator orders restores and evictions per device, not across devices: a
    # restore on device 1 may run before the eviction from device 0 it follows.
    rec = Recorder()
    m = manager({"rm": rec})

    async def main() -> None:
        await m.restore("rm", 0, 0)
        restore = asyncio.create_task(m.restore("rm", 0, 1))
        action = asyncio.create_task(m.execute(act(1, 4), place(1, 1)))
        await ticks()
        assert not restore.done() and not action.done()
        await m.evict("rm", 0, 0)
        await restore
        assert await action == (1, 40)
        await m.close()

    run(main())
    assert [e[:2] for e in rec.events] == [("load", 0), ("offload", 0), ("restore", 1), ("batch", 1), ("close",)]


def test_restore_waits_for_offload_on_same_device():
    slow, fast = Recorder(), Recorder()
    m = manager({"a": slow, "b": fast})
    gate = threading.Event()
    order: list[str] = []
    original = slow.offload

    def offload(handle):  # type: ignore[no-untyped-def]
        assert gate.wait(WAIT)
        order.append("offload a")
        original(handle)

    slow.offload = offload  # type: ignore[method-assign]
    original_load = fast.load

    def load(device):  # type: ignore[no-untyped-def]
        order.append("load b")
        return original_load(device)

    fast.load = load  # type: ignore[method-assign]

    async def main() -> None:
        await m.restore("a", 0, 0)
        evict = asyncio.create_task(m.evict("a", 0, 0))
        await ticks()
        restore = asyncio.create_task(m.restore("b", 0, 0))
        await asyncio.sleep(0.05)
        assert not restore.done() and order == []  # b waits for a's memory to be freed
        gate.set()
        await evict
        await restore
        await m.close()

    run(main())
    assert order == ["offload a", "load b"]


def test_evict_errors():
    m = manager({"rm": Recorder()})

    async def main() -> None:
        with pytest.raises(ManagerError) as e:
            await m.evict("rm", 0, 0)
        assert e.value.field == "services.rm" and "offloaded" in e.value.reason
        await m.restore("rm", 0, 0)
        rec = m.hooks["rm"]
        rec.gate = threading.Event()  # type: ignore[attr-defined]
        task = asyncio.create_task(m.execute(act(1, 1), place(1, 0)))
        await ticks()
        with pytest.raises(ManagerError) as e:
            await m.evict("rm", 0, 0)  # the core never evicts a service with running actions
        assert "1 of its actions run" in e.value.reason
        with pytest.raises(ManagerError) as e:
            await m.evict("rm", 0, 1)
        assert "resident on device 0" in e.value.reason
        with pytest.raises(ManagerError) as e:
            await m.restore("nope", 0, 0)
        assert e.value.field == "services.nope"
        with pytest.raises(ManagerError) as e:
            await m.restore("rm", 1, 0)
        assert e.value.field == "node"
        with pytest.raises(ManagerError) as e:
            await m.restore("rm", 0, 5)
        assert e.value.field == "devices"
        rec.gate.set()  # type: ignore[attr-defined]
        await task
        await m.evict("rm", 0, 0)
        await m.close()

    run(main())


def test_batching_routes_outputs():
    rec = Recorder()
    m = manager({"rm": rec}, max_batch=3)

    async def main() -> list[Any]:
        await m.restore("rm", 0, 1)
        out = await asyncio.gather(*(m.execute(act(i, i), place(i, 1)) for i in range(7)))
        await m.close()
        return out

    out = run(main())
    assert out == [(1, 10 * i) for i in range(7)]
    assert rec.batches == [[0, 1, 2], [3, 4, 5], [6]]  # ceil(7 / 3) batch calls
    assert m.describe()["services"]["rm"]["batches"] == 3


def test_requests_queue_while_a_batch_runs():
    rec = Recorder()
    rec.gate = threading.Event()
    m = manager({"rm": rec}, max_batch=8)

    async def main() -> list[Any]:
        await m.restore("rm", 0, 0)
        first = asyncio.create_task(m.execute(act(0, 0), place(0, 0)))
        await asyncio.to_thread(rec.entered.wait, WAIT)
        rest = [asyncio.create_task(m.execute(act(i, i), place(i, 0))) for i in range(1, 5)]
        await ticks()
        rec.gate.set()
        return await asyncio.gather(first, *rest)

    assert run(main()) == [(0, 10 * i) for i in range(5)]
    assert rec.batches == [[0], [1, 2, 3, 4]]


def test_batch_window_lets_later_requests_join():
    rec = Recorder()
    m = manager({"rm": rec}, max_batch=8, batch_window=0.05)

    async def main() -> None:
        await m.restore("rm", 0, 0)
        first = asyncio.create_task(m.execute(act(0, 0), place(0, 0)))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(m.execute(act(1, 1), place(1, 0)))
        assert await asyncio.gather(first, second) == [(0, 0), (0, 10)]

    run(main())
    assert rec.batches == [[0, 1]]


def test_batch_error_fails_every_action_typed():
    rec = Recorder(fail_batch=ValueError("tokenizer exploded"))
    m = manager({"rm": rec}, max_batch=4)

    async def main() -> list[Any]:
        await m.restore("rm", 0, 0)
        return await asyncio.gather(*(m.execute(act(i, i), place(i, 0)) for i in range(3)),
                                    return_exceptions=True)

    errors = run(main())
    assert [type(e) for e in errors] == [ActionFailed] * 3
    assert [e.action_id for e in errors] == [0, 1, 2]
    for e in errors:
        assert e.error_type == "ValueError" and "tokenizer exploded" in e.reason
        assert "ValueError: tokenizer exploded" in e.remote_traceback


def test_service_survives_a_failed_batch():
    rec = Recorder(fail_batch=ValueError("once"))
    m = manager({"rm": rec})

    async def main() -> Any:
        await m.restore("rm", 0, 0)
        with pytest.raises(ActionFailed):
            await m.execute(act(1, 1), place(1, 0))
        rec.fail_batch = None
        return await m.execute(act(2, 2), place(2, 0))

    assert run(main()) == (0, 20)


class Flaky(Recorder):
    """A Recorder whose instance can break: `broken` makes its batches raise and its
    healthy hook say no, until a load makes a new instance."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.loads = 0
        self.health_checks = 0

    def load(self, device):  # type: ignore[no-untyped-def]
        self.loads += 1
        self.broken = False
        return {**super().load(device), "instance": self.loads}

    def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
        if self.broken:
            raise ConnectionError("the server is gone")
        return [(handle["instance"], x) for x in inputs]

    def healthy(self, handle):  # type: ignore[no-untyped-def]
        self.health_checks += 1
        return not self.broken


def test_an_unhealthy_service_is_restarted_in_place():
    """A batch fails and the healthy hook says no: the service is closed and loaded again on
    its device (the core still holds it there), and later actions run on the new instance."""
    hooks = Flaky()
    m = manager({"rm": hooks})

    async def main() -> Any:
        await m.restore("rm", 0, 1)
        assert await m.execute(act(1, "a"), place(1, 1)) == (1, "a")
        hooks.broken = True
        with pytest.raises(ActionFailed, match="the server is gone"):
            await m.execute(act(2, "b"), place(2, 1))
        return await m.execute(act(3, "c"), place(3, 1))

    assert run(main()) == (2, "c")
    assert hooks.loads == 2 and hooks.health_checks == 1
    assert [e[0] for e in hooks.events].count("close") == 1 and ("load", 1) in hooks.events[-2:]
    assert m.describe()["services"]["rm"]["restarts"] == 1


def test_a_healthy_service_is_not_restarted_after_a_failed_batch():
    rec = Recorder(fail_batch=ValueError("bad input"))
    m = manager({"rm": rec})

    async def main() -> None:
        await m.restore("rm", 0, 0)
        with pytest.raises(ActionFailed):
            await m.execute(act(1, 1), place(1, 0))

    run(main())
    assert [e[0] for e in rec.events] == ["load", "batch"] and m.describe()["services"]["rm"]["restarts"] == 0


def test_a_failed_restart_fails_what_waits_and_the_next_restore_loads_again():
    hooks = Flaky()
    m = manager({"rm": hooks})

    async def main() -> Any:
        await m.restore("rm", 0, 0)
        hooks.broken = True
        hooks.fail_restore = RuntimeError("no memory for a new instance")
        with pytest.raises(ActionFailed, match="the server is gone"):
            await m.execute(act(1, 1), place(1, 0))
        with pytest.raises(ActionFailed, match="no memory for a new instance"):
            await m.execute(act(2, 2), place(2, 0))
        await m.evict("rm", 0, 0)  # nothing resident: the failed restart left none
        hooks.fail_restore = None
        await m.restore("rm", 0, 0)
        return await m.execute(act(3, 3), place(3, 0))

    assert run(main()) == (3, 3)


def test_a_failed_restart_is_tried_again_by_a_later_request():
    """The core still holds the service resident after its restart failed: requests fail
    at once, until one arrives RESTART_RETRY_SECONDS after the failure and loads it again."""
    hooks = Flaky()
    m = manager({"rm": hooks})
    m.RESTART_RETRY_SECONDS = 0.2  # type: ignore[misc]

    async def main() -> Any:
        await m.restore("rm", 0, 0)
        hooks.broken = True
        hooks.fail_restore = RuntimeError("no memory for a new instance")
        with pytest.raises(ActionFailed, match="the server is gone"):
            await m.execute(act(1, 1), place(1, 0))
        await until(lambda: m._services["rm"].restart_failed_at is not None)
        hooks.fail_restore = None
        with pytest.raises(ActionFailed, match="no memory for a new instance"):  # within the retry time
            await m.execute(act(2, 2), place(2, 0))
        await asyncio.sleep(0.25)
        return await m.execute(act(3, 3), place(3, 0))

    assert run(main()) == (3, 3)
    assert m.describe()["services"]["rm"]["restarts"] == 1


class Concurrent(Recorder):
    concurrent_batches = True

    def batch(self, handle, inputs):  # type: ignore[no-untyped-def]
        self._enter("batch", handle["on"], tuple(inputs))
        try:
            self.entered.set()
            assert self.gate is not None and self.gate.wait(WAIT)
            return [x for x in inputs]
        finally:
            self.running -= 1


def test_concurrent_batches_run_side_by_side():
    """Hooks with concurrent_batches (a server batching continuously): a request arriving
    while a batch is in flight goes out at once, in a batch of its own."""
    hooks = Concurrent()
    hooks.gate = threading.Event()
    m = manager({"rm": hooks}, max_batch=4)

    async def main() -> list[Any]:
        await m.restore("rm", 0, 0)
        first = asyncio.ensure_future(m.execute(act(1, 1), place(1, 0)))
        await until(hooks.entered.is_set)
        second = asyncio.ensure_future(m.execute(act(2, 2), place(2, 0)))
        await until(lambda: len([e for e in hooks.events if e[0] == "batch"]) == 2)
        hooks.gate.set()
        return await asyncio.gather(first, second)

    assert run(main()) == [1, 2]
    assert hooks.overlap and len({t for t in hooks.threads if "batch" in t}) == 2


def test_hooks_may_set_their_own_hook_timeout():
    rec = Recorder()
    rec.hook_timeout = 0.05  # type: ignore[misc]
    rec.hold = threading.Event()
    m = manager({"rm": rec}, hook_timeout=600)

    async def main() -> None:
        with pytest.raises(ManagerError, match=r"hook_timeout=0.05 s"):
            await m.restore("rm", 0, 0)

    run(main())
    rec.hold.set()


class XidNvml(FakeNvml):
    """FakeNvml with NVML's event API: `emit(gpu, xid)` queues a critical Xid event."""

    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        super().__init__()
        self.events: "queue.Queue[Any]" = queue.Queue()
        self.registered: list[int] = []
        self.freed = False

    def module(self) -> types.ModuleType:
        m = super().module()
        for name in ("nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree",
                     "nvmlDeviceGetIndex"):
            setattr(m, name, getattr(self, name))
        m.NVML_ERROR_TIMEOUT = self.NVML_ERROR_TIMEOUT  # type: ignore[attr-defined]
        m.nvmlEventTypeXidCriticalError = self.nvmlEventTypeXidCriticalError  # type: ignore[attr-defined]
        return m

    def emit(self, gpu: int, xid: int) -> None:
        self.events.put(types.SimpleNamespace(device=("gpu", gpu), eventType=self.nvmlEventTypeXidCriticalError,
                                              eventData=xid))

    def nvmlEventSetCreate(self) -> str:
        self._live()
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: Any, types_: int, events: str) -> None:
        assert types_ == self.nvmlEventTypeXidCriticalError and events == "events"
        self.registered.append(handle[1])

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, events: str) -> None:
        self.freed = True

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return handle[1]


def test_xid_errors_are_watched_and_make_services_there_prove_their_health(monkeypatch, no_fake):
    """NVML reports Xid 43 (a process's fault) on GPU 0: the manager records it, and the
    service resident there is asked for its health before its next batch (unhealthy:
    restarted). GPU 1's MIG instances are watched through their parent."""
    nvml = XidNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    hooks = Flaky()
    m = GpuManager(services={"rm": hooks})
    m.attach(Inventory([Node("n0", {"cpu": 8}, [Gpu(d.memory_mib) for d in discover()])],
                       services=[Service("rm", 10000, 1.0)]))

    async def main() -> Any:
        await m.start()
        await m.restore("rm", 0, 0)
        assert await m.execute(act(1, "a"), place(1, 0)) == (1, "a")
        await until(lambda: sorted(nvml.registered) == [0, 1])
        hooks.broken = True  # what the Xid did to its process
        nvml.emit(0, 43)
        await until(lambda: m.xid_events)
        result = await m.execute(act(2, "b"), place(2, 0))
        await m.close()
        return result

    assert run(main()) == (2, "b")  # on the restarted instance, without a failed batch first
    assert hooks.health_checks == 1 and m.describe()["services"]["rm"]["restarts"] == 1
    event = m.xid_events[0]
    assert (event["device"], event["xid"], event["fatal"]) == (0, 43, False)
    assert nvml.freed and nvml.initialised == 0


def test_after_a_fatal_xid_a_service_there_is_closed_not_restarted():
    """Xid 79 (fallen off the bus) on device 0: the service resident there is not restarted
    on that GPU; its actions fail at once, naming the device, and its eviction (the core
    evicts it once idle) closes it instead of offloading; its next restore is a fresh load."""
    hooks = Flaky()
    m = manager({"rm": hooks})

    async def main() -> Any:
        await m.restore("rm", 0, 0)
        assert await m.execute(act(1, "a"), place(1, 0)) == (1, "a")
        m.device_fault(0, 79)
        with pytest.raises(ActionFailed, match="device 0 is out of placement"):
            await m.execute(act(2, "b"), place(2, 0))
        assert await m.evict("rm", 0, 0) is None
        await m.restore("rm", 0, 1)
        return await m.execute(act(3, "c"), place(3, 1))

    assert run(main()) == (2, "c")  # a second load, on device 1
    assert [e[0] for e in hooks.events].count("offload") == 0 and hooks.health_checks == 0
    assert m.offline_devices == {0} and m.xid_events[0]["fatal"]


def test_batch_wrong_output_count():
    rec = Recorder(outputs=["only one"])
    m = manager({"rm": rec}, max_batch=4)

    async def main() -> list[Any]:
        await m.restore("rm", 0, 0)
        return await asyncio.gather(*(m.execute(act(i, i), place(i, 0)) for i in range(2)), return_exceptions=True)

    errors = run(main())
    assert all(isinstance(e, ActionFailed) and "returned 1 outputs for 2 inputs" in e.reason for e in errors)

    rec2 = Recorder(outputs=42)  # not a list at all
    m2 = manager({"rm": rec2})

    async def main2() -> Any:
        await m2.restore("rm", 0, 0)
        return await m2.execute(act(1, 1), place(1, 0))

    with pytest.raises(ActionFailed) as e:
        run(main2())
    assert e.value.error_type == "TypeError" and "returned int, not a list" in e.value.reason


def test_cancel_queued_and_in_flight_requests():
    rec = Recorder()
    rec.gate = threading.Event()
    m = manager({"rm": rec}, max_batch=2)

    async def main() -> None:
        await m.restore("rm", 0, 0)
        a = asyncio.create_task(m.execute(act(0, 0), place(0, 0)))
        b = asyncio.create_task(m.execute(act(1, 1), place(1, 0)))
        await asyncio.to_thread(rec.entered.wait, WAIT)  # batch [0, 1] is in flight
        c = asyncio.create_task(m.execute(act(2, 2), place(2, 0)))
        d = asyncio.create_task(m.execute(act(3, 3), place(3, 0)))
        await ticks()
        c.cancel()  # queued: removed from the queue
        b.cancel()  # in flight: its output is dropped
        await ticks()
        assert c.cancelled() and b.cancelled()
        rec.gate.set()
        assert await a == (0, 0)
        assert await d == (0, 30)
        assert m._services["rm"].active[0] == 0
        await m.evict("rm", 0, 0)  # nothing runs any more
        await m.close()

    run(main())
    assert rec.batches == [[0, 1], [3]]


def test_cancel_while_waiting_for_residency():
    m = manager({"rm": Recorder()})

    async def main() -> None:
        task = asyncio.create_task(m.execute(act(1, 1), place(1, 0)))
        await ticks()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert m._services["rm"].active[0] == 0
        await m.restore("rm", 0, 0)
        await m.evict("rm", 0, 0)
        await m.close()

    run(main())


def test_execute_rejects_bad_calls():
    m = manager({"rm": Recorder()})

    async def main() -> None:
        await m.restore("rm", 0, 0)
        cases = [
            (LiveAction(1, Call(fn=print, gpu_memory=100)), "CPU manager"),
            (LiveAction(2, Call(args=(1, 2), service="rm")), "args"),
            (LiveAction(3, Call(args=(), service="rm")), "args"),
            (LiveAction(4, Call(args=(1,), kwargs={"k": 1}, service="rm")), "args"),
            (LiveAction(5, Call(args=(1,), service="other")), "no service named 'other'"),
            (LiveAction(6, Call(fn=print, args=(1,), service="rm")), "fn"),
        ]
        for action, words in cases:
            with pytest.raises(ActionFailed) as e:
                await m.execute(action, place(action.id, 0))
            assert words in e.value.reason and e.value.action_id == action.id
            if action.id == 1:
                assert "Placement.env" in e.value.reason
        with pytest.raises(ActionFailed) as e:
            await m.execute(act(7, 1), place(7, None))
        assert "placement" in e.value.reason
        await m.close()

    run(main())


def test_function_service():
    calls: list[Any] = []
    scorer = FunctionService(lambda text: len(text))
    batched = FunctionService(batch_fn=lambda xs: (calls.append(list(xs)), [x.upper() for x in xs])[1])
    m = manager({"len": scorer, "up": batched}, max_batch=4)

    async def main() -> list[Any]:
        await m.restore("len", 0, 0)
        await m.restore("up", 0, 1)
        out = await asyncio.gather(m.execute(act(1, "abc", "len"), place(1, 0)),
                                   m.execute(act(2, "ab", "up"), place(2, 1)),
                                   m.execute(act(3, "cd", "up"), place(3, 1)))
        await m.evict("len", 0, 0)
        await m.close()
        return out

    assert run(main()) == [3, "AB", "CD"]
    assert calls == [["ab", "cd"]]
    with pytest.raises(tangram.ValidationError):
        FunctionService()


def test_close_runs_close_hooks_of_loaded_services_only():
    loaded, idle = Recorder(), Recorder()
    m = manager({"a": loaded, "b": idle})

    async def main() -> None:
        await m.restore("a", 0, 0)
        await m.close()

    run(main())
    assert loaded.events == [("load", 0), ("close",)] and idle.events == []


# ------------------------------------------------------------------ attach, grants, describe


def test_attach_errors():
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices=[1.0, 1.0]).attach(inv(services=[("rm", 1), ("judge", 2)]))
    assert e.value.field == "services.judge" and "no hooks" in e.value.reason
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder(), "extra": Recorder()}, devices=[1.0, 1.0]).attach(inv(gpus=(1.0, 1.0)))
    assert e.value.field == "services.extra" and "does not declare" in e.value.reason
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": lambda x: x})  # type: ignore[dict-item]
    assert e.value.field == "services.rm"
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices=[81920.0]).attach(inv())
    assert e.value.field == "devices" and "declares 2 GPU(s)" in e.value.reason
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices=[81920.0, 1000.0]).attach(inv())
    assert e.value.field == "devices[1]"
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices=[81920.0, "x"]).attach(inv())  # type: ignore[list-item]
    assert e.value.field == "devices[1]"
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices=[WHOLE, WHOLE]).attach(inv())
    assert e.value.field == "devices[1].index"
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices="inventory", node="nope").attach(inv())
    assert e.value.field == "node"
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": Recorder()}, devices="inventory", node=3).attach(inv())
    assert e.value.field == "node"
    for bad in (-1, "soon", math.inf):
        with pytest.raises(ManagerError) as e:
            GpuManager(batch_window=bad)  # type: ignore[arg-type]
        assert e.value.field == "batch_window"
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": "no_such_module:Hooks"})
    assert e.value.field == "services.rm" and "cannot import" in e.value.reason
    with pytest.raises(ManagerError) as e:
        GpuManager(services={"rm": "tangram.runtime.managers.gpu:FunctionService"})  # needs fn: not constructible bare
    assert e.value.field == "services.rm" and "cannot construct" in e.value.reason
    assert isinstance(GpuManager(services={"rm": f"{__name__}:Recorder"}).hooks["rm"], Recorder)



def test_attach_discovers_devices(monkeypatch, no_fake):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_fails=True).module())
    with pytest.raises(ManagerError) as e:  # no GPU here, and no fake inventory chosen
        GpuManager(services={"rm": Recorder()}).attach(inv())
    assert e.value.field == "devices" and "TANGRAM_FAKE_GPUS=81920,81920" in e.value.reason
    GpuManager().attach(Inventory.uniform(1, {"cpu": 4}))  # no GPU in the inventory: nothing needed
    monkeypatch.setenv("TANGRAM_FAKE_GPUS", "81920,81920")
    m = GpuManager(services={"rm": Recorder()})
    m.attach(inv())
    assert [d.uuid for d in m.devices] == ["GPU-fake-0", "GPU-fake-1"]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module())
    monkeypatch.delenv("TANGRAM_FAKE_GPUS")
    with pytest.raises(ManagerError) as e:  # NVML's total, not what is free: the driver's and another's
        GpuManager(services={"rm": Recorder()}, node="n1").attach(inv(gpus=(81559.0, 19968.0, 4800.0), nodes=2))
    assert e.value.field == "devices[0]" and "GPU-aaaa has 80023 MiB" in e.value.reason
    m = GpuManager(services={"rm": Recorder()}, node="n1")
    m.attach(inv(gpus=(80023.0, 19968.0, 4800.0), nodes=2))
    assert m.node == 1 and [d.uuid for d in m.devices] == ["GPU-aaaa", "MIG-1111", "MIG-2222"]
    assert m.describe()["source"] == "nvml" and m.describe()["mig"] is True
    m = GpuManager(services={"rm": Recorder()}, devices="inventory")
    m.attach(inv())
    assert [(d.uuid, d.memory_mib) for d in m.devices] == [("GPU-fake-0", 81920.0), ("GPU-fake-1", 81920.0)]
    m = GpuManager(services={"rm": Recorder()}, devices="81920,81920")
    m.attach(inv())
    assert m.describe()["source"] == "fake"


def test_device_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    m = manager({"rm": Recorder()})
    assert m.mps is False and m.describe()["mps"] is False
    assert m.device_environment(0, 1, 20480) == {"CUDA_VISIBLE_DEVICES": "GPU-fake-1", "TANGRAM_GPU_MEMORY_MIB": "20480"}
    assert m.device_environment(place(1, 1, gpu_memory=20480)) == m.device_environment(0, 1, 20480)
    assert m.device_environment(place(1, None)) == {}
    with pytest.raises(ManagerError):
        m.device_environment(1, 0, 100)
    (tmp_path / "control").touch()
    m = manager({"rm": Recorder()})  # MPS detected at attach, and its pipe directory carried
    env = m.device_environment(0, 0, 40960)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M" and env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert str(tmp_path) in m.describe()["slices"]
    plain = manager({"rm": Recorder()}, mps=False).device_environment(0, 0, 1)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in plain and "CUDA_MPS_PIPE_DIRECTORY" not in plain


def test_describe():
    m = manager({"rm": Recorder()}, max_batch=4, batch_window=0.01)
    d = m.describe()
    assert d["source"] == "fake" and d["mig"] is False and d["node"] == 0 and d["batch_window"] == 0.01
    assert [x["uuid"] for x in d["devices"]] == ["GPU-fake-0", "GPU-fake-1"]
    assert d["services"] == {"rm": {"max_batch": 4, "resident_on": None, "batches": 0, "restarts": 0, "out_of_use": None}}
    assert d["xid_events"] == [] and d["xid_watch"] == []


def test_context_mib_defaults_and_validation(monkeypatch, no_fake):
    from tangram.runtime.managers.gpu import CUDA_CONTEXT_MIB

    assert manager().context_mib == 0.0  # fake devices hold no CUDA context
    assert manager(context_mib=300).context_mib == 300.0
    with pytest.raises(ManagerError, match="context_mib"):
        GpuManager(context_mib=-1)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module())
    m = GpuManager(watch_xids=False)
    m.attach(Inventory([Node("n0", {"cpu": 8}, [Gpu(d.memory_mib) for d in discover()])]))
    assert m.context_mib == CUDA_CONTEXT_MIB and m.describe()["context_mib"] == CUDA_CONTEXT_MIB


def test_a_discard_closes_the_service_instead_of_offloading_it():
    """The core's discard (its state given up): a resident service is closed, not
    offloaded, and one whose process sleeps on the device is closed there; either way its
    next restore is a load."""
    rec = Recorder()
    m = manager({"rm": rec})

    async def main() -> None:
        await m.restore("rm", 0, 0)
        assert await m.evict("rm", 0, 0, discard=True) is None
        await m.restore("rm", 0, 1)  # a load again
        await m.evict("rm", 0, 1)  # offloaded: its process sleeps on device 1
        await m.evict("rm", 0, 0, discard=True)  # not its device: nothing to give up
        assert [e[0] for e in rec.events].count("close") == 1
        await m.evict("rm", 0, 1, discard=True)  # its process there is given up
        await m.restore("rm", 0, 1)

    run(main())
    assert [e[0] for e in rec.events] == ["load", "close", "load", "offload", "close", "load"]
