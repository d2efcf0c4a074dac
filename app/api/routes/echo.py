"""POST /v1/echo: the transport ceiling for benchmarks, answering with the bytes it read, or the first of them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.background import BackgroundTask

from app.api.deps import SettingsDep
from app.api.exchange import BodyBuffers, read_body
from app.api.limits import limit_of
from app.api.schemas import ErrorBody
from app.errors import InvalidParameter, NotFound

router = APIRouter(prefix="/v1", tags=["benchmarks"])

AnswerBytesParam = Annotated[
    int | None,
    Query(
        ge=0,
        description="Answer with the body's first this many bytes (at most its length), so that an exchange moves "
        "what a product's does: its operands in, its answer out. Default: the whole body.",
    ),
]


@router.post(
    "/echo",
    summary="Echo the body (benchmarks only)",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The body, or its first answer_bytes."},
        404: {"model": ErrorBody, "description": "MATMUL_ECHO_ROUTE is off (the default)."},
        422: {"model": ErrorBody, "description": "answer_bytes is negative or longer than the body."},
    },
)
async def echo(request: Request, settings: SettingsDep, answer_bytes: AnswerBytesParam = None) -> Response:
    """With MATMUL_ECHO_ROUTE=true: read the body and send it back, or its first `answer_bytes`, to measure HTTP
    alone against /matmul."""
    if not settings.echo_route:
        raise NotFound("POST /v1/echo is off; set MATMUL_ECHO_ROUTE=true to measure the transport")
    buffers: BodyBuffers = request.app.state.body_buffers
    body = await read_body(request, limit_of(settings, request.headers), buffers)
    length = len(body) if answer_bytes is None else answer_bytes
    if length > len(body):
        if isinstance(body, bytearray):
            buffers.give(body)
        raise InvalidParameter(
            f"answer_bytes={answer_bytes} is longer than the body's {len(body)} bytes",
            location=["query", "answer_bytes"],
        )
    if isinstance(body, bytearray):  # lent by the buffers, as for /matmul: given back once sent
        sent = BackgroundTask(buffers.give, body)
        return Response(memoryview(body)[:length], media_type="application/octet-stream", background=sent)
    return Response(content=body[:length], media_type="application/octet-stream")
