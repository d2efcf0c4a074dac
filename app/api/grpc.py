"""The Open Inference Protocol over gRPC: Triton's and KServe's `inference.GRPCInferenceService`, served by every
HTTP worker on MATMUL_GRPC_PORT (the workers share the port: SO_REUSEPORT), in front of the same engines as the HTTP
routes, with the same models, parameters, limits, API keys and errors.

The messages and the service's base class are those of Triton's Python client (`tritonclient.grpc`), compiled from
the protocol's upstream `grpc_service.proto`: the wire format is the one Triton's clients, KServe's and
`perf_analyzer -i grpc` speak, by construction. An infer request is read into the protocol's JSON form and decoded by
the same code as over HTTP (`app.codecs.inference_v2.decode_infer_document`), its raw input contents as views; C
goes back as raw output contents, or into the client's shared-memory region when the request puts it there.

Errors are gRPC status codes matching the HTTP statuses (`STATUS_CODES`), with the message the HTTP answer carries.
A call's deadline is the product's deadline in the queue (capped at MATMUL_REQUEST_TIMEOUT_S, as over HTTP); a
cancelled call cancels its product, which leaves the queue. The RPCs of model repositories, tracing, logging and
streaming are not served (UNIMPLEMENTED), as for the HTTP protocol.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from app import __version__
from app.api.auth import check_key, presented_key
from app.api.errors import status_of
from app.api.v2.models import VERSION, ModelCatalogue
from app.api.v2.shared_memory import check_enabled, shared_memory_enabled
from app.api.v2.statistics import InferenceStatistics
from app.codecs import inference_v2
from app.config import Settings, SharedMemoryKind
from app.dataplane.engine_client import EngineClient
from app.dataplane.wire import RegionKind
from app.errors import MalformedPayload, MatmulError, PayloadTooLarge
from app.service import MatmulService, Product, Stopwatch
from matmul_client.wire import data_bytes

log = logging.getLogger(__name__)

STATUS_CODES: Mapping[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    406: grpc.StatusCode.INVALID_ARGUMENT,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}
"""The gRPC status of each HTTP status the service answers with (app.api.errors.STATUS)."""
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
"""The RPCs that need no API key, as the HTTP health probes need none."""
MAX_DETAILS_BYTES = 2048
"""The most UTF-8 bytes of a status message sent. One that echoes a client's 100 KB name would pass the 8-16 KiB of
metadata gRPC clients take, and the client would read RESOURCE_EXHAUSTED instead of the status; in the grpc-message
header each byte past ASCII takes three (percent-encoded), so 2 KiB stays under 8 KiB whatever the text."""
MESSAGE_OVERHEAD_BYTES = 1 << 20
"""Room for a message's fields beside the tensors' bytes, within the size limits."""
MAX_MESSAGE_BYTES = (1 << 31) - 1
"""The largest message gRPC carries: its message-size options are C ints, and protobuf encodes no message of 2 GiB.
A MATMUL_MAX_BODY_BYTES past it, less MESSAGE_OVERHEAD_BYTES, holds over HTTP alone."""
STOP_GRACE_S = 10.0
"""How long calls in flight may take to finish when the worker stops, before they are cancelled."""

Handler = Callable[["InferenceServicer", Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _details(error: MatmulError) -> str:
    """The status message of `error`: its message, cut to MAX_DETAILS_BYTES of UTF-8 (at a whole character)."""
    encoded = error.message.encode()
    if len(encoded) <= MAX_DETAILS_BYTES:
        return error.message
    return encoded[: MAX_DETAILS_BYTES - 3].decode(errors="ignore") + "..."


async def _abort(context: grpc.aio.ServicerContext, error: MatmulError) -> None:
    """End the call with the status matching `error`'s HTTP status and its message (abort raises)."""
    await context.abort(STATUS_CODES.get(status_of(error), grpc.StatusCode.INTERNAL), _details(error))


def _rpc(handler: Handler) -> Handler:
    """An RPC of the servicer: the API key checked first (OPEN_METHODS need none); a MatmulError ends the call with
    the matching status and the error's message, anything else with INTERNAL."""
    method = handler.__name__

    @functools.wraps(handler)
    async def answer(self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check_key(method, context)
            return await handler(self, request, context)
        except MatmulError as exc:
            await _abort(context, exc)
            raise  # abort raises; this line is never reached
        except Exception:
            log.exception("the gRPC call %s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            raise

    return answer


def _unserved_rpc(method: str) -> Handler:
    """A call of the protocol that this service does not serve: UNIMPLEMENTED once the API key is checked, and nothing
    logged. The generated base class raises NotImplementedError for it, which gRPC logged with its traceback on every
    call, with or without a key."""

    async def unserved(self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check_key(method, context)
        except MatmulError as exc:
            await _abort(context, exc)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not served by matmul-service")

    unserved.__name__ = method
    return unserved


def _named_rpc(handler: Handler, reply: Any) -> Handler:
    """`handler` as the RPC that answers with `reply`: the RPC is named after it (SystemSharedMemoryStatusResponse
    answers SystemSharedMemoryStatus), for the key check and the log."""
    handler.__name__ = handler.__qualname__ = reply.__name__.removesuffix("Response")
    return _rpc(handler)


def _region_status_rpc(kind: RegionKind, reply: Any) -> Handler:
    """The status RPC of clients' shared memory of one kind: every registered region, or the one named."""

    async def status(self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        check_enabled(self.settings, SharedMemoryKind(kind))
        regions = await self.engine.region_status(request.name or None, kind)
        return reply(regions={str(region["name"]): reply.RegionStatus(**region) for region in regions})

    return _named_rpc(status, reply)


def _unregister_rpc(kind: RegionKind, reply: Any) -> Handler:
    """The unregister RPC of clients' shared memory of one kind: the region named, or every one."""

    async def unregister(self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        check_enabled(self.settings, SharedMemoryKind(kind))
        await self.engine.unregister_region(request.name or None, kind)
        return reply()

    return _named_rpc(unregister, reply)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Every RPC of the protocol this service serves, over one HTTP worker's engine link."""

    def __init__(self, settings: Settings, engine: EngineClient, statistics: InferenceStatistics) -> None:
        self.settings = settings
        self.engine = engine
        self.statistics = statistics
        self._keys = [key.get_secret_value().encode() for key in settings.api_keys]

    # ------------------------------------------------------------------------------------- the calls

    # model repositories, tracing, logging and streaming: not served
    RepositoryIndex = _unserved_rpc("RepositoryIndex")
    RepositoryModelLoad = _unserved_rpc("RepositoryModelLoad")
    RepositoryModelUnload = _unserved_rpc("RepositoryModelUnload")
    TraceSetting = _unserved_rpc("TraceSetting")
    LogSettings = _unserved_rpc("LogSettings")
    ModelStreamInfer = _unserved_rpc("ModelStreamInfer")

    def _check_key(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """With MATMUL_API_KEYS set, the call's metadata must carry one (authorization: Bearer, or x-api-key)."""
        if not self._keys or method in OPEN_METHODS:
            return
        metadata = (
            (key.encode(), value if isinstance(value, bytes) else value.encode())  # "-bin" keys' values are bytes
            for key, value in context.invocation_metadata() or ()
        )
        check_key(
            presented_key(metadata), self._keys, "the metadata 'authorization: Bearer <key>' or 'x-api-key: <key>'"
        )

    def _catalogue(self) -> ModelCatalogue:
        return ModelCatalogue.of(self.engine)

    @_rpc
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    def _ready(self) -> bool:
        """Whether the engines are ready (the kernels compiled and self-tested): a readiness probe's answer."""
        try:
            self.engine.check_ready()
        except MatmulError:
            return False
        return True

    @_rpc
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self._ready())

    @_rpc
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._catalogue().kernel_of(request.name, request.version or None)
        return pb.ModelReadyResponse(ready=self._ready())

    @_rpc
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        extensions = ["binary_tensor_data", "statistics", "model_configuration"]
        extensions += [
            f"{kind}_shared_memory" for kind in SharedMemoryKind if shared_memory_enabled(self.settings, kind)
        ]
        return pb.ServerMetadataResponse(name="matmul-service", version=__version__, extensions=extensions)

    @_rpc
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        catalogue = self._catalogue()
        catalogue.kernel_of(request.name, request.version or None)
        described = {key: value for key, value in catalogue.metadata(request.name).items() if key != "parameters"}
        return json_format.ParseDict(described, pb.ModelMetadataResponse())

    @_rpc
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        catalogue = self._catalogue()
        catalogue.kernel_of(request.name, request.version or None)
        return json_format.ParseDict({"config": catalogue.config(request.name)}, pb.ModelConfigResponse())

    @_rpc
    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        catalogue = self._catalogue()
        if request.name:
            catalogue.kernel_of(request.name, request.version or None)
        names = [request.name] if request.name else list(catalogue.kernels)
        stats = self.statistics.model_stats(names)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    @_rpc
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        clock = Stopwatch()
        model = request.model_name
        catalogue = self._catalogue()
        catalogue.kernel_of(model, request.model_version or None)
        service = MatmulService(self.engine, self.settings)
        try:
            service.admit()
            clock.mark_read()
            document, raw = _document(request)
            decoded = inference_v2.decode_infer_document(document, raw.take, service.limits)
            raw.check_all_taken()
            clock.mark_decoded()
            options = catalogue.options_for(model, decoded.operands.options)
            product = await service.run(
                decoded.operands, options, context.time_remaining(), clock, decoded.output_region
            )
            try:
                response = _infer_response(product, model, decoded)
                timing = product.describe().timing
            finally:
                product.release()
            _check_answer_fits(response, self.settings)
        except MatmulError:
            self.statistics.record_failure(model, clock.elapsed_ms())
            raise
        self.statistics.record_success(model, timing)
        return response

    # ------------------------------------------------------------------------- clients' shared memory

    SystemSharedMemoryStatus = _region_status_rpc("system", pb.SystemSharedMemoryStatusResponse)
    SystemSharedMemoryUnregister = _unregister_rpc("system", pb.SystemSharedMemoryUnregisterResponse)
    CudaSharedMemoryStatus = _region_status_rpc("cuda", pb.CudaSharedMemoryStatusResponse)
    CudaSharedMemoryUnregister = _unregister_rpc("cuda", pb.CudaSharedMemoryUnregisterResponse)

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        check_enabled(self.settings, SharedMemoryKind.SYSTEM)
        await self.engine.register_region(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        check_enabled(self.settings, SharedMemoryKind.CUDA)
        handle = base64.b64encode(request.raw_handle).decode()
        await self.engine.register_cuda_region(request.name, handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()


# ------------------------------------------------------------------------------------- infer's messages


class _RawContents:
    """A request's raw input contents, one for each input that is neither in shared memory nor typed contents,
    in the order of the inputs, taken as views; every one must be taken."""

    def __init__(self, contents: list[bytes]) -> None:
        self.contents = contents
        self.taken = 0

    def take(self, name: str, nbytes: int) -> memoryview:
        """The next raw contents: `_document` declared their own length as the input's binary_data_size, which the
        decoder has checked against the input's shape."""
        view = memoryview(self.contents[self.taken])
        self.taken += 1
        return view

    def check_all_taken(self) -> None:
        if self.taken != len(self.contents):
            raise MalformedPayload(f"{len(self.contents) - self.taken} raw input contents belong to no input")


def _parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The protocol's parameters (InferParameter's one value each) as the JSON form has them."""
    read = {}
    for name, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        if which is not None:
            read[name] = getattr(parameter, which)
    return read


TYPED_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT8": "int_contents"}
"""The typed contents field of each datatype that has one (FP16 tensors travel as raw contents)."""


def _document(request: Any) -> tuple[dict[str, Any], _RawContents]:
    """A ModelInferRequest in the protocol's JSON form: typed contents as data, raw contents as binary inputs."""
    raw = list(request.raw_input_contents)
    inputs, binary = [], 0
    for tensor in request.inputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
            "parameters": _parameters(tensor.parameters),
        }
        typed = TYPED_CONTENTS.get(tensor.datatype)
        if tensor.HasField("contents"):
            if tensor.datatype not in inference_v2.DATATYPES:
                raise inference_v2.unsupported_datatype(tensor.name, tensor.datatype)
            if typed is None:
                raise MalformedPayload(
                    f"input '{tensor.name}' is {tensor.datatype}: send it as raw contents", location=[tensor.name]
                )
            entry["data"] = list(getattr(tensor.contents, typed))
        elif "shared_memory_region" not in entry["parameters"]:
            if len(raw) <= binary:
                raise MalformedPayload(f"input '{tensor.name}' has no raw contents", location=[tensor.name])
            entry["parameters"]["binary_data_size"] = len(raw[binary])  # checked against its shape by the decoder
            binary += 1
        inputs.append(entry)
    document: dict[str, Any] = {"inputs": inputs, "parameters": _parameters(request.parameters)}
    if request.outputs:
        document["outputs"] = [{"name": o.name, "parameters": _parameters(o.parameters)} for o in request.outputs]
    if request.id:
        document["id"] = request.id
    return document, _RawContents(raw)


def _parameter(value: Any) -> Any:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))


def _infer_response(product: Product, model: str, decoded: inference_v2.InferRequest) -> Any:
    """C as raw output contents (or its place in the client's region), with the kernel, backend, batch size,
    precision, error bound and roofline as parameters, as the HTTP answer has them."""
    parameters = product.protocol_parameters()
    output = pb.ModelInferResponse.InferOutputTensor(
        name=inference_v2.OUTPUT,
        datatype=inference_v2.DATATYPE_OF[product.dtype.name],
        shape=list(product.shape.result),
    )
    response = pb.ModelInferResponse(
        model_name=model,
        model_version=VERSION,
        id=decoded.id or "",
        parameters={name: _parameter(value) for name, value in parameters.items()},
    )
    region = decoded.output_region
    if region is not None:
        placed = {
            "shared_memory_region": region.region,
            "shared_memory_offset": region.offset,
            "shared_memory_byte_size": math.prod(product.shape.result) * product.dtype.itemsize,
        }
        for name, value in placed.items():
            output.parameters[name].CopyFrom(_parameter(value))
    else:
        response.raw_output_contents.append(bytes(data_bytes(product.c)))
    response.outputs.append(output)
    return response


# ------------------------------------------------------------------------------------------ the server


def message_limit(settings: Settings) -> int:
    """The largest message either way: the body limit over HTTP, and room for the fields beside the tensors, up to
    the most gRPC carries."""
    return min(settings.max_body_bytes + MESSAGE_OVERHEAD_BYTES, MAX_MESSAGE_BYTES)


def _message_limit_source(settings: Settings) -> str:
    """What sets message_limit, in the words of the answers it refuses."""
    if settings.max_body_bytes + MESSAGE_OVERHEAD_BYTES > MAX_MESSAGE_BYTES:
        return "the most gRPC carries; MATMUL_MAX_BODY_BYTES is more, over HTTP only"
    return "MATMUL_MAX_BODY_BYTES and 1 MiB for the other fields"


def _check_answer_fits(response: Any, settings: Settings) -> None:
    """PayloadTooLarge (RESOURCE_EXHAUSTED) for an answer past the message limit, saying what to do instead, rather
    than the transport's own failure to send it: a product's C can be far larger than its operands (m x 1 @ 1 x n)."""
    size, limit = response.ByteSize(), message_limit(settings)
    if size > limit:
        raise PayloadTooLarge(
            f"the answer is {size} bytes, over the gRPC message limit of {limit} ({_message_limit_source(settings)}): "
            "ask for C in shared memory, or over HTTP"
        )


async def start_server(settings: Settings, engine: EngineClient, statistics: InferenceStatistics) -> grpc.aio.Server:
    """This HTTP worker's gRPC server on MATMUL_GRPC_HOST:MATMUL_GRPC_PORT, the port shared with the other workers."""
    limit = message_limit(settings)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(settings, engine, statistics), server)
    address = f"{settings.grpc_host}:{settings.grpc_port}"
    server.add_insecure_port(address)  # RuntimeError where it cannot listen there
    await server.start()
    log.info("gRPC inference protocol on %s", address)
    if settings.max_body_bytes + MESSAGE_OVERHEAD_BYTES > limit:
        # a warning: uvicorn's HTTP workers show no info of the service's loggers
        log.warning("gRPC messages are limited to %d bytes (%s)", limit, _message_limit_source(settings))
    return server
