"""uvicorn's httptools connection with the bounds its parser lacks: the size of a request's head, the time it may take
to arrive, and how long the connection may idle between requests.

httptools buffers a header of any size (a 48 MiB header was answered 200, the event loop busy for seconds
buffering it), and uvicorn times out a connection only while it idles between requests: one that sends half its
headers, or nothing, was held open forever. `GuardedHttpProtocol` counts the bytes of the request line and
headers as they arrive and answers 431 once they pass `MATMUL_MAX_HEADER_BYTES`, before any body is read; and it
closes a connection whose request has not delivered all its headers `MATMUL_HEADER_TIMEOUT_S` after the
connection was made, or after that request began on a kept-alive connection (408 when part of a request came).

Between requests a connection idles for up to `MATMUL_KEEP_ALIVE_TIMEOUT_S` (uvicorn's own default is 5 s): longer
than the pools in front of the service keep it, so that a proxy or a client never sends a request into a connection
the server is closing (app.config.DEFAULT_KEEP_ALIVE_TIMEOUT_S). On shutdown uvicorn closes the idle ones at once.

It also hands a body to the app in pieces of up to BODY_PIECE_BYTES instead of uvicorn's 64 KiB: each piece is a
round trip through the event loop and the middleware, and a 128 MiB body read in 64 KiB pieces made 2,000 of them.

uvicorn takes it by import string, `uvicorn app.main:create_app --factory --http
app.api.connection:GuardedHttpProtocol`, which every start-up of this service uses (`make run`, `matmul-service`,
the container, the scripts and tests). Its limits are the app's settings, handed over in the lifespan state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from app.api.errors import error_body_for, status_of
from app.config import Settings
from app.errors import HeadersTooLarge, HeaderTimeout, MatmulError

CONNECTION_LIMITS = "matmul.connection_limits"
"""The key of the lifespan state under which the app hands its ConnectionLimits to the connections."""


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout_s: float
    keep_alive_timeout_s: int

    @classmethod
    def of(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            header_timeout_s=settings.header_timeout_s,
            keep_alive_timeout_s=settings.keep_alive_timeout_s,
        )


BODY_PIECE_BYTES = 1 << 20
"""Reading pauses once this much of a body waits for the app, which then receives it as one piece."""

DEFAULT_LIMITS = ConnectionLimits(
    max_header_bytes=Settings.model_fields["max_header_bytes"].default,
    header_timeout_s=Settings.model_fields["header_timeout_s"].default,
    keep_alive_timeout_s=Settings.model_fields["keep_alive_timeout_s"].default,
)
"""Where no lifespan handed limits over (uvicorn --lifespan off): the settings' defaults."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a bounded request head (431), a header timeout and the service's keep-alive."""

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
        self.in_head = True
        """Between the end of one request's body and the end of the next one's headers: bytes are the head's."""
        self.head_bytes = 0
        self.head_begun = False
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False
        """Answered 431 or 408: what the client still sends is read and dropped until it closes."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.in_head:
            super().data_received(data)
            return
        if self.refused:
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
        """Answer `error` in the format of the path asked (as far as it arrived) and end the connection: the answer,
        then the end of the stream, and what the client still sends is read and dropped until it closes (at most
        for the header timeout). Closing at once with unread bytes would reset the connection, and a reset can
        discard the answer before the client reads it."""
        body = error_body_for(self.url.decode("latin-1") if self.head_begun else "", error)
        head = [STATUS_LINE[status_of(error)]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.refused = True
        self.cancel_head_timer()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.transport.close)
