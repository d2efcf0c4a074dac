"""The Open Inference Protocol v2 (KServe / Triton HTTP): health, metadata, config, statistics and infer.

The models are app.api.v2.models' catalogue. Errors are `{"error": "..."}` (app.api.errors renders them).
An answer's `parameters` name the kernel and backend that ran it and carry its roofline as `roofline_<field>`
(the fields of /matmul's `roofline` that are not null: the protocol's parameters are numbers or strings).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Path, Request, Response

from app import __version__, codecs
from app.api.deps import EngineDep, SettingsDep, service_of, settings_of
from app.api.errors import PROTOCOL_PREFIX
from app.api.exchange import off_loop_if_large, reading_body, requested_deadline_s, unless_disconnected
from app.api.limits import infer_body_limit
from app.api.responses import BuffersResponse, server_timing
from app.api.v2.models import CatalogueDep, ModelCatalogue
from app.api.v2.responses import protocol_error
from app.api.v2.shared_memory import shared_memory_enabled
from app.api.v2.statistics import StatisticsDep, statistics_of
from app.codecs.operands import declared_size
from app.config import SharedMemoryKind
from app.errors import MatmulError
from app.service import Stopwatch

router = APIRouter(prefix=PROTOCOL_PREFIX, tags=["inference protocol v2"])
_ERROR = protocol_error("The protocol's error answer.")
# A range, not 422 alone: FastAPI would otherwise document its own 422 body, which these routes never send.
_MODEL_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": protocol_error(
        "400: a path or query parameter out of its bounds; 401: MATMUL_API_KEYS is set and no valid key was sent; "
        "404: no such model or version."
    )
}
_GUARDED: dict[int | str, dict[str, Any]] = {401: protocol_error("MATMUL_API_KEYS is set and no valid key was sent.")}
_INFER_ERRORS: dict[int | str, dict[str, Any]] = {
    400: protocol_error(
        "Two different Content-Type headers, an id that is not a string, a parameter out of its bounds."
    ),
    404: _ERROR,
    422: _ERROR,
    **_GUARDED,
    408: protocol_error("The body stopped arriving for MATMUL_BODY_TIMEOUT_S."),
    413: protocol_error(
        "The body is larger than MATMUL_MAX_BODY_BYTES, or its JSON (the whole body without binary tensors, else the "
        "header before them) than MATMUL_MAX_JSON_BYTES."
    ),
    415: protocol_error("A Content-Encoding other than identity."),
    500: protocol_error("The device or the service failed unexpectedly; the message names no internals."),
    503: protocol_error("The queue is full, the kernels are not ready, the device is out of memory or was lost."),
    504: protocol_error("The inference was still queued when its deadline passed; it was dropped, never run."),
}


ModelName = Annotated[str, Path(max_length=128, description="`matmul` (auto), or `matmul_<kernel>`.")]
VersionName = Annotated[str, Path(max_length=32, description="The model version; only `1` exists.")]


async def _known_version(model: ModelName, version: VersionName, catalogue: CatalogueDep) -> None:
    """The `{version}` of the versioned routes: the model must have it (the unversioned routes take none)."""
    catalogue.kernel_of(model, version)


VERSIONED = [Depends(_known_version)]
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def _model_route(
    method: str,
    suffix: str,
    summary: str,
    versioned_summary: str,
    responses: dict[int | str, dict[str, Any]],
    **extra: Any,
) -> Callable[[Endpoint], Endpoint]:
    """The route at /models/{model}<suffix>, and its twin at /models/{model}/versions/{version}<suffix>."""

    def register(endpoint: Endpoint) -> Endpoint:
        for path, route_summary, dependencies in (
            (f"/models/{{model}}/versions/{{version}}{suffix}", versioned_summary, VERSIONED),
            (f"/models/{{model}}{suffix}", summary, []),
        ):
            router.add_api_route(
                path,
                endpoint,
                methods=[method],
                dependencies=dependencies,
                summary=route_summary,
                responses=responses,
                **extra,
            )
        return endpoint

    return register


@router.get("", summary="Server metadata", responses=_GUARDED)
async def server_metadata(settings: SettingsDep) -> dict[str, Any]:
    """Name, version and the protocol extensions this server implements (shared memory when enabled)."""
    extensions = ["binary_tensor_data", "statistics", "model_configuration"]
    extensions += [f"{kind}_shared_memory" for kind in SharedMemoryKind if shared_memory_enabled(settings, kind)]
    return {"name": "matmul-service", "version": __version__, "extensions": extensions}


@router.get("/health/live", summary="Server liveness")
async def live() -> dict[str, bool]:
    """200 while the process serves HTTP."""
    return {"live": True}


@router.get("/health/ready", summary="Server readiness", responses={503: _ERROR})
async def ready(engine: EngineDep) -> dict[str, bool]:
    """200 once the kernels are compiled and self-tested."""
    engine.check_ready()
    return {"ready": True}


@router.get("/models/stats", summary="Statistics of every model", responses=_GUARDED)
async def all_statistics(catalogue: CatalogueDep, statistics: StatisticsDep) -> dict[str, Any]:
    """The statistics extension for every model."""
    return {"model_stats": statistics.model_stats(catalogue.kernels)}


@_model_route("GET", "", "Model metadata", "Model version metadata", _MODEL_ERRORS)
async def model_metadata(model: ModelName, catalogue: CatalogueDep) -> dict[str, Any]:
    """Inputs A (m x k) and B (k x n), FP16, FP32 or FP64; output C (m x n), FP32 or FP64; -1 marks a variable
    dimension."""
    catalogue.kernel_of(model)
    return catalogue.metadata(model)


@_model_route("GET", "/ready", "Model readiness", "Model version readiness", {**_MODEL_ERRORS, 503: _ERROR})
async def model_ready(model: ModelName, catalogue: CatalogueDep, engine: EngineDep) -> dict[str, Any]:
    """200 when the model exists and the kernels are ready."""
    catalogue.kernel_of(model)
    engine.check_ready()
    return {"name": model, "ready": True}


@_model_route("GET", "/config", "Model configuration", "Model version configuration", _MODEL_ERRORS)
async def model_config(model: ModelName, catalogue: CatalogueDep) -> dict[str, Any]:
    """Triton's model configuration extension: a minimal config (no batching dimension)."""
    catalogue.kernel_of(model)
    return catalogue.config(model)


@_model_route("GET", "/stats", "Model statistics", "Model version statistics", _MODEL_ERRORS)
async def model_statistics(model: ModelName, catalogue: CatalogueDep, statistics: StatisticsDep) -> dict[str, Any]:
    """The statistics extension: counts and cumulative nanoseconds of success, fail, queue and compute stages."""
    catalogue.kernel_of(model)
    return {"model_stats": statistics.model_stats([model])}


_INFER_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "example": {
                    "inputs": [
                        {"name": "A", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]},
                        {"name": "B", "shape": [2, 2], "datatype": "FP32", "data": [5, 6, 7, 8]},
                    ],
                    "parameters": {"kernel": "tiled"},
                }
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "The JSON header (its length in Inference-Header-Content-Length), then the raw "
                "little-endian bytes of each input whose parameters give binary_data_size, in order.",
            },
        },
    }
}


@_model_route("POST", "/infer", "Infer", "Infer (versioned)", _INFER_ERRORS, openapi_extra=_INFER_BODY)
async def infer(model: ModelName, request: Request) -> Response:
    """C = A @ B; tensors as JSON data or binary tensor data; C in binary when the request asks for it."""
    clock = Stopwatch()
    service, settings = service_of(request), settings_of(request)
    catalogue, statistics = ModelCatalogue.of(service.engine), statistics_of(request)
    catalogue.kernel_of(model)
    try:
        service.admit()
        header_length = request.headers.get(codecs.inference_v2.HEADER_LENGTH)
        # binary tensors are decoded as views of the body: in the engine's memory, with the first one aligned
        # (after the JSON header), they are not copied again
        data_at = None if header_length is None else declared_size(header_length)
        lend = None if data_at is None else partial(service.engine.lend, data_at=data_at)
        async with reading_body(request, infer_body_limit(settings, request.headers), lend) as body:
            clock.mark_read()
            # the codec parses the JSON: the whole body, or the header before binary tensors (views of the rest)
            parsed_bytes = len(body) if data_at is None else min(data_at, len(body))
            decoded = await off_loop_if_large(
                parsed_bytes, settings, codecs.decode_infer, body, header_length, service.limits
            )
            clock.mark_decoded()
            options = catalogue.options_for(model, decoded.operands.options)
            product = await unless_disconnected(
                request,
                service.run(decoded.operands, options, requested_deadline_s(request), clock, decoded.output_region),
            )
        parameters = product.protocol_parameters()
        try:
            if decoded.output_region is not None:
                header = codecs.inference_v2.encode_infer_in_region(
                    product.shape.result, product.dtype, decoded.output_region, model, decoded.id, parameters
                )
                data = None
            else:
                # binary: a JSON header and a view of C in its slab, nothing to move off the loop
                encoding_bytes = 0 if decoded.binary_output else product.c.nbytes
                header, data = await off_loop_if_large(
                    encoding_bytes,
                    settings,
                    codecs.inference_v2.encode_infer,
                    product.c,
                    model,
                    decoded.id,
                    decoded.binary_output,
                    parameters,
                )
            request.state.product = meta = product.describe()
        except BaseException:
            product.release()
            raise
    except MatmulError:
        statistics.record_failure(model, clock.elapsed_ms())
        raise
    statistics.record_success(model, meta.timing)
    headers = {"Server-Timing": server_timing(meta.timing)}
    if data is None:
        product.release()  # the JSON text is a copy
        return Response(content=header, media_type=codecs.JSON_MEDIA_TYPE, headers=headers)
    headers[codecs.inference_v2.HEADER_LENGTH] = str(len(header))
    media_type = codecs.inference_v2.BINARY_MEDIA_TYPE
    return BuffersResponse([header, data], media_type=media_type, headers=headers, on_sent=product.release)
