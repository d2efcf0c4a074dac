"""Domain errors -> HTTP answers, in one place: the one table from error class to status, and the one renderer
every handler, middleware and connection answers through: `{"code", "message", "location"}` with the error's
status, or the inference protocol's `{"error": "<message>"}` under /v2."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from app.api.middleware import HttpMiddleware
from app.api.schemas import ErrorBody
from app.errors import (
    BadRequest,
    BodyTimeout,
    ClientGone,
    DeadlineExceeded,
    HeadersTooLarge,
    HeaderTimeout,
    InvalidInput,
    InvalidParameter,
    MatmulError,
    NotAcceptable,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    UnsupportedMediaType,
)

log = logging.getLogger(__name__)

PROTOCOL_PREFIX = "/v2"
"""The inference protocol's surface: its errors are `{"error": "<message>"}`, its bad parameters 400."""

STATUS: Mapping[type, int] = {
    MatmulError: 500,
    InvalidInput: 422,
    BadRequest: 400,
    NotFound: 404,
    Unauthorized: 401,
    BodyTimeout: 408,
    HeaderTimeout: 408,
    HeadersTooLarge: 431,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    NotAcceptable: 406,
    ServiceUnavailable: 503,
    DeadlineExceeded: 504,
    ClientGone: 499,
}
"""The HTTP status of each domain error; a class not listed answers with its nearest listed ancestor's."""
_ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


def status_of(error: MatmulError) -> int:
    """The HTTP status of a domain error: the first class of its MRO the table lists."""
    return next(STATUS[cls] for cls in type(error).__mro__ if cls in STATUS)


def _headers(error: MatmulError, retry_after_s: int) -> dict[str, str]:
    if isinstance(error, ServiceUnavailable):
        return {"Retry-After": str(retry_after_s)}
    if isinstance(error, Unauthorized):
        return {"WWW-Authenticate": 'Bearer realm="matmul-service"'}
    return {}


def _body(path: str, code: str, message: str, location: list[str | int] | None) -> bytes:
    if path.startswith(PROTOCOL_PREFIX):
        return orjson.dumps({"error": message})
    return orjson.dumps(ErrorBody(code=code, message=message, location=location).model_dump())


def error_body_for(path: str, error: MatmulError) -> bytes:
    """The JSON body of the answer to `error` in the format of the surface `path` belongs to: the inference
    protocol's under /v2, the service's everywhere else."""
    return _body(path, error.code, error.message, error.location)


def error_response_for(path: str, error: MatmulError, retry_after_s: int) -> Response:
    """The answer to `error` on the surface `path` belongs to, with its status and headers."""
    return Response(
        error_body_for(path, error),
        status_code=status_of(error),
        headers=_headers(error, retry_after_s),
        media_type="application/json",
    )


def _retry_after(request: Request) -> int:
    settings = getattr(request.app.state, "settings", None)
    return settings.retry_after_s if settings is not None else 1


async def _on_matmul_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MatmulError)
    status = status_of(exc)
    if status >= 500:
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, status, exc.code, exc.message)
    return error_response_for(request.url.path, exc, _retry_after(request))


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    """A path, query or header parameter out of its bounds: 422 invalid_parameter, 400 under the protocol."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    location = [part for part in first.get("loc", ()) if isinstance(part, str | int)]
    message = f"{'.'.join(str(part) for part in location)}: {first.get('msg', 'invalid')}"
    path = request.url.path
    error = BadRequest if path.startswith(PROTOCOL_PREFIX) else InvalidParameter
    return error_response_for(path, error(message, location=location), _retry_after(request))


async def _on_routing_error(request: Request, exc: Exception) -> Response:
    """Routing's own answers (404 no such route, 405 wrong method), in the format of the surface asked."""
    assert isinstance(exc, StarletteHTTPException)
    code = _ROUTING_CODES.get(exc.status_code, "http_error")
    body = _body(request.url.path, code, str(exc.detail), None)
    return Response(body, status_code=exc.status_code, headers=exc.headers, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(MatmulError, _on_matmul_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_routing_error)


class UnexpectedErrors(HttpMiddleware):
    """An exception no handler knows: logged once with its traceback and answered 500 in the route's error format,
    naming nothing of it. (A handler for Exception would not do: Starlette re-raises the exception once the handler
    has answered, and the server logs the same traceback a second time.) If the answer had already begun, the
    exception goes on to the server, which logs it once and closes the connection."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
            error = MatmulError("internal server error")
            await error_response_for(scope["path"], error, retry_after_s=0)(scope, receive, send)
