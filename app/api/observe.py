"""One look at every request: its id (X-Request-ID), Prometheus counts, and one JSON access-log line."""

from __future__ import annotations

import logging
import re
import uuid
from time import perf_counter
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from app.api.connection import DIRECT_BODY, DirectBody
from app.api.middleware import HttpMiddleware
from app.metrics import ServiceMetrics
from app.product import MatmulMetadata

access_log = logging.getLogger("app.access")
_VALID_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def _request_id(scope: Scope) -> str:
    """The client's X-Request-ID when it is a plain token (it is logged), else a new one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _VALID_REQUEST_ID.fullmatch(value):
            return bytes(value).decode()
    return uuid.uuid4().hex


class RequestObserver(HttpMiddleware):
    """Outermost middleware, so it also sees answers the inner layers give without reaching a route."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics: ServiceMetrics = scope["app"].state.metrics
        request_id = _request_id(scope)
        started = perf_counter()
        seen = {"in": 0, "out": 0, "status": 500}

        async def counting_receive() -> Message:
            message = await receive()
            seen["in"] += len(message.get("body", b""))
            return message

        async def tagging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                seen["out"] += len(message.get("body", b""))
            await send(message)

        metrics.in_flight.inc()
        try:
            await self.app(scope, counting_receive, tagging_send)
        finally:
            metrics.in_flight.dec()
            seconds = perf_counter() - started
            direct: DirectBody | None = scope.get("state", {}).get(DIRECT_BODY)
            if direct is not None:  # the body's bytes the app read without receive()
                seen["in"] += direct.received
            route = getattr(scope.get("route"), "path", "unmatched")
            product: MatmulMetadata | None = scope.get("state", {}).get("product")
            kernel = product.kernel if product is not None else ""
            metrics.requests.labels(
                route=route, method=scope["method"], status=str(seen["status"]), kernel=kernel
            ).inc()
            metrics.latency.labels(route=route).observe(seconds)
            metrics.bytes_in.labels(route=route).inc(seen["in"])
            metrics.bytes_out.labels(route=route).inc(seen["out"])
            if product is not None:
                metrics.observe_product(kernel, product.timing)
            if access_log.isEnabledFor(logging.INFO):
                line: dict[str, Any] = {
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": route,
                    "path": scope["path"],
                    "status": seen["status"],
                    "duration_ms": round(seconds * 1e3, 3),
                    "bytes_in": seen["in"],
                    "bytes_out": seen["out"],
                    "client": scope["client"][0] if scope.get("client") else None,
                }
                if product is not None:
                    line |= product.model_dump(include={"shape", "dtype", "kernel", "tile", "backend", "timing"})
                access_log.info(orjson.dumps(line).decode())


def configure_access_log(enabled: bool) -> None:
    """One JSON line per request on stderr, through the `app.access` logger (uvicorn's access log adds nothing)."""
    if not enabled:
        access_log.setLevel(logging.WARNING)
        return
    access_log.setLevel(logging.INFO)
    if not access_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
    access_log.propagate = False
