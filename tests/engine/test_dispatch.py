"""What the engine asks of its backend, seen from a backend that records it: the plan of an m x k @ k x n product
is asked for (m, n, k); a product given the memory it goes to is computed there, the backend being handed that
memory; queued products share a launch only when their shapes, dtype, kernel and tile are all the same (a product
batched with another of a different dtype would be computed in the other's dtype), either all of them or none were
given their memory, the kernel can be batched, and the batch has room; a batch that one operand spoils, or a device
lost under a batch, fails only what it must; and an empty inner dimension (k = 0) gives exact zeros on every kernel
of the CPU engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from app.engine import BatchPolicy, DeviceWorker, EngineState, LocalEngine, Outcome
from app.errors import DeviceLost, InvalidInput, NotReady
from numerics.reference import assert_close_to_reference
from tests.fakes import BLAS, GATE_TIMEOUT_S, SteeredBackend, multiply, until

pytestmark = pytest.mark.anyio

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


@asynccontextmanager
async def _engine(backend: SteeredBackend, batching: BatchPolicy | None = None) -> AsyncIterator[LocalEngine]:
    engine = LocalEngine(DeviceWorker(backend, queue_size=8, batching=batching))
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
        outcome = await multiply(engine, a, b, F64, "tiled", 8, None)
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
        first = asyncio.create_task(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F64, "numpy"))
        # once the worker is inside the first launch, the two products wait in its queue together
        assert await asyncio.to_thread(backend.entered.acquire, True, GATE_TIMEOUT_S)
        products = [
            asyncio.create_task(multiply(engine, a, b, dtype, kernel, tile, None))
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


async def _queued_together(
    backend: SteeredBackend,
    engine: LocalEngine,
    products: list[tuple[np.ndarray, np.ndarray]],
    dtype: np.dtype = F64,
    outs: list[np.ndarray | None] | None = None,
) -> list[Outcome | BaseException]:
    """What each of `products` (with `numpy`, into its entry of `outs` where one is given) got, queued while the
    worker is inside a first launch, so that they all wait for it together."""
    backend.gate.clear()
    first = asyncio.create_task(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F64, "numpy"))
    assert await asyncio.to_thread(backend.entered.acquire, True, GATE_TIMEOUT_S)
    queued = [
        asyncio.create_task(multiply(engine, a, b, dtype, "numpy", None, None, out=out))
        for (a, b), out in zip(products, outs or [None] * len(products), strict=True)
    ]
    await until(lambda: engine.queue_depth == len(queued))
    backend.gate.set()
    await asyncio.wait_for(first, GATE_TIMEOUT_S)
    return await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), GATE_TIMEOUT_S)


@pytest.mark.parametrize(
    ("max_size", "unbatchable", "launches"),
    [(8, set(), [1, 3]), (2, set(), [1, 2, 1]), (8, {"numpy"}, [1, 1, 1, 1])],
    ids=["room for all", "room for two", "kernel not batchable"],
)
async def test_a_batch_takes_no_more_than_its_size_and_only_a_batchable_kernel(
    max_size: int, unbatchable: set[str], launches: list[int]
) -> None:
    backend = SteeredBackend()
    backend.unbatchable = unbatchable
    products = [(np.full((2, 3), i + 1.0), np.ones((3, 1))) for i in range(3)]
    async with _engine(backend, BatchPolicy(max_size=max_size, max_delay_s=0.01)) as engine:
        outcomes = await _queued_together(backend, engine, products)
    assert [s.products for s in backend.submitted] == launches
    sizes = [size for size in launches[1:] for _ in range(size)]
    for i, outcome in enumerate(outcomes):
        assert isinstance(outcome, Outcome) and outcome.batch_size == sizes[i]
        np.testing.assert_array_equal(outcome.c, np.full((2, 1), 3.0 * (i + 1)))


async def test_a_stack_is_a_launch_of_its_own_never_merged_with_other_requests() -> None:
    """Two stacks of one shape, and single products of their matrices' shape, queued together: each stack runs
    alone, answered with exactly its own products (batch_size: its matrices), and the single products still share
    a launch."""
    backend = SteeredBackend()
    rng = np.random.default_rng(3)
    stacks = [(rng.standard_normal((4, 2, 3)), rng.standard_normal((3, 1))) for _ in range(2)]
    singles = [(rng.standard_normal((2, 3)), rng.standard_normal((3, 1))) for _ in range(2)]
    async with _engine(backend, BatchPolicy(max_size=8, max_delay_s=0.01)) as engine:
        outcomes = await _queued_together(backend, engine, [*stacks, *singles])
    assert [s.products for s in backend.submitted] == [1, 1, 1, 2]
    for (a, b), outcome in zip([*stacks, *singles], outcomes, strict=True):
        assert isinstance(outcome, Outcome)
        assert outcome.batch_size == (4 if a.ndim == 3 else 2)
        assert_close_to_reference(outcome.c, a, b, F64)


async def test_a_stack_dropped_from_the_queue_does_not_let_the_stacks_behind_it_merge() -> None:
    """The first of three queued stacks of one shape is dropped (its client went away): the worker finds it
    without its operands, yet knows it for a stack, and the two behind it run a launch each, each answered with its
    own products."""
    backend = SteeredBackend()
    rng = np.random.default_rng(4)
    stacks = [(rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5))) for _ in range(3)]
    async with _engine(backend, BatchPolicy(max_size=8, max_delay_s=0.01)) as engine:
        backend.gate.clear()
        first = asyncio.create_task(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F64, "numpy"))
        assert await asyncio.to_thread(backend.entered.acquire, True, GATE_TIMEOUT_S)
        dropped = asyncio.create_task(multiply(engine, *stacks[0], F64, "numpy"))
        await until(lambda: engine.queue_depth == 1)
        kept = [asyncio.create_task(multiply(engine, a, b, F64, "numpy")) for a, b in stacks[1:]]
        await until(lambda: engine.queue_depth == 3)
        dropped.cancel()
        await until(lambda: engine.queue_depth == 2)
        backend.gate.set()
        await asyncio.wait_for(first, GATE_TIMEOUT_S)
        outcomes = await asyncio.wait_for(asyncio.gather(*kept), GATE_TIMEOUT_S)
    assert [s.products for s in backend.submitted] == [1, 1, 1]
    for (a, b), outcome in zip(stacks[1:], outcomes, strict=True):
        assert outcome.batch_size == 2
        assert_close_to_reference(outcome.c, a, b, F64)


async def test_a_product_given_its_memory_is_computed_there_and_answered_with_that_memory() -> None:
    backend = SteeredBackend()
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((3, 7))
    out = np.full((5, 7), np.nan)
    async with _engine(backend) as engine:
        outcome = await multiply(engine, a, b, F64, "numpy", None, None, out=out)
    [launch] = backend.submitted
    assert launch.outputs is not None and [given is out for given in launch.outputs] == [True]
    assert np.shares_memory(outcome.c, out) and outcome.c.shape == out.shape
    assert_close_to_reference(out, a, b, F64)


@pytest.mark.parametrize(
    "given", [[True, False, True], [False, True, False]], ids=["given, allocated, given", "allocated, given, allocated"]
)
async def test_products_given_their_memory_share_a_launch_only_with_one_another(given: list[bool]) -> None:
    """Outputs go to the backend for a whole launch or not at all: a batch of products with memory given and
    products without would lose a product or have one written to memory nobody reads."""
    backend = SteeredBackend()
    products = [(np.full((2, 3), i + 1.0), np.ones((3, 1))) for i in range(3)]
    outs = [np.full((2, 1), np.nan) if into else None for into in given]
    async with _engine(backend, BatchPolicy(max_size=8, max_delay_s=0.01)) as engine:
        outcomes = await _queued_together(backend, engine, products, outs=outs)
    # the first and the third share a launch; the second, pulled meanwhile, is held back for the next one
    assert [s.products for s in backend.submitted] == [1, 2, 1]
    expected_outputs = [[outs[0], outs[2]], [outs[1]]]
    for launch, expected in zip(backend.submitted[1:], expected_outputs, strict=True):
        if expected[0] is None:
            assert launch.outputs is None
        else:
            assert launch.outputs is not None and len(launch.outputs) == len(expected)
            assert all(given is out for given, out in zip(launch.outputs, expected, strict=True))
    for i, (outcome, out) in enumerate(zip(outcomes, outs, strict=True)):
        assert isinstance(outcome, Outcome) and outcome.batch_size == (1 if i == 1 else 2)
        np.testing.assert_array_equal(outcome.c, np.full((2, 1), 3.0 * (i + 1)))
        if out is None:
            assert not any(other is not None and np.shares_memory(outcome.c, other) for other in outs)
        else:
            assert np.shares_memory(outcome.c, out)
            np.testing.assert_array_equal(out, np.full((2, 1), 3.0 * (i + 1)))


async def test_with_the_device_idle_a_batch_waits_its_window_for_products_to_join() -> None:
    backend = SteeredBackend()
    # a window far longer than the test: the batch is launched because it is full, not because the window ended
    async with _engine(backend, BatchPolicy(max_size=2, max_delay_s=3600)) as engine:
        first = asyncio.create_task(multiply(engine, np.ones((2, 1)), np.ones((1, 1)), F64, "numpy"))
        await until(lambda: backend.asked_to_batch == ["numpy"])  # the worker has begun a batch with it
        second = asyncio.create_task(multiply(engine, np.full((2, 1), 2.0), np.ones((1, 1)), F64, "numpy"))
        outcomes = await asyncio.wait_for(asyncio.gather(first, second), GATE_TIMEOUT_S)
    assert [s.products for s in backend.submitted] == [2]
    assert [(o.c.tolist(), o.batch_size) for o in outcomes] == [([[1.0], [1.0]], 2), ([[2.0], [2.0]], 2)]


async def test_a_batch_of_two_spoiled_by_one_operand_fails_only_that_product() -> None:
    backend = SteeredBackend()
    products = [(np.ones((2, 3)), np.ones((3, 1))), (np.full((2, 3), 1e39), np.ones((3, 1)))]
    async with _engine(backend, BatchPolicy(max_size=2, max_delay_s=0.01)) as engine:
        good, spoiled = await _queued_together(backend, engine, products, F32)
    # the batch, refused by the operand too large for float32, then each product alone
    assert [s.products for s in backend.submitted] == [1, 2, 1, 1]
    assert isinstance(good, Outcome) and good.c.tolist() == [[3.0], [3.0]] and good.batch_size == 1
    assert isinstance(spoiled, InvalidInput)
    assert spoiled.message == "a[0][0] = 1e+39 is out of range for float32 (largest 3.403e+38)"


async def test_stopping_ends_a_batch_still_gathering_and_runs_it() -> None:
    backend = SteeredBackend()
    # a window far longer than the test: only the stop ends the batch
    async with _engine(backend, BatchPolicy(max_size=8, max_delay_s=3600)) as engine:
        product = asyncio.create_task(multiply(engine, np.ones((2, 1)), np.ones((1, 1)), F64, "numpy"))
        await until(lambda: engine.queue_depth == 1)
        await asyncio.wait_for(engine.stop(), GATE_TIMEOUT_S)
        outcome = await asyncio.wait_for(product, GATE_TIMEOUT_S)
    assert outcome.c.tolist() == [[1.0], [1.0]] and outcome.batch_size == 1
    assert [s.products for s in backend.submitted] == [1] and engine.state is EngineState.STOPPED


async def test_a_device_lost_under_a_batch_answers_the_products_held_back_from_it_with_503() -> None:
    backend = SteeredBackend()
    backend.fail_next = DeviceLost("cudaErrorIllegalAddress")
    shapes = [(2, 3), (5, 3), (2, 3)]
    # the first product waits for a second of its shape (the window is far longer than the test); the (5, 3) one
    # pulled meanwhile is held back for the next launch
    async with _engine(backend, BatchPolicy(max_size=2, max_delay_s=3600)) as engine:
        queued = [
            asyncio.create_task(multiply(engine, np.ones(shape), np.ones((3, 1)), F64, "numpy")) for shape in shapes
        ]
        first, held, second = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), GATE_TIMEOUT_S)
        assert engine.state is EngineState.FAILED
    assert [s.products for s in backend.submitted] == [2]
    for lost in (first, second):
        assert isinstance(lost, DeviceLost) and lost.message == "cudaErrorIllegalAddress"
    assert isinstance(held, NotReady) and held.message == "the device was lost: cudaErrorIllegalAddress"


CPU_KERNELS = [("numpy", None), ("naive", None), *(("tiled", tile) for tile in (8, 16, 32))]


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize(("kernel", "tile"), CPU_KERNELS, ids=str)
async def test_k_zero_gives_exact_zeros_through_the_cpu_engine(kernel: str, tile: int | None, dtype: np.dtype) -> None:
    backend = SteeredBackend()
    a, b = np.ones((6, 0)), np.ones((0, 5))
    async with _engine(backend) as engine:
        outcome = await multiply(engine, a, b, dtype, kernel, tile, None)
    assert outcome.c.dtype == dtype and outcome.c.shape == (6, 5)
    assert_close_to_reference(outcome.c, a, b, dtype)
