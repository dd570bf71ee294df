"""What a GPU service (a reward model) implements: ServiceHooks, and FunctionService, hooks
made of plain functions. Apart from the GPU manager (gpu.py) so that the runtime's
configuration can check a service's hooks without loading the manager."""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar

from ..._errors import ValidationError
from ...devices import GpuDevice


class ServiceHooks(abc.ABC):
    """What a GPU service (a reward model) does, as blocking user code. Subclass it.

    The manager calls the hooks of one service in one worker thread, one at a time, in the
    order the core decided: `load` once on its first residency, then `offload` and
    `restore` as the core evicts and restores it, `batch` while it is resident, `close`
    when the runtime closes. A hook that raises fails what it was called for: a restore
    (the waiting actions fail with ActionFailed), or every action of a batch.

    `device` is the GpuDevice to use (`device.uuid`, `device.nvml_index`; a hook that
    starts a worker process can give it `grant_environment(device, device.memory_mib,
    False)`). In-process CUDA code should select the device by UUID or PCI order
    (CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA ordinals match `nvml_index`).

    A replicated service (`Service(replicas=N)`) has one hooks object for its N instances:
    keep each instance's state in the handle `load` returns, not in the object.
    """

    @abc.abstractmethod
    def load(self, device: GpuDevice | None) -> Any:
        """Load the model onto `device` (first residency) and return its handle."""

    @abc.abstractmethod
    def offload(self, handle: Any) -> None:
        """Move the model from its device to host memory, freeing the device memory."""

    @abc.abstractmethod
    def restore(self, handle: Any, device: GpuDevice | None) -> bool | None:
        """Move the model from host memory onto `device` (possibly another one than before).
        Return False when it was a fresh load instead (e.g. a server process restarted):
        the manager then does not count its time as a restore's."""

    @abc.abstractmethod
    def batch(self, handle: Any, inputs: list[Any]) -> list[Any]:
        """Run the model on `inputs`: one output per input, in the same order."""

    def close(self, handle: Any) -> None:
        """Release the model (called once at shutdown, only if it was loaded; and before
        a restart, below)."""

    def healthy(self, handle: Any) -> bool:
        """Whether the loaded model still serves (e.g. its server process is alive and its
        health endpoint answers). The manager asks after a batch hook raised, and before
        the next batch on a device that reported an Xid error; False (or an exception)
        restarts the service in place: `close`, then `load` on its device, while its
        actions wait. Default: always healthy."""
        return True

    # Whether the manager may run several batches at once (a server that batches
    # continuously); else one batch at a time, in this service's hook thread.
    concurrent_batches: ClassVar[bool] = False
    # Seconds any one hook call of this service may take, when it needs another limit than
    # the manager's hook_timeout (a server's load waits for its startup); None: the manager's.
    hook_timeout: float | None = None


class FunctionService(ServiceHooks):
    """A service that needs no device: a CPU-only scorer. `fn(input) -> output`, or
    `batch_fn(inputs) -> outputs` for a whole batch at once; load, offload, restore and
    close do nothing."""

    def __init__(self, fn: Callable[[Any], Any] | None = None,
                 batch_fn: Callable[[list[Any]], list[Any]] | None = None) -> None:
        if fn is None and batch_fn is None:
            raise ValidationError("fn", "FunctionService needs fn or batch_fn")
        self.fn = fn
        self.batch_fn = batch_fn

    def load(self, device: GpuDevice | None) -> Any:
        return None

    def offload(self, handle: Any) -> None:
        pass

    def restore(self, handle: Any, device: GpuDevice | None) -> None:
        pass

    def batch(self, handle: Any, inputs: list[Any]) -> list[Any]:
        if self.batch_fn is not None:
            return self.batch_fn(inputs)
        assert self.fn is not None
        return [self.fn(x) for x in inputs]
