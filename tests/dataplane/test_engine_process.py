"""Real engine processes (CPU backend) and the HTTP workers' side of them, without HTTP: several workers' products
batch in one engine, a worker that hangs up loses its queued work, a killed engine fails what it held at once and
a restarted one serves the same links again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import numpy as np
import pytest

from app.config import Settings
from app.dataplane import wire
from app.dataplane.engine_client import EngineClient
from app.dataplane.engine_process import _event_loop
from app.dataplane.slab import Arena
from app.dataplane.supervisor import EngineSupervisor
from app.engine import EngineState, ProductRequest
from app.errors import DeviceLost, NotReady, Overloaded, SharedMemoryError, UnknownKernel
from numerics.reference import assert_close_to_reference
from numerics.roofline import DevicePeaks
from tests.fakes import multiply, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
MIB = 1 << 20
WINDOW_US = 1_000_000
"""A batching window of a second: a product waits in the engine for that long unless its batch fills."""


@pytest.fixture
def settings() -> Settings:
    return Settings(backend="cpu", batching=True, max_batch_size=2, max_queue_delay_us=WINDOW_US, slab_bytes=8 * MIB)


async def _connected(supervisor: EngineSupervisor, settings: Settings) -> EngineClient:
    engine = EngineClient(supervisor.sockets, settings)
    await engine.start()
    await until(lambda: engine.state is EngineState.READY, guard_s=60)
    return engine


@pytest.fixture
async def workers(supervisor: EngineSupervisor, settings: Settings) -> AsyncIterator[list[EngineClient]]:
    """Two HTTP workers' links to the one engine process, each with its own arena."""
    engines = [await _connected(supervisor, settings) for _ in range(2)]
    yield engines
    for engine in engines:
        await engine.stop()
        engine.arena.close()


def _operands(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((33, 17)), rng.standard_normal((17, 9))


async def _product(engine: EngineClient, seed: int, kernel: str = "auto") -> np.ndarray:
    a, b = _operands(seed)
    outcome = await multiply(engine, a, b, np.dtype(np.float64), kernel, None, timeout_s=30)
    try:
        assert_close_to_reference(outcome.c, a, b, np.dtype(np.float64))
        assert outcome.stage_ms >= 0 and outcome.handoff_ms >= 0
        return np.array([outcome.batch_size])
    finally:
        outcome.release()


async def test_products_of_two_http_workers_batch_in_the_one_engine(workers: list[EngineClient]) -> None:
    """A batch of 2 fills only when both workers' products are queued together: each alone would wait 1 s."""
    first, second = await asyncio.gather(_product(workers[0], 1), _product(workers[1], 2))
    assert first.tolist() == second.tolist() == [2]
    assert {w.describe()[0]["engine_pid"] for w in workers} == {w.links[0].welcome.engine_pid for w in workers}
    await until(lambda: all(w.arena.used_bytes == 0 for w in workers))  # given back on the loop, soon after


async def test_an_http_worker_of_another_channel_version_is_refused_saying_which(
    supervisor: EngineSupervisor, settings: Settings, engine: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hello and Welcome carry the channel's version: an engine answers a Hello of another version with its Welcome
    and hangs up, and the HTTP worker's start fails at once naming both versions (not after the welcome timeout)."""
    ours = wire.PROTOCOL_VERSION
    arena = Arena(MIB)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(supervisor.sockets[0])
    wire.send_hello(sock, wire.Hello(pid=os.getpid(), arena_bytes=arena.capacity, version=ours + 1), arena.fd)
    sock.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        async with asyncio.timeout(10):
            welcome = await wire.receive_from_engine(reader)
            assert isinstance(welcome, wire.Welcome) and welcome.version == ours
            with pytest.raises(wire.ChannelClosed):
                await wire.receive_from_engine(reader)
    finally:
        writer.close()
        arena.close()

    monkeypatch.setattr(wire, "PROTOCOL_VERSION", ours + 1)
    newer = EngineClient(supervisor.sockets, settings)
    try:
        async with asyncio.timeout(10):
            with pytest.raises(
                RuntimeError, match=f"speaks version {ours} of the control channel and this HTTP worker {ours + 1}"
            ):
                await newer.start()
    finally:
        newer.arena.close()
    assert engine.state is EngineState.READY  # the engine serves its other workers on


async def test_the_engine_checks_the_kernel_and_its_refusal_reaches_the_worker(workers: list[EngineClient]) -> None:
    with pytest.raises(UnknownKernel, match="'fast' needs the GPU backend"):
        await _product(workers[0], 1, kernel="fast")
    await until(lambda: workers[0].arena.used_bytes == 0)


async def test_a_cancelled_product_keeps_its_slab_until_the_engine_lets_go(workers: list[EngineClient]) -> None:
    worker = workers[0]
    waiting = asyncio.create_task(_product(worker, 3))
    await until(lambda: worker.links[0].in_flight == 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert worker.arena.used_bytes > 0  # the engine may still write C: the slab waits for its reply
    await until(lambda: worker.arena.used_bytes == 0, guard_s=10)


async def test_a_product_cancelled_in_the_same_read_as_it_is_still_answered_once(
    supervisor: EngineSupervisor, engine: EngineClient
) -> None:
    """A Cancel that reaches the engine with its Matmul, in one read, cancels the product's task before it first
    runs; the product still gets exactly one reply (the HTTP worker frees its slab on it), here from a bare client
    of the engine's socket (once `engine` found it ready)."""
    arena = Arena(MIB)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(supervisor.sockets[0])
    wire.send_hello(sock, wire.Hello(pid=os.getpid(), arena_bytes=arena.capacity), arena.fd)
    sock.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=sock)

    async def replies(within_s: float) -> list[wire.Reply]:
        """The replies that come within `within_s`."""
        came: list[wire.Reply] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while True:
                    message = await wire.receive_from_engine(reader)
                    came += [message] if isinstance(message, wire.Failed | wire.Computed | wire.RegionsDone) else []
        return came

    try:
        place = wire.InArena(0, (4, 4))
        matmul = wire.Matmul(place, place, wire.InArena(64, (4, 4)), ProductRequest(4, 4, 4), 30.0, id=7)
        writer.write(wire.frame(matmul) + wire.frame(wire.Cancel(id=7)))
        came = await replies(within_s=WINDOW_US / 1e6 + 1)  # a product run would be answered after the window
        assert [(reply.id, type(reply)) for reply in came] == [(7, wire.Failed)]
        assert isinstance(came[0], wire.Failed) and came[0].code == "client_gone"
    finally:
        writer.close()
        arena.close()


async def test_a_killed_engine_fails_what_it_held_at_once_and_a_fresh_one_serves_the_same_link(
    supervisor: EngineSupervisor, workers: list[EngineClient]
) -> None:
    worker = workers[0]
    first_pid = worker.links[0].welcome.engine_pid
    held = asyncio.create_task(_product(worker, 4))  # waits out the batching window in the engine
    await until(lambda: worker.links[0].in_flight == 1)
    os.kill(first_pid, signal.SIGKILL)
    with pytest.raises(DeviceLost, match=f"engine process {first_pid} exited"):
        await asyncio.wait_for(held, timeout=5)  # far less than the window: failed when the socket closed
    await until(lambda: worker.arena.used_bytes == 0)
    with pytest.raises(NotReady, match="a new one is starting"):
        worker.check_ready()
    await until(lambda: all(w.state is EngineState.READY for w in workers), guard_s=60)
    assert worker.links[0].welcome.engine_pid != first_pid
    assert supervisor.engines[0].exits == [-signal.SIGKILL]
    assert (await asyncio.gather(_product(worker, 5), _product(workers[1], 6)))[0].tolist() == [2]


async def test_a_worker_that_hangs_up_loses_its_queued_product_and_its_arena_is_unmapped(
    supervisor: EngineSupervisor, settings: Settings
) -> None:
    leaving, staying = await _connected(supervisor, settings), await _connected(supervisor, settings)
    await until(lambda: staying.describe()[0]["engine_http_workers"] == 2)
    assert staying.describe()[0]["engine_shared_memory_bytes"] == 2 * settings.slab_bytes
    queued = asyncio.create_task(_product(leaving, 7))
    await until(lambda: leaving.links[0].in_flight == 1)
    await leaving.stop()  # its connection closes, as when its process dies
    with pytest.raises(DeviceLost):
        await queued
    await until(lambda: staying.describe()[0]["engine_http_workers"] == 1)
    assert staying.describe()[0]["engine_shared_memory_bytes"] == settings.slab_bytes
    assert staying.queue_depth == 0
    await staying.stop()
    leaving.arena.close()
    staying.arena.close()


def test_the_engine_process_runs_on_uvloop_where_it_is_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = _event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def _two_engines() -> EngineClient:
    """A worker's side of two GPU engine processes that are never started: the tests set what their links heard."""
    engine = EngineClient(["device-0.sock", "device-1.sock"], Settings(backend="cpu", slab_bytes=MIB))
    for index, link in enumerate(engine.links):
        link._writer = object()  # type: ignore[assignment]  # connected
        link.welcome = wire.Welcome(index, "gpu", index, f"GPU {index}", queue_size=8, kernels=[], peaks=DevicePeaks())
    return engine


def _status(state: Literal["starting", "ready", "failed"], failure: str | None = None, load: int = 0) -> wire.Status:
    return wire.Status(state, failure, 0, load, {}, 0, 0, 0, http_workers=1, regions=[], auto=[])


def test_each_product_goes_to_the_least_loaded_ready_engine_and_is_refused_when_every_queue_is_full() -> None:
    """Products queued or running on each engine, as its last status said: the least-loaded ready engine takes the
    next product; a failed one takes none, however idle; Overloaded once every ready engine's queue is full."""
    engine = _two_engines()
    first, second = engine.links
    try:
        first._take(_status("ready", load=3))
        second._take(_status("ready", load=1))
        assert engine._least_loaded() is second
        second._take(_status("ready", load=4))
        assert engine._least_loaded() is first
        first._take(_status("failed", "device lost"))
        assert engine._least_loaded() is second
        engine.check_room()
        second._take(_status("ready", load=engine.queue_size))
        with pytest.raises(Overloaded, match=r"^every engine's queue is full \(8 waiting\); retry later$"):
            engine.check_room()
        first._take(_status("ready", load=engine.queue_size - 1))
        engine.check_room()
        assert engine._least_loaded() is first
    finally:
        engine.arena.close()


def test_with_several_engines_the_service_is_ready_while_one_of_them_is_once_all_have_been() -> None:
    """At start-up products wait until every engine is ready (as the engines' statuses say, whether or not anyone
    asked meanwhile); after that they are taken while any engine is (the others' go to it), and refused while none
    is, saying why."""
    engine = _two_engines()
    first, second = engine.links
    try:
        first._take(_status("ready"))
        second._take(_status("starting"))
        with pytest.raises(NotReady, match="still being compiled"):  # the second is still starting
            engine.check_ready()
        second._take(_status("ready"))
        second._take(_status("failed", "device lost"))
        engine.check_ready()  # the first serves while the second starts again
        assert engine._least_loaded(frozenset()) is first
        first._take(_status("failed", "device lost"))
        with pytest.raises(NotReady, match="the engine is failed: device lost"):
            engine.check_ready()
    finally:
        engine.arena.close()


async def test_a_cuda_region_name_held_on_another_device_is_refused() -> None:
    """Region names are one namespace: a product names its region and the engine holding the name computes it, so
    a second device must not register a name the first holds."""
    engine = _two_engines()
    asked: list[tuple[int, str]] = []

    def answering(index: int, cuda_names: list[str]) -> Callable[[wire.Request], Awaitable[wire.RegionsDone]]:
        async def ask(request: wire.Request) -> wire.RegionsDone:
            asked.append((index, type(request).__name__))
            return wire.RegionsDone(request.id, 0, [{"name": name} for name in cuda_names])

        return ask

    engine.links[0].ask = answering(0, ["out"])  # type: ignore[method-assign]
    engine.links[1].ask = answering(1, [])  # type: ignore[method-assign]
    try:
        with pytest.raises(SharedMemoryError, match="'out' is already registered \\(on another device\\)"):
            await engine.register_cuda_region("out", "handle", device_id=1, byte_size=64)
        assert asked == [(0, "RegionStatus")]
        await engine.register_cuda_region("in", "handle", device_id=1, byte_size=64)
        assert asked[1:] == [(0, "RegionStatus"), (1, "RegisterCudaRegion")]
    finally:
        engine.arena.close()
