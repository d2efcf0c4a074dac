"""Which HTTP worker takes a new connection: the one that holds the fewest.

The HTTP workers share one listening socket, and without this each worker's event loop accepts whatever connections
are waiting when it wakes: on a 16-core H200 host eight connections opened together landed on three or four of the
eight workers (once six on one), and a closed-loop load of 512^2 products on them ran at 678 to 1,248 products/s by
that placement alone. A user with a few threads met a service of two or three workers.

So with several workers `matmul-service` runs each one's event loop from `new_event_loop` (uvicorn's `--loop`
import string). That loop serves the shared socket with an `Acceptor` instead of its own server: when a connection
waits, a worker that holds more connections than another accepting worker leaves it to the ones that hold fewer for
MATMUL_ACCEPT_HANDOFF_MS, and takes it itself only if none of those accepted a connection by then (they may all be
busy). Where one did, the connection that waits at the hand-off's end may have come during it, and it is left to them
in turn: taking it would give it to a worker that holds more while one that holds fewer, asleep in a hand-off of its
own or slow to wake, would take it in a moment. What the workers that hold more accept meanwhile does not count:
were it to, the first of two waiting workers to take a connection would hold the other back at every hand-off after,
and take a burst of connections nearly alone.

The counts are a `ConnectionTable`, a small file every worker maps (MATMUL_CONNECTION_TABLE, made by `matmul-service`
before the workers start), one slot of (pid, open connections, connections accepted) per accepting worker: a worker
claims one when it starts accepting (after its start-up) and frees it when it stops (before it drains), so that no
worker waits on one that cannot take a connection. A worker counts a connection from its accept to its protocol's
`connection_lost`. A worker that dies leaves its slot, which no one reads once its pid is gone, and the worker that
replaces it claims a free one.

Without the variable (one worker, or uvicorn started by hand) the loop is uvloop's own, unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import signal
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

import uvloop

from app.config import Settings

TABLE_VARIABLE = "MATMUL_CONNECTION_TABLE"
"""The path of the connection table the HTTP workers share, set by `matmul-service`."""
ACCEPT_RETRY_S = 1.0
"""How long a worker stops accepting after the system refused it a socket (out of descriptors): asyncio's own."""
OUT_OF_SOCKETS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""What `accept` fails with when the system has no socket to give: the connection waits in the backlog meanwhile."""
_SLOT_WORDS = 3
"""A slot's 64-bit words: the worker's pid (0 where free), the connections it holds, and those it has accepted."""

log = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, though not ours
        return True
    return True


class ConnectionTable:
    """The HTTP workers' open connections, one slot each, in a file all of them map. Each worker writes its own slot
    only (from its event loop's thread); a slot is claimed under the file's lock."""

    def __init__(self, path: str, pid: int | None = None) -> None:
        """This process's slot in the table at `path`: a free one, or one whose worker is gone."""
        self.path = path
        self.pid = os.getpid() if pid is None else pid
        self.released = False
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
            self._words = memoryview(self._map).cast("q")
            fcntl.flock(file, fcntl.LOCK_EX)
            try:
                free = (slot for slot in range(self.slots) if not self._pid(slot) or not _alive(self._pid(slot)))
                claimed = next(free, None)
                if claimed is None:
                    raise RuntimeError(f"the connection table {path} has no free slot of {self.slots}")
                self.slot: int = claimed
                base = claimed * _SLOT_WORDS
                self._words[base + 1] = self._words[base + 2] = 0
                self._words[base] = self.pid
            finally:
                fcntl.flock(file, fcntl.LOCK_UN)

    @staticmethod
    def create(path: str, slots: int) -> str:
        """A new table of `slots` free slots at `path`; the path."""
        with open(path, "wb") as file:
            file.write(bytes(slots * _SLOT_WORDS * 8))
        return path

    @property
    def slots(self) -> int:
        return len(self._words) // _SLOT_WORDS

    def _pid(self, slot: int) -> int:
        return self._words[slot * _SLOT_WORDS]

    def held(self, slot: int | None = None) -> int:
        """The connections the worker of `slot` (this one's by default) holds."""
        return self._words[(self.slot if slot is None else slot) * _SLOT_WORDS + 1]

    def add(self, change: int) -> None:
        """This worker holds `change` more connections; nothing once its slot is released (the connections it
        drains end after it stopped accepting, and the slot may be another worker's by then)."""
        if not self.released:
            self._words[self.slot * _SLOT_WORDS + 1] += change

    def accepted_one(self) -> None:
        """This worker accepted a connection: it holds one more, and has accepted one more."""
        if not self.released:
            self.add(1)
            self._words[self.slot * _SLOT_WORDS + 2] += 1

    def accepted(self, slot: int | None = None) -> int:
        """The connections the worker of `slot` (this one's by default) accepted since it claimed the slot (0 once it
        is freed, and for the next worker to claim it)."""
        return self._words[(self.slot if slot is None else slot) * _SLOT_WORDS + 2]

    def fewer(self) -> dict[int, int]:
        """The other live workers that hold fewer connections than this one: each one's slot, and the connections it
        has accepted so far (empty where this worker holds the fewest)."""
        mine = self.held()
        return {
            slot: self.accepted(slot)
            for slot in range(self.slots)
            if slot != self.slot and (pid := self._pid(slot)) and self.held(slot) < mine and _alive(pid)
        }

    def release(self) -> None:
        """Free this worker's slot and unmap the table (it stops accepting); once only."""
        if self.released:
            return
        self.released = True
        base = self.slot * _SLOT_WORDS
        self._words[base + 1] = self._words[base + 2] = 0
        self._words[base] = 0
        self._words.release()
        self._map.close()


class _Counted(asyncio.BufferedProtocol):
    """A connection's own protocol, with its end counted off the table. uvloop looks up `get_buffer` and
    `buffer_updated` once a connection, so the connection's own are set on this object: no hop per read."""

    def __init__(self, inner: asyncio.BaseProtocol, ended: Callable[[], None]) -> None:
        if not isinstance(inner, asyncio.BufferedProtocol):
            raise TypeError(f"{type(inner).__name__} is not a BufferedProtocol, which the acceptor hands on")
        self.inner = inner
        self.ended: Callable[[], None] | None = ended
        self.get_buffer = inner.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = inner.buffer_updated  # type: ignore[method-assign]

    def end(self) -> None:
        """Count the connection off, once."""
        ended, self.ended = self.ended, None
        if ended is not None:
            ended()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.end()
        self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Acceptor(asyncio.AbstractServer):
    """Accepts connections on a shared listening socket for this worker, leaving each for `handoff_s` to workers that
    hold fewer (module docstring), and hands them to the event loop with uvicorn's protocol. Its slot in the table is
    claimed when it starts and freed when it is closed."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listener: socket.socket,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        table: ConnectionTable,
        handoff_s: float,
        tls: SSLContext | None = None,
        backlog: int = 100,
    ) -> None:
        self.loop = loop
        self.listener = listener
        self.protocol_factory = protocol_factory
        self.table = table
        self.handoff_s = handoff_s
        self.tls = tls
        self.adopting: set[asyncio.Task[None]] = set()
        self.fd = listener.fileno()
        listener.setblocking(False)
        listener.listen(backlog)  # uvicorn binds the socket, the server listens on it
        self.task: asyncio.Task[None] | None = loop.create_task(self.accept_forever())
        self.task.add_done_callback(self._stopped)

    @staticmethod
    def _stopped(task: asyncio.Task[None]) -> None:
        """A worker whose accepting failed is stopped, so that its supervisor starts another in its place (uvicorn
        does): it would otherwise serve the connections it holds and never take another."""
        if task.cancelled() or task.exception() is None:
            return
        log.critical("accepting connections failed; stopping this worker", exc_info=task.exception())
        os.kill(os.getpid(), signal.SIGTERM)

    async def _readable(self) -> None:
        """Wait until a connection waits. The reader is one-shot: a worker leaving a connection to the others must
        not be woken for it again and again."""
        waiting: asyncio.Future[None] = self.loop.create_future()

        def ready() -> None:
            if not waiting.done():
                waiting.set_result(None)

        self.loop.add_reader(self.fd, ready)
        try:
            await waiting
        finally:
            if self.task is not None:  # close() removed it while the descriptor was open; it may be another's now
                self.loop.remove_reader(self.fd)

    async def accept_forever(self) -> None:
        while True:
            await self._readable()
            if self.handoff_s and (fewer := self.table.fewer()):
                await asyncio.sleep(self.handoff_s)
                if any(self.table.accepted(slot) != accepted for slot, accepted in fewer.items()):
                    continue  # one that holds fewer took one meanwhile: what waits may have come since, theirs first
            try:
                connection, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue  # another worker took it, or the client gave up
            except OSError as exc:
                if exc.errno not in OUT_OF_SOCKETS:  # this connection's own failure (asyncio's loops skip it too)
                    log.warning("accepting a connection failed: %s", exc)
                    continue
                log.error("accepting a connection failed (%s); accepting again in %g s", exc, ACCEPT_RETRY_S)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            self.table.accepted_one()
            task = self.loop.create_task(self.adopt(connection))
            self.adopting.add(task)
            task.add_done_callback(self.adopting.discard)

    async def adopt(self, connection: socket.socket) -> None:
        """Serve `connection` with a new protocol, counted off the table when it ends (or fails to start)."""
        counted: _Counted | None = None

        def protocol() -> asyncio.BaseProtocol:
            nonlocal counted
            counted = _Counted(self.protocol_factory(), lambda: self.table.add(-1))
            return counted

        connection.setblocking(False)
        try:
            await self.loop.connect_accepted_socket(protocol, connection, ssl=self.tls)
        except BaseException as exc:
            if counted is None:  # no protocol, so no transport: the socket is still this acceptor's to close
                self.table.add(-1)
                connection.close()
            else:  # the transport owns the socket and closes it
                counted.end()
            if not isinstance(exc, Exception):
                raise
            log.warning("a connection could not be served: %r", exc)

    # asyncio.AbstractServer: what uvicorn calls of the servers it makes (close, on shutdown)
    def close(self) -> None:
        """Stop accepting: uvicorn calls this when the worker begins to stop, before it drains its connections."""
        if self.task is not None:
            self.loop.remove_reader(self.fd)  # now, while the descriptor is open: uvicorn closes it next
            self.task.cancel()
            self.task = None
            self.table.release()
        self.listener.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    def is_serving(self) -> bool:
        return self.task is not None

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def wait_closed(self) -> None:
        if self.adopting:
            await asyncio.gather(*self.adopting, return_exceptions=True)


class BalancedLoop(uvloop.Loop):
    """uvloop's loop, serving a listening socket it is given with an Acceptor that claims a slot of the connection
    table at `table_path` and leaves connections to workers that hold fewer for `handoff_s`."""

    def __init__(self, table_path: str, handoff_s: float) -> None:
        super().__init__()
        self.table_path = table_path
        self.handoff_s = handoff_s

    async def create_server(  # type: ignore[override]  # uvloop's signature, of which uvicorn uses these
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: Any = None,
        port: Any = None,
        *,
        sock: socket.socket | None = None,
        ssl: SSLContext | None = None,
        backlog: int = 100,
        **options: Any,
    ) -> asyncio.AbstractServer:
        if sock is None:
            return await super().create_server(protocol_factory, host, port, ssl=ssl, backlog=backlog, **options)
        table = ConnectionTable(self.table_path)
        return Acceptor(self, sock, protocol_factory, table, self.handoff_s, ssl, backlog)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """An HTTP worker's event loop (uvicorn's `--loop app.api.accepting:new_event_loop`): a BalancedLoop on the
    table MATMUL_CONNECTION_TABLE names, or uvloop's own where it names none."""
    path = os.environ.get(TABLE_VARIABLE)
    if not path:
        return uvloop.new_event_loop()
    return BalancedLoop(path, Settings().accept_handoff_ms / 1e3)
