"""The limits on request bodies: which one a body has, refusing a body over it before reading it, stopping once a
body passes it, and giving up on a body whose next piece does not come within `body_timeout_s` (a client that
declared more than it sends).

JSON costs about 20 times the memory and time of binary data per element, so a body sent as JSON (its Content-Type)
has MATMUL_MAX_JSON_BYTES on every route, and any other body MATMUL_MAX_BODY_BYTES. The inference protocol's infer
route reads its body as JSON whatever its Content-Type says, and holds a body with no binary tensors to
MATMUL_MAX_JSON_BYTES as well, and the JSON header before binary tensors (`Inference-Header-Content-Length`) too
(`infer_body_limit`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from app.api.errors import error_response_for
from app.api.middleware import HttpMiddleware
from app.codecs import JSON_MEDIA_TYPE
from app.codecs.inference_v2 import HEADER_LENGTH
from app.codecs.operands import declared_size
from app.config import Settings
from app.errors import BodyTimeout, MalformedPayload, PayloadTooLarge


@dataclass(frozen=True)
class BodyLimit:
    """The most bytes of a body (or of its JSON part), and how a refusal names it: the same words on every route."""

    max_bytes: int
    what: str
    """'body', 'JSON body' or 'JSON header'."""
    variable: str
    """The setting that sets it."""

    def declared_over(self, declared: str) -> PayloadTooLarge:
        """The refusal of a size declared up front (Content-Length, Inference-Header-Content-Length), as its header
        gave it: its value, or how many digits it has where that is too many to read."""
        size = declared_size(declared)
        said = str(size) if size is not None else f"a {len(declared.lstrip('0'))}-digit number of"
        return PayloadTooLarge(f"the {self.what} is {said} bytes, over the limit of {self.max_bytes} ({self.variable})")

    def passed(self) -> PayloadTooLarge:
        """The refusal of a body that passed the limit as it arrived."""
        return PayloadTooLarge(f"the {self.what} passed the limit of {self.max_bytes} bytes ({self.variable})")

    def admits(self, declared: str) -> bool:
        """Whether a size declared as a header's digits is within the limit (without turning a huge one into an
        int)."""
        size = declared_size(declared)
        return size is not None and size <= self.max_bytes


def body_limit(settings: Settings) -> BodyLimit:
    return BodyLimit(settings.max_body_bytes, "body", "MATMUL_MAX_BODY_BYTES")


def json_limit(settings: Settings, what: str = "JSON body") -> BodyLimit:
    """MATMUL_MAX_JSON_BYTES, or MATMUL_MAX_BODY_BYTES where that is the smaller: JSON is a body too."""
    if settings.max_body_bytes < settings.max_json_bytes:
        return BodyLimit(settings.max_body_bytes, what, "MATMUL_MAX_BODY_BYTES")
    return BodyLimit(settings.max_json_bytes, what, "MATMUL_MAX_JSON_BYTES")


def is_json(headers: Headers) -> bool:
    """Whether the body is JSON by its Content-Type."""
    return headers.get("content-type", "").split(";")[0].strip().lower() == JSON_MEDIA_TYPE


def limit_of(settings: Settings, headers: Headers) -> BodyLimit:
    """The limit of a request's body: MATMUL_MAX_JSON_BYTES for JSON, else MATMUL_MAX_BODY_BYTES."""
    return json_limit(settings) if is_json(headers) else body_limit(settings)


def infer_body_limit(settings: Settings, headers: Headers) -> BodyLimit:
    """The limit of an inference request's body, which is JSON whatever its Content-Type unless it declares a JSON
    header followed by binary tensors; that header is refused here when it declares more than MATMUL_MAX_JSON_BYTES
    (its length is checked against the body's once the body is read)."""
    header_length = headers.get(HEADER_LENGTH)
    if header_length is None:
        return json_limit(settings)
    header_limit = json_limit(settings, "JSON header")
    if header_length.isascii() and header_length.isdigit() and not header_limit.admits(header_length):
        raise header_limit.declared_over(header_length)
    return limit_of(settings, headers)


class BodyLimitMiddleware(HttpMiddleware):
    """Checks `Content-Length` up front, and counts the bytes actually received (a client may lie)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings: Settings = scope["app"].state.settings
        headers = Headers(scope=scope)
        limit = limit_of(settings, headers)
        declared = headers.get("content-length")
        error: PayloadTooLarge | MalformedPayload | None = None
        if declared is not None:
            if not (declared.isascii() and declared.isdigit()):
                error = MalformedPayload(f"Content-Length {declared[:40]!r} is not a byte count")
            elif not limit.admits(declared):
                error = limit.declared_over(declared)
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
                raise BodyTimeout.after(timeout_s, received) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit.max_bytes:
                    raise limit.passed()
            return message

        await self.app(scope, counting_receive, send)
