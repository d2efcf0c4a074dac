"""What a product route does with HTTP around the service: read the body under its limit, run a codec off the event
loop when its input is large, read the deadline a request asks for, and take the product back when the client
leaves.

The off-loop threshold is the API's: it protects the loop that serves every connection of this worker, the codecs
stay plain functions and the service never blocks (it only awaits the engine).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from app.config import Settings
from app.errors import ClientGone, InvalidParameter, PayloadTooLarge

TIMEOUT_HEADER = "X-Request-Timeout"
T = TypeVar("T")


async def off_loop_if_large(size: int, settings: Settings, function: Callable[..., T], *args: Any) -> T:
    """Run `function` on the event loop for small inputs, in a worker thread for large ones."""
    if size <= settings.inline_codec_bytes:
        return function(*args)
    return await run_in_threadpool(function, *args)


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit` bytes (declared or received)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the {what} is {int(declared)} bytes, over the limit of {limit}")
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise PayloadTooLarge(f"the {what} passed the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after sending {received} bytes of the {what}") from None
    return b"".join(chunks)


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
    and gets ClientGone."""
    done = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({done, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not done.done():
            done.cancel()
    if not done.done() or done.cancelled():
        raise ClientGone("the client disconnected before its product was computed")
    return done.result()
