"""The engine: one worker per device, each product sent to the least-loaded one; and `EngineFront`, what the
service and the routes ask of an engine, whether it runs in their process (this one) or in engine processes
behind the data plane (`app.dataplane.remote`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from app.engine.autotune import AutoChoice
from app.engine.base import KernelInfo, Outcome, ProductRequest
from app.engine.worker import EngineState, Worker
from app.errors import NotReady, SharedMemoryError
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


class Engine:
    """Workers of one backend kind (one CPU worker, or one GPU worker per device)."""

    def __init__(self, workers: list[Worker]) -> None:
        if not workers:
            raise ValueError("an engine needs at least one worker")
        self.workers = workers

    @property
    def backend_name(self) -> Literal["cpu", "gpu"]:
        return self.workers[0].backend.name

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    async def stop(self) -> None:
        await asyncio.gather(*(worker.stop() for worker in self.workers))

    @property
    def state(self) -> EngineState:
        """READY when every worker is; otherwise the first state that is not."""
        return next((w.state for w in self.workers if w.state is not EngineState.READY), EngineState.READY)

    @property
    def failure(self) -> str | None:
        return next((w.failure for w in self.workers if w.failure), None)

    @property
    def device_lost(self) -> bool:
        return any(worker.device_lost for worker in self.workers)

    def check_ready(self) -> None:
        for worker in self.workers:
            worker.check_ready()

    def check_room(self) -> None:
        """Overloaded when no ready worker's queue has room: said before the body is read, and checked again
        when the product is queued."""
        ready = [worker for worker in self.workers if worker.state is EngineState.READY]
        if ready and not any(worker.has_room for worker in ready):
            raise ready[0].overloaded()

    @property
    def queue_size(self) -> int:
        """Products each worker may hold waiting."""
        return self.workers[0].queue_size

    @property
    def queue_depth(self) -> int:
        return sum(worker.queue_depth for worker in self.workers)

    def kernels(self) -> list[KernelInfo]:
        return self.workers[0].backend.kernels()

    def auto_choices(self) -> list[AutoChoice]:
        """What auto picks, as the first device measured it (devices of one server are alike)."""
        return self.workers[0].backend.auto_choices()

    def describe(self) -> list[dict[str, Any]]:
        """Every device, with its worker's state and queue."""
        return [
            {**worker.backend.describe(), "state": worker.state.value, "queue_depth": worker.queue_depth}
            for worker in self.workers
        ]

    def memory_held(self) -> int:
        return sum(worker.backend.memory_held() for worker in self.workers)

    def compiled_instances(self) -> int:
        return sum(worker.backend.compiled_instances() for worker in self.workers)

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
        """a @ b on the least-loaded ready worker's device (into `out`, when given), with the request's kernel (and
        tile) checked and resolved there (UnknownKernel, InvalidParameter) before the product is queued. Clients'
        shared-memory regions are held by engine processes (which resolve them into arrays first), not here."""
        if into is not None or isinstance(a, SharedTensor) or isinstance(b, SharedTensor):
            raise SharedMemoryError("shared-memory regions are served by engine processes, not an in-process engine")
        ready = [worker for worker in self.workers if worker.state is EngineState.READY]
        if not ready:
            self.check_ready()
            raise NotReady("no device is ready")
        worker = min(ready, key=lambda w: w.load)
        plan = worker.backend.plan(request)
        return await worker.matmul(a, b, np.dtype(request.dtype), plan, timeout_s=timeout_s, out=out)
