"""Refuse bodies over `max_body_bytes` before reading them, stop reading once a body passes it, and give up
on a body whose next piece does not come within `body_timeout_s` (a client that declared more than it sends)."""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope, Send

from app.api.errors import error_response_for
from app.api.middleware import HttpMiddleware
from app.errors import BodyTimeout, MalformedPayload, PayloadTooLarge


class BodyLimitMiddleware(HttpMiddleware):
    """Checks `Content-Length` up front, and counts the bytes actually received (a client may lie)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = scope["app"].state.settings
        limit: int = settings.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        error: PayloadTooLarge | MalformedPayload | None = None
        if declared is not None:
            if not (declared.isascii() and declared.isdigit()):
                error = MalformedPayload(f"Content-Length {declared[:40].decode('latin-1')!r} is not a byte count")
            elif len(declared) > len(str(limit)) or int(declared) > limit:
                error = PayloadTooLarge(f"the body is {declared[:40].decode()} bytes, over the limit of {limit}")
        if error is not None:
            await error_response_for(scope["path"], error, settings.retry_after_s)(scope, receive, send)
            return

        received = 0
        body_done = False
        timeout_s: float = settings.body_timeout_s

        async def counting_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()  # after the body, receive() waits for a disconnect: no timeout
            try:
                message = await asyncio.wait_for(receive(), timeout_s)
            except TimeoutError:
                raise BodyTimeout(
                    f"the body stopped arriving: nothing for {timeout_s:g} s after {received} bytes"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    raise PayloadTooLarge(f"the body passed the limit of {limit} bytes")
            return message

        await self.app(scope, counting_receive, send)
