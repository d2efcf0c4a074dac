"""The inference protocol over gRPC, through Triton's own gRPC clients (tritonclient.grpc, sync and asyncio),
against the service running as a real process on the CPU backend: every RPC, raw and typed contents, the errors as
status codes, API keys in metadata, message limits, system shared memory, and 64 concurrent calls whose answers are
each checked against their own float64 product."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from app.api import grpc as grpc_front
from app.api.v2.statistics import InferenceStatistics
from app.config import Settings
from app.engine import DeviceWorker, EngineState
from app.metrics import ServiceMetrics
from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.precision import Precision
from numerics.reference import assert_close_to_reference
from tests.fakes import RecordingEngine, SteeredBackend, until

pytestmark = pytest.mark.timeout(300)
MIB = 1 << 20
MAX_BODY_BYTES = 4 * MIB
GUARD_S = 120
"""How long a test waits for an answer it expects: a hang guard only."""


def _serve(env: dict[str, str]) -> Iterator[str]:
    port, grpc_port = free_port(), free_port()
    settings = {
        "MATMUL_BACKEND": "cpu",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_GRPC_PORT": str(grpc_port),
        "MATMUL_GRPC_HOST": "127.0.0.1",
        **env,
    }
    with running_server(uvicorn_command(port), port, env=settings):
        yield f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    yield from _serve({"MATMUL_SHARED_MEMORY": "system", "MATMUL_MAX_BODY_BYTES": str(MAX_BODY_BYTES)})


@pytest.fixture
def triton(url: str) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(url=url)
    yield client
    client.close()


def _inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    datatype = {"float16": "FP16", "float32": "FP32", "float64": "FP64"}[a.dtype.name]
    tensors = [grpcclient.InferInput("A", list(a.shape), datatype), grpcclient.InferInput("B", list(b.shape), datatype)]
    tensors[0].set_data_from_numpy(a)
    tensors[1].set_data_from_numpy(b)
    return tensors


def _operands(seed: int, m: int = 33, k: int = 17, n: int = 9, dtype: type = np.float32) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


def test_health_metadata_and_configuration(triton: grpcclient.InferenceServerClient) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("matmul") and triton.is_model_ready("matmul_numpy", "1")
    metadata = triton.get_server_metadata()
    assert metadata.name == "matmul-service"
    assert set(metadata.extensions) >= {"binary_tensor_data", "statistics", "model_configuration"}
    assert "system_shared_memory" in metadata.extensions and "cuda_shared_memory" not in metadata.extensions
    model = triton.get_model_metadata("matmul_numpy")
    assert (model.name, list(model.versions)) == ("matmul_numpy", ["1"])
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("A", "FP32", [-1, -1]),
        ("B", "FP32", [-1, -1]),
    ]
    assert [t.name for t in model.outputs] == ["C"]
    config = triton.get_model_config("matmul").config
    assert (config.name, config.max_batch_size, [t.name for t in config.input]) == ("matmul", 0, ["A", "B"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_infer_with_raw_contents_and_its_statistics(triton: grpcclient.InferenceServerClient, dtype: type) -> None:
    model = "matmul_tiled" if dtype == np.float32 else "matmul_naive"
    before = triton.get_inference_statistics(model).model_stats[0].inference_stats.success.count
    a, b = _operands(4, dtype=dtype)
    result = triton.infer(model, _inputs(a, b), request_id="mine", outputs=[grpcclient.InferRequestedOutput("C")])
    c = result.as_numpy("C")
    assert c.dtype == dtype and result.get_response().id == "mine"
    assert_close_to_reference(c, a, b, np.dtype(dtype))
    parameters = result.get_response().parameters
    assert parameters["kernel"].string_param == model.removeprefix("matmul_")
    assert parameters["backend"].string_param == "cpu" and parameters["roofline_flops"].int64_param == 2 * 33 * 17 * 9
    stats = triton.get_inference_statistics(model).model_stats[0]
    assert stats.inference_stats.success.count == before + 1 and stats.inference_stats.success.ns > 0


def test_parameters_choose_the_kernel_and_fp16_inputs_run_in_fp16(triton: grpcclient.InferenceServerClient) -> None:
    a, b = _operands(5)
    tiled = triton.infer("matmul", _inputs(a, b), parameters={"kernel": "tiled", "tile": 8})
    assert tiled.get_response().parameters["kernel"].string_param == "tiled"
    assert_close_to_reference(tiled.as_numpy("C"), a, b, np.dtype(np.float32))
    halves = a.astype(np.float16), b.astype(np.float16)
    fp16 = triton.infer("matmul", _inputs(*halves))
    assert fp16.get_response().parameters["precision"].string_param == "fp16"
    assert_close_to_reference(fp16.as_numpy("C"), *halves, np.dtype(np.float32), precision=Precision.FP16)


def test_typed_contents_are_read_as_the_tensors_values(url: str) -> None:
    """Clients of other languages send typed contents (fp32_contents) instead of raw bytes."""
    a, b = _operands(6, m=3, k=4, n=2)
    request = pb.ModelInferRequest(model_name="matmul")
    for name, x in (("A", a), ("B", b)):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(url) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    [output] = response.outputs
    c = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(output.shape))
    assert_close_to_reference(c, a, b, np.dtype(np.float32))


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        (lambda t: t.infer("nope", _inputs(*_operands(1))), "StatusCode.NOT_FOUND", "unknown model 'nope'"),
        (lambda t: t.get_model_metadata("matmul", "7"), "StatusCode.NOT_FOUND", "has no version '7'"),
        (
            lambda t: t.infer("matmul", _inputs(*_operands(1)), parameters={"kernel": "fast"}),
            "StatusCode.INVALID_ARGUMENT",
            "'fast' needs the GPU backend",
        ),
        (
            lambda t: t.infer("matmul", _inputs(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))),
            "StatusCode.INVALID_ARGUMENT",
            "inner dimensions",
        ),
        (
            lambda t: t.infer("matmul", _inputs(*_operands(1, m=1, k=1500, n=1500))),
            "StatusCode.RESOURCE_EXHAUSTED",
            "larger than max",
        ),
        (
            lambda t: t.get_cuda_shared_memory_status(),
            "StatusCode.NOT_FOUND",
            "cuda shared memory is off; MATMUL_SHARED_MEMORY=cuda enables it",
        ),
    ],
    ids=["unknown model", "unknown version", "a kernel of another backend", "shapes", "message too large", "off"],
)
def test_errors_are_the_status_codes_of_the_http_statuses(
    triton: grpcclient.InferenceServerClient, call: object, code: str, message: str
) -> None:
    with pytest.raises(InferenceServerException) as raised:
        call(triton)  # type: ignore[operator]
    assert raised.value.status() == code and message in raised.value.message()


def test_a_model_of_one_kernel_refuses_another(triton: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="runs kernel 'numpy'") as raised:
        triton.infer("matmul_numpy", _inputs(*_operands(1)), parameters={"kernel": "tiled"})
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_system_shared_memory_holds_the_operands_and_the_product(triton: grpcclient.InferenceServerClient) -> None:
    a, b = _operands(7)
    name = f"grpc-{uuid.uuid4().hex[:8]}"
    c_at = a.nbytes + b.nbytes
    size = c_at + a.shape[0] * b.shape[1] * 4
    handle = shm.create_shared_memory_region(name, f"/{name}", size)
    try:
        shm.set_shared_memory_region(handle, [a, b])
        triton.register_system_shared_memory(name, f"/{name}", size)
        status = triton.get_system_shared_memory_status(name)
        assert status.regions[name].byte_size == size and status.regions[name].key == f"/{name}"
        inputs = [grpcclient.InferInput("A", list(a.shape), "FP32"), grpcclient.InferInput("B", list(b.shape), "FP32")]
        inputs[0].set_shared_memory(name, a.nbytes)
        inputs[1].set_shared_memory(name, b.nbytes, offset=a.nbytes)
        output = grpcclient.InferRequestedOutput("C")
        output.set_shared_memory(name, size - c_at, offset=c_at)
        result = triton.infer("matmul", inputs, outputs=[output])
        placed = result.get_output("C")
        assert placed.parameters["shared_memory_offset"].int64_param == c_at
        c = shm.get_contents_as_numpy(handle, np.float32, [a.shape[0], b.shape[1]], offset=c_at)
        assert_close_to_reference(c, a, b, np.dtype(np.float32))
        triton.unregister_system_shared_memory(name)
        assert name not in triton.get_system_shared_memory_status().regions
        with pytest.raises(InferenceServerException, match=f"no shared-memory region named '{name}'"):
            triton.infer("matmul", inputs, outputs=[output])
    finally:
        shm.destroy_shared_memory_region(handle)


def test_64_concurrent_calls_each_get_their_own_product(url: str) -> None:
    async def run() -> None:
        client = grpcaio.InferenceServerClient(url=url)
        try:
            operands = [_operands(100 + i, m=8 + i, k=16, n=24 - i % 8) for i in range(64)]
            results = await asyncio.gather(*(client.infer("matmul", _inputs(a, b)) for a, b in operands))
            for (a, b), result in zip(operands, results, strict=True):
                assert_close_to_reference(result.as_numpy("C"), a, b, np.dtype(np.float32))
        finally:
            await client.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    yield from _serve({"MATMUL_API_KEYS": "first,second"})


def test_api_keys_travel_in_metadata_and_liveness_needs_none(keyed_url: str) -> None:
    triton = grpcclient.InferenceServerClient(url=keyed_url)
    try:
        assert triton.is_server_live() and triton.is_server_ready()
        with pytest.raises(InferenceServerException, match="needs an API key") as raised:
            triton.get_server_metadata()
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException, match="not valid"):
            triton.get_server_metadata(headers={"authorization": "Bearer third"})
        a, b = _operands(8)
        for headers in ({"authorization": "Bearer first"}, {"x-api-key": "second"}):
            result = triton.infer("matmul", _inputs(a, b), headers=headers)
            assert_close_to_reference(result.as_numpy("C"), a, b, np.dtype(np.float32))
    finally:
        triton.close()


# ---------------------------------------------------------------------- the service in this process


@pytest.fixture
async def in_process() -> AsyncIterator[tuple[grpcaio.InferenceServerClient, RecordingEngine, SteeredBackend]]:
    """The gRPC service over an in-process engine whose launches wait at a gate the test opens, recording each
    product's request and deadline; and Triton's asyncio client of it."""
    backend = SteeredBackend()
    engine = RecordingEngine(DeviceWorker(backend, queue_size=4))
    engine.start()
    await until(lambda: engine.state is EngineState.READY)
    settings = Settings(backend="cpu", grpc_port=free_port(), grpc_host="127.0.0.1", request_timeout_s=30.0)
    server = await grpc_front.start_server(settings, engine, InferenceStatistics(ServiceMetrics()))  # type: ignore[arg-type]
    client = grpcaio.InferenceServerClient(url=f"127.0.0.1:{settings.grpc_port}")
    try:
        yield client, engine, backend
    finally:
        backend.gate.set()
        await client.close()
        await server.stop(None)
        await engine.stop()


@pytest.mark.anyio
async def test_a_calls_deadline_is_its_products_capped_at_the_request_timeout(
    in_process: tuple[grpcaio.InferenceServerClient, RecordingEngine, SteeredBackend],
) -> None:
    client, engine, _ = in_process
    a, b = _operands(11)
    await client.infer("matmul", _inputs(a, b), client_timeout=5.0)
    await client.infer("matmul", _inputs(a, b))
    await client.infer("matmul", _inputs(a, b), client_timeout=3600.0)
    deadlines = [deadline for _, deadline in engine.calls]
    # what is left of the call's 5 s when the server reads it (the grpc-timeout header rounds up its last unit)
    assert deadlines[0] is not None and 1.0 < deadlines[0] <= 5.1
    assert deadlines[1:] == [30.0, 30.0]


@pytest.mark.anyio
async def test_a_cancelled_call_takes_its_product_out_of_the_queue(
    in_process: tuple[grpcaio.InferenceServerClient, RecordingEngine, SteeredBackend],
) -> None:
    client, engine, backend = in_process
    backend.gate.clear()
    running = asyncio.create_task(client.infer("matmul", _inputs(*_operands(12))))
    assert await asyncio.to_thread(backend.entered.acquire, True, GUARD_S)
    queued = asyncio.create_task(client.infer("matmul", _inputs(*_operands(13))))
    await until(lambda: engine.queue_depth == 1)
    queued.cancel()
    await until(lambda: engine.queue_depth == 0)  # it left the queue while the first still runs
    backend.gate.set()
    a, b = _operands(12)
    assert_close_to_reference((await running).as_numpy("C"), a, b, np.dtype(np.float32))
    assert backend.batches == [1]  # the cancelled product was never launched
