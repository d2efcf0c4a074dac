"""Clients' system shared-memory regions in the engine process: the key names an object and nothing else, only
the registered window is mapped, a region in use outlives its unregistering until its products end, and a new
engine process starts with none."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.config import Settings, SharedMemoryKind
from app.dataplane import wire
from app.dataplane.engine_client import EngineClient
from app.dataplane.engine_process import EngineServer
from app.dataplane.regions import SHARED_MEMORY_FOLDER, object_path, open_window
from app.dataplane.supervisor import EngineSupervisor
from app.engine import DeviceWorker, EngineState
from app.errors import SharedMemoryError
from app.shared_memory import SharedOutput, SharedTensor
from numerics.precision import Precision
from numerics.reference import assert_close_to_reference
from tests.fakes import SteeredBackend, multiply, until

pytestmark = pytest.mark.timeout(120)
F64 = np.dtype(np.float64)
F32 = np.dtype(np.float32)
GUARD_S = 30


@pytest.fixture
def shared_object() -> Iterator[tuple[str, Path]]:
    """A shared-memory object of 3 pages, as shm_open makes them: (key, its file)."""
    name = f"test-regions-{uuid.uuid4().hex[:12]}"
    path = SHARED_MEMORY_FOLDER / name
    path.write_bytes(bytes(3 * mmap.PAGESIZE))
    yield f"/{name}", path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("key", ["/ok-name_1.x", "ok-name_1.x"])
def test_a_key_names_one_object(key: str) -> None:
    assert object_path(key) == SHARED_MEMORY_FOLDER / "ok-name_1.x"


@pytest.mark.parametrize("key", ["", "/", "..", "/..", ".", "/a/b", "../x", "/x/../../etc/passwd", "a b", "x" * 256])
def test_a_key_that_is_not_one_objects_name_is_refused(key: str) -> None:
    with pytest.raises(SharedMemoryError, match="does not name a shared-memory object"):
        object_path(key)


def test_only_the_window_is_mapped(shared_object: tuple[str, Path]) -> None:
    key, path = shared_object
    with path.open("r+b") as file:
        file.seek(mmap.PAGESIZE + 10)
        file.write(b"window")
    mapping, start = open_window(key, mmap.PAGESIZE + 10, 100)
    try:
        assert start == 10 and len(mapping) == 110  # from the page the window starts in, to its end
        assert mapping[start : start + 6] == b"window"
        mapping[start : start + 6] = b"WINDOW"  # read and write
    finally:
        mapping.close()
    assert path.read_bytes()[mmap.PAGESIZE + 10 : mmap.PAGESIZE + 16] == b"WINDOW"


@pytest.mark.parametrize(
    ("offset", "byte_size", "problem"),
    [
        (0, 3 * mmap.PAGESIZE + 1, "passes its end"),
        (3 * mmap.PAGESIZE, 1, "passes its end"),
        (0, 0, "byte_size > 0"),
        (-1, 8, "offset >= 0"),
    ],
)
def test_a_window_outside_the_object_is_refused(
    shared_object: tuple[str, Path], offset: int, byte_size: int, problem: str
) -> None:
    with pytest.raises(SharedMemoryError, match=problem):
        open_window(shared_object[0], offset, byte_size)


def test_a_link_or_a_missing_object_is_refused(shared_object: tuple[str, Path]) -> None:
    key, path = shared_object
    link = SHARED_MEMORY_FOLDER / f"{path.name}-link"
    link.symlink_to(path)
    try:
        with pytest.raises(SharedMemoryError, match="cannot be opened"):
            open_window(f"/{link.name}", 0, 8)
    finally:
        link.unlink()
    with pytest.raises(SharedMemoryError, match="cannot be opened: No such file"):
        open_window(f"{key}-missing", 0, 8)


# ------------------------------------------------------------------------------ through an engine process


@pytest.fixture
def settings() -> Settings:
    """Batches of 2 and a batching window of 1 s: a lone product waits that long in the engine."""
    return Settings(
        backend="cpu",
        batching=True,
        max_batch_size=2,
        max_queue_delay_us=1_000_000,
        slab_bytes=1 << 20,
        shared_memory=["system"],
    )


def _mapped(pid: int, path: Path) -> bool:
    return str(path) in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.anyio
async def test_a_region_unregistered_while_in_use_is_unmapped_and_the_unregistration_answered_when_its_product_ends(
    engine: EngineClient, shared_object: tuple[str, Path]
) -> None:
    key, path = shared_object
    pid = engine.links[0].welcome.engine_pid
    memory = np.memmap(path, F64, "r+", shape=(3 * mmap.PAGESIZE // 8,))
    rng = np.random.default_rng(41)
    a, b = rng.standard_normal((9, 5)), rng.standard_normal((5, 7))
    memory[:45], memory[64 : 64 + 35] = a.ravel(), b.ravel()
    await engine.register_region("r", key, 0, 3 * mmap.PAGESIZE)
    assert _mapped(pid, path)
    product = asyncio.create_task(
        multiply(
            engine,
            SharedTensor("r", 0, (9, 5), F64),
            SharedTensor("r", 64 * 8, (5, 7), F64),
            F64,
            "numpy",
            None,
            timeout_s=30,
            into=SharedOutput("r", 128 * 8, 63 * 8),
        )
    )
    await until(lambda: engine.links[0].in_flight == 1)  # queued: it waits out the batching window
    unregistering = asyncio.create_task(engine.unregister_region("r"))
    await asyncio.sleep(0.1)
    assert await engine.region_status(None) == []  # no new product may name it
    # its product still reads and writes it: the client, which frees its memory once told, is not told yet
    assert _mapped(pid, path) and not unregistering.done()
    outcome = await product
    await asyncio.wait_for(unregistering, 10)
    assert not _mapped(pid, path)
    assert outcome.c is None
    assert_close_to_reference(np.array(memory[128 : 128 + 63]).reshape(9, 7), a, b, F64)


@pytest.mark.anyio
async def test_a_fresh_engine_process_holds_no_region(engine: EngineClient, shared_object: tuple[str, Path]) -> None:
    key, _ = shared_object
    await engine.register_region("r", key, 0, 64)
    assert [status["name"] for status in await engine.region_status(None)] == ["r"]
    os.kill(engine.links[0].welcome.engine_pid, signal.SIGKILL)
    await until(lambda: engine.links[0].lost is not None)
    await until(lambda: engine.state is EngineState.READY, guard_s=60)
    assert await engine.region_status(None) == []
    with pytest.raises(SharedMemoryError, match="no shared-memory region named 'r'"):
        await multiply(engine, SharedTensor("r", 0, (2, 2), F64), np.ones((2, 2)), F64, "numpy", None, timeout_s=5)


@pytest.mark.anyio
async def test_regions_are_refused_when_the_setting_is_off(shared_object: tuple[str, Path]) -> None:
    settings = Settings(backend="cpu", slab_bytes=1 << 20)
    supervisor = EngineSupervisor(settings)
    supervisor.start()
    engine = EngineClient(supervisor.sockets, settings)
    try:
        await engine.start()
        await until(lambda: engine.state is EngineState.READY, guard_s=60)
        with pytest.raises(SharedMemoryError, match="shared memory is off"):
            await engine.register_region("r", shared_object[0], 0, 64)
        with pytest.raises(SharedMemoryError, match="shared memory is off"):
            await multiply(engine, SharedTensor("r", 0, (2, 2), F64), np.ones((2, 2)), F64, "numpy", None, timeout_s=5)
    finally:
        await engine.stop()
        engine.arena.close()
        supervisor.stop()


@pytest.mark.anyio
async def test_when_one_of_two_engines_restarts_every_engine_forgets_the_regions(
    shared_object: tuple[str, Path],
) -> None:
    """Two engine processes (as with two GPUs; here two CPU supervisors): the restarted one starts with no region,
    so the HTTP worker that sees it come back unregisters them from the other one too."""
    settings = Settings(backend="cpu", slab_bytes=1 << 20, shared_memory=["system"])
    supervisors = [EngineSupervisor(settings) for _ in range(2)]
    for supervisor in supervisors:
        supervisor.start()
    engine = EngineClient([path for supervisor in supervisors for path in supervisor.sockets], settings)
    try:
        await engine.start()
        await until(lambda: engine.state is EngineState.READY, guard_s=60)
        survivor = engine.links[1]

        async def survivor_regions() -> list[str]:
            return [region["name"] for region in (await survivor.ask(wire.RegionStatus("system", None))).regions]

        await engine.register_region("r", shared_object[0], 0, 64)
        assert await survivor_regions() == ["r"]
        os.kill(engine.links[0].welcome.engine_pid, signal.SIGKILL)
        await until(lambda: engine.links[0].lost is not None)
        await until(lambda: engine.state is EngineState.READY, guard_s=60)
        for _ in range(1000):  # the unregistering runs on its own once the new engine process welcomes the link
            if not await survivor_regions():
                break
            await asyncio.sleep(0.01)
        assert await survivor_regions() == []
        assert await engine.region_status(None) == []
    finally:
        await engine.stop()
        engine.arena.close()
        for supervisor in supervisors:
            supervisor.stop()


class SlowChecks(SteeredBackend):
    """A backend whose check of an operand in a client's region waits, once it has begun (`checking`), until the
    test lets it go on (`go_on`), then records whether the region's memory was still mapped as it went on to read it
    (reading unmapped memory would crash the process, so it reads only what is mapped)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.checking = threading.Event()
        self.go_on = threading.Event()
        self.mapped_when_read: list[bool] = []

    def check_operand(self, operand: Any, name: str, precision: Precision) -> None:
        self.checking.set()
        self.go_on.wait(GUARD_S)
        self.mapped_when_read.append(_mapped(os.getpid(), self.path))
        if self.mapped_when_read[-1]:
            super().check_operand(operand, name, precision)


@pytest.mark.anyio
async def test_a_product_cancelled_during_its_region_check_keeps_the_region_mapped_until_the_check_returns(
    shared_object: tuple[str, Path], tmp_path: Path
) -> None:
    """An engine (here in this process, its backend's check steered) checking an operand in a client's region for
    fp16, when the product is cancelled and the region unregistered: the unregistration waits for the check, which
    reads the region still mapped; then the region is unmapped."""
    key, path = shared_object
    backend = SlowChecks(path)
    worker = DeviceWorker(backend, queue_size=4)
    server = EngineServer(worker, None, drain_s=5, shared_memory=frozenset({SharedMemoryKind.SYSTEM}))
    worker.start()
    socket_path = str(tmp_path / "engine.sock")
    serving = asyncio.create_task(server.serve(socket_path))
    settings = Settings(backend="cpu", slab_bytes=1 << 20, shared_memory=["system"])
    engine = EngineClient([socket_path], settings)
    try:
        await until(lambda: Path(socket_path).exists())
        await engine.start()
        await until(lambda: engine.state is EngineState.READY)
        await engine.register_region("r", key, 0, 3 * mmap.PAGESIZE)
        a = SharedTensor("r", 0, (4, 4), np.dtype(np.float32))
        product = asyncio.create_task(multiply(engine, a, np.ones((4, 4), np.float32), F32, precision=Precision.FP16))
        assert await asyncio.to_thread(backend.checking.wait, GUARD_S)
        product.cancel()
        unregistering = asyncio.create_task(engine.unregister_region("r"))
        await until(lambda: "r" not in server.regions.names())  # unregistered: no new product may name it
        await asyncio.wait({unregistering}, timeout=0.5)
        assert not unregistering.done() and _mapped(os.getpid(), path), "unmapped while its check runs"
        backend.go_on.set()
        await asyncio.wait_for(unregistering, GUARD_S)
        assert backend.mapped_when_read == [True]
        assert not _mapped(os.getpid(), path)
        with pytest.raises(asyncio.CancelledError):
            await product
    finally:
        backend.go_on.set()
        await engine.stop()
        engine.arena.close()
        server.stop()
        await asyncio.wait_for(serving, GUARD_S)
        await worker.stop()
