"""The Open Inference Protocol v2 (KServe / Triton HTTP): health, metadata, config, statistics and infer.

Models: `matmul` runs `auto` and takes `parameters.kernel` (and `tile`) per request; `matmul_<kernel>` runs
one kernel of this backend (`matmul_tiled`, `matmul_cublas`, ...), so tools that address a model by name
alone (perf_analyzer) can still choose the kernel. Each has version "1". Errors are `{"error": "..."}`.
An answer's `parameters` name the kernel and backend that ran it and carry its roofline as `roofline_<field>`
(the fields of /matmul's `roofline` that are not null: the protocol's parameters are numbers or strings).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from time import perf_counter
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from app import __version__, inference_protocol
from app.api.deps import EngineDep, SettingsDep
from app.api.errors import PROTOCOL_PREFIX, protocol_error_response
from app.api.product import (
    Stopwatch,
    compute,
    decode_client_bytes,
    describe,
    limits_of,
    off_loop_if_large,
    read_body,
    roofline_of,
    server_timing,
)
from app.codecs import JSON_MEDIA_TYPE, Operands, RequestOptions
from app.engine import Engine
from app.errors import InvalidParameter, MatmulError, UnknownModel
from app.inference_stats import ModelStatistics

MODEL = "matmul"
VERSION = "1"


class V2Route(APIRoute):
    """Answers errors in the protocol's format, `{"error": "<message>"}`, with the domain error's status."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def protocol_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except MatmulError as exc:
                return protocol_error_response(exc, request.app.state.settings.retry_after_s)
            except RequestValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in first.get("loc", ()))
                return JSONResponse({"error": f"{where}: {first.get('msg', 'invalid')}"}, status_code=400)

        return protocol_errors


router = APIRouter(prefix=PROTOCOL_PREFIX, tags=["inference protocol v2"], route_class=V2Route)
_ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def _error(description: str) -> dict[str, Any]:
    """An error answer of the protocol, `{"error": "<message>"}`, documented."""
    example = {"error": "inner dimensions differ: ..."}
    return {"description": description, "content": {"application/json": {"schema": _ERROR_BODY, "example": example}}}


_ERROR = _error("The protocol's error answer.")
# A range, not 422 alone: FastAPI would otherwise document its own 422 body, which these routes never send.
_MODEL_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": _error(
        "400: a path or query parameter out of its bounds; 401: MATMUL_API_KEYS is set and no valid key was sent; "
        "404: no such model or version."
    )
}
_GUARDED: dict[int | str, dict[str, Any]] = {401: _error("MATMUL_API_KEYS is set and no valid key was sent.")}
_INFER_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("Two different Content-Type headers, an id that is not a string, a parameter out of its bounds."),
    404: _ERROR,
    422: _ERROR,
    **_GUARDED,
    408: _error("The body stopped arriving for MATMUL_BODY_TIMEOUT_S."),
    413: _error("The body is larger than MATMUL_MAX_BODY_BYTES."),
    415: _error("A Content-Encoding other than identity."),
    500: _error("The device or the service failed unexpectedly; the message names no internals."),
    503: _error("The queue is full, the kernels are not ready, the device is out of memory or was lost."),
    504: _error("The inference was still queued when its deadline passed; it was dropped, never run."),
}


def model_kernels(engine: Engine) -> dict[str, str | None]:
    """Model name -> the kernel it runs (None: the request's parameters.kernel, else auto)."""
    kernels = [k.name for k in engine.kernels() if k.kind != "auto"]
    return {MODEL: None} | {f"{MODEL}_{name}": name for name in kernels}


def _statistics(request: Request) -> dict[str, ModelStatistics]:
    stats: dict[str, ModelStatistics] = request.app.state.inference_stats
    return stats


def _model(model: str, engine: Engine, version: str | None = None) -> str | None:
    models = model_kernels(engine)
    if model not in models:
        raise UnknownModel(f"unknown model '{model}'; this server has {list(models)}")
    if version is not None and version != VERSION:
        raise UnknownModel(f"model '{model}' has no version '{version}'; its only version is '{VERSION}'")
    return models[model]


ModelName = Annotated[str, Path(max_length=128, description="`matmul` (auto), or `matmul_<kernel>`.")]
VersionName = Annotated[str, Path(max_length=32, description="The model version; only `1` exists.")]


def _known_version(model: ModelName, version: VersionName, engine: EngineDep) -> None:
    """The `{version}` of the versioned routes: the model must have it (the unversioned routes take none)."""
    _model(model, engine, version)


VERSIONED = [Depends(_known_version)]


def _metadata(model: str, engine: Engine) -> dict[str, Any]:
    def tensor(name: str) -> dict[str, Any]:
        return {"name": name, "datatype": "FP32", "shape": [-1, -1]}

    return {
        "name": model,
        "versions": [VERSION],
        "platform": "matmul-service",
        "inputs": [tensor(name) for name in inference_protocol.INPUTS],
        "outputs": [tensor(inference_protocol.OUTPUT)],
        "parameters": {"backend": engine.backend_name, "datatypes": list(inference_protocol.DATATYPES)},
    }


@router.get("", summary="Server metadata", responses=_GUARDED)
async def server_metadata() -> dict[str, Any]:
    """Name, version and the protocol extensions this server implements."""
    return {
        "name": "matmul-service",
        "version": __version__,
        "extensions": ["binary_tensor_data", "statistics", "model_configuration"],
    }


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
async def all_statistics(request: Request) -> dict[str, Any]:
    """The statistics extension for every model."""
    return {"model_stats": [stats.as_json(name) for name, stats in _statistics(request).items()]}


@router.get("/models/{model}", summary="Model metadata", responses=_MODEL_ERRORS)
@router.get(
    "/models/{model}/versions/{version}",
    dependencies=VERSIONED,
    summary="Model version metadata",
    responses=_MODEL_ERRORS,
)
async def model_metadata(model: ModelName, engine: EngineDep) -> dict[str, Any]:
    """Inputs A (m x k) and B (k x n), output C (m x n), FP32 or FP64; -1 marks a variable dimension."""
    _model(model, engine)
    return _metadata(model, engine)


@router.get("/models/{model}/ready", summary="Model readiness", responses={**_MODEL_ERRORS, 503: _ERROR})
@router.get(
    "/models/{model}/versions/{version}/ready",
    dependencies=VERSIONED,
    summary="Model version readiness",
    responses={**_MODEL_ERRORS, 503: _ERROR},
)
async def model_ready(model: ModelName, engine: EngineDep) -> dict[str, Any]:
    """200 when the model exists and the kernels are ready."""
    _model(model, engine)
    engine.check_ready()
    return {"name": model, "ready": True}


@router.get("/models/{model}/config", summary="Model configuration", responses=_MODEL_ERRORS)
@router.get(
    "/models/{model}/versions/{version}/config",
    dependencies=VERSIONED,
    summary="Model version configuration",
    responses=_MODEL_ERRORS,
)
async def model_config(model: ModelName, engine: EngineDep) -> dict[str, Any]:
    """Triton's model configuration extension: a minimal config (no batching dimension)."""
    _model(model, engine)

    def tensor(name: str) -> dict[str, Any]:
        return {"name": name, "data_type": "TYPE_FP32", "dims": [-1, -1]}

    return {
        "name": model,
        "platform": "matmul-service",
        "backend": engine.backend_name,
        "max_batch_size": 0,
        "input": [tensor(name) for name in inference_protocol.INPUTS],
        "output": [tensor(inference_protocol.OUTPUT)],
    }


@router.get("/models/{model}/stats", summary="Model statistics", responses=_MODEL_ERRORS)
@router.get(
    "/models/{model}/versions/{version}/stats",
    dependencies=VERSIONED,
    summary="Model version statistics",
    responses=_MODEL_ERRORS,
)
async def model_statistics(model: ModelName, request: Request, engine: EngineDep) -> dict[str, Any]:
    """The statistics extension: counts and cumulative nanoseconds of success, fail, queue and compute stages."""
    _model(model, engine)
    return {"model_stats": [_statistics(request)[model].as_json(model)]}


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


def _record_failure(request: Request, model: str, clock: Stopwatch) -> None:
    stats = _statistics(request).get(model)
    if stats is not None:
        stats.record_failure((perf_counter() - clock.received) * 1e3)


@router.post(
    "/models/{model}/infer",
    summary="Infer",
    responses=_INFER_ERRORS,
    openapi_extra=_INFER_BODY,
)
@router.post(
    "/models/{model}/versions/{version}/infer",
    dependencies=VERSIONED,
    summary="Infer (versioned)",
    responses=_INFER_ERRORS,
    openapi_extra=_INFER_BODY,
)
async def infer(model: ModelName, request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    """C = A @ B; tensors as JSON data or binary tensor data; C in binary when the request asks for it."""
    clock = Stopwatch()
    fixed_kernel = _model(model, engine)
    try:
        engine.check_ready()
        engine.check_room()
        limits = limits_of(settings)
        body = await read_body(request, settings.max_body_bytes, "body")
        clock.read_ms = (perf_counter() - clock.received) * 1e3
        header_length = request.headers.get(inference_protocol.HEADER_LENGTH)
        decoded = await decode_client_bytes(
            "inference request", len(body), settings, inference_protocol.decode_infer, body, header_length, limits
        )
        clock.mark_decoded()
        options = decoded.operands.options
        if fixed_kernel is not None:
            if options.kernel not in (None, fixed_kernel):
                raise InvalidParameter(f"model '{model}' runs kernel '{fixed_kernel}'; use model '{MODEL}' to choose")
            options = RequestOptions(kernel=fixed_kernel, tile=options.tile, dtype=options.dtype)
        operands = Operands(a=decoded.operands.a, b=decoded.operands.b, options=options)
        product = await compute(request, engine, settings, operands, options)
        clock.computed = perf_counter()
        c = product.outcome.c
        roofline = roofline_of(product).model_dump(exclude_none=True)
        parameters = {
            "kernel": product.outcome.plan.kernel,
            "backend": engine.backend_name,
            **{f"roofline_{name}": value for name, value in roofline.items()},
        }
        body, header_size = await off_loop_if_large(
            c.nbytes, settings, inference_protocol.encode_infer, c, model, decoded.id, decoded.binary_output, parameters
        )
    except MatmulError:
        _record_failure(request, model, clock)
        raise
    meta = describe(request, engine, product, clock)
    _statistics(request)[model].record_success(meta.timing)
    headers = {"Server-Timing": server_timing(meta.timing)}
    if header_size is None:
        return Response(content=body, media_type=JSON_MEDIA_TYPE, headers=headers)
    headers[inference_protocol.HEADER_LENGTH] = str(header_size)
    return Response(content=body, media_type=inference_protocol.BINARY_MEDIA_TYPE, headers=headers)


def new_statistics(engine: Engine) -> dict[str, ModelStatistics]:
    """Empty statistics for every model the engine serves."""
    return {name: ModelStatistics() for name in model_kernels(engine)}
