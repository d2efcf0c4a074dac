"""The in-process engine, over a device worker of the steered CPU backend: its readiness, room, queue and device
taken from its worker, and its refusals by their whole message."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import numpy as np
import pytest

from app.engine import DeviceWorker, EngineState, LocalEngine
from app.engine.autotune import SHAPE_CLASSES, AutoChoice
from app.errors import NotReady, Overloaded, SharedMemoryError
from app.shared_memory import SharedOutput, SharedTensor
from tests.fakes import GATE_TIMEOUT_S, SteeredBackend, multiply, until

pytestmark = pytest.mark.anyio

F32 = np.dtype(np.float32)


async def test_before_it_starts_the_engine_is_starting_and_says_so() -> None:
    engine = LocalEngine(DeviceWorker(SteeredBackend(), queue_size=3))
    assert engine.state is EngineState.STARTING and engine.failure is None and not engine.device_lost
    with pytest.raises(NotReady, match=r"^the kernels are still being compiled and warmed; retry shortly$"):
        engine.check_ready()
    with pytest.raises(NotReady):
        await multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F32, "numpy")
    engine.check_room()  # no ready worker: readiness, not room, is what is refused
    assert (engine.backend_name, engine.queue_size, engine.queue_depth) == ("cpu", 3, 0)


class _Measured(SteeredBackend):
    """A backend whose `auto` was measured: one choice, for small products."""

    def auto_choices(self) -> list[AutoChoice]:
        return [AutoChoice(SHAPE_CLASSES[0], "numpy", {"numpy": 0.5})]


async def test_what_the_engine_takes_from_its_worker_and_its_room() -> None:
    backend = _Measured()
    engine = LocalEngine(DeviceWorker(backend, queue_size=1))
    engine.start()
    try:
        await until(lambda: engine.state is EngineState.READY)
        engine.check_ready()
        assert [k.name for k in engine.kernels()] == [k.name for k in backend.kernels()]
        assert engine.auto_choices() == backend.auto_choices()
        assert engine.memory_held() == 0 and engine.compiled_instances() == 0
        assert [(d["name"], d["state"], d["queue_depth"]) for d in engine.describe()] == [
            (backend.device_name, "ready", 0)
        ]
        # the device busy and one product queued behind it: the queue has no room
        backend.gate.clear()
        running = [asyncio.ensure_future(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F32, "numpy"))]
        assert await asyncio.to_thread(backend.entered.acquire, timeout=GATE_TIMEOUT_S)
        engine.check_room()
        running.append(asyncio.ensure_future(multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F32, "numpy")))
        await until(lambda: engine.queue_depth == 1)
        with pytest.raises(Overloaded, match=r"^the cpu worker's queue is full \(1 waiting\); retry later$"):
            engine.check_room()
        backend.gate.set()
        for outcome in await asyncio.wait_for(asyncio.gather(*running), GATE_TIMEOUT_S):
            assert outcome.c is not None and outcome.c.tolist() == [[1.0]]
    finally:
        backend.gate.set()
        await engine.stop()
    assert engine.state is EngineState.STOPPED


@contextlib.asynccontextmanager
async def _failed_engine(reason: str) -> AsyncIterator[LocalEngine]:
    """An engine whose worker failed preparing its kernels, for `reason`."""
    backend = SteeredBackend()
    backend.prepare_error = RuntimeError(reason)
    engine = LocalEngine(DeviceWorker(backend, queue_size=1))
    engine.start()
    try:
        await until(lambda: engine.state is EngineState.FAILED)
        yield engine
    finally:
        await engine.stop()


async def test_a_failed_worker_makes_the_engine_failed_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    async with _failed_engine("no kernels today") as engine:
        assert engine.failure == "preparing the kernels failed: no kernels today"
        await until(lambda: any(r.levelno == logging.ERROR for r in caplog.records))  # logged after it failed
        [logged] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert logged.getMessage() == "the cpu backend failed to start" and logged.exc_info is not None
        with pytest.raises(NotReady, match=r"^the cpu backend is failed: preparing the kernels failed: no kernels"):
            engine.check_ready()


async def test_with_no_ready_worker_a_product_is_refused_as_not_ready() -> None:
    async with _failed_engine("broken") as engine:
        with pytest.raises(NotReady, match=r"^the cpu backend is failed: preparing the kernels failed: broken$"):
            await multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F32, "numpy")


async def test_an_engine_in_this_process_refuses_clients_shared_memory() -> None:
    """Regions are mapped by engine processes, which hand their engine arrays; one named here cannot be read."""
    engine = LocalEngine(DeviceWorker(SteeredBackend(), queue_size=3))
    tensor = SharedTensor("r", 0, (1, 1), F32)
    for call in (
        multiply(engine, tensor, np.ones((1, 1)), F32, "numpy"),
        multiply(engine, np.ones((1, 1)), tensor, F32, "numpy"),
        multiply(engine, np.ones((1, 1)), np.ones((1, 1)), F32, "numpy", None, None, into=SharedOutput("r", 0, 4)),
    ):
        with pytest.raises(SharedMemoryError, match=r"^shared-memory regions are served by engine processes"):
            await call
