"""POST /matmul: read the body, decode it, run the product through the service, encode the answer."""

from __future__ import annotations

from typing import Annotated, Any, get_args

from fastapi import APIRouter, Query, Request, Response

from app import codecs
from app.api.deps import service_of, settings_of
from app.api.exchange import off_loop_if_large, reading_body, requested_deadline_s, unless_disconnected
from app.api.limits import limit_of
from app.api.negotiation import choose_encoding
from app.api.responses import BuffersResponse, product_headers
from app.api.schemas import ErrorBody, MatmulResponse
from app.product import DtypeName, PrecisionName
from app.service import WORKING_DTYPES, Stopwatch

router = APIRouter(tags=["matmul"])

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
                        "dtype": {"type": "string", "enum": list(WORKING_DTYPES)},
                        "kernel": {"type": "string"},
                        "tile": {"type": "integer"},
                        "precision": {"type": "string", "enum": list(get_args(PrecisionName))},
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
        413: "The body is larger than MATMUL_MAX_BODY_BYTES, or a JSON body than MATMUL_MAX_JSON_BYTES.",
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
        description="naive, tiled, coalesced, blocktile1d, blocktile2d, fast, cublas, auto and on Hopper mma_sync, "
        "wgmma, dmma on the GPU backend; naive, tiled (emulations of the GPU kernels), numpy or auto on the CPU "
        "backend (GET /v1/kernels lists them, with the dtypes and precisions of each). Default: auto.",
    ),
]
TileParam = Annotated[int | None, Query(ge=1, le=1024, description="Tile width of the tiled kernel: 8, 16 or 32.")]
DtypeParam = Annotated[
    DtypeName | None,
    Query(
        description="Working dtype. int32: the exact product of int8 operands (values from -128 to 127, k up to "
        "131071). Default: int32 for two int8 operands (.npy, .npz), else float64 if an operand is float64, else "
        "float32."
    ),
]
PrecisionParam = Annotated[
    PrecisionName | None,
    Query(
        description="How the multiplier rounds float32 operands: fp32 (default, exact operands), tf32, 3xtf32 "
        "(fp32-like accuracy from TF32 parts), bf16, fp16 (tensor cores on the GPU backend, an emulation of the "
        "rounding on the CPU backend); int8 for an int32 product (int8 operands, exact sums). The answer's "
        "error_bound says what each promises."
    ),
]


@router.post(
    "/matmul",
    summary="Multiply two matrices",
    response_model=None,
    responses=_RESPONSES,
    openapi_extra=_REQUEST_BODY_DOC,
)
async def matmul(
    request: Request,
    kernel: KernelParam = None,
    tile: TileParam = None,
    dtype: DtypeParam = None,
    precision: PrecisionParam = None,
) -> Response:
    """Compute C = A @ B from JSON, multipart .npy parts or an .npz body; answer JSON or .npy (Accept)."""
    clock = Stopwatch()
    service, settings = service_of(request), settings_of(request)
    answer_as = choose_encoding(request.headers.get("accept"))
    service.admit()
    content_type = request.headers.get("content-type", "")
    media_type = codecs.decodable_media_type(content_type)
    # .npy parts are decoded as views of the body: in the engine's memory, they are not copied again
    lend = service.engine.lend if media_type == codecs.MULTIPART_MEDIA_TYPE else None
    async with reading_body(request, limit_of(settings, request.headers), lend) as body:
        clock.mark_read()
        # .npy parts found by their headers' lengths cost well under a millisecond whatever their size, where a
        # thread's round trip cost 2.3 ms under load
        operands = codecs.decode_by_headers(content_type, body, service.limits)
        if operands is None:
            operands = await off_loop_if_large(
                len(body), settings, codecs.decode, content_type, body, service.limits, settings.max_body_bytes
            )
        clock.mark_decoded()
        query = codecs.RequestOptions(kernel=kernel, tile=tile, dtype=dtype, precision=precision)
        options = query.merged_with(operands.options)
        deadline_s = requested_deadline_s(request)
        product = await unless_disconnected(request, service.run(operands, options, deadline_s, clock))

    try:
        # .npy: a header and a view of the product's memory, nothing to move off the loop
        encoding_bytes = product.c.nbytes if answer_as == codecs.JSON_MEDIA_TYPE else 0
        encoded = await off_loop_if_large(encoding_bytes, settings, codecs.encode, answer_as, product.c)
        request.state.product = meta = product.describe()
    except BaseException:
        product.release()
        raise
    if answer_as == codecs.NPY_MEDIA_TYPE:
        return BuffersResponse(encoded, media_type=answer_as, headers=product_headers(meta), on_sent=product.release)
    product.release()  # the JSON text is a copy
    body = codecs.encode_json_envelope(encoded[0], meta.model_dump())
    return Response(content=body, media_type=answer_as, headers=product_headers(meta))
