"""Domain errors -> HTTP answers, in one place: `{"code", "message", "location"}` with the error's status, or the
inference protocol's `{"error": "<message>"}` under /v2."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.schemas import ErrorBody
from app.errors import MatmulError, ServiceUnavailable, Unauthorized

log = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
PROTOCOL_PREFIX = "/v2"


def _headers(exc: MatmulError, retry_after_s: int) -> dict[str, str]:
    if isinstance(exc, ServiceUnavailable):
        return {"Retry-After": str(retry_after_s)}
    if isinstance(exc, Unauthorized):
        return {"WWW-Authenticate": 'Bearer realm="matmul-service"'}
    return {}


def error_response(exc: MatmulError, retry_after_s: int) -> JSONResponse:
    """The service's error answer: {"code", "message", "location"}."""
    body = ErrorBody(code=exc.code, message=exc.message, location=exc.location)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=_headers(exc, retry_after_s))


def protocol_error_response(exc: MatmulError, retry_after_s: int) -> JSONResponse:
    """The inference protocol's error answer: {"error": "<message>"}."""
    return JSONResponse({"error": exc.message}, status_code=exc.status_code, headers=_headers(exc, retry_after_s))


def error_response_for(path: str, exc: MatmulError, retry_after_s: int) -> JSONResponse:
    """The error answer in the format of the route `path` belongs to, for middleware that answers before
    routing: the inference protocol's under /v2, the service's everywhere else."""
    respond = protocol_error_response if path.startswith(PROTOCOL_PREFIX) else error_response
    return respond(exc, retry_after_s)


def error_body_for(path: str, exc: MatmulError) -> bytes:
    """The JSON body of error_response_for, for a connection that answers before any app sees the request."""
    if path.startswith(PROTOCOL_PREFIX):
        return orjson.dumps({"error": exc.message})
    return orjson.dumps(ErrorBody(code=exc.code, message=exc.message, location=exc.location).model_dump())


def _retry_after(request: Request) -> int:
    settings = getattr(request.app.state, "settings", None)
    return settings.retry_after_s if settings is not None else 1


async def _on_matmul_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MatmulError)
    if exc.status_code >= 500:
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code, exc.code, exc.message)
    return error_response(exc, _retry_after(request))


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    location = [part for part in first.get("loc", ()) if isinstance(part, str | int)]
    where = ".".join(str(part) for part in location)
    body = ErrorBody(code="invalid_parameter", message=f"{where}: {first.get('msg', 'invalid')}", location=location)
    return JSONResponse(body.model_dump(), status_code=422)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Routing's own answers (404 no such route, 405 wrong method), in the format of the surface asked."""
    assert isinstance(exc, StarletteHTTPException)
    if request.url.path.startswith(PROTOCOL_PREFIX):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    body = ErrorBody(code=code, message=str(exc.detail), location=None)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(MatmulError, _on_matmul_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)


class UnexpectedErrors:
    """An exception no handler knows: logged once with its traceback and answered 500 in the route's error format,
    naming nothing of it. (A handler for Exception would not do: Starlette re-raises the exception once the handler
    has answered, and the server logs the same traceback a second time.) If the answer had already begun, the
    exception goes on to the server, which logs it once and closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
