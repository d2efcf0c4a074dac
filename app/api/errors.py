"""Domain errors -> HTTP answers, in one place: `{"code", "message", "location"}` with the error's status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    body = ErrorBody(code=code, message=str(exc.detail), location=None)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    body = ErrorBody(code="internal_error", message="internal server error", location=None)
    return JSONResponse(body.model_dump(), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(MatmulError, _on_matmul_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
