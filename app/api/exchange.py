"""What a product route does with HTTP around the service: read the body under its limit, run a codec off the event
loop when its input is large, read the deadline a request asks for, and take the product back when the client
leaves.

The off-loop threshold is the API's: it protects the loop that serves every connection of this worker, the codecs
stay plain functions and the service never blocks (it only awaits the engine).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from app.api.connection import DIRECT_BODY, DirectBody
from app.api.limits import BodyLimit
from app.awaiting import settled
from app.codecs import Body
from app.codecs.operands import declared_size
from app.config import Settings
from app.engine import LentMemory
from app.errors import ClientGone, InvalidParameter, MalformedPayload

TIMEOUT_HEADER = "X-Request-Timeout"
T = TypeVar("T")


async def off_loop_if_large(size: int, settings: Settings, function: Callable[..., T], *args: Any) -> T:
    """Run `function` on the event loop for small inputs, in a worker thread for large ones."""
    if size <= settings.inline_codec_bytes:
        return function(*args)
    return await run_in_threadpool(function, *args)


POOLED_BODY_BYTES = 1 << 20
"""Bodies of at least this many bytes (by Content-Length) are read into BodyBuffers' memory."""
KEPT_BODY_BUFFERS = 4
"""Buffers a worker keeps for bodies to come, the most recently given back first."""
KEPT_BODY_BYTES = 512 << 20
"""The most bytes those buffers hold together: three 4096^2 float32 bodies (134 MB each), not four of 1 GiB."""


class BodyBuffers:
    """Memory for large request bodies, kept for the next body of the same size.

    Joining a 134 MB body's pieces into new memory page-faulted every page of it in: a third of an HTTP worker's
    time in the 4096^2 cell (H100, 8 workers, 16 connections, py-spy). Clients send the same shapes again and
    again, so a worker keeps the last KEPT_BODY_BUFFERS buffers it read into and reads the next body of one of
    their sizes into it: memory already mapped and touched. A buffer is lent for one request; whoever took it
    gives it back once nothing reads it any more."""

    def __init__(
        self, kept: int = KEPT_BODY_BUFFERS, min_bytes: int = POOLED_BODY_BYTES, kept_bytes: int = KEPT_BODY_BYTES
    ) -> None:
        self.kept = kept
        self.kept_bytes = kept_bytes
        self.min_bytes = min_bytes
        """Bodies declaring fewer bytes are joined from their pieces as they come: new memory is cheap there."""
        self._free: list[bytearray] = []

    def take(self, nbytes: int) -> bytearray:
        """A buffer of exactly `nbytes`: a kept one of that size, else a new one."""
        for index in range(len(self._free) - 1, -1, -1):
            if len(self._free[index]) == nbytes:
                return self._free.pop(index)
        return bytearray(nbytes)

    def give(self, buffer: bytearray) -> None:
        """Keep `buffer` for a body of its size, forgetting the longest unused ones past `kept` buffers or
        `kept_bytes` bytes (a buffer larger than that on its own is not kept)."""
        self._free.append(buffer)
        while len(self._free) > self.kept or sum(map(len, self._free)) > self.kept_bytes:
            del self._free[0]


async def read_body(request: Request, limit: BodyLimit, buffers: BodyBuffers) -> bytes | bytearray:
    """The whole body, refused with 413 as soon as it passes `limit` (declared or received). One that declares at
    least `buffers.min_bytes` comes in a bytearray taken from `buffers`: give it back when done (`reading_body`
    does)."""
    header = request.headers.get("content-length", "")
    declared = declared_size(header)
    if header.isdigit() and not limit.admits(header):
        raise limit.declared_over(header)
    if declared is not None and declared >= buffers.min_bytes:
        buffer = buffers.take(declared)
        try:
            await _read_into(request, memoryview(buffer), limit.what)
        except BaseException:
            buffers.give(buffer)
            raise
        return buffer
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit.max_bytes:
                raise limit.passed()
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after sending {received} bytes of the {limit.what}") from None
    return b"".join(chunks)


async def _read_into(request: Request, target: memoryview, what: str) -> None:
    """The body into `target`, whose length its Content-Length declared (uvicorn holds the client to it): received
    straight into it where the connection offers that (app.api.connection.DirectBody), else piece by piece."""
    direct: DirectBody | None = request.scope.get("state", {}).get(DIRECT_BODY)
    if direct is not None and direct.length == len(target):
        try:
            await direct.read_into(target, request.app.state.settings.body_timeout_s)
        except ClientDisconnect:
            raise ClientGone(f"the client disconnected after sending {direct.received} bytes of the {what}") from None
        return
    received = 0
    try:
        async for chunk in request.stream():
            end = received + len(chunk)
            if end > len(target):
                raise MalformedPayload(f"the {what} is longer than its Content-Length of {len(target)} bytes")
            target[received:end] = chunk
            received = end
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after sending {received} bytes of the {what}") from None
    if received != len(target):
        raise MalformedPayload(f"the {what} is {received} bytes, not its Content-Length of {len(target)}")


@asynccontextmanager
async def reading_body(
    request: Request, limit: BodyLimit, lend: Callable[[int], LentMemory | None] | None = None
) -> AsyncIterator[Body]:
    """read_body, into memory that `lend` lends for the body's declared size when it does (the engine's shared
    memory, where operands are read without a copy), else with the app's BodyBuffers; the memory is given back
    when the block ends: end it only once nothing views the body (operands decoded from it are staged by then,
    or held by the product that reads them)."""
    buffers: BodyBuffers = request.app.state.body_buffers
    declared = declared_size(request.headers.get("content-length", ""))
    lent = None
    if lend is not None and declared is not None and buffers.min_bytes <= declared <= limit.max_bytes:
        lent = lend(declared)
    if lent is not None:
        try:
            body = lent.memory.data
            await _read_into(request, body, limit.what)
            yield body
        finally:
            lent.release()
        return
    kept = await read_body(request, limit, buffers)
    try:
        yield kept
    finally:
        if isinstance(kept, bytearray):
            buffers.give(kept)


def requested_deadline_s(request: Request) -> float | None:
    """The seconds a product may wait in the queue, if the request sent X-Request-Timeout."""
    sent = request.headers.get(TIMEOUT_HEADER)
    if sent is None:
        return None
    try:
        seconds = float(sent)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 86_400:
        raise InvalidParameter(
            f"{TIMEOUT_HEADER} must be a number of seconds in (0, 86400], not {sent!r}", location=[TIMEOUT_HEADER]
        )
    return seconds


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """What `work` returns; a client that disconnects first cancels it (a product waiting in the queue leaves it)
    and gets ClientGone. Either way `work` has ended when this returns or raises: it reads the request's body,
    which is given back after."""
    done = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({done, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not done.done():
            done.cancel()
            await settled(done)
    if done.cancelled():
        raise ClientGone("the client disconnected before its product was computed")
    try:
        return done.result()
    finally:
        # A refusal's traceback holds this frame, and the frame the task that holds the refusal: a cycle, which would
        # keep the work's frames, and the body they view, until a garbage collection.
        del done
