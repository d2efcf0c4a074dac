"""POST /matmul: read the body, decode it, run the product on the engine, encode the answer."""

from __future__ import annotations

from time import perf_counter
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from app import codecs
from app.api.deps import EngineDep, SettingsDep
from app.api.multipart import decode_multipart
from app.api.product import (
    Stopwatch,
    compute,
    decode_client_bytes,
    describe,
    limits_of,
    off_loop_if_large,
    read_body,
    server_timing,
)
from app.api.responses import BuffersResponse
from app.api.schemas import DtypeName, ErrorBody, MatmulMetadata, MatmulResponse
from app.config import Settings
from app.errors import UnsupportedMediaType

router = APIRouter(tags=["matmul"])
MULTIPART_MEDIA_TYPE = "multipart/form-data"

_NPY_FILE = {"type": "string", "format": "binary", "description": "A 2-D .npy file (np.save)."}
_REQUEST_BODY_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["a", "b"],
                    "properties": {
                        "a": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        "b": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        "dtype": {"type": "string", "enum": list(codecs.WORKING_DTYPES)},
                        "kernel": {"type": "string"},
                        "tile": {"type": "integer"},
                    },
                },
                "example": {"a": [[1, 2], [3, 4]], "b": [[5, 6], [7, 8]]},
            },
            "multipart/form-data": {
                "schema": {"type": "object", "required": ["a", "b"], "properties": {"a": _NPY_FILE, "b": _NPY_FILE}}
            },
            codecs.NPZ_MEDIA_TYPE: {
                "schema": {"type": "string", "format": "binary", "description": "np.savez(f, a=a, b=b)."}
            },
        },
    }
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in {
        400: "The request has two different Content-Type headers.",
        406: "The Accept header names neither application/json nor application/x-npy.",
        413: "The body is larger than MATMUL_MAX_BODY_BYTES.",
        415: "The Content-Type is not JSON, multipart/form-data or application/x-npz, or a Content-Encoding "
        "other than identity is sent.",
        422: "Malformed body, not a 2-D numeric matrix, shapes that do not multiply, unknown kernel, bad tile "
        "or dtype, a query parameter given twice; `code` and `location` say which.",
        408: "The body stopped arriving for MATMUL_BODY_TIMEOUT_S (a Content-Length larger than what is sent).",
        500: "The device raised an error the service did not expect (device_failure), or the service failed "
        "(internal_error); the message names no internals.",
        503: "The worker's queue is full, the kernels are not ready, the device is out of memory or was lost; "
        "retry after Retry-After seconds.",
        504: "The product was still queued when its deadline (X-Request-Timeout, MATMUL_REQUEST_TIMEOUT_S) "
        "passed; it was dropped, never run.",
    }.items()
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": MatmulResponse,
        "description": "The product. Timing is also in the Server-Timing header, with X-Matmul-* headers "
        "for kernel, tile, backend, device, shape, dtype, GFLOP/s, batch size and the roofline "
        "(X-Matmul-Roofline-*, one per field that is not null).",
        "content": {codecs.NPY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    },
    **_ERRORS,
}

KernelParam = Annotated[
    str | None,
    Query(
        max_length=64,
        description="naive, tiled, coalesced, blocktile1d, blocktile2d, fast, cublas or auto on the GPU backend; "
        "naive, tiled (emulations of the GPU kernels), numpy or auto on the CPU backend (GET /v1/kernels lists "
        "them). Default: auto.",
    ),
]
TileParam = Annotated[int | None, Query(ge=1, le=1024, description="Tile width of the tiled kernel: 8, 16 or 32.")]
DtypeParam = Annotated[
    DtypeName | None,
    Query(description="Working dtype. Default: float64 if an operand is float64, else float32."),
]


async def _read_operands(request: Request, settings: Settings, limits: codecs.Limits) -> tuple[codecs.Operands, float]:
    """The decoded operands, and the milliseconds spent receiving the body (the rest is decoding)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    started = perf_counter()
    if content_type not in (codecs.JSON_MEDIA_TYPE, codecs.NPZ_MEDIA_TYPE, MULTIPART_MEDIA_TYPE):
        raise UnsupportedMediaType(
            f"Content-Type {content_type or '(none)'!r} is not supported; send {codecs.JSON_MEDIA_TYPE}, "
            f"multipart/form-data with .npy parts 'a' and 'b', or {codecs.NPZ_MEDIA_TYPE}"
        )
    if content_type == codecs.JSON_MEDIA_TYPE:
        body = await read_body(request, settings.max_json_bytes, "JSON body")
    else:
        body = await read_body(request, settings.max_body_bytes, "body")
    read_ms = (perf_counter() - started) * 1e3
    if content_type == MULTIPART_MEDIA_TYPE:
        operands = await decode_client_bytes(
            "multipart body", len(body), settings, decode_multipart, body, request.headers["content-type"], limits
        )
    elif content_type == codecs.JSON_MEDIA_TYPE:
        operands = await decode_client_bytes("JSON body", len(body), settings, codecs.decode_json, body, limits)
    else:
        operands = await decode_client_bytes(
            ".npz archive", len(body), settings, codecs.decode_npz, body, limits, settings.max_body_bytes
        )
    return operands, read_ms


def _headers(meta: MatmulMetadata) -> dict[str, str]:
    headers = {
        "Server-Timing": server_timing(meta.timing),
        "X-Matmul-Kernel": meta.kernel,
        "X-Matmul-Backend": meta.backend,
        "X-Matmul-Device": meta.device,
        "X-Matmul-Shape": f"{meta.shape[0]}x{meta.shape[1]}",
        "X-Matmul-Dtype": meta.dtype,
        "X-Matmul-Batch-Size": str(meta.batch_size),
    }
    if meta.tile is not None:
        headers["X-Matmul-Tile"] = str(meta.tile)
    if meta.gflops is not None:
        headers["X-Matmul-Gflops"] = f"{meta.gflops:.3f}"
    for name, value in meta.roofline.model_dump(exclude_none=True).items():
        header = "X-Matmul-Roofline-" + "-".join(word.capitalize() for word in name.split("_"))
        headers[header] = str(value) if isinstance(value, int) else f"{value:.6g}"
    return headers


@router.post(
    "/matmul",
    summary="Multiply two matrices",
    response_model=None,
    responses=_RESPONSES,
    openapi_extra=_REQUEST_BODY_DOC,
)
async def matmul(
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    kernel: KernelParam = None,
    tile: TileParam = None,
    dtype: DtypeParam = None,
) -> Response:
    """Compute C = A @ B from JSON, multipart .npy parts or an .npz body; answer JSON or .npy (Accept)."""
    clock = Stopwatch()
    answer_as = codecs.choose_encoding(request.headers.get("accept"))
    engine.check_ready()
    engine.check_room()
    limits = limits_of(settings)
    operands, clock.read_ms = await _read_operands(request, settings, limits)
    clock.mark_decoded()
    options = codecs.RequestOptions(kernel=kernel, tile=tile, dtype=dtype).merged_with(operands.options)
    product = await compute(request, engine, settings, operands, options)
    c = product.outcome.c

    clock.computed = perf_counter()
    if answer_as == codecs.NPY_MEDIA_TYPE:
        npy = codecs.npy_parts(c)
        return BuffersResponse(npy, media_type=answer_as, headers=_headers(describe(request, engine, product, clock)))
    matrix = await off_loop_if_large(c.nbytes, settings, codecs.encode_json_matrix, c)
    meta = describe(request, engine, product, clock)
    body = codecs.encode_json_envelope(matrix, meta.model_dump())
    return Response(content=body, media_type=answer_as, headers=_headers(meta))
