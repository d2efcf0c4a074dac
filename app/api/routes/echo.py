"""POST /v1/echo: the transport ceiling for benchmarks, answering with as many bytes as it read."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.background import BackgroundTask

from app.api.deps import SettingsDep
from app.api.exchange import BodyBuffers, read_body
from app.api.limits import limit_of
from app.api.schemas import ErrorBody
from app.errors import NotFound

router = APIRouter(prefix="/v1", tags=["benchmarks"])


@router.post(
    "/echo",
    summary="Echo the body (benchmarks only)",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The body, as received."},
        404: {"model": ErrorBody, "description": "MATMUL_ECHO_ROUTE is off (the default)."},
    },
)
async def echo(request: Request, settings: SettingsDep) -> Response:
    """With MATMUL_ECHO_ROUTE=true: read the body and send it back, to measure HTTP alone against /matmul."""
    if not settings.echo_route:
        raise NotFound("POST /v1/echo is off; set MATMUL_ECHO_ROUTE=true to measure the transport")
    buffers: BodyBuffers = request.app.state.body_buffers
    body = await read_body(request, limit_of(settings, request.headers), buffers)
    if isinstance(body, bytearray):  # lent by the buffers, as for /matmul: given back once sent
        sent = BackgroundTask(buffers.give, body)
        return Response(memoryview(body), media_type="application/octet-stream", background=sent)
    return Response(content=body, media_type="application/octet-stream")
