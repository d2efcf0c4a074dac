"""A CPU backend the tests steer, for what CI must catch without a GPU: it records what the engine plans and each
launch it submits, with the memory given for its products, can hold a launch until the test opens its gate, can fail
the next launch with the error a GPU backend raises (DeviceOutOfMemory, DeviceLost) and can refuse to batch a kernel,
as a GPU backend does with kernels not built for batches. It computes with the real CPU backend, and offers one more
library kernel, `blas`, which computes as `numpy` does: two kernels whose plans differ only in their name."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from app.dataplane import engine_client
from app.engine import DeviceTiming, DeviceWorker, EngineFront, KernelInfo, LocalEngine, Outcome, Plan, ProductRequest
from app.engine.base import AUTO, Finished, Outputs, Pairs
from app.engine.cpu import CpuBackend
from app.shared_memory import Matrix
from numerics.precision import Precision
from numerics.roofline import DevicePeaks

BLAS = "blas"
GATE_TIMEOUT_S = 10
"""A hang guard: the longest a held launch waits for its gate."""


async def multiply(
    engine: EngineFront | LocalEngine,
    a: Matrix,
    b: Matrix,
    dtype: np.dtype,
    kernel: str = AUTO,
    tile: int | None = None,
    timeout_s: float | None = None,
    precision: Precision = Precision.FP32,
    **where: Any,
) -> Outcome:
    """`engine.matmul` of a @ b, its request made from the operands as the service makes it."""
    return await engine.matmul(a, b, ProductRequest.of(a, b, dtype, kernel, tile, precision), timeout_s, **where)


async def until(condition: Callable[[], bool], guard_s: float = GATE_TIMEOUT_S) -> None:
    """Return once `condition()` holds, looked at every millisecond or so; a hang guard fails after `guard_s`."""
    for _ in range(int(guard_s * 1000)):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


def record_staging(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the operands the HTTP worker copies into a slab from here on (`EngineClient` staging them)."""
    names: list[str] = []
    copy = engine_client.cast_into

    def recording(target: np.ndarray, operand: np.ndarray, name: str, **kwargs: Any) -> None:
        names.append(name)
        copy(target, operand, name, **kwargs)

    monkeypatch.setattr(engine_client, "cast_into", recording)
    return names


@dataclass(frozen=True)
class Submitted:
    """One launch as the worker submitted it: the plan it ran, the products in it and where they go."""

    kernel: str
    label: str | None
    dtype: np.dtype
    products: int
    shapes: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    """The shape of each product's A."""
    outputs: tuple[np.ndarray, ...] | None = field(default=None, compare=False)
    """The memory given for the products, one array per product; None: the backend allocates them."""


class SteeredBackend(CpuBackend):
    """The CPU backend's products, launched as far as the test lets them (`gate`), ready when the test says
    (`prepared`, `prepare_error`), reporting what the test says (`timing`, `peaks`), failing where it asks
    (`fail_next`), with a record of what it planned and launched."""

    def __init__(self, timing: DeviceTiming | None = None, peaks: DevicePeaks | None = None) -> None:
        super().__init__(reason="a test steers it")
        self.timing = timing
        """The device times every launch reports; None: the CPU backend's own."""
        if peaks is not None:
            self.peaks = peaks
        self.planned: list[tuple[int, int, int]] = []
        """(m, n, k) of every plan the engine asked for."""
        self.submitted: list[Submitted] = []
        self.gate = threading.Event()
        """Open (set) unless the test closes it; a launch waits here before it computes."""
        self.gate.set()
        self.prepared = threading.Event()
        """Open (set) unless the test closes it; preparing the kernels waits here (the engine is starting)."""
        self.prepared.set()
        self.prepare_error: Exception | None = None
        """Raised by preparing the kernels, once `prepared` is open."""
        self.entered = threading.Semaphore(0)
        """Released once per launch, as it reaches the gate."""
        self.fail_next: Exception | None = None
        self.unbatchable: set[str] = set()
        """Kernels whose launches take one product each."""
        self.asked_to_batch: list[str] = []
        """The kernel of every product the worker began a batch with, as it asked whether it batches."""

    @property
    def multiplied(self) -> list[tuple[int, ...]]:
        """The shape of A of every product launched (the launch may have failed), in order."""
        return [shape for launch in self.submitted for shape in launch.shapes]

    @property
    def batches(self) -> list[int]:
        """The products of each launch, in order."""
        return [launch.products for launch in self.submitted]

    def kernels(self) -> list[KernelInfo]:
        return [*super().kernels(), KernelInfo(name=BLAS, kind="library", summary="numpy.matmul under another name")]

    def plan(self, request: ProductRequest) -> Plan:
        self.planned.append((request.m, request.n, request.k))
        if request.kernel == BLAS and request.tile is None:
            return Plan(kernel=BLAS, precision=request.precision)
        return super().plan(request)

    def prepare(self) -> None:
        if not self.prepared.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never let the kernels be prepared")
        if self.prepare_error is not None:
            raise self.prepare_error
        super().prepare()

    def batchable(self, plan: Plan) -> bool:
        self.asked_to_batch.append(plan.kernel)
        return plan.kernel not in self.unbatchable

    def submit(
        self, pairs: Pairs, dtype: np.dtype, plan: Plan, on_done: Callable[[], None], outputs: Outputs = None
    ) -> Finished:
        label = plan.config.label if plan.config is not None else None
        given = None if outputs is None else tuple(outputs)
        shapes = tuple(a.shape for a, _ in pairs)
        self.submitted.append(Submitted(plan.kernel, label, dtype, len(pairs), shapes, given))
        self.entered.release()
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        finished = super().submit(pairs, dtype, Plan(kernel="numpy") if plan.kernel == BLAS else plan, on_done, outputs)
        return finished if self.timing is None else Finished(finished.products, self.timing)


class RecordingEngine(LocalEngine):
    """The in-process engine, remembering the request and deadline each product was handed to it with."""

    def __init__(self, worker: DeviceWorker) -> None:
        super().__init__(worker)
        self.calls: list[tuple[ProductRequest, float | None]] = []

    async def matmul(
        self, a: Matrix, b: Matrix, request: ProductRequest, timeout_s: float | None, **where: Any
    ) -> Outcome:
        """LocalEngine.matmul, `where` being its `into` and `out`."""
        self.calls.append((request, timeout_s))
        return await super().matmul(a, b, request, timeout_s, **where)
