"""What a request's head must not leave in doubt, checked before any route reads it: one Content-Type, no content
coding the service would have to undo, each query parameter once. A request that does gets an answer naming it
(400, 415, 422) in the format of the surface it was sent to, instead of one of its values chosen silently."""

from __future__ import annotations

from collections import Counter
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import error_response_for
from app.errors import BadRequest, InvalidParameter, MatmulError, UnsupportedMediaType


def head_problem(headers: list[tuple[bytes, bytes]], query_string: bytes) -> MatmulError | None:
    """What is ambiguous in a request's headers or query string, if anything."""
    content_types: list[str] = []
    codings: list[str] = []
    for header, value in headers:
        if header == b"content-type":
            content_types.append(value.decode("latin-1").strip())
        elif header == b"content-encoding":
            codings += [coding.strip() for coding in value.decode("latin-1").split(",") if coding.strip()]
    if len({content_type.lower() for content_type in content_types}) > 1:
        return BadRequest(
            f"the request has {len(content_types)} different Content-Type headers {content_types}; send one",
            location=["Content-Type"],
        )
    unsupported = [coding for coding in codings if coding.lower() != "identity"]
    if unsupported:
        return UnsupportedMediaType(
            f"Content-Encoding {', '.join(unsupported)!r} is not supported; send the body as it is (identity)",
            location=["Content-Encoding"],
        )
    if query_string:
        counts = Counter(name for name, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        repeated = [(name, count) for name, count in counts.items() if count > 1]
        if repeated:
            name, count = repeated[0]
            return InvalidParameter(
                f"query parameter {name!r} is given {count} times; give it once", location=["query", name]
            )
    return None


class RequestHeadMiddleware:
    """Answers a request whose head is ambiguous (see head_problem) before the app reads it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = head_problem(scope["headers"], scope["query_string"])
            if problem is not None:
                retry_after_s: int = scope["app"].state.settings.retry_after_s
                await error_response_for(scope["path"], problem, retry_after_s)(scope, receive, send)
                return
        await self.app(scope, receive, send)
