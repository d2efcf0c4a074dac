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
from app.engine import EngineFront, KernelInfo, LocalEngine, Outcome, Plan, ProductRequest
from app.engine.base import AUTO, Finished, Outputs, Pairs
from app.engine.cpu import CpuBackend
from app.shared_memory import Matrix
from numerics.precision import Precision

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
    outputs: tuple[np.ndarray, ...] | None = field(default=None, compare=False)
    """The memory given for the products, one array per product; None: the backend allocates them."""


class SteeredBackend(CpuBackend):
    def __init__(self) -> None:
        super().__init__(reason="a test steers it")
        self.planned: list[tuple[int, int, int]] = []
        """(m, n, k) of every plan the engine asked for."""
        self.submitted: list[Submitted] = []
        self.gate = threading.Event()
        """Open (set) unless the test closes it; a launch waits here before it computes."""
        self.gate.set()
        self.entered = threading.Semaphore(0)
        """Released once per launch, as it reaches the gate."""
        self.fail_next: Exception | None = None
        self.unbatchable: set[str] = set()
        """Kernels whose launches take one product each."""
        self.asked_to_batch: list[str] = []
        """The kernel of every product the worker began a batch with, as it asked whether it batches."""

    def kernels(self) -> list[KernelInfo]:
        return [*super().kernels(), KernelInfo(name=BLAS, kind="library", summary="numpy.matmul under another name")]

    def plan(self, request: ProductRequest) -> Plan:
        self.planned.append((request.m, request.n, request.k))
        if request.kernel == BLAS and request.tile is None:
            return Plan(kernel=BLAS, precision=request.precision)
        return super().plan(request)

    def batchable(self, plan: Plan) -> bool:
        self.asked_to_batch.append(plan.kernel)
        return plan.kernel not in self.unbatchable

    def submit(
        self, pairs: Pairs, dtype: np.dtype, plan: Plan, on_done: Callable[[], None], outputs: Outputs = None
    ) -> Finished:
        label = plan.config.label if plan.config is not None else None
        given = None if outputs is None else tuple(outputs)
        self.submitted.append(Submitted(plan.kernel, label, dtype, len(pairs), given))
        self.entered.release()
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        return super().submit(pairs, dtype, Plan(kernel="numpy") if plan.kernel == BLAS else plan, on_done, outputs)
