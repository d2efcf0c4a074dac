"""uvicorn's httptools connection with the bounds its parser lacks: the size of a request's head, the time it may take
to arrive, and how long the connection may idle between requests.

httptools buffers a header of any size (a 48 MiB header was answered 200, the event loop busy for seconds
buffering it), and uvicorn times out a connection only while it idles between requests: one that sends half its
headers, or nothing, was held open forever. `GuardedHttpProtocol` counts the bytes of the request line and
headers as they arrive and answers 431 once they pass `MATMUL_MAX_HEADER_BYTES`, before any body is read; and it
closes a connection whose request has not delivered all its headers `MATMUL_HEADER_TIMEOUT_S` after the
connection was made, or after that request began on a kept-alive connection (408 when part of a request came).

An answer given before the request has all arrived (those 431 and 408; from the app a 413 for a declared length over
the limit, a 503 while overloaded or not ready) on a connection that ends after it (`Connection: close`, HTTP/1.0)
ends it by `HttpConnection.linger`. uvicorn closed it at once, the body unread in the socket: the kernel answers unread
bytes with a reset, which destroys the answer before the client reads it. On a kept-alive connection uvicorn reads the
rest of the body through its parser, drops it, and serves the next request.

Between requests a connection idles for up to `MATMUL_KEEP_ALIVE_TIMEOUT_S` (uvicorn's own default is 5 s): longer
than the pools in front of the service keep it, so that a proxy or a client never sends a request into a connection
the server is closing (app.config.DEFAULT_KEEP_ALIVE_TIMEOUT_S). On shutdown uvicorn closes the idle ones at once.

It also hands a body to the app in pieces of up to BODY_PIECE_BYTES instead of uvicorn's 64 KiB: each piece is a
round trip through the event loop and the middleware, and a 128 MiB body read in 64 KiB pieces made 2,000 of them.
And it lets a route read a body it knows the length of straight into memory of its own (`DirectBody`, in the
request's scope["state"]): the socket receives into that memory, where uvicorn's path copied every byte four
times more in Python (a bytes object per read, one per parsed piece, the piece joined into a bytearray and copied out
of it for the app). On an H100 host a 128 MiB v2 request spent 270-300 of its 292-333 ms reading its body that way,
and a body costs a server more per byte coming in than an answer going out.

A connection from a loopback address (127.0.0.0/8, ::1: a benchmark or a proxy on the same host and in the same
network namespace) gets socket buffers of `MATMUL_LOOPBACK_SOCKET_BUFFER_BYTES` instead of the kernel's autotuned
ones, which grow to tens of MiB, so that no event-loop turn drains more than that from one socket while the answers of
the worker's other connections wait (app.config.DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES). Every other peer keeps the
kernel's windows, which must cover the network's delay; so do the containerised set-ups, whose peers come from a
bridge's addresses (compose's balancer, an ingress in another pod, a port Docker publishes).

uvicorn takes it by import string, `uvicorn app.main:create_app --factory --http
app.api.connection:GuardedHttpProtocol`, which every start-up of this service uses (`make run`, `matmul-service`,
the container, the scripts and tests). Its limits are the app's settings, handed over in the lifespan state.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from app.api.errors import error_body_for, status_of
from app.config import Settings
from app.errors import BodyTimeout, HeadersTooLarge, HeaderTimeout, MatmulError

CONNECTION_LIMITS = "matmul.connection_limits"
"""The key of the lifespan state under which the app hands its ConnectionLimits to the connections."""


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout_s: float
    keep_alive_timeout_s: int
    loopback_socket_buffer_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            header_timeout_s=settings.header_timeout_s,
            keep_alive_timeout_s=settings.keep_alive_timeout_s,
            loopback_socket_buffer_bytes=settings.loopback_socket_buffer_bytes,
        )


BODY_PIECE_BYTES = 1 << 20
"""Reading pauses once this much of a body waits for the app, which then receives it as one piece."""
READ_BYTES = 256 << 10
"""The most a connection receives at once outside a direct body (uvloop's own read size)."""
LINGER_BYTES = 64 << 20
"""The most a connection reads and drops after an answer given before the request was all in (`linger`): a client
still sending past this keeps the worker reading for a request already answered (four reads a MiB)."""
DIRECT_BODY = "matmul.direct_body"
"""The key of a request's DirectBody in its scope["state"], where its body's length is declared."""

DEFAULT_LIMITS = ConnectionLimits(
    max_header_bytes=Settings.model_fields["max_header_bytes"].default,
    header_timeout_s=Settings.model_fields["header_timeout_s"].default,
    keep_alive_timeout_s=Settings.model_fields["keep_alive_timeout_s"].default,
    loopback_socket_buffer_bytes=Settings.model_fields["loopback_socket_buffer_bytes"].default,
)
"""Where no lifespan handed limits over (uvicorn --lifespan off): the settings' defaults."""


def is_loopback_peer(address: str) -> bool:
    """Whether a TCP peer's address (as getpeername gives it) is this host's loopback, IPv4-mapped IPv6 included."""
    try:
        peer = ipaddress.ip_address(address)
    except ValueError:  # not an IP address at all: no loopback peer
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        return peer.ipv4_mapped.is_loopback
    return peer.is_loopback


class TransportSocket(Protocol):
    """What a transport's "socket" extra is on either event loop (asyncio's TransportSocket, uvloop's PseudoSocket):
    the part of a socket this module uses."""

    @property
    def family(self) -> int: ...

    def getpeername(self) -> Any: ...

    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def size_loopback_buffers(sock: TransportSocket | None, nbytes: int) -> bool:
    """Ask `nbytes` of send and receive buffer for `sock` when it is a TCP connection from a loopback address; whether
    it did. 0, another peer, a peer already gone, a socket of another kind, or a kernel that refuses the size: left to
    the kernel (Linux takes any size, capping it at net.core.wmem_max and rmem_max)."""
    if nbytes == 0 or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        if not is_loopback_peer(sock.getpeername()[0]):
            return False
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, nbytes)
    except OSError:  # the peer left (getpeername), or the size was refused (ENOBUFS past a BSD's maximum)
        return False
    return True


_read_buffers = threading.local()


def _read_buffer() -> memoryview:
    """The buffer every connection served by this thread's event loop receives into outside direct bodies: a read's
    bytes are parsed (copied) before the loop reads again."""
    buffer: memoryview | None = getattr(_read_buffers, "buffer", None)
    if buffer is None:
        buffer = _read_buffers.buffer = memoryview(bytearray(READ_BYTES))
    return buffer


class DirectBody:
    """The body of one request, `length` bytes by its Content-Length, received straight into memory the route gives
    (`read_into`): the connection hands the socket that memory to receive into, bypassing its parser until the body
    is in, then parses the next request with a parser made anew. What arrived before the route asked (at most
    BODY_PIECE_BYTES and a read) is copied in first."""

    def __init__(self, protocol: HttpConnection, cycle: RequestResponseCycle, length: int) -> None:
        self.protocol = protocol
        self.cycle = cycle
        self.length = length
        self.received = 0
        """Bytes of the body in the route's memory so far."""
        self.last_arrival = 0.0
        """When bytes last arrived, by the event loop's clock (or when the route began to wait for them)."""
        self.target: memoryview | None = None

    async def read_into(self, target: memoryview, idle_timeout_s: float) -> None:
        """The body into `target`, whose length must be the body's. ClientDisconnect when the client leaves first;
        BodyTimeout when nothing arrives for `idle_timeout_s`. A body not read whole ends its connection once
        answered: the parser never saw the part received here, and would take what is left for the next request."""
        if len(target) != self.length or self.target is not None or self.received:
            raise ValueError(f"a body of {self.length} bytes is read once, into as many bytes, not {len(target)}")
        cycle = self.cycle
        if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
            cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        arrived = len(cycle.body)
        target[:arrived] = cycle.body
        cycle.body = bytearray()
        self.received = arrived
        loop = self.protocol.loop
        self.last_arrival = loop.time()
        if cycle.more_body and not cycle.disconnected:
            self.target = target
            self.protocol.direct = self
            cycle.flow.resume_reading()
        try:
            while cycle.more_body:
                if cycle.disconnected:
                    raise ClientDisconnect()
                cycle.message_event.clear()
                quiet_s = loop.time() - self.last_arrival
                if quiet_s >= idle_timeout_s:
                    raise BodyTimeout.after(idle_timeout_s, self.received)
                # woken when the body is whole or the client leaves, or to look again once the quiet could be over
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cycle.message_event.wait(), idle_timeout_s - quiet_s)
        except BaseException:
            cycle.keep_alive = False
            raise
        finally:
            self.target = None
            if self.protocol.direct is self:
                self.protocol.direct = None

    def buffer(self) -> memoryview:
        """Where the socket receives next: the rest of the body."""
        assert self.target is not None
        return self.target[self.received :]

    def arrived(self, nbytes: int) -> bool:
        """`nbytes` more came; whether the body is whole. The route waiting in `read_into` is not woken for a piece:
        a wake-up and a new timeout for each of a large body's hundreds of reads cost the worker more than the
        reads, so it is woken once the body is whole (`on_message_complete`), and checks the quiet on its timer."""
        self.received += nbytes
        self.last_arrival = self.protocol.loop.time()
        return self.received == self.length


class AnswerTransport(asyncio.Transport):
    """The transport a request's RequestResponseCycle answers through: its connection's, whose end it leaves to the
    connection (`HttpConnection.end_after_answer`). A cycle writes, asks whether the transport is closing, and closes
    it once an answer that does not keep the connection alive is sent, or on a failure."""

    def __init__(self, connection: HttpConnection) -> None:
        super().__init__()
        self.connection = connection

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.connection.transport.write(data)

    def is_closing(self) -> bool:
        return self.connection.transport.is_closing()

    def close(self) -> None:
        self.connection.end_after_answer()


class GuardedHttpProtocol(asyncio.BufferedProtocol):
    """What uvicorn serves each connection with (`--http app.api.connection:GuardedHttpProtocol`): an HttpConnection,
    driven by the event loop as a BufferedProtocol, which receives into memory the protocol gives. uvloop does so
    only for a protocol that is not an asyncio.Protocol, which uvicorn's are: hence this wrapper."""

    def __init__(self, *uvicorns: Any, **named: Any) -> None:
        """uvicorn's arguments for its protocols (config, server_state, app_state), handed on."""
        self.http = HttpConnection(*uvicorns, **named)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def eof_received(self) -> None:
        self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.http.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.http.buffer_updated(nbytes)


class HttpConnection(HttpToolsProtocol):
    """HttpToolsProtocol with a bounded request head (431), a header timeout, the service's keep-alive, and bodies
    received straight into a route's memory (DirectBody). It receives into memory it gives the event loop
    (`get_buffer`): one buffer per event-loop thread for heads and bodies the app reads in pieces, a route's memory
    for a direct body."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits: ConnectionLimits = app_state.get(CONNECTION_LIMITS, DEFAULT_LIMITS)
        self.max_header_bytes = limits.max_header_bytes
        self.header_timeout_s = limits.header_timeout_s
        self.timeout_keep_alive = limits.keep_alive_timeout_s  # uvicorn's, armed after each answer
        self.loopback_socket_buffer_bytes = limits.loopback_socket_buffer_bytes
        self.in_head = True
        """Between the end of one request's body and the end of the next one's headers: bytes are the head's."""
        self.head_bytes = 0
        self.head_begun = False
        self.head_timer: asyncio.TimerHandle | None = None
        self.lingering = False
        """Answered and ended its side of the stream (`linger`): what the client still sends is read and dropped."""
        self.dropped_bytes = 0
        self.answer_transport = AnswerTransport(self)
        self.direct: DirectBody | None = None
        """The body being received straight into a route's memory, if one is."""
        self.read_buffer = _read_buffer()

    def new_parser(self) -> httptools.HttpRequestParser:
        """A parser for the next request, set up as uvicorn sets up its own."""
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
        return parser

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.direct.buffer() if self.direct is not None else self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.direct is None:
            self.data_received(bytes(self.read_buffer[:nbytes]))
        elif self.direct.arrived(nbytes):
            # the whole body is in, unseen by the parser, which still waits for it: the next request gets a new one
            self.direct = None
            self.parser = self.new_parser()
            self.on_message_complete()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        size_loopback_buffers(transport.get_extra_info("socket"), self.loopback_socket_buffer_bytes)
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.dropped_bytes += len(data)
            if self.dropped_bytes > LINGER_BYTES:
                self.transport.close()
            return
        if not self.in_head:
            super().data_received(data)
            return
        room = self.max_header_bytes - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            super().data_received(data)
            return
        # The limit falls inside this piece: the headers may still end before it.
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self.in_head:
            self.refuse(
                HeadersTooLarge(
                    f"the request line and headers passed the limit of {self.max_header_bytes} bytes "
                    "(MATMUL_MAX_HEADER_BYTES)"
                )
            )
            return
        super().data_received(data[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_begun = True
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.header_timeout_s, self.on_header_timeout)

    def on_headers_complete(self) -> None:
        self.in_head = self.head_begun = False
        self.cancel_head_timer()
        super().on_headers_complete()
        if self.cycle is None or self.cycle.scope is not self.scope:  # an upgrade: no request to answer here
            return
        self.cycle.transport = self.answer_transport
        length = self.declared_length()
        if length is not None:
            self.scope["state"][DIRECT_BODY] = DirectBody(self, self.cycle, length)
            if length > BODY_PIECE_BYTES:
                # The rest stays in the socket until the app asks for it (DirectBody.read_into, receive()): then it
                # lands straight in a route's memory, where read now it would be copied four times through the
                # parser first, up to BODY_PIECE_BYTES of it. An answer given without reading it resumes reading.
                self.flow.pause_reading()

    def declared_length(self) -> int | None:
        """The body's length by its one Content-Length, where it has one and no Transfer-Encoding (the parser has
        refused a Content-Length that is not a number, and any request that has both)."""
        lengths = [value for name, value in self.headers if name == b"content-length"]
        chunked = any(name == b"transfer-encoding" for name, _ in self.headers)
        return int(lengths[0]) if len(lengths) == 1 and not chunked else None

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What follows is the next request's head. The rest of the current piece is not counted: at most one read
        # more than the limit, when requests are pipelined.
        self.in_head, self.head_bytes = True, 0

    def on_body(self, body: bytes) -> None:
        # uvicorn's on_body, pausing at BODY_PIECE_BYTES instead of 64 KiB
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        self.cycle.body += body
        if len(self.cycle.body) > BODY_PIECE_BYTES:
            self.flow.pause_reading()
        self.cycle.message_event.set()

    def on_header_timeout(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request is incomplete: close once the answer is sent
        elif self.head_begun:
            self.refuse(HeaderTimeout(f"the request's headers did not all arrive within {self.header_timeout_s:g} s"))
        else:
            self.transport.close()

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def refuse(self, error: MatmulError) -> None:
        """Answer `error` in the format of the path asked (as far as it arrived) and end the connection by `linger`:
        the client may still be sending its head."""
        body = error_body_for(self.url.decode("latin-1") if self.head_begun else "", error)
        head = [STATUS_LINE[status_of(error)]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.linger()

    def end_after_answer(self) -> None:
        """End the connection when a request's cycle closes it (answered, not to be kept alive, or failed): at once
        where the request has all arrived, else by `linger`: its client may still be sending the body."""
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            self.linger()
        else:
            self.transport.close()

    def linger(self) -> None:
        """End the connection after an answer given while the client may still be sending: the end of the stream after
        the answer, then what the client still sends is read and dropped until it closes, for at most the header
        timeout and LINGER_BYTES. Closing at once with unread bytes would reset the connection, and a reset can
        discard the answer before the client reads it. Requests pipelined behind the answered one are dropped, as a
        close drops them."""
        self.lingering = True
        self.pipeline.clear()
        self.cancel_head_timer()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.transport.close)
