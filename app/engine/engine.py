"""`EngineFront`, what the service and the routes ask of an engine, whether it runs in engine processes behind the
data plane (`app.dataplane.engine_client.EngineClient`, what the service uses) or in this process (`LocalEngine`,
one device worker: what tests and benchmarks use)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from app.engine.autotune import AutoChoice
from app.engine.base import KernelInfo, Outcome, ProductRequest
from app.engine.device_worker import DeviceWorker, EngineState
from app.errors import SharedMemoryError
from app.shared_memory import Matrix, SharedOutput, SharedTensor


@dataclass(frozen=True)
class SlabUse:
    """The shared memory an HTTP worker has for its requests' operands and products."""

    capacity_bytes: int
    used_bytes: int
    waiting: int
    """Requests waiting for room."""


@dataclass(frozen=True)
class LentMemory:
    """Shared memory lent to a request for its body, where the engine reads operands without a copy."""

    memory: np.ndarray
    """The body's bytes (uint8), to be read into; every view of them keeps them from going back."""
    release: Callable[[], None]
    """The request is done with them: they go back once no view of them is left."""


class EngineFront(Protocol):
    """What the service, the routes and the probes use of an engine."""

    @property
    def backend_name(self) -> Literal["cpu", "gpu"]: ...

    @property
    def state(self) -> EngineState: ...

    @property
    def failure(self) -> str | None: ...

    def check_ready(self) -> None:
        """NotReady unless the engine can take a product now."""
        ...

    def check_room(self) -> None:
        """Overloaded when no ready device's queue has room."""
        ...

    @property
    def queue_size(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    def kernels(self) -> list[KernelInfo]: ...

    def auto_choices(self) -> list[AutoChoice]: ...

    def describe(self) -> list[dict[str, Any]]: ...

    def memory_held(self) -> int: ...

    def compiled_instances(self) -> int: ...

    def slab_use(self) -> SlabUse | None:
        """The shared memory of this process's requests, where they travel through it (None in-process)."""
        ...

    def lend(self, nbytes: int, data_at: int = 0) -> LentMemory | None:
        """Shared memory for a body of `nbytes` now, byte `data_at` of it (where its binary data begins) aligned
        for the engine; None where there is none to lend (in-process, or none free now)."""
        ...

    async def matmul(
        self, a: Matrix, b: Matrix, request: ProductRequest, timeout_s: float | None, into: SharedOutput | None = None
    ) -> Outcome:
        """a @ b as `request` asks, if it leaves the queue within `timeout_s`; operands and the product may lie in a
        client's registered shared-memory regions (`SharedTensor`, `into`), which only engine processes hold."""
        ...


class LocalEngine:
    """One device worker in this process, behind the interface the service uses (`EngineFront`): what tests and
    benchmarks serve through. The service itself reaches its engine processes through `EngineClient`
    (`app.dataplane.engine_client`), which also spreads products over several devices."""

    def __init__(self, worker: DeviceWorker) -> None:
        self.worker = worker

    @property
    def backend_name(self) -> Literal["cpu", "gpu"]:
        return self.worker.backend.name

    def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        await self.worker.stop()

    @property
    def state(self) -> EngineState:
        return self.worker.state

    @property
    def failure(self) -> str | None:
        return self.worker.failure

    @property
    def device_lost(self) -> bool:
        return self.worker.device_lost

    def check_ready(self) -> None:
        self.worker.check_ready()

    def check_room(self) -> None:
        """Overloaded when the ready worker's queue has no room: said before the body is read, and checked again
        when the product is queued."""
        if self.worker.state is EngineState.READY and not self.worker.has_room:
            raise self.worker.overloaded()

    @property
    def queue_size(self) -> int:
        return self.worker.queue_size

    @property
    def queue_depth(self) -> int:
        return self.worker.queue_depth

    def kernels(self) -> list[KernelInfo]:
        return self.worker.backend.kernels()

    def auto_choices(self) -> list[AutoChoice]:
        return self.worker.backend.auto_choices()

    def describe(self) -> list[dict[str, Any]]:
        """The device, with its worker's state and queue."""
        worker = self.worker
        return [{**worker.backend.describe(), "state": worker.state.value, "queue_depth": worker.queue_depth}]

    def memory_held(self) -> int:
        return self.worker.backend.memory_held()

    def compiled_instances(self) -> int:
        return self.worker.backend.compiled_instances()

    def lend(self, nbytes: int, data_at: int = 0) -> None:
        """In-process operands are read where they are: nothing to lend."""
        return None

    def slab_use(self) -> None:
        return None

    async def matmul(
        self,
        a: Matrix,
        b: Matrix,
        request: ProductRequest,
        timeout_s: float | None,
        into: SharedOutput | None = None,
        out: np.ndarray | None = None,
    ) -> Outcome:
        """a @ b on the worker's device (into `out`, when given), with the request's kernel (and tile) checked and
        resolved (UnknownKernel, InvalidParameter) before the product is queued. Clients' shared-memory regions are
        held by engine processes (which resolve them into arrays first), not here."""
        if into is not None or isinstance(a, SharedTensor) or isinstance(b, SharedTensor):
            raise SharedMemoryError("shared-memory regions are served by engine processes, not an in-process engine")
        self.worker.check_ready()
        plan = self.worker.backend.plan(request)
        return await self.worker.matmul(a, b, np.dtype(request.dtype), plan, timeout_s=timeout_s, out=out)
