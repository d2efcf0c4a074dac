"""The worker: readiness, the bounded queue, abandoned jobs and backend failures, with a backend we control."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import numpy as np
import pytest

from app.config import Settings
from app.engine import (
    BatchPolicy,
    DeviceTiming,
    DeviceWorker,
    EngineState,
    LocalEngine,
    Outcome,
    Plan,
)
from app.engine.base import Outputs
from app.engine.cpu import CpuBackend
from app.errors import DeviceFailure, DeviceOutOfMemory, NotReady
from app.main import create_app
from matmul_tools.service import wait_ready_async
from tests.fakes import SteeredBackend, multiply

pytestmark = pytest.mark.anyio


async def _wait(predicate: Any) -> None:
    """Until `predicate()` holds, looked at every millisecond or so (for 30 s at most: a hang guard, not a figure)."""
    for _ in range(30_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


@pytest.fixture
async def gated() -> AsyncIterator[tuple[SteeredBackend, LocalEngine, httpx.AsyncClient]]:
    backend = SteeredBackend()
    backend.prepared.clear()
    backend.gate.clear()
    engine = LocalEngine(DeviceWorker(backend, queue_size=1))
    app = create_app(Settings(backend="cpu", retry_after_s=7))
    async with app.router.lifespan_context(app):
        app.state.engine = engine  # in place of the lifespan's, which the lifespan still stops
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield backend, engine, client
            backend.prepared.set()
            backend.gate.set()
        await engine.stop()


BODY = {"a": [[1.0, 2.0]], "b": [[3.0], [4.0]]}


async def _one_product_running(
    backend: SteeredBackend, engine: LocalEngine, client: httpx.AsyncClient
) -> asyncio.Task[httpx.Response]:
    """Let the engine get ready, then start one request and wait until the backend is inside it."""
    backend.prepared.set()
    await _wait(lambda: engine.state is EngineState.READY)
    running = asyncio.create_task(client.post("/matmul", json=BODY))
    await asyncio.to_thread(backend.entered.acquire, True, 5)
    return running


async def test_not_ready_until_the_kernels_are_prepared(
    gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient],
) -> None:
    backend, engine, client = gated
    r = await client.get("/readyz")
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.json()["code"] == "not_ready" and "compiled" in r.json()["message"]
    assert (await client.post("/matmul", json=BODY)).status_code == 503
    assert (await client.get("/healthz")).status_code == 200
    backend.prepared.set()
    await _wait(lambda: engine.state is EngineState.READY)
    assert (await client.get("/readyz")).status_code == 200


async def test_a_full_queue_answers_503_at_once(gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient]) -> None:
    backend, engine, client = gated
    running = await _one_product_running(backend, engine, client)
    queued = asyncio.create_task(client.post("/matmul", json=BODY))
    await _wait(lambda: engine.queue_depth == 1)
    refused = await client.post("/matmul", json=BODY)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "7"
    assert refused.json()["code"] == "overloaded" and "queue is full (1 waiting)" in refused.json()["message"]
    backend.gate.set()
    assert (await running).json()["result"] == [[11.0]]
    assert (await queued).status_code == 200


async def test_a_full_queue_answers_503_before_reading_the_body(
    gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient],
) -> None:
    """A body that never comes: the 503 cannot wait for it."""
    backend, engine, client = gated
    running = await _one_product_running(backend, engine, client)
    queued = asyncio.create_task(client.post("/matmul", json=BODY))
    await _wait(lambda: engine.queue_depth == 1)
    never = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        await never.wait()
        yield b"{}"

    headers = {"content-type": "application/json", "content-length": "1000000"}
    refused = await asyncio.wait_for(client.post("/matmul", content=body(), headers=headers), 5)
    assert refused.status_code == 503 and refused.json()["code"] == "overloaded"
    backend.gate.set()
    assert (await running).status_code == 200 and (await queued).status_code == 200


async def test_an_abandoned_job_is_not_run(gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient]) -> None:
    backend, engine, _ = gated
    backend.prepared.set()
    await _wait(lambda: engine.state is EngineState.READY)
    f64 = np.dtype(np.float64)
    first = asyncio.create_task(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), f64, "numpy"))
    await asyncio.to_thread(backend.entered.acquire, True, 5)
    a = np.ones((2, 1))
    operand = weakref.ref(a)
    abandoned = asyncio.create_task(multiply(engine, a, np.ones((1, 1)), f64, "numpy"))
    await _wait(lambda: engine.queue_depth == 1)
    abandoned.cancel()
    await asyncio.wait([abandoned])  # not awaited itself: its CancelledError's frames would hold `a` here
    assert abandoned.cancelled()
    # its entry still waits behind the running product, but it no longer counts and holds no operands
    del a, abandoned
    gc.collect()
    assert engine.queue_depth == 0 and operand() is None
    backend.gate.set()
    await first
    await _wait(lambda: engine.queue_depth == 0)
    backend.gate.set()
    await multiply(engine, np.ones((3, 1)), np.ones((1, 1)), f64, "numpy")
    assert backend.multiplied == [(1, 1), (3, 1)]


async def test_an_unexpected_backend_error_is_a_device_failure_and_the_worker_goes_on(
    gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient],
) -> None:
    backend, engine, client = gated
    backend.prepared.set()
    await _wait(lambda: engine.state is EngineState.READY)
    backend.fail_next = RuntimeError("cudaErrorLaunchFailure")
    backend.gate.set()
    r = await client.post("/matmul", json=BODY)
    assert r.status_code == 500 and r.json()["code"] == "device_failure"
    assert "cudaErrorLaunchFailure" in r.json()["message"]
    backend.gate.set()
    assert (await client.post("/matmul", json=BODY)).status_code == 200


async def test_a_backend_that_cannot_prepare_is_reported_not_ready() -> None:
    backend = SteeredBackend()
    backend.prepare_error = RuntimeError("nvrtc: error in tiled.cu")
    engine = DeviceWorker(backend, queue_size=4)
    engine.start()
    await _wait(lambda: engine.state is EngineState.FAILED)
    with pytest.raises(NotReady, match=r"nvrtc: error in tiled\.cu"):
        engine.check_ready()
    await engine.stop()


async def test_a_product_still_queued_past_its_deadline_gets_504_and_is_never_run(
    gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient],
) -> None:
    backend, engine, client = gated
    running = await _one_product_running(backend, engine, client)
    late = await client.post("/matmul", json={"a": [[9.0]], "b": [[9.0]]}, headers={"x-request-timeout": "0.05"})
    assert late.status_code == 504 and late.json()["code"] == "deadline_exceeded"
    # its place in the queue (of one) is free at once, while the product before it still runs
    assert engine.queue_depth == 0
    next_one = asyncio.create_task(client.post("/matmul", json={"a": [[3.0]], "b": [[3.0]]}))
    await _wait(lambda: engine.queue_depth == 1)
    backend.gate.set()
    assert (await running).status_code == 200
    assert (await next_one).json()["result"] == [[9.0]]
    assert backend.multiplied == [(1, 2), (1, 1)]


@pytest.mark.parametrize("sent", ["0", "-1", "soon", "nan", "1e9"])
async def test_a_bad_request_timeout_is_refused(client: httpx.AsyncClient, sent: str) -> None:
    r = await client.post("/matmul", json=BODY, headers={"x-request-timeout": sent})
    assert r.status_code == 422 and r.json()["location"] == ["X-Request-Timeout"]


async def test_a_client_that_disconnects_while_queued_takes_its_product_out_of_the_queue(
    gated: tuple[SteeredBackend, LocalEngine, httpx.AsyncClient],
) -> None:
    backend, engine, client = gated
    running = await _one_product_running(backend, engine, client)

    gone = asyncio.Event()
    body = [{"type": "http.request", "body": b'{"a": [[5.0]], "b": [[5.0]]}', "more_body": False}]

    async def receive() -> dict[str, object]:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        return None

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/matmul", "raw_path": b"/matmul", "query_string": b"", "root_path": "", "state": {},
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80),
    }  # fmt: skip
    call = asyncio.create_task(client._transport.app(scope, receive, send))  # type: ignore[attr-defined]
    await _wait(lambda: engine.queue_depth == 1)
    gone.set()
    await asyncio.wait_for(call, 5)
    assert engine.queue_depth == 0
    backend.gate.set()
    assert (await running).status_code == 200
    await _wait(lambda: engine.queue_depth == 0)
    assert backend.multiplied == [(1, 2)]


async def test_a_lost_device_fails_the_engine_answers_the_queue_with_503_and_asks_for_a_restart() -> None:
    from app.errors import DeviceLost

    backend = SteeredBackend()
    backend.gate.clear()
    lost = asyncio.Event()
    engine = DeviceWorker(backend, queue_size=4, on_device_lost=lost.set)
    engine.start()
    await _wait(lambda: engine.state is EngineState.READY)
    plan = Plan(kernel="numpy")
    backend.fail_next = DeviceLost("cudaErrorIllegalInstruction; the CUDA context is unusable")
    first = asyncio.create_task(engine.matmul(np.ones((1, 1)), np.ones((1, 1)), np.dtype(np.float64), plan))
    await asyncio.to_thread(backend.entered.acquire, True, 5)
    queued = asyncio.create_task(engine.matmul(np.ones((2, 1)), np.ones((1, 1)), np.dtype(np.float64), plan))
    await _wait(lambda: engine.queue_depth == 1)
    backend.gate.set()
    with pytest.raises(DeviceLost):
        await first
    with pytest.raises(NotReady, match="the device was lost"):
        await queued
    await asyncio.wait_for(lost.wait(), 5)
    assert engine.state is EngineState.FAILED and engine.device_lost
    with pytest.raises(NotReady, match="the device was lost"):
        engine.check_ready()
    assert backend.multiplied == [(1, 1)]  # the launch that failed; the product queued behind it never launched
    await engine.stop()


@pytest.mark.parametrize("policy", [None, BatchPolicy(max_size=8, max_delay_s=0.5)])
async def test_queued_products_of_one_shape_run_as_one_batch(policy: BatchPolicy | None) -> None:
    backend = SteeredBackend()
    backend.gate.clear()
    engine = LocalEngine(DeviceWorker(backend, queue_size=16, batching=policy))
    engine.start()
    await _wait(lambda: engine.state is EngineState.READY)
    f64 = np.dtype(np.float64)
    first = asyncio.create_task(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), f64, "numpy"))
    await asyncio.to_thread(backend.entered.acquire, True, 5)
    shapes = [(2, 3), (2, 3), (5, 3), (2, 3), (2, 3)]
    rest = [
        asyncio.create_task(multiply(engine, np.full(shape, i + 1.0), np.ones((3, 1)), f64, "numpy"))
        for i, shape in enumerate(shapes)
    ]
    await _wait(lambda: engine.queue_depth == len(shapes))
    backend.gate.set()
    outcomes = [await first, *[await task for task in rest]]
    if policy is None:
        assert backend.batches == [1] * 6
    else:
        # the first ran alone (nothing else was queued), then the four (2, 3) in one launch, then (5, 3)
        assert backend.batches == [1, 4, 1]
        assert [o.batch_size for o in outcomes] == [1, 4, 4, 1, 4, 4]
    for i, outcome in enumerate(outcomes[1:]):
        np.testing.assert_array_equal(outcome.c, np.full((shapes[i][0], 1), 3.0 * (i + 1)))
    await engine.stop()


class PipelinedBackend(SteeredBackend):
    """Keeps two launches in flight; each one finishes only when the test sets its event, and what the worker
    does (submit or collect, with the first operand's value) is logged in order."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared.set()
        self.log: list[str] = []
        self.launches: list[HeldLaunch] = []

    @property
    def max_in_flight(self) -> int:
        return 2

    def submit(
        self,
        pairs: Sequence[tuple[np.ndarray, np.ndarray]],
        dtype: np.dtype,
        plan: Plan,
        on_done: Callable[[], None],
        outputs: Outputs = None,
    ) -> HeldLaunch:
        label = f"{pairs[0][0][0, 0]:g}"
        self.log.append(f"submit {label}")
        launch = HeldLaunch(self, label, [a @ b for a, b in pairs], on_done)
        self.launches.append(launch)
        return launch


class HeldLaunch:
    def __init__(
        self, backend: PipelinedBackend, label: str, products: list[np.ndarray], on_done: Callable[[], None]
    ) -> None:
        self.backend, self.label, self.products, self.on_done = backend, label, products, on_done
        self.finished = threading.Event()
        self.collecting = threading.Event()
        """Set when the worker starts waiting for this launch's result."""
        self.error: Exception | None = None

    def finish(self, error: Exception | None = None, call_back: bool = True) -> None:
        """What the device does: the launch ends (with `error`, if given) and calls back, unless a lost device
        never does."""
        self.error = error
        self.finished.set()
        if call_back:
            self.on_done()

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self) -> tuple[list[np.ndarray], DeviceTiming]:
        self.collecting.set()
        assert self.finished.wait(timeout=10)
        self.backend.log.append(f"collect {self.label}")
        if self.error is not None:
            raise self.error
        return self.products, DeviceTiming(h2d_ms=1.0, kernel_ms=1.0, d2h_ms=1.0)


@contextlib.asynccontextmanager
async def _pipelined(batching: BatchPolicy | None = None) -> AsyncIterator[tuple[LocalEngine, PipelinedBackend]]:
    """A ready engine over a PipelinedBackend, and the backend; the engine is stopped on the way out."""
    backend = PipelinedBackend()
    engine = LocalEngine(DeviceWorker(backend, queue_size=8, batching=batching))
    engine.start()
    try:
        await _wait(lambda: engine.state is EngineState.READY)
        yield engine, backend
    finally:
        await engine.stop()


def _product(engine: LocalEngine, value: float) -> asyncio.Task[Outcome]:
    f64 = np.dtype(np.float64)
    return asyncio.create_task(multiply(engine, np.full((1, 1), value), np.ones((1, 1)), f64, "numpy"))


async def _submitted(engine: LocalEngine, backend: PipelinedBackend, value: float) -> asyncio.Task[Outcome]:
    """A product of `value`, once the backend holds its launch (the launch before it already submitted)."""
    launches = len(backend.launches)
    product = _product(engine, value)
    await _wait(lambda: len(backend.launches) == launches + 1)
    return product


async def test_the_next_launch_is_submitted_while_the_previous_one_runs() -> None:
    async with _pipelined() as (engine, backend):
        first = await _submitted(engine, backend, 1)
        rest = [_product(engine, 2), _product(engine, 3)]
        await _wait(lambda: len(backend.launches) == 2)
        # two in flight and the worker waiting on the first: the third waits for the first to be answered
        assert await asyncio.to_thread(backend.launches[0].collecting.wait, 10)
        assert backend.log == ["submit 1", "submit 2"] and engine.queue_depth == 1 and engine.worker.load == 3
        assert not first.done()
        backend.launches[0].finish()
        assert (await first).c[0, 0] == 1.0
        await _wait(lambda: len(backend.launches) == 3)
        for launch in backend.launches[1:]:
            launch.finish()
        assert [(await task).c[0, 0] for task in rest] == [2.0, 3.0]
        assert backend.log == ["submit 1", "submit 2", "collect 1", "submit 3", "collect 2", "collect 3"]


async def test_a_finished_launch_is_collected_before_the_next_is_submitted() -> None:
    async with _pipelined() as (engine, backend):
        first = await _submitted(engine, backend, 1)
        backend.launches[0].finish()
        await first
        second = await _submitted(engine, backend, 2)
        backend.launches[1].finish()
        await second
        assert backend.log == ["submit 1", "collect 1", "submit 2", "collect 2"]


async def test_a_launch_that_fails_on_the_device_fails_only_its_own_requests() -> None:
    async with _pipelined() as (engine, backend):
        first = await _submitted(engine, backend, 1)
        second = await _submitted(engine, backend, 2)
        backend.launches[0].finish(DeviceOutOfMemory("the product does not fit in device memory now"))
        backend.launches[1].finish()
        with pytest.raises(DeviceOutOfMemory):
            await first
        assert (await second).c[0, 0] == 2.0
        assert engine.state is EngineState.READY


async def test_a_launch_that_ends_without_calling_back_is_still_collected() -> None:
    async with _pipelined() as (engine, backend):
        product = await _submitted(engine, backend, 1)
        backend.launches[0].finish(call_back=False)
        assert (await asyncio.wait_for(product, 10)).c[0, 0] == 1.0


async def test_stopping_answers_the_launch_in_flight_first() -> None:
    async with _pipelined() as (engine, backend):
        product = await _submitted(engine, backend, 1)
        stopping = asyncio.create_task(engine.stop())
        # one launch in flight of the two allowed: the worker waits for its result only once it has been told to stop
        assert await asyncio.to_thread(backend.launches[0].collecting.wait, 10)
        backend.launches[0].finish()
        assert (await asyncio.wait_for(product, 10)).c[0, 0] == 1.0
        await asyncio.wait_for(stopping, 10)
        assert engine.state is EngineState.STOPPED


async def test_a_product_held_back_from_a_batch_is_submitted_while_the_launch_before_it_runs() -> None:
    async with _pipelined(BatchPolicy(max_size=2, max_delay_s=0.01)) as (engine, backend):
        first = await _submitted(engine, backend, 1)
        second = await _submitted(engine, backend, 2)
        # two launches in flight: the worker waits on the first while a 1 x 1 and a 2 x 1 product queue
        assert await asyncio.to_thread(backend.launches[0].collecting.wait, 10)
        f64 = np.dtype(np.float64)
        alike = _product(engine, 3)
        other = asyncio.create_task(multiply(engine, np.full((2, 1), 4.0), np.ones((1, 1)), f64, "numpy"))
        await _wait(lambda: engine.queue_depth == 2)
        backend.launches[0].finish()
        # the 1 x 1 one is launched, the 2 x 1 one it pulled is held back for the next launch
        await _wait(lambda: len(backend.launches) == 3)
        backend.launches[1].finish()
        await _wait(lambda: len(backend.launches) == 4)
        assert backend.log == ["submit 1", "submit 2", "collect 1", "submit 3", "collect 2", "submit 4"]
        for launch in backend.launches[2:]:
            launch.finish()
        assert [(await p).c[0, 0] for p in (first, second, alike, other)] == [1.0, 2.0, 3.0, 4.0]


async def test_a_batched_launch_that_fails_on_the_device_fails_each_of_its_products_naming_the_kernel() -> None:
    async with _pipelined(BatchPolicy(max_size=2, max_delay_s=3600)) as (engine, backend):
        products = [_product(engine, 1), _product(engine, 2)]
        await _wait(lambda: len(backend.launches) == 1)
        backend.launches[0].finish(RuntimeError("cudaErrorLaunchFailure"))
        for product in products:
            with pytest.raises(DeviceFailure) as caught:
                await asyncio.wait_for(product, 10)
            assert caught.value.message == "the cpu backend failed running 'numpy': cudaErrorLaunchFailure"
        assert [len(launch.products) for launch in backend.launches] == [2] and engine.state is EngineState.READY


async def test_while_the_device_is_busy_a_product_is_submitted_without_waiting_for_the_batching_window() -> None:
    # a window far longer than the test: a product that waited for it would never be submitted
    async with _pipelined(BatchPolicy(max_size=2, max_delay_s=3600)) as (engine, backend):
        batch = [_product(engine, 1), _product(engine, 1)]
        await _wait(lambda: len(backend.launches) == 1)
        alone = await _submitted(engine, backend, 3)
        assert [len(launch.products) for launch in backend.launches] == [2, 1]
        for launch in backend.launches:
            launch.finish()
        assert [(await product).batch_size for product in [*batch, alone]] == [2, 2, 1]


async def test_a_bad_operand_in_a_batch_fails_only_its_own_request() -> None:
    """In the engine (in-process here: over the data plane the HTTP worker refuses the value before)."""
    backend = CpuBackend("tests")
    launches: list[int] = []
    submit = backend.submit

    def counting_submit(pairs: Sequence[tuple[np.ndarray, np.ndarray]], *args: Any) -> Any:
        launches.append(len(pairs))
        return submit(pairs, *args)

    backend.submit = counting_submit  # type: ignore[method-assign]
    engine = LocalEngine(DeviceWorker(backend, queue_size=8, batching=BatchPolicy(max_size=8, max_delay_s=0.2)))
    app = create_app(Settings(backend="cpu", access_log=False))
    async with app.router.lifespan_context(app):
        app.state.engine = engine  # in place of the lifespan's, which the lifespan still stops
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await wait_ready_async(client, timeout_s=30)
            bodies = [{"a": [[1.0, 2.0]], "b": [[3.0], [4.0]]}] * 3 + [{"a": [[1.0, 1e39]], "b": [[3.0], [4.0]]}]
            answers = await asyncio.gather(*(client.post("/matmul", json=body) for body in bodies))
        await engine.stop()
    assert launches == [4, 1, 1, 1, 1]  # the batch, refused by the bad operand, then each alone
    assert [r.status_code for r in answers] == [200, 200, 200, 422]
    assert all(r.json()["result"] == [[11.0]] for r in answers[:3])
    assert "out of range for float32" in answers[3].json()["message"]
