"""The engine as an HTTP worker sees it: engine processes at the end of Unix sockets, operands in shared memory.

`EngineClient` is what the service and the routes call (`app.engine.EngineFront`). A product reserves a slab of
this worker's arena, its operands are converted into the dtype they are multiplied in (the working dtype; int8 for
an int32 product) straight into the slab (one pass, off the event loop when large), and a descriptor goes to the
least-loaded ready engine; the answer's C is a view of the slab, whose bytes go back to the arena once the request
has released it and the answer no longer reads them (`app.dataplane.slab`). A large binary body may have been read
into the arena itself (`lend`): an operand there that is already in that dtype, C-ordered and aligned is not
copied; the engine reads it where it lies.
Nothing here imports CuPy.

Each `EngineLink` keeps its connection: it connects (again, after an engine process restarted) with the arena's
file descriptor, keeps the engine's last status, and settles its requests from the engine's replies. When the
connection drops, every request in flight on it gets 503 `device_lost` at once and the link reads as failed
(`/readyz` 503) until the restarted engine reports ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
from collections.abc import Callable
from functools import partial
from time import monotonic, perf_counter
from typing import Any, Literal

import msgspec
import numpy as np

from app.awaiting import in_thread
from app.config import Settings
from app.dataplane import wire
from app.dataplane.slab import ALIGNMENT, Arena, Placement, Slab, aligned
from app.engine import EngineState, KernelInfo, LentMemory, Outcome, Plan, ProductRequest, SlabUse
from app.engine.autotune import SHAPE_CLASSES, AutoChoice
from app.engine.base import DeviceTiming
from app.engine.staging import cast_into, check_in_format, reads_elements
from app.errors import DeviceLost, EngineUnresponsive, NotReady, Overloaded, SharedMemoryError, error_of
from app.shared_memory import Matrix, SharedOutput, SharedTensor
from numerics.precision import Precision, operand_dtype
from numerics.roofline import DevicePeaks

log = logging.getLogger(__name__)

CONNECT_RETRY_S = 0.05
"""Pause between attempts to reach an engine that is not (yet, or again) listening."""
DEFAULT_WAIT_S = 60.0
"""A product's wait for shared memory and in the queue when the caller sets no deadline."""
WELCOME_TIMEOUT_S = 120.0
"""Longest `EngineClient.start` waits for every engine process to answer: a cold start imports CuPy."""


class EngineLink:
    """One engine process: the channel to it, its requests in flight, what it last said about itself."""

    def __init__(self, path: str, arena: Arena, silence_s: float) -> None:
        self.path = path
        self.arena = arena
        self.silence_s = silence_s
        """How long a ready engine may say nothing (it sends a status every STATUS_EVERY_S) before it is taken for
        hung."""
        self.welcome: wire.Welcome | None = None
        self.status: wire.Status | None = None
        self.lost: str | None = None
        """Why the link is down after having been up (the engine process exited), until it is back."""
        self.refused: str | None = None
        """Why the engine cannot be used at all (it speaks another version of the channel); then no reconnecting."""
        self.welcomed = asyncio.Event()
        """Set by the first welcome (or refusal)."""
        self.on_restart: Callable[[], None] | None = None
        """Called when a new engine process welcomes this link after the one before it exited."""
        self.on_status: Callable[[], None] | None = None
        """Called after each status the engine sends."""
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[wire.Reply]] = {}
        self._ids = itertools.count()
        self._load = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._heard_at = 0.0
        """When the engine last said anything (time.monotonic)."""
        self._silent: asyncio.Future[None] | None = None
        """Settled once the engine has said nothing for `silence_s`; a new one when it speaks again."""

    # ------------------------------------------------------------------------------------------ state

    @property
    def kernels(self) -> list[KernelInfo]:
        """The welcome's kernels: every v2 request asks for them."""
        return [] if self.welcome is None else self.welcome.kernels

    @property
    def peaks(self) -> DevicePeaks:
        return DevicePeaks() if self.welcome is None else self.welcome.peaks

    @property
    def state(self) -> EngineState:
        if self._writer is None or self.status is None:
            return EngineState.FAILED if self.lost else EngineState.STARTING
        if self.is_silent:
            return EngineState.FAILED
        return EngineState(self.status.state)

    @property
    def failure(self) -> str | None:
        if self._writer is None:
            return self.lost
        if self.is_silent:
            return self._silence()
        return None if self.status is None else self.status.failure

    @property
    def is_silent(self) -> bool:
        """Whether the engine, connected and ready when it last spoke, has said nothing for `silence_s`."""
        return self._silent is not None and self._silent.done()

    def _silence(self) -> str:
        pid = self.welcome.engine_pid if self.welcome else "?"
        return f"the engine process {pid} has said nothing for more than {self.silence_s:g} s"

    @property
    def in_flight(self) -> int:
        """Products this worker sent to the engine that it has not answered yet."""
        return len(self._pending)

    @property
    def load(self) -> int:
        """Products queued or running on the engine, as it last said, plus those sent to it since."""
        return self._load

    # --------------------------------------------------------------------------------------- channel

    def start(self) -> None:
        self._silent = asyncio.get_running_loop().create_future()
        self._tasks = [
            asyncio.create_task(self._keep_connected(), name=f"engine-link {self.path}"),
            asyncio.create_task(self._watch_silence(), name=f"engine-silence {self.path}"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._drop("the HTTP worker is shutting down")

    async def wait_for(self, reply: asyncio.Future[wire.Reply]) -> None:
        """Until the reply has come; EngineUnresponsive if the engine falls silent first (the reply still comes if
        it speaks again, to whoever waits for it then)."""
        silent = self._silent
        if silent is not None and not reply.done():
            await asyncio.wait((reply, silent), return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            raise EngineUnresponsive(f"{self._silence()}; the product was given up")

    async def _watch_silence(self) -> None:
        """Settle `_silent` once a ready engine has said nothing for `silence_s` (it is stopped, or its event loop
        is stuck): a hung engine keeps its socket open, so its end says nothing."""
        while True:
            await asyncio.sleep(self.silence_s / 4)
            ready = (
                self._writer is not None and self.status is not None and self.status.state == EngineState.READY.value
            )
            silent = self._silent
            if ready and silent is not None and not silent.done() and monotonic() - self._heard_at > self.silence_s:
                log.error("%s: taken for hung until it speaks again", self._silence())
                silent.set_result(None)

    async def _keep_connected(self) -> None:
        while True:
            try:
                reader, writer = await self._connect()
            except OSError:
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            self._writer, self.lost = writer, None
            try:
                while True:
                    self._take(await wire.receive_from_engine(reader))
            except _Refused as exc:
                log.critical("the engine process on %s cannot be used: %s", self.path, exc)
                self._drop(str(exc))
                self.refused = str(exc)
                self.welcomed.set()
                return
            except wire.ChannelClosed as exc:
                pid = self.welcome.engine_pid if self.welcome else "?"
                log.error("engine process %s (%s) went away: %s", pid, self.path, exc)
                if isinstance(exc, wire.ChannelCorrupt):
                    # The engine may still be computing into this worker's slabs: hang up and let it finish
                    # before they are given back (it closes its end once the products it holds have ended).
                    writer.close()
                    with contextlib.suppress(ConnectionError):
                        while await reader.read(1 << 16):
                            pass
                self._drop(f"the engine process {pid} exited; a new one is starting")
            finally:
                writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, self.path)
            sock.setblocking(True)
            hello = wire.Hello(pid=os.getpid(), arena_bytes=self.arena.capacity, version=wire.PROTOCOL_VERSION)
            await asyncio.to_thread(wire.send_hello, sock, hello, self.arena.fd)
            sock.setblocking(False)
            return await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            raise

    def _drop(self, why: str) -> None:
        """The connection is gone: what was in flight on it is lost with the engine."""
        self._writer, self.status, self.lost = None, None, why
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(DeviceLost(f"{why}; the product was lost with it"))

    def _take(self, message: wire.FromEngine) -> None:
        self._heard_at = monotonic()
        if self.is_silent:
            log.warning("the engine process on %s speaks again", self.path)
            self._silent = asyncio.get_running_loop().create_future()
        match message:
            case wire.Welcome(version=version) if version != wire.PROTOCOL_VERSION:
                raise _Refused(
                    f"it speaks version {version} of the control channel and this HTTP worker "
                    f"{wire.PROTOCOL_VERSION}: the two come from different builds"
                )
            case wire.Welcome():
                if self.welcome is not None and self.on_restart is not None:
                    self.on_restart()
                self.welcome = message
                self.welcomed.set()
            case wire.Status():
                self.status = message
                self._load = message.load
                if self.on_status is not None:
                    self.on_status()
            case _:
                self._load = message.load
                future = self._pending.pop(message.id, None)
                if future is not None and not future.done():
                    future.set_result(message)

    def send(self, request: wire.Matmul) -> tuple[int, asyncio.Future[wire.Reply]]:
        """Send a product request; the future is settled by its reply (or the connection's end)."""
        key, future = self._request(request)
        self._load += 1
        return key, future

    async def ask(self, request: wire.Request) -> wire.RegionsDone:
        """Send a region request and wait for its reply; the error it reports, raised."""
        _, future = self._request(request)
        reply = await future
        if isinstance(reply, wire.Failed):
            raise error_of(reply.code, reply.message, reply.location)
        if not isinstance(reply, wire.RegionsDone):
            raise TypeError(f"a {type(reply).__name__} answered a region request")
        return reply

    def _request(self, request: wire.Request) -> tuple[int, asyncio.Future[wire.Reply]]:
        if self._writer is None:
            raise NotReady(self.lost or "the engine process is not connected yet")
        key = next(self._ids)
        future: asyncio.Future[wire.Reply] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        wire.send(self._writer, msgspec.structs.replace(request, id=key))
        return key, future

    def cancel(self, key: int) -> None:
        if self._writer is not None:
            with contextlib.suppress(wire.ChannelClosed):
                wire.send(self._writer, wire.Cancel(id=key))


class _Refused(Exception):
    """The engine process cannot serve this HTTP worker (another version of the channel)."""


class EngineClient:
    """Every engine process of the server, for one HTTP worker."""

    def __init__(self, paths: list[str], settings: Settings) -> None:
        if not paths:
            raise ValueError("an engine client needs at least one engine process")
        self.arena = Arena(settings.slab_bytes)
        self.links = [EngineLink(path, self.arena, settings.engine_silence_s) for path in paths]
        self.inline_bytes = settings.inline_codec_bytes
        self._all_were_ready = False
        """Every engine process has been ready at once (start-up is over): from then on one ready engine serves."""
        self._forgetting: set[asyncio.Task[None]] = set()
        for link in self.links:
            link.on_restart = self._forget_regions
            link.on_status = self._note_readiness

    def _forget_regions(self) -> None:
        """An engine process restarted without the regions clients had registered: unregister them from the
        others too, so that every engine holds the same ones (none) and the clients register again."""
        if len(self.links) > 1:
            task = asyncio.create_task(self._unregister_everywhere())
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)

    async def start(self) -> None:
        """Connect to every engine and wait for each one's welcome (not for its kernels: see `state`)."""
        for link in self.links:
            link.start()
        try:
            async with asyncio.timeout(WELCOME_TIMEOUT_S):
                await asyncio.gather(*(link.welcomed.wait() for link in self.links))
        except TimeoutError:
            await self.stop()
            silent = [link.path for link in self.links if not link.welcomed.is_set()]
            raise RuntimeError(f"no engine process answered on {silent} in {WELCOME_TIMEOUT_S:g} s") from None
        refusals = [f"{link.path}: {link.refused}" for link in self.links if link.refused]
        if refusals:
            await self.stop()
            raise RuntimeError(f"engine processes this HTTP worker cannot use: {'; '.join(refusals)}")

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links))

    def _first_welcome(self) -> wire.Welcome:
        return next(link.welcome for link in self.links if link.welcome is not None)

    # -------------------------------------------------------------------------------------- what it is

    @property
    def backend_name(self) -> Literal["cpu", "gpu"]:
        return self._first_welcome().backend

    @property
    def state(self) -> EngineState:
        return next((link.state for link in self.links if link.state is not EngineState.READY), EngineState.READY)

    @property
    def failure(self) -> str | None:
        return next((link.failure for link in self.links if link.failure), None)

    def _note_readiness(self) -> None:
        """Start-up is over once every engine process has said it is ready at once."""
        self._all_were_ready = self._all_were_ready or all(link.state is EngineState.READY for link in self.links)

    def check_ready(self) -> None:
        """NotReady at start-up until every engine process is ready; after that, only while none is: with several,
        the ready ones serve while another starts again (its products go to them; `describe` says which is down)."""
        self._note_readiness()
        if self._all_were_ready and any(link.state is EngineState.READY for link in self.links):
            return
        for link in self.links:
            state = link.state
            if state is EngineState.STARTING:
                raise NotReady("the kernels are still being compiled and warmed; retry shortly")
            if state is not EngineState.READY:
                raise NotReady(f"the engine is {state.value}: {link.failure or 'shut down'}")

    def check_room(self) -> None:
        ready = [link for link in self.links if link.state is EngineState.READY]
        if ready and all(link.load >= self.queue_size for link in ready):
            raise Overloaded(f"every engine's queue is full ({self.queue_size} waiting); retry later")

    @property
    def queue_size(self) -> int:
        return self._first_welcome().queue_size

    @property
    def queue_depth(self) -> int:
        return sum(link.status.queue_depth for link in self.links if link.status is not None)

    def kernels(self) -> list[KernelInfo]:
        return next(link.kernels for link in self.links if link.welcome is not None)

    def auto_choices(self) -> list[AutoChoice]:
        status = next((link.status for link in self.links if link.status is not None), None)
        classes = {shape_class.name: shape_class for shape_class in SHAPE_CLASSES}
        return [
            AutoChoice(
                shape_class=classes[pick.shape_class],
                kernel=pick.kernel,
                probe_ms=pick.probe_ms,
                precision=Precision(pick.precision),
                dtype=pick.dtype,
            )
            for pick in (status.auto if status else [])
        ]

    def describe(self) -> list[dict[str, Any]]:
        described = []
        for link in self.links:
            status, welcome = link.status, link.welcome
            described.append(
                {
                    "index": welcome.device_index if welcome else None,
                    **(status.describe if status else {"name": welcome.device_name if welcome else None}),
                    "state": link.state.value,
                    "queue_depth": status.queue_depth if status else 0,
                    "engine_pid": welcome.engine_pid if welcome else None,
                    "engine_http_workers": status.http_workers if status else 0,
                    "engine_shared_memory_bytes": status.shared_memory_bytes if status else 0,
                }
            )
        return described

    def memory_held(self) -> int:
        return sum(link.status.memory_held for link in self.links if link.status is not None)

    def compiled_instances(self) -> int:
        return sum(link.status.compiled_instances for link in self.links if link.status is not None)

    def slab_use(self) -> SlabUse:
        return SlabUse(self.arena.capacity, self.arena.used_bytes, self.arena.waiting)

    def lend(self, nbytes: int, data_at: int = 0) -> LentMemory | None:
        """Arena memory for a body, if the arena lends it now (`Arena.lend`), placed so that byte `data_at` of the
        body falls on an ALIGNMENT boundary."""
        pad = -data_at % ALIGNMENT
        slab = self.arena.lend(pad + nbytes)
        return None if slab is None else LentMemory(slab.memory(pad, nbytes), slab.release)

    # ---------------------------------------------------------------------------------------- products

    async def matmul(
        self, a: Matrix, b: Matrix, request: ProductRequest, timeout_s: float | None, into: SharedOutput | None = None
    ) -> Outcome:
        """a @ b as `request` asks, on the least-loaded ready engine; waits for shared memory within `timeout_s`,
        which then bounds the product's wait in the engine's queue too. Operands in a client's regions
        (`SharedTensor`) and a product asked `into` one are not staged: the engine process reads and writes them
        there."""
        began = perf_counter()
        dtype, precision = np.dtype(request.dtype), request.precision
        named = frozenset(where.region for where in (a, b, into) if isinstance(where, SharedTensor | SharedOutput))
        self._least_loaded(named)  # NotReady now rather than after a wait for shared memory
        result = request.shape.result
        result_bytes = math.prod(result) * dtype.itemsize
        if into is not None and into.byte_size < result_bytes:
            raise SharedMemoryError(
                f"output 'C' is {'x'.join(map(str, result))} {dtype} ({result_bytes} bytes), more than the "
                f"{into.byte_size} bytes its shared_memory_byte_size gives",
                location=["outputs", 0],
            )
        budget_s = DEFAULT_WAIT_S if timeout_s is None else timeout_s
        operands_in = operand_dtype(dtype)
        in_arena = {
            name: offset
            for name, operand in (("a", a), ("b", b))
            if isinstance(operand, np.ndarray) and (offset := self._offset_as_is(operand, operands_in)) is not None
        }
        staged_bytes = [
            math.prod(operand.shape) * operands_in.itemsize
            for name, operand in (("a", a), ("b", b))
            if isinstance(operand, np.ndarray) and name not in in_arena
        ]
        if into is None:
            staged_bytes.append(result_bytes)
        nbytes = sum(aligned(size) for size in staged_bytes)
        held = sum(self.arena.bytes_in(operand) for operand in (a, b) if isinstance(operand, np.ndarray))
        slab = await self.arena.reserve(nbytes, budget_s, holding=held)
        try:
            a_at = await self._place(a, slab, operands_in, "a", precision, in_arena.get("a"))
            b_at = await self._place(b, slab, operands_in, "b", precision, in_arena.get("b"))
            c_at = None
            if into is None:
                c_at = slab.place(result, dtype)
                c_place: wire.Place = wire.InArena(c_at.offset, c_at.shape)
            else:
                c_place = _in_region(into, result, dtype)
            staged = perf_counter()
            left_s = max(budget_s - (staged - began), 1e-3)
            link = self._least_loaded(named)  # chosen when sent: one may have gone, or come back, meanwhile
            key, reply = link.send(wire.Matmul(a_at, b_at, c_place, request, timeout_s=left_s))
        except BaseException:
            slab.release()
            raise
        read_in_place = tuple(
            operand for name, operand in (("a", a), ("b", b)) if name in in_arena and isinstance(operand, np.ndarray)
        )
        try:
            return await self._answer(link, key, reply, slab, c_at, began, staged, precision, read_in_place)
        finally:
            del reply  # as in _answer: the reply holds a failure, whose traceback holds this frame

    def _offset_as_is(self, operand: np.ndarray, dtype: np.dtype) -> int | None:
        """Where the engine can read `operand` as it is: its offset in the arena (in a lent body), when it lies
        there in the dtype operands are multiplied in, C-ordered and aligned; else None (it is converted into the
        slab)."""
        if operand.dtype != dtype or not (operand.flags.c_contiguous and operand.flags.aligned):
            return None
        return self.arena.offset_of(operand)

    async def _place(
        self,
        operand: Matrix,
        slab: Slab,
        dtype: np.dtype,
        name: str,
        precision: Precision,
        offset: int | None,
    ) -> wire.Place:
        """Where the engine finds an operand: at `offset` in the arena where it already lies as the engine reads it,
        else converted into the slab (either way checked to be in range for `precision`); or in the client's region
        where it is (the engine checks it there)."""
        if isinstance(operand, SharedTensor):
            return _in_region(operand, operand.shape, operand.dtype)
        if offset is not None:
            # on the loop where it reads little or nothing: a thread's round trip cost a 4096^2 v2 product about
            # 2 ms on a busy H100 host
            if operand.nbytes <= self.inline_bytes or not reads_elements(precision):
                check_in_format(operand, name, precision)
            else:
                await in_thread(check_in_format, operand, name, precision)
            return wire.InArena(offset, operand.shape)
        at = slab.place(operand.shape, dtype)
        await self._stage(operand, slab.array(at), name, precision)
        return wire.InArena(at.offset, at.shape)

    # ------------------------------------------------------------------- clients' shared memory regions

    async def register_region(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register a system shared-memory region with every engine process (each maps and pins it)."""
        await self._register(self.links, wire.RegisterRegion(name, key, offset, byte_size))

    async def register_cuda_region(self, name: str, raw_handle: str, device_id: int, byte_size: int) -> None:
        """Register a CUDA shared-memory region (its IPC handle in base64) with the engine process of its device,
        which opens it; products that name it run there."""
        request = wire.RegisterCudaRegion(name, raw_handle, device_id, byte_size)
        owners = [link for link in self.links if link.welcome is not None and link.welcome.device_index == device_id]
        await self._check_no_cuda_region_named(name, [link for link in self.links if link not in owners])
        if not owners and self.backend_name == "gpu":
            raise SharedMemoryError(
                f"no engine process of this server serves device {device_id}", location=["device_id"]
            )
        await self._register(owners or self.links[:1], request)  # on the CPU backend, its engine says why not

    async def _check_no_cuda_region_named(self, name: str, others: list[EngineLink]) -> None:
        """SharedMemoryError when another device's engine holds a CUDA region of this name: names are one namespace
        across the server (a product names its region, and the engine holding that name computes it); each engine
        checks its own when it registers. An engine that cannot answer now holds none (a new one starts empty)."""
        request = wire.RegionStatus("cuda", None)
        replies = await asyncio.gather(*(link.ask(request) for link in others), return_exceptions=True)
        for reply in replies:
            if not isinstance(reply, BaseException) and any(region["name"] == name for region in reply.regions):
                raise SharedMemoryError(
                    f"a region named '{name}' is already registered (on another device)", location=["name"]
                )

    async def _register(self, links: list[EngineLink], request: wire.RegisterRegion | wire.RegisterCudaRegion) -> None:
        """Register a region with `links`' engines; when one refuses, those that took it forget it again."""
        replies = await asyncio.gather(*(link.ask(request) for link in links), return_exceptions=True)
        failure = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if failure is None:
            return
        undo = wire.UnregisterRegion("cuda" if isinstance(request, wire.RegisterCudaRegion) else "system", request.name)
        took = [link for link, reply in zip(links, replies, strict=True) if not isinstance(reply, BaseException)]
        await asyncio.gather(*(link.ask(undo) for link in took), return_exceptions=True)
        raise failure

    async def unregister_region(self, name: str | None, kind: wire.RegionKind = "system") -> None:
        """Unregister one region of a kind ("system" or "cuda"; every one of it when `name` is None) from every
        engine process."""
        request = wire.UnregisterRegion(kind, name)
        replies = await asyncio.gather(*(link.ask(request) for link in self.links), return_exceptions=True)
        failure = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if failure is not None:
            raise failure

    async def _unregister_everywhere(self) -> None:
        for kind in ("system", "cuda"):
            request = wire.UnregisterRegion(kind, None)
            replies = await asyncio.gather(*(link.ask(request) for link in self.links), return_exceptions=True)
            for link, reply in zip(self.links, replies, strict=True):
                if isinstance(reply, Exception) and not isinstance(reply, SharedMemoryError):
                    log.warning("the engine process on %s may still hold clients' regions: %s", link.path, reply)

    async def region_status(self, name: str | None, kind: wire.RegionKind = "system") -> list[dict[str, str | int]]:
        """The registered regions of a kind (the one named): system ones as the first engine process holds them
        (every one holds the same), CUDA ones from the engine processes of their devices."""
        if kind == "system":
            return (await self.links[0].ask(wire.RegionStatus(kind, name))).regions
        request = wire.RegionStatus(kind, None)
        found = [region for link in self.links for region in (await link.ask(request)).regions]
        if name is None:
            return found
        named = [region for region in found if region["name"] == name]
        if not named:
            raise SharedMemoryError(f"no shared-memory region of this kind is named '{name}'", location=[name])
        return named

    def _least_loaded(self, regions: frozenset[str] = frozenset()) -> EngineLink:
        """The ready engine with the least work; among those that hold every region named, when one does (a CUDA
        region is held by the engine of its device only)."""
        ready = [link for link in self.links if link.state is EngineState.READY]
        if not ready:
            self.check_ready()
            raise NotReady("no engine is ready")
        holding = [link for link in ready if link.status is not None and regions <= set(link.status.regions)]
        return min(holding or ready, key=lambda link: link.load)

    async def _stage(self, operand: np.ndarray, target: np.ndarray, name: str, precision: Precision) -> None:
        """Convert the operand into its place in the slab: on the event loop when small, else in a thread, which a
        cancellation waits for (the operand is a view of a request body that is given back once this returns)."""
        if target.nbytes <= self.inline_bytes:
            cast_into(target, operand, name, precision=precision)
            return
        await in_thread(cast_into, target, operand, name, precision=precision)

    async def _answer(
        self,
        link: EngineLink,
        key: int,
        reply: asyncio.Future[wire.Reply],
        slab: Slab,
        c_at: Placement | None,
        began: float,
        staged: float,
        precision: Precision,
        read_in_place: tuple[np.ndarray, ...],
    ) -> Outcome:
        try:
            await link.wait_for(reply)
            message = reply.result()
        except (asyncio.CancelledError, EngineUnresponsive):
            # The engine may still be writing C, and reading operands that lie in a lent body: the slab is freed,
            # and those operands let go of, by the reply to the cancel (or the engine's end), not now.
            link.cancel(key)
            reply.add_done_callback(partial(_release_after_reply, slab, read_in_place))
            raise
        except BaseException:
            slab.release()
            # the error's traceback holds this frame: without the reply that holds the error, no cycle keeps the
            # operands read in place (a lent body) until a garbage collection
            del reply
            raise
        if not isinstance(message, wire.Computed):
            slab.release()
            if isinstance(message, wire.Failed):
                raise error_of(message.code, message.message, message.location)
            raise TypeError(f"a {type(message).__name__} answered a product")
        return self._outcome(link, message, slab, c_at, began, staged, precision)

    def _outcome(
        self,
        link: EngineLink,
        message: wire.Computed,
        slab: Slab,
        c_at: Placement | None,
        began: float,
        staged: float,
        precision: Precision,
    ) -> Outcome:
        device = DeviceTiming(h2d_ms=message.h2d_ms, kernel_ms=message.kernel_ms, d2h_ms=message.d2h_ms)
        engine_ms = message.queue_ms + device.h2d_ms + device.kernel_ms + device.d2h_ms
        return Outcome(
            c=None if c_at is None else slab.array(c_at),
            plan=Plan(kernel=message.kernel, tile=message.tile, precision=precision),
            queue_ms=message.queue_ms,
            device=device,
            device_name=link.welcome.device_name if link.welcome else "",
            peaks=link.peaks,
            global_elements=message.global_elements,
            batch_size=message.batch_size,
            stage_ms=(staged - began) * 1e3,
            handoff_ms=max((perf_counter() - staged) * 1e3 - engine_ms, 0.0),
            release=slab.release,
        )


def _in_region(where: SharedTensor | SharedOutput, shape: tuple[int, ...], dtype: np.dtype) -> wire.InRegion:
    return wire.InRegion(where.region, where.offset, shape, dtype.name)


def _release_after_reply(slab: Slab, read_in_place: tuple[np.ndarray, ...], reply: asyncio.Future[wire.Reply]) -> None:
    """The reply to a cancelled product came: the engine no longer writes its C (its outcome is not wanted) nor reads
    `read_in_place`, operands in a lent body, which were held until now (their views keep its bytes from going back)."""
    if not reply.cancelled():
        reply.exception()
    slab.release()
