"""What the engine asks of its backend, seen from a backend that records it: the plan of an m x k @ k x n product
is asked for (m, n, k), and queued products share a launch only when their shapes, dtype, kernel and tile are all
the same (a product batched with another of a different dtype would be computed in the other's dtype); and an empty
inner dimension (k = 0) gives exact zeros on every kernel of the CPU engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from app.engine import BatchPolicy, Engine, EngineState, Worker
from kernels.reference import assert_close_to_reference
from tests.fakes import BLAS, GATE_TIMEOUT_S, SteeredBackend, until

pytestmark = pytest.mark.anyio

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


@asynccontextmanager
async def _engine(backend: SteeredBackend, batching: BatchPolicy | None = None) -> AsyncIterator[Engine]:
    engine = Engine([Worker(backend, queue_size=8, batching=batching)])
    engine.start()
    try:
        await until(lambda: engine.state is EngineState.READY)
        yield engine
    finally:
        backend.gate.set()
        await engine.stop()


async def test_the_plan_is_asked_for_m_n_k_of_the_product() -> None:
    """m, n and k all differ, so any two swapped (the vector width and the tiles a GPU kernel is chosen by depend
    on n and k, the grid's rows on m) show."""
    backend = SteeredBackend()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((3, 7))
    async with _engine(backend) as engine:
        outcome = await engine.matmul(a, b, F64, "tiled", 8, None)
    assert backend.planned == [(5, 7, 3)]
    assert_close_to_reference(outcome.c, a, b, F64)


Request = tuple[str, int | None, np.dtype]
"""kernel, tile, dtype"""
PAIRS: dict[str, tuple[Request, Request]] = {
    "alike": (("numpy", None, F32), ("numpy", None, F32)),
    "dtype": (("numpy", None, F32), ("numpy", None, F64)),
    "kernel": (("numpy", None, F32), (BLAS, None, F32)),
    "tile": (("tiled", 8, F32), ("tiled", 16, F32)),
}
"""Two products of one shape queued together, alike or differing in one thing only (`numpy` and `blas`: two
kernels whose plans have no config, so only their names tell them apart)."""


@pytest.mark.parametrize("differing", PAIRS)
async def test_queued_products_share_a_launch_only_with_the_same_dtype_kernel_and_tile(differing: str) -> None:
    backend = SteeredBackend()
    rng = np.random.default_rng(1)
    requests = PAIRS[differing]
    operands = [(rng.standard_normal((6, 5)), rng.standard_normal((5, 4))) for _ in requests]
    async with _engine(backend, BatchPolicy(max_size=8, max_delay_s=0.01)) as engine:
        backend.gate.clear()
        first = asyncio.create_task(engine.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, "numpy", None, None))
        # once the worker is inside the first launch, the two products wait in its queue together
        assert await asyncio.to_thread(backend.entered.acquire, True, GATE_TIMEOUT_S)
        products = [
            asyncio.create_task(engine.matmul(a, b, dtype, kernel, tile, None))
            for (a, b), (kernel, tile, dtype) in zip(operands, requests, strict=True)
        ]
        await until(lambda: engine.queue_depth == len(products))
        backend.gate.set()
        await first
        outcomes = [await product for product in products]
    launches = [(launch.kernel, launch.label, launch.dtype, launch.products) for launch in backend.submitted[1:]]
    if differing == "alike":
        (kernel, tile, dtype), _ = requests
        assert launches == [(kernel, None, dtype, 2)]
    else:  # the tiled kernel's instances are labelled by their tile
        assert launches == [(kernel, None if tile is None else str(tile), dtype, 1) for kernel, tile, dtype in requests]
    for (a, b), (kernel, tile, dtype), outcome in zip(operands, requests, outcomes, strict=True):
        assert (outcome.plan.kernel, outcome.plan.tile, outcome.c.dtype) == (kernel, tile, dtype)
        assert_close_to_reference(outcome.c, a, b, dtype)


CPU_KERNELS = [("numpy", None), ("naive", None), *(("tiled", tile) for tile in (8, 16, 32))]


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize(("kernel", "tile"), CPU_KERNELS, ids=str)
async def test_k_zero_gives_exact_zeros_through_the_cpu_engine(kernel: str, tile: int | None, dtype: np.dtype) -> None:
    backend = SteeredBackend()
    a, b = np.ones((6, 0)), np.ones((0, 5))
    async with _engine(backend) as engine:
        outcome = await engine.matmul(a, b, dtype, kernel, tile, None)
    assert outcome.c.dtype == dtype and outcome.c.shape == (6, 5)
    assert_close_to_reference(outcome.c, a, b, dtype)
