"""The engine process: the one owner of one device (or of the CPU backend), serving every HTTP worker.

`python -m app.dataplane.engine_process --device 0 --socket PATH` (the supervisor starts it; settings come from
the same MATMUL_* variables as the HTTP workers'). It builds the device's backend and its one worker (CUDA
context, compiled kernels, autotune, the queue and the batching window: `app.engine`), then accepts HTTP workers
on a Unix socket. Each connects with its arena of shared memory (`app.dataplane.slab`), which is mapped and pinned
here once; each product request names where its A, B and C lie in that arena, and the product is computed from
there into there. Requests of every HTTP worker share the one queue, so they batch together.

With MATMUL_SHARED_MEMORY, clients' registered shared-memory regions live here too (`app.dataplane.regions`):
system ones mapped and pinned once, CUDA ones opened once from their IPC handles, read and written in place by the
products that name them.

When an HTTP worker goes away, its queued products are dropped, those on the device finish, and its arena is
unpinned and unmapped. When the device is lost (a sticky CUDA error), the process answers what it holds and exits
with DEVICE_LOST_EXIT_CODE; the supervisor starts a fresh one. SIGTERM and SIGINT drain: no new products are
taken, those held are finished and answered, and the process exits once its HTTP workers have gone (or after
`DRAIN_S`). End of file on stdin (the supervisor is gone) drains it too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import logging
import mmap
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import numpy as np

from app.allocator import cap_malloc_arenas
from app.awaiting import in_thread
from app.config import Settings, SharedMemoryKind
from app.dataplane import wire
from app.dataplane.regions import CudaRegion, Region, Regions, SystemRegion
from app.dataplane.slab import Placement, view
from app.engine import BatchPolicy, DeviceWorker, EngineState, Outcome
from app.engine.base import Backend
from app.engine.cpu import CpuBackend
from app.errors import InvalidParameter, MatmulError, NotReady, SharedMemoryError
from numerics.precision import Precision, operand_dtype

log = logging.getLogger("app.engine_process")

DEVICE_LOST_EXIT_CODE = 75
"""EX_TEMPFAIL: the device's CUDA context was poisoned; the supervisor starts a fresh process."""
HELLO_TIMEOUT_S = 10.0
STATUS_EVERY_S = 0.5
"""How often every HTTP worker is sent the engine's status (and at once when its state changes)."""
STATE_POLL_S = 0.05
CUDA_IPC_HANDLE_BYTES = 64
DRAIN_S = 60.0
"""Longest a draining engine waits for its HTTP workers to go."""


def build_backend(settings: Settings, device: int | None, why_cpu: str) -> Backend:
    if device is None:
        return CpuBackend(reason=why_cpu)
    from app.engine import gpu

    return gpu.GpuBackend(
        device,
        settings.device_memory_limit_bytes,
        settings.fault_injection,
        settings.pipeline_depth,
        auto_batch=settings.max_batch_size if settings.batching else 1,
        kernel_cache=settings.kernel_cache_dir,
    )


class _Peer:
    """One connected HTTP worker: its arena, mapped and pinned here, and its products in progress."""

    def __init__(self, pid: int, fd: int, arena_bytes: int, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.fd = fd
        self.map = mmap.mmap(fd, arena_bytes)
        self.memory = np.frombuffer(self.map, np.uint8)
        self.writer = writer
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.pinning: asyncio.Task[None] | None = None

    def start(self, key: int, request: Coroutine[Any, Any, None], load: Callable[[], int]) -> None:
        """Run a request as a task of this peer's, until it has replied. A request answers its own cancellation,
        but a task cancelled before its first step never runs: a Cancel read in the same breath as its Matmul
        (both in one read from the socket) does that, and the Failed is then sent here, so that every request
        still gets its one reply (the HTTP worker frees the product's slab on it)."""
        task = asyncio.create_task(request)
        self.tasks[key] = task
        task.add_done_callback(partial(self._ended, key, load))

    def _ended(self, key: int, load: Callable[[], int], task: asyncio.Task[None]) -> None:
        self.tasks.pop(key, None)
        if task.cancelled():
            with contextlib.suppress(wire.ChannelClosed):
                wire.send(self.writer, wire.Failed(key, load(), "client_gone", "cancelled"))

    def array(self, where: wire.InArena, dtype: str) -> np.ndarray:
        try:
            return view(self.memory, Placement(where.offset, where.shape, dtype))
        except ValueError as exc:
            raise InvalidParameter(str(exc)) from None

    def close(self) -> None:
        """Close the file; the mapping goes now, or with the last array that still views it."""
        del self.memory
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)


class EngineServer:
    """Serves its device's worker to every HTTP worker that connects to its socket."""

    def __init__(
        self,
        worker: DeviceWorker,
        device_index: int | None,
        drain_s: float = DRAIN_S,
        shared_memory: frozenset[SharedMemoryKind] = frozenset(),
    ) -> None:
        self.worker = worker
        self.backend = worker.backend
        self.shared_memory = shared_memory
        """The kinds of clients' shared-memory regions MATMUL_SHARED_MEMORY enables."""
        self.regions = Regions(self.backend)
        self.device_index = device_index
        self.drain_s = drain_s
        self.exit_code = 0
        self._peers: set[_Peer] = set()
        self._closing: set[asyncio.Task[None]] = set()
        """Regions being closed once their last product gave them back."""
        self._connections: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._draining = False
        self._started = asyncio.Event()
        """Set once the engine has left STARTING (compiling, self-testing and timing the kernels)."""

    def stop(self, exit_code: int = 0) -> None:
        """Drain and end `serve` (with `exit_code` for the process)."""
        self.exit_code = self.exit_code or exit_code
        self._draining = True
        self._stopping.set()

    async def serve(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(256)
        listener.setblocking(False)
        accepting = asyncio.create_task(self._accept(loop, listener))
        statuses = asyncio.create_task(self._send_statuses())
        log.info("engine %d serving %s on %s", os.getpid(), self.backend.device_name, path)
        await self._stopping.wait()
        accepting.cancel()
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        await self._drain()
        statuses.cancel()
        everything = self.regions.remove(SystemRegion, None) + self.regions.remove(CudaRegion, None)
        await self._close([region for region in everything if region.users == 0])
        await asyncio.gather(*self._closing)

    async def _drain(self) -> None:
        """Finish what is held; then, unless the device was lost, wait for the HTTP workers to hang up (at most
        drain_s in all)."""
        try:
            async with asyncio.timeout(self.drain_s):
                while any(peer.tasks for peer in self._peers):
                    await asyncio.wait([t for peer in self._peers for t in peer.tasks.values()])
                if self.exit_code == 0 and self._connections:
                    await asyncio.wait(self._connections)
        except TimeoutError:
            log.warning("%d HTTP workers still connected after %.0f s of draining", len(self._peers), self.drain_s)

    async def _accept(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        while True:
            connection, _ = await loop.sock_accept(listener)
            task = asyncio.create_task(self._connection(connection))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _connection(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(HELLO_TIMEOUT_S)
            hello, fd = await asyncio.to_thread(wire.receive_hello, connection)
        except (OSError, wire.ChannelClosed) as exc:
            log.warning("an HTTP worker's handshake failed: %s", exc)
            connection.close()
            return
        if hello.version != wire.PROTOCOL_VERSION:
            log.error(
                "HTTP worker %d speaks version %d of the control channel, this engine %d: refused",
                hello.pid, hello.version, wire.PROTOCOL_VERSION,
            )  # fmt: skip
            with contextlib.suppress(OSError):
                connection.sendall(wire.frame(self._welcome()))  # so that the worker can say which versions met
            os.close(fd)
            connection.close()
            return
        try:
            connection.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=connection)
            peer = _Peer(hello.pid, fd, hello.arena_bytes, writer)
        except (OSError, ValueError) as exc:
            log.warning("an HTTP worker's handshake failed: %s", exc)
            os.close(fd)
            connection.close()
            return
        # Pinned in the background once the engine has started, so that neither this worker's start nor readiness
        # waits for it (about 0.3 s a GiB): registering 8 GiB while the kernels were being self-tested and timed
        # doubled the time to ready with 8 HTTP workers. Until then the backend stages operands through pinned
        # buffers of its own, as for any memory.
        peer.pinning = asyncio.create_task(self._pin(peer))
        self._peers.add(peer)
        log.info("HTTP worker %d connected (%d bytes of shared memory)", peer.pid, peer.map.size())
        try:
            wire.send(writer, self._welcome())
            wire.send(writer, self._status())
            while True:
                message = await wire.receive_from_worker(reader)
                if isinstance(message, wire.Matmul):
                    peer.start(message.id, self._matmul(peer, message), self._load)
                elif isinstance(message, wire.Cancel):
                    if (running := peer.tasks.get(message.id)) is not None:
                        running.cancel()
                else:
                    peer.start(message.id, self._region_op(peer, message), self._load)
        except wire.ChannelClosed:
            pass
        finally:
            await self._hang_up(peer)

    def _load(self) -> int:
        return self.worker.load

    async def _pin(self, peer: _Peer) -> None:
        await self._started.wait()
        try:
            await asyncio.to_thread(self.backend.pin, peer.memory)
        except MatmulError as exc:
            log.error("HTTP worker %d's shared memory stays unpinned (copies are staged): %s", peer.pid, exc)

    async def _hang_up(self, peer: _Peer) -> None:
        """The HTTP worker went: drop its queued products, let those on the device finish, free its arena."""
        for task in peer.tasks.values():
            task.cancel()
        await asyncio.gather(*peer.tasks.values(), return_exceptions=True)
        if peer.pinning is not None:
            if not self._started.is_set():
                peer.pinning.cancel()  # still waiting for the start: nothing registered yet
            await asyncio.gather(peer.pinning, return_exceptions=True)
        with contextlib.suppress(MatmulError):
            await asyncio.to_thread(self.backend.unpin, peer.memory)
        peer.writer.close()
        peer.close()
        self._peers.discard(peer)
        log.info("HTTP worker %d disconnected", peer.pid)

    def _operand(self, peer: _Peer, where: wire.Place, dtype: str, name: str, lent: list[Region]) -> Any:
        """An operand or product where the message says: in the peer's arena (in `dtype`: the product's, or the one
        its operands are multiplied in), or in a registered region (a device array for a CUDA one), which it then
        holds (`lent`)."""
        if isinstance(where, wire.InArena):
            return peer.array(where, dtype)
        if not self.shared_memory:
            raise SharedMemoryError("shared memory is off: MATMUL_SHARED_MEMORY does not enable it")
        region = self.regions.get(where.region)
        tensor = region.tensor(where.offset, where.shape, np.dtype(where.dtype), name)
        self.regions.lend(region)
        lent.append(region)
        return tensor

    def _give_back(self, lent: list[Region]) -> None:
        """The product no longer uses these regions; one unregistered meanwhile is closed now, in the background,
        when it was the last (the product's reply does not wait for it, the unregistration's does)."""
        last = [region for region in lent if self.regions.give_back(region)]
        if last:
            closing = asyncio.create_task(self._close(last))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def _close(self, regions: list[Region]) -> None:
        """Close regions no product uses any more (in a thread: unpinning and unmapping block), then tell whoever
        waits for them."""
        try:
            await in_thread(self.regions.close, regions)
        finally:
            for region in regions:
                region.closed.set()

    async def _unregister(self, kind: type[Region], name: str | None) -> None:
        """Forget regions and close them: at once those no product uses, the others when their last product gives
        them back. Returns once every one is closed: the client may free or rewrite its memory after the answer."""
        removed = self.regions.remove(kind, name)
        await self._close([region for region in removed if region.users == 0])
        await asyncio.gather(*(region.closed.wait() for region in removed))

    async def _region_op(self, peer: _Peer, message: wire.Request) -> None:
        """Register, unregister or describe clients' shared-memory regions. The blocking part of each runs in one
        thread call, waited for to its end even when this task is cancelled (its HTTP worker went). Every HTTP worker
        is sent the new list of regions before the reply, so that one of them asked to serve a product in a region
        just registered finds the engine that holds it."""
        reply: wire.Reply
        try:
            regions = await self._on_regions(message)
            reply = wire.RegionsDone(id=message.id, load=self.worker.load, regions=regions)
        except MatmulError as exc:
            reply = _failed(message.id, self.worker.load, exc)
        except Exception:
            log.exception("%s of HTTP worker %d failed", type(message).__name__, peer.pid)
            reply = wire.Failed(message.id, self.worker.load, "internal_error", "internal error")
        with contextlib.suppress(wire.ChannelClosed):
            wire.send(peer.writer, reply)

    async def _on_regions(self, message: wire.Request) -> list[dict[str, str | int]]:
        """What a region request asks: the regions listed (RegionStatus), else none once it is done."""
        kind: type[Region] = SystemRegion
        if isinstance(message, wire.RegisterCudaRegion) or getattr(message, "kind", None) == "cuda":
            kind = CudaRegion
        wanted = SharedMemoryKind.CUDA if kind is CudaRegion else SharedMemoryKind.SYSTEM
        if wanted not in self.shared_memory:
            raise SharedMemoryError(f"{wanted} shared memory is off: MATMUL_SHARED_MEMORY does not enable it")
        match message:
            case wire.RegionStatus(name=name):
                return self.regions.status(kind, name)
            case wire.RegisterRegion(name=name, key=key, offset=offset, byte_size=byte_size):
                await in_thread(self.regions.register_system, name, key, offset, byte_size)
            case wire.RegisterCudaRegion(name=name, raw_handle=raw, device_id=device_id, byte_size=byte_size):
                await in_thread(self.regions.register_cuda, name, _raw_handle(raw), device_id, byte_size)
            case wire.UnregisterRegion(name=name):
                await self._unregister(kind, name)
            case _:
                raise InvalidParameter(f"{type(message).__name__} is not a region request")
        self._broadcast(self._status())
        return []

    async def _matmul(self, peer: _Peer, message: wire.Matmul) -> None:
        key = message.id
        lent: list[Region] = []
        reply: wire.Reply
        try:
            outcome = await self._compute(peer, message, lent)
        except MatmulError as exc:
            reply = _failed(key, self.worker.load, exc)
        except asyncio.CancelledError:
            reply = wire.Failed(key, self.worker.load, "client_gone", "cancelled")
        except Exception:
            log.exception("product %s of HTTP worker %d failed", key, peer.pid)
            # what went wrong stays in this log; the client is told no more than of any unexpected error
            reply = wire.Failed(key, self.worker.load, "internal_error", "internal error")
        else:
            request = message.request
            reply = wire.Computed(
                id=key,
                load=self.worker.load,
                kernel=outcome.plan.kernel,
                tile=outcome.plan.tile,
                global_elements=outcome.plan.global_elements(request.m, request.n, request.k),
                queue_ms=outcome.queue_ms,
                h2d_ms=outcome.device.h2d_ms,
                kernel_ms=outcome.device.kernel_ms,
                d2h_ms=outcome.device.d2h_ms,
                batch_size=outcome.batch_size,
            )
        self._give_back(lent)  # after `_compute` returned: no variable of it views a region any more
        with contextlib.suppress(wire.ChannelClosed):
            wire.send(peer.writer, reply)

    async def _compute(self, peer: _Peer, message: wire.Matmul, lent: list[Region]) -> Outcome:
        """The product the message asks for, computed where it says."""
        if self._draining:
            raise NotReady("the engine is shutting down")
        dtype, precision = np.dtype(message.request.dtype), message.request.precision
        places = {"a": message.a, "b": message.b, "c": message.c}
        in_arena = {"a": operand_dtype(dtype), "b": operand_dtype(dtype), "c": dtype}
        a, b, c = (self._operand(peer, place, in_arena[name].name, name, lent) for name, place in places.items())
        for name, operand in (("a", a), ("b", b)):
            # in a client's region, no HTTP worker staged and checked it; fp32 rounds nothing, so nothing to check
            if isinstance(places[name], wire.InRegion) and precision is not Precision.FP32:
                await in_thread(self.backend.check_operand, operand, name, precision)
        plan = self.backend.plan(message.request)
        return await self.worker.matmul(a, b, dtype, plan, timeout_s=message.timeout_s, out=c)

    def _welcome(self) -> wire.Welcome:
        return wire.Welcome(
            engine_pid=os.getpid(),
            backend=self.backend.name,
            device_index=self.device_index,
            device_name=self.backend.device_name,
            queue_size=self.worker.queue_size,
            kernels=self.backend.kernels(),
            peaks=self.backend.peaks,
        )

    def _status(self) -> wire.Status:
        worker = self.worker
        return wire.Status(
            state="stopped" if self._draining else worker.state.value,
            failure=worker.failure or ("the engine is shutting down" if self._draining else None),
            queue_depth=worker.queue_depth,
            load=worker.load,
            describe=self.backend.describe(),
            memory_held=self.backend.memory_held(),
            compiled_instances=self.backend.compiled_instances(),
            shared_memory_bytes=sum(peer.map.size() for peer in self._peers),
            http_workers=len(self._peers),
            regions=self.regions.names(),
            auto=[
                wire.AutoPick(
                    shape_class=choice.shape_class.name,
                    precision=choice.precision,
                    dtype=choice.dtype,
                    kernel=choice.kernel,
                    probe_ms=dict(choice.probe_ms),
                )
                for choice in self.backend.auto_choices()
            ],
        )

    def _broadcast(self, message: wire.Status) -> None:
        for peer in list(self._peers):
            with contextlib.suppress(wire.ChannelClosed):
                wire.send(peer.writer, message)

    async def _send_statuses(self) -> None:
        """Every STATUS_EVERY_S, and within STATE_POLL_S of a change of state, to every HTTP worker."""
        loop = asyncio.get_running_loop()
        last_state, last_sent = None, 0.0
        while True:
            state = (self.worker.state, self._draining)
            if state[0] is not EngineState.STARTING:
                self._started.set()
            if state != last_state or loop.time() - last_sent >= STATUS_EVERY_S:
                self._broadcast(self._status())
                last_state, last_sent = state, loop.time()
            await asyncio.sleep(STATE_POLL_S)


async def _serve(settings: Settings, device: int | None, why_cpu: str, path: str) -> int:
    backend = build_backend(settings, device, why_cpu)
    batching = (
        BatchPolicy(max_size=settings.max_batch_size, max_delay_s=settings.max_queue_delay_us / 1e6)
        if settings.batching
        else None
    )
    server: EngineServer | None = None

    def device_lost() -> None:
        if server is not None:
            server.stop(DEVICE_LOST_EXIT_CODE)

    worker = DeviceWorker(backend, queue_size=settings.queue_size, on_device_lost=device_lost, batching=batching)
    server = EngineServer(worker, device, shared_memory=frozenset(settings.shared_memory))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.stop)
    loop.add_reader(sys.stdin.fileno(), _stop_at_end_of_file, server)
    worker.start()
    await server.serve(path)
    if server.exit_code == 0:
        await worker.stop()
    return server.exit_code


def _failed(key: int, load: int, error: MatmulError) -> wire.Failed:
    return wire.Failed(key, load, error.code, error.message, error.location)


def _raw_handle(encoded: str) -> bytes:
    """A CUDA IPC handle from its base64 text (64 bytes, cudaIpcMemHandle_t), or SharedMemoryError."""
    try:
        handle = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise SharedMemoryError("raw_handle.b64 is not base64", location=["raw_handle"]) from None
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        raise SharedMemoryError(
            f"raw_handle is {len(handle)} bytes; a CUDA IPC handle has {CUDA_IPC_HANDLE_BYTES}", location=["raw_handle"]
        )
    return handle


def _stop_at_end_of_file(server: EngineServer) -> None:
    """stdin is a pipe from the supervisor: readable with nothing in it means the supervisor is gone."""
    if not os.read(sys.stdin.fileno(), 1):
        asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
        server.stop()


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (uvicorn[standard] brings it, and the HTTP workers run on it), else
    asyncio's. The engine's loop turns every product's frames around and is woken by the device threads once per
    launch: with 64^2 products at 4,500 a second it was the engine process's busiest thread."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.dataplane.engine_process", description=__doc__)
    parser.add_argument("--device", help="a CUDA device ordinal, or cpu")
    parser.add_argument("--why-cpu", default="", help="with --device cpu: why the CPU backend runs")
    parser.add_argument("--socket", help="the Unix socket to serve on")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s engine[%(process)d] %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings()
    if args.device is None or args.socket is None:
        parser.error("--device and --socket are needed")
    cap_malloc_arenas()
    device = None if args.device == "cpu" else int(args.device)
    with asyncio.Runner(loop_factory=_event_loop) as runner:
        code = runner.run(_serve(settings, device, args.why_cpu, args.socket))
    logging.shutdown()
    # After a lost device CuPy's clean-up at exit would touch the poisoned context; leave without it.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
