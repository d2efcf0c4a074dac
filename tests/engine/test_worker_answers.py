"""What a worker answers, by its whole message and fields: a product's outcome and its time in the queue, a product
given the memory it goes to, a call cancelled while its launch runs, a launch that fails unexpectedly, a deadline
passed in the queue, a lost device (for the launch, the queue and every later request) and a stopped worker."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from time import perf_counter

import numpy as np
import pytest

from app.engine import DeviceWorker, EngineState, Outcome, Plan, device_worker
from app.engine.device_worker import _where
from app.errors import DeadlineExceeded, DeviceFailure, DeviceLost, InvalidMatrix, NotReady, Overloaded
from tests.fakes import GATE_TIMEOUT_S, SteeredBackend, until

pytestmark = pytest.mark.anyio

F64 = np.dtype(np.float64)
NUMPY = Plan(kernel="numpy")


async def _ready(
    backend: SteeredBackend, queue_size: int = 4, on_device_lost: Callable[[], None] | None = None
) -> DeviceWorker:
    worker = DeviceWorker(backend, queue_size=queue_size, on_device_lost=on_device_lost)
    worker.start()
    await until(lambda: worker.state is EngineState.READY)
    return worker


async def _entered(backend: SteeredBackend) -> None:
    assert await asyncio.to_thread(backend.entered.acquire, timeout=GATE_TIMEOUT_S)


async def _held(backend: SteeredBackend, worker: DeviceWorker) -> asyncio.Future[Outcome]:
    """A 1x1 product the worker has taken and that waits at the backend's closed gate."""
    backend.gate.clear()
    running = asyncio.ensure_future(worker.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, NUMPY))
    await _entered(backend)
    return running


async def test_an_outcome_says_how_its_product_was_made() -> None:
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
        before = perf_counter()
        outcome = await worker.matmul(a, b, F64, NUMPY)
        waited_ms = (perf_counter() - before) * 1e3
        np.testing.assert_array_equal(outcome.c, a @ b)
        assert (outcome.plan, outcome.device_name, outcome.peaks, outcome.batch_size) == (
            NUMPY,
            backend.device_name,
            backend.peaks,
            1,
        )
        # not a speed claim: the time it says it queued lies within the time the call took
        assert 0 <= outcome.queue_ms <= waited_ms and outcome.device.kernel_ms >= 0
    finally:
        await worker.stop()


async def test_a_product_given_its_memory_is_computed_there_and_answered_with_that_memory() -> None:
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
        out = np.full((2, 4), np.nan)
        outcome = await worker.matmul(a, b, F64, NUMPY, out=out)
    finally:
        await worker.stop()
    np.testing.assert_array_equal(out, a @ b)
    assert np.shares_memory(outcome.c, out) and outcome.c.shape == out.shape
    [launch] = backend.submitted
    assert launch.outputs is not None and [given is out for given in launch.outputs] == [True]


async def _cancelled_during_launch(
    backend: SteeredBackend, call: asyncio.Future[Outcome], out: np.ndarray, times: int
) -> list[list[list[float]]]:
    """Cancel `call`, held at the backend's closed gate, `times` times (it must not end), then open the gate: once
    it has ended cancelled, what `out` held at that moment (one entry: it ended once)."""
    memory_when_it_ended: list[list[list[float]]] = []
    call.add_done_callback(lambda _: memory_when_it_ended.append(out.tolist()))
    for _ in range(times):
        call.cancel()
        # the cancelled call's step was scheduled first, so it has taken the cancellation when this one resumes
        await asyncio.sleep(0)
        assert not call.done()
    backend.gate.set()
    await asyncio.wait([call], timeout=GATE_TIMEOUT_S)
    assert call.cancelled()
    return memory_when_it_ended


async def test_a_call_cancelled_while_its_launch_runs_ends_only_after_the_launch_has_written_its_memory() -> None:
    """When the call ends, its caller reuses the operands' and the product's memory (the data plane frees the slab
    they lie in): the device must be done with them by then, however often the call is cancelled meanwhile."""
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        out = np.full((2, 1), np.nan)
        backend.gate.clear()
        call = asyncio.ensure_future(worker.matmul(np.ones((2, 3)), np.ones((3, 1)), F64, NUMPY, out=out))
        await _entered(backend)
        assert await _cancelled_during_launch(backend, call, out, times=2) == [[[3.0], [3.0]]]
    finally:
        backend.gate.set()
        await worker.stop()
    assert [s.products for s in backend.submitted] == [1]


async def test_a_call_past_its_deadline_while_its_launch_runs_then_cancelled_ends_only_after_the_launch() -> None:
    """The deadline passes while the launch is held, so the call waits for it; cancelled then (its HTTP worker
    hung up), it still ends only once the launch has written its memory."""
    backend = SteeredBackend()
    worker = await _ready(backend)
    loop = asyncio.get_running_loop()
    try:
        out = np.full((2, 1), np.nan)
        backend.gate.clear()
        deadline_s, called_at = 1.0, loop.time()
        call = asyncio.ensure_future(
            worker.matmul(np.ones((2, 3)), np.ones((3, 1)), F64, NUMPY, timeout_s=deadline_s, out=out)
        )
        await _entered(backend)
        await asyncio.sleep(called_at + deadline_s + 0.1 - loop.time())  # the deadline passes during the launch
        assert not call.done()
        assert await _cancelled_during_launch(backend, call, out, times=1) == [[[3.0], [3.0]]]
    finally:
        backend.gate.set()
        await worker.stop()


class _Clock:
    """The worker's `perf_counter`, moved only by the test, or `step` seconds on after each reading."""

    def __init__(self, now: float, step: float = 0.0) -> None:
        self.now, self.step = now, step

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now


async def test_a_ready_worker_says_where_and_how_soon_from_a_daemon_thread_named_for_its_device(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.engine.device_worker")
    monkeypatch.setattr("app.engine.device_worker.perf_counter", _Clock(100.0, step=1.25))
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        await until(lambda: any(r.levelno == logging.INFO for r in caplog.records))  # logged once it is ready
        [logged] = [r for r in caplog.records if r.levelno == logging.INFO]
        assert logged.getMessage() == f"cpu backend ready on {backend.device_name} in 1.25 s"
        # the one thread that owns the device, told apart in logs; it never keeps a process that exits alive
        [thread] = [t for t in threading.enumerate() if t.ident == logged.thread]
        assert thread.name == f"cpu-worker-{backend.device_name}" and thread.daemon
    finally:
        await worker.stop()


async def test_the_queue_time_runs_from_queueing_to_submitting_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(100.0)
    monkeypatch.setattr("app.engine.device_worker.perf_counter", clock)
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        running = await _held(backend, worker)
        queued = asyncio.ensure_future(worker.matmul(np.ones((2, 1)), np.ones((1, 1)), F64, NUMPY))
        await until(lambda: worker.queue_depth == 1)
        clock.now = 100.25
        backend.gate.set()
        assert (await asyncio.wait_for(running, GATE_TIMEOUT_S)).queue_ms == 0.0
        assert (await asyncio.wait_for(queued, GATE_TIMEOUT_S)).queue_ms == 250.0
    finally:
        backend.gate.set()
        await worker.stop()


async def test_an_unexpected_error_is_a_device_failure_naming_backend_kernel_and_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="app.engine.device_worker")
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        cause = RuntimeError("cudaErrorLaunchFailure")
        backend.fail_next = cause
        with pytest.raises(DeviceFailure) as caught:
            await worker.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, NUMPY)
        assert caught.value.message == "the cpu backend failed running 'numpy': cudaErrorLaunchFailure"
        assert caught.value.__cause__ is cause
        [logged] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert logged.getMessage() == "numpy failed on the cpu backend" and logged.exc_info is not None
        assert worker.state is EngineState.READY and worker.failure is None and not worker.device_lost
        assert (await worker.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, NUMPY)).c.tolist() == [[1.0]]
    finally:
        await worker.stop()


@pytest.mark.usefixtures("without_garbage_collection")
@pytest.mark.parametrize("failing", ["refused operand", "failed launch"])
async def test_a_failed_product_holds_its_operands_no_longer_than_its_error(
    failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error answered holds the frames it was raised through, the worker's and the caller's, and they the job
    and its operands: none may keep it in a reference cycle, which would hold the operands (a lent body, a client's
    shared-memory region) until a garbage collection."""
    # the failed launch is logged with its traceback, which pytest's handlers keep: they are not the service's
    monkeypatch.setattr(device_worker.log, "propagate", False)
    backend = SteeredBackend()
    worker = await _ready(backend)
    try:
        a = np.ones((4, 4))
        if failing == "refused operand":
            a[1, 2] = 1e39  # beyond float32
        else:
            backend.fail_next = RuntimeError("cudaErrorLaunchFailure")
        gone = weakref.ref(a)
        with pytest.raises((InvalidMatrix, DeviceFailure)):
            await worker.matmul(a, np.ones((4, 4)), np.dtype(np.float32), NUMPY)
        del a
        await until(lambda: gone() is None)
    finally:
        await worker.stop()


async def test_a_product_past_its_deadline_in_the_queue_is_dropped_and_says_after_how_long() -> None:
    backend = SteeredBackend()
    worker = await _ready(backend, queue_size=1)
    try:
        running = await _held(backend, worker)
        with pytest.raises(DeadlineExceeded) as caught:
            await worker.matmul(np.ones((2, 1)), np.ones((1, 1)), F64, NUMPY, timeout_s=0.05)
        assert caught.value.message == "the product was still queued after its deadline of 0.05 s and was dropped"
        assert worker.queue_depth == 0 and worker.has_room
        backend.gate.set()
        assert (await asyncio.wait_for(running, GATE_TIMEOUT_S)).c.tolist() == [[1.0]]
    finally:
        backend.gate.set()
        await worker.stop()
    assert [s.products for s in backend.submitted] == [1]


async def test_a_full_queue_says_how_many_wait() -> None:
    backend = SteeredBackend()
    worker = await _ready(backend, queue_size=1)
    try:
        running = await _held(backend, worker)
        assert worker.load == 1 and worker.queue_depth == 0 and worker.has_room
        queued = asyncio.ensure_future(worker.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, NUMPY))
        await until(lambda: worker.queue_depth == 1)
        assert worker.load == 2 and not worker.has_room
        with pytest.raises(Overloaded) as caught:
            await worker.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, NUMPY)
        assert caught.value.message == "the cpu worker's queue is full (1 waiting); retry later"
        backend.gate.set()
        await asyncio.wait_for(asyncio.gather(running, queued), GATE_TIMEOUT_S)
        await until(lambda: worker.load == 0)
    finally:
        backend.gate.set()
        await worker.stop()


async def test_a_lost_device_fails_the_worker_with_its_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="app.engine.device_worker")
    backend = SteeredBackend()
    lost = asyncio.Event()
    worker = await _ready(backend, on_device_lost=lost.set)
    try:
        backend.gate.clear()
        backend.fail_next = DeviceLost("cudaErrorIllegalInstruction")
        first = asyncio.ensure_future(worker.matmul(np.ones((1, 1)), np.ones((1, 1)), F64, NUMPY))
        await _entered(backend)
        queued = asyncio.ensure_future(worker.matmul(np.ones((2, 1)), np.ones((1, 1)), F64, NUMPY))
        await until(lambda: worker.queue_depth == 1)
        backend.gate.set()
        with pytest.raises(DeviceLost, match=r"^cudaErrorIllegalInstruction$"):
            await asyncio.wait_for(first, GATE_TIMEOUT_S)
        with pytest.raises(NotReady) as queued_error:
            await asyncio.wait_for(queued, GATE_TIMEOUT_S)
        assert queued_error.value.message == "the device was lost: cudaErrorIllegalInstruction"
        await asyncio.wait_for(lost.wait(), GATE_TIMEOUT_S)
        [logged] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
        assert logged.getMessage() == "device lost running 'numpy': cudaErrorIllegalInstruction"
        assert worker.state is EngineState.FAILED and worker.device_lost
        assert worker.failure == "the device was lost: cudaErrorIllegalInstruction"
        with pytest.raises(NotReady) as later:
            worker.check_ready()
        assert later.value.message == "the cpu backend is failed: the device was lost: cudaErrorIllegalInstruction"
        assert worker.queue_depth == 0 and worker.load == 0
    finally:
        backend.gate.set()
        await worker.stop()
    assert [s.products for s in backend.submitted] == [1]


async def test_a_stopped_worker_says_it_is_shut_down() -> None:
    worker = await _ready(SteeredBackend())
    await worker.stop()
    assert worker.state is EngineState.STOPPED
    with pytest.raises(NotReady) as caught:
        worker.check_ready()
    assert caught.value.message == "the cpu backend is stopped: shut down"


class _DeviceArray:
    """Stands for a CuPy array: not a NumPy one."""


@pytest.mark.parametrize(
    ("a", "b", "out", "where"),
    [
        (np.ones(1), np.ones(1), None, (True, True, None)),
        (np.ones(1), np.ones(1), np.ones(1), (True, True, True)),
        (_DeviceArray(), np.ones(1), _DeviceArray(), (False, True, False)),
        (np.ones(1).view(np.recarray), _DeviceArray(), np.ones(1), (True, False, True)),
    ],
)
def test_where_operands_lie_is_part_of_the_batch_key(
    a: object, b: object, out: object, where: tuple[object, ...]
) -> None:
    """One launch copies all of its A, B and C one way: host arrays (any NumPy array) and device memory apart."""
    assert _where(a, b, out) == where  # type: ignore[arg-type]
