"""The inference protocol over gRPC, through Triton's own gRPC clients (tritonclient.grpc, sync and asyncio),
against the service running as a real process on the CPU backend: every RPC, raw and typed contents, the errors as
status codes, API keys in metadata, message limits, system shared memory, and 64 concurrent calls whose answers are
each checked against their own float64 product."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

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
from app.errors import NotReady
from app.metrics import ServiceMetrics
from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.precision import Precision, input_error
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


def test_a_stack_keeps_its_batch_dimension(triton: grpcclient.InferenceServerClient) -> None:
    """A (1, k, n) B, a stack of one, is broadcast against A's stack of 4, as numpy.matmul does."""
    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((4, 6, 5), np.float32), rng.standard_normal((1, 5, 3), np.float32)
    result = triton.infer("matmul", _inputs(a, b), outputs=[grpcclient.InferRequestedOutput("C")])
    c = result.as_numpy("C")
    assert c.shape == (4, 6, 3) and result.get_response().outputs[0].shape == [4, 6, 3]
    assert_close_to_reference(c, a, b, np.float32)
    assert result.get_response().parameters["batch_size"].int64_param == 4


def test_parameters_choose_the_kernel_and_fp16_inputs_run_in_fp16(triton: grpcclient.InferenceServerClient) -> None:
    a, b = _operands(5)
    tiled = triton.infer("matmul", _inputs(a, b), parameters={"kernel": "tiled", "tile": 8})
    assert tiled.get_response().parameters["kernel"].string_param == "tiled"
    assert_close_to_reference(tiled.as_numpy("C"), a, b, np.dtype(np.float32))
    halves = a.astype(np.float16), b.astype(np.float16)
    fp16 = triton.infer("matmul", _inputs(*halves))
    assert fp16.get_response().parameters["precision"].string_param == "fp16"
    assert_close_to_reference(fp16.as_numpy("C"), *halves, np.dtype(np.float32), precision=Precision.FP16)


def test_an_answer_names_its_model_and_says_how_the_product_was_made_in_typed_parameters(url: str) -> None:
    """A request without an id gets an empty one; the parameters carry each value in its own type (strings, int64,
    double), as the HTTP answer's JSON has them."""
    a, b = _operands(7, m=5, k=6, n=4)
    request = _infer_request(a, b)
    request.parameters["precision"].string_param = "bf16"
    with grpc.insecure_channel(url) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert (response.model_name, response.model_version, response.id) == ("matmul", "1", "")
    parameters = response.parameters
    assert (parameters["kernel"].string_param, parameters["precision"].string_param) == ("numpy", "bf16")
    assert parameters["batch_size"].int64_param == 1 and parameters["roofline_flops"].int64_param == 2 * 5 * 6 * 4
    assert parameters["error_bound_input"].double_param == input_error(Precision.BF16) > 0


def test_an_answer_past_the_message_limit_is_refused_saying_what_to_do(url: str) -> None:
    """2048 x 1 @ 1 x 1024: a request of 12 KiB whose C is 8 MiB, past the 5 MiB limit either way; a client that would
    take it still gets RESOURCE_EXHAUSTED, saying how to get C, and the next product is served."""
    a, b = _operands(9, m=2048, k=1, n=1024)
    unlimited = [("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(url, options=unlimited) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(_infer_request(a, b))
        assert stub.ModelInfer(_infer_request(a[:8], b)).outputs[0].shape == [8, 1024]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    said = re.fullmatch(
        rf"the answer is (\d+) bytes, over the gRPC message limit of {MAX_BODY_BYTES + MIB} \(MATMUL_MAX_BODY_BYTES "
        r"and 1 MiB for the other fields\): ask for C in shared memory, or over HTTP",
        refused.value.details(),
    )
    assert said is not None and 2048 * 1024 * 4 < int(said[1]) < 2048 * 1024 * 4 + 4096, refused.value.details()


def test_an_input_without_raw_contents_is_refused_naming_it(url: str) -> None:
    a, b = _operands(8, m=2, k=3, n=2)
    request = _infer_request(a, b)
    del request.raw_input_contents[1]
    with grpc.insecure_channel(url) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'B' has no raw contents",
    )


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


def test_int8_inputs_answer_their_exact_int32_product(triton: grpcclient.InferenceServerClient, url: str) -> None:
    """INT8 inputs as raw contents (tritonclient) and as typed int_contents (other languages' clients) are multiplied
    exactly into an INT32 output; a typed value out of int8's range is refused saying where."""
    rng = np.random.default_rng(9)
    a, b = rng.integers(-128, 128, (5, 2000), np.int8), rng.integers(-128, 128, (2000, 3), np.int8)
    a[0], b[:, 0] = -128, -128
    expected = a.astype(np.int64) @ b.astype(np.int64)
    inputs = [grpcclient.InferInput("A", list(a.shape), "INT8"), grpcclient.InferInput("B", list(b.shape), "INT8")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    raw = triton.infer("matmul", inputs)
    assert raw.get_output("C").datatype == "INT32" and np.array_equal(raw.as_numpy("C"), expected)
    assert raw.get_response().parameters["precision"].string_param == "int8"

    def typed(b_values: list[int]) -> Any:
        request = pb.ModelInferRequest(model_name="matmul")
        for name, x in (("A", a), ("B", b)):
            tensor = request.inputs.add(name=name, datatype="INT8", shape=list(x.shape))
            tensor.contents.int_contents.extend(b_values if name == "B" else x.ravel().tolist())
        return request

    with grpc.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(typed(b.ravel().tolist()))
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(typed([*b.ravel().tolist()[:-1], 200]))
    [output] = response.outputs
    assert output.datatype == "INT32"
    assert np.array_equal(np.frombuffer(response.raw_output_contents[0], "<i4").reshape(list(output.shape)), expected)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "input 'B' is INT8: B[1999][2] = 200 is not an int8 (an integer from -128 to 127)"
    )


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


def _infer_request(a: np.ndarray, b: np.ndarray) -> Any:
    """A ModelInfer request of a @ b in FP32, its operands as raw contents."""
    request = pb.ModelInferRequest(model_name="matmul", raw_input_contents=[a.tobytes(), b.tobytes()])
    for name, x in (("A", a), ("B", b)):
        request.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
    return request


def _of_size(request: Any, size: int) -> Any:
    """`request` with its last raw contents grown or shrunk so that the whole message is `size` bytes."""
    while (missing := size - request.ByteSize()) != 0:
        contents = request.raw_input_contents[-1]
        request.raw_input_contents[-1] = contents + bytes(missing) if missing > 0 else contents[:missing]
    return request


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
        assert placed.parameters["shared_memory_region"].string_param == name
        assert placed.parameters["shared_memory_offset"].int64_param == c_at
        assert placed.parameters["shared_memory_byte_size"].int64_param == a.shape[0] * b.shape[1] * 4
        c = shm.get_contents_as_numpy(handle, np.float32, [a.shape[0], b.shape[1]], offset=c_at)
        assert_close_to_reference(c, a, b, np.dtype(np.float32))
        other = f"{name}-other"  # a second region over the same object: status and unregister of one by name
        triton.register_system_shared_memory(other, f"/{name}", size)
        assert list(triton.get_system_shared_memory_status(name).regions) == [name]
        triton.unregister_system_shared_memory(name)
        assert list(triton.get_system_shared_memory_status().regions) == [other]
        triton.unregister_system_shared_memory(other)
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


@asynccontextmanager
async def serving_in_process(settings: Settings) -> AsyncIterator[tuple[str, RecordingEngine, SteeredBackend]]:
    """The gRPC service of `settings` in this process, over an in-process engine whose launches wait at a gate the
    test opens, recording each product's request and deadline: its address, the engine and the backend."""
    backend = SteeredBackend()
    engine = RecordingEngine(DeviceWorker(backend, queue_size=4))
    engine.start()
    await until(lambda: engine.state is EngineState.READY)
    server = await grpc_front.start_server(settings, engine, InferenceStatistics(ServiceMetrics()))  # type: ignore[arg-type]
    try:
        yield f"{settings.grpc_host}:{settings.grpc_port}", engine, backend
    finally:
        backend.gate.set()
        await server.stop(None)
        await engine.stop()


def _in_process_settings(**settings: Any) -> Settings:
    return Settings(backend="cpu", grpc_port=free_port(), grpc_host="127.0.0.1", request_timeout_s=30.0, **settings)


@pytest.fixture
async def in_process() -> AsyncIterator[tuple[grpcaio.InferenceServerClient, RecordingEngine, SteeredBackend]]:
    """The service in this process (`serving_in_process`), and Triton's asyncio client of it."""
    async with serving_in_process(_in_process_settings()) as (address, engine, backend):
        client = grpcaio.InferenceServerClient(url=address)
        try:
            yield client, engine, backend
        finally:
            await client.close()


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


def _of_size(request: Any, size: int) -> Any:
    """`request` with its last raw contents grown or shrunk so that the whole message is `size` bytes."""
    while (missing := size - request.ByteSize()) != 0:
        contents = request.raw_input_contents[-1]
        request.raw_input_contents[-1] = contents + bytes(missing) if missing > 0 else contents[:missing]
    return request


@pytest.mark.anyio
async def test_tensors_of_the_body_limit_are_served_and_a_message_past_the_grpc_limit_is_refused() -> None:
    """A ModelInfer whose tensors are exactly MATMUL_MAX_BODY_BYTES (4 MiB) is served, though the message is larger
    by its other fields; a message one byte past the gRPC limit is RESOURCE_EXHAUSTED, and one of exactly the limit
    is read (and refused only for what it holds)."""
    settings = _in_process_settings(max_body_bytes=MAX_BODY_BYTES)
    limit = grpc_front.message_limit(settings)
    a, b = np.full((1024, 512), 0.5, np.float32), np.full((512, 1024), 0.25, np.float32)
    assert a.nbytes + b.nbytes == MAX_BODY_BYTES
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with (
        serving_in_process(settings) as (address, _, _),
        grpc.aio.insecure_channel(address, unlimited) as channel,
    ):
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        request = _infer_request(a, b)
        assert request.ByteSize() > MAX_BODY_BYTES
        response = await infer(request)
        c = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(response.outputs[0].shape))
        np.testing.assert_array_equal(c, np.full((1024, 1024), 64.0, np.float32))
        for size, code, words in (
            (limit, grpc.StatusCode.INVALID_ARGUMENT, "but its binary_data_size is"),
            (limit + 1, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await infer(_of_size(_infer_request(a, b), size))
            assert raised.value.code() == code and words in str(raised.value.details()), raised.value.details()


@pytest.mark.anyio
async def test_a_body_limit_past_what_grpc_carries_caps_the_grpc_messages_alone_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MATMUL_MAX_BODY_BYTES of 4 GiB, for HTTP: gRPC, on by default, starts with the largest message it carries,
    2 GiB - 1 (the body limit and 1 MiB would not fit its 32-bit option), serves, and the log says so; a limit that
    fits is not capped."""
    assert grpc_front.message_limit(_in_process_settings(max_body_bytes=(1 << 31) - 1 - MIB)) == (1 << 31) - 1
    settings = _in_process_settings(max_body_bytes=4 << 30)
    assert grpc_front.message_limit(settings) == (1 << 31) - 1
    with caplog.at_level(logging.INFO, logger=grpc_front.__name__):
        async with serving_in_process(settings) as (address, _, _):
            client = grpcaio.InferenceServerClient(url=address)
            try:
                a, b = _operands(14)
                result = await client.infer("matmul", _inputs(a, b))
            finally:
                await client.close()
    assert_close_to_reference(result.as_numpy("C"), a, b, np.dtype(np.float32))
    [warning] = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning == (
        "gRPC messages are limited to 2147483647 bytes "
        "(the most gRPC carries; MATMUL_MAX_BODY_BYTES is more, over HTTP only)"
    )


# ---------------------------------------------------------------------------------- API keys, every RPC

KEYED_RPCS: dict[str, Any] = {
    "ServerMetadata": pb.ServerMetadataRequest(),
    "ModelReady": pb.ModelReadyRequest(name="matmul"),
    "ModelMetadata": pb.ModelMetadataRequest(name="matmul"),
    "ModelConfig": pb.ModelConfigRequest(name="matmul"),
    "ModelStatistics": pb.ModelStatisticsRequest(name="matmul"),
    "ModelInfer": _infer_request(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),
    "SystemSharedMemoryStatus": pb.SystemSharedMemoryStatusRequest(),
    "SystemSharedMemoryRegister": pb.SystemSharedMemoryRegisterRequest(name="r", key="/no-such-object", byte_size=64),
    "SystemSharedMemoryUnregister": pb.SystemSharedMemoryUnregisterRequest(name="r"),
    "CudaSharedMemoryStatus": pb.CudaSharedMemoryStatusRequest(),
    "CudaSharedMemoryRegister": pb.CudaSharedMemoryRegisterRequest(name="r", raw_handle=b"x" * 64, byte_size=64),
    "CudaSharedMemoryUnregister": pb.CudaSharedMemoryUnregisterRequest(name="r"),
}
"""A request of every RPC the service serves that needs an API key: all but the liveness and readiness probes."""
OPEN_RPCS = {"ServerLive": pb.ServerLiveRequest(), "ServerReady": pb.ServerReadyRequest()}
NO_KEY = "this server needs an API key: send the metadata 'authorization: Bearer <key>' or 'x-api-key: <key>'"
WRONG_KEY = "the API key is not valid"
REFUSED_METADATA = {
    "no key": ([], NO_KEY),
    "a key without its scheme": ([("authorization", "first")], NO_KEY),
    "another key": ([("authorization", "Bearer third")], WRONG_KEY),
    "a prefix of a key": ([("x-api-key", "firs")], WRONG_KEY),
    "a key and more": ([("x-api-key", "first-")], WRONG_KEY),
    "both keys listed": ([("authorization", "Bearer first,second")], WRONG_KEY),
}
PAST_THE_KEY = {
    "first as a bearer token": [("authorization", "Bearer first")],
    "second as x-api-key": [("x-api-key", "second")],
}


@pytest.fixture
async def keyed_in_process() -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    """A stub of the service in this process with MATMUL_API_KEYS=first,second (shared memory off)."""
    settings = _in_process_settings(api_keys="first,second")
    async with serving_in_process(settings) as (address, _, _), grpc.aio.insecure_channel(address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def test_the_tables_hold_every_rpc_the_service_serves() -> None:
    """Every RPC of the protocol is the servicer's own: served (keyed or open), or answered UNIMPLEMENTED."""
    rpcs = {method.name for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert rpcs <= set(vars(grpc_front.InferenceServicer))
    assert rpcs == set(KEYED_RPCS) | set(OPEN_RPCS) | set(UNSERVED_RPCS) | {"ModelStreamInfer"}
    assert set(OPEN_RPCS) == grpc_front.OPEN_METHODS


@pytest.mark.anyio
@pytest.mark.parametrize("letter", ["m", "é", "😀"])
async def test_a_status_message_echoing_a_huge_name_is_cut_not_lost(letter: str) -> None:
    """A model name of 100,000 characters is echoed in NOT_FOUND's message: cut to MAX_DETAILS_BYTES of UTF-8, the
    client reads NOT_FOUND, not RESOURCE_EXHAUSTED for metadata past its limit (a character past ASCII takes up to 12
    bytes there, percent-encoded)."""
    async with (
        serving_in_process(_in_process_settings()) as (address, _, _),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):  # past 8 KiB, a client refuses such metadata at random
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ModelMetadata(pb.ModelMetadataRequest(name=letter * 100_000))
            details = str(raised.value.details())
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND, details[:200]
            assert len(details.encode()) <= grpc_front.MAX_DETAILS_BYTES and details.endswith(letter + "...")


UNSERVED_RPCS: dict[str, Any] = {
    "RepositoryIndex": pb.RepositoryIndexRequest(),
    "RepositoryModelLoad": pb.RepositoryModelLoadRequest(model_name="matmul"),
    "RepositoryModelUnload": pb.RepositoryModelUnloadRequest(model_name="matmul"),
    "TraceSetting": pb.TraceSettingRequest(),
    "LogSettings": pb.LogSettingsRequest(),
}


@pytest.mark.anyio
async def test_the_rpcs_not_served_are_unimplemented_after_the_key_and_log_nothing(
    keyed_in_process: pb_grpc.GRPCInferenceServiceStub, caplog: pytest.LogCaptureFixture
) -> None:
    """They used to raise the base class's NotImplementedError, which gRPC logged with its traceback on every call,
    keyed or not: anyone reaching the port could fill the log."""
    key = PAST_THE_KEY["first as a bearer token"]
    calls = [(getattr(keyed_in_process, rpc), request) for rpc, request in UNSERVED_RPCS.items()]
    stream = keyed_in_process.ModelStreamInfer
    for metadata, expected in (([], grpc.StatusCode.UNAUTHENTICATED), (key, grpc.StatusCode.UNIMPLEMENTED)):
        for call, request in calls:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(request, metadata=metadata)
            assert raised.value.code() == expected, raised.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stream(iter([KEYED_RPCS["ModelInfer"]]), metadata=metadata):
                pass
        assert raised.value.code() == expected
    assert raised.value.details() == "ModelStreamInfer is not served by matmul-service"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.anyio
@pytest.mark.parametrize(("metadata", "message"), REFUSED_METADATA.values(), ids=REFUSED_METADATA.keys())
@pytest.mark.parametrize("rpc", KEYED_RPCS)
async def test_every_rpc_but_the_probes_is_refused_without_a_valid_key(
    keyed_in_process: pb_grpc.GRPCInferenceServiceStub, rpc: str, metadata: list[tuple[str, str]], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await getattr(keyed_in_process, rpc)(KEYED_RPCS[rpc], metadata=metadata)
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)


@pytest.mark.anyio
@pytest.mark.parametrize("metadata", PAST_THE_KEY.values(), ids=PAST_THE_KEY.keys())
@pytest.mark.parametrize("rpc", [*KEYED_RPCS, *OPEN_RPCS])
async def test_with_a_valid_key_every_rpc_gets_past_the_key(
    keyed_in_process: pb_grpc.GRPCInferenceServiceStub, rpc: str, metadata: list[tuple[str, str]]
) -> None:
    """Answered, or refused for what it asks (shared memory off), never for its key."""
    call = getattr(keyed_in_process, rpc)({**KEYED_RPCS, **OPEN_RPCS}[rpc], metadata=metadata)
    if "SharedMemory" in rpc:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "shared memory is off" in str(
            raised.value.details()
        )
    else:
        assert (await call).ByteSize() >= 0


@pytest.mark.anyio
@pytest.mark.parametrize("rpc", OPEN_RPCS)
async def test_the_probes_need_no_key(keyed_in_process: pb_grpc.GRPCInferenceServiceStub, rpc: str) -> None:
    assert (await getattr(keyed_in_process, rpc)(OPEN_RPCS[rpc])).ListFields()


@pytest.mark.anyio
async def test_readiness_is_false_while_the_engine_is_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """ServerReady and ModelReady answer (no error) ready=False while the engine refuses work, True once it serves."""
    async with (
        serving_in_process(_in_process_settings()) as (address, engine, _),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        model = pb.ModelReadyRequest(name="matmul")
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready and (await stub.ModelReady(model)).ready

        def compiling() -> None:
            raise NotReady("the kernels are still compiling")

        monkeypatch.setattr(engine, "check_ready", compiling)
        assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
        assert not (await stub.ModelReady(model)).ready


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("contents", "message"),
    [("one raw contents too many", "1 raw input contents belong to no input"),
     ("FP16 as typed contents", "input 'A' is FP16: send it as raw contents"),
     ("INT32 as typed contents", "input 'A' has datatype 'INT32'; this model takes ['FP16', 'FP32', 'FP64', 'INT8']"),
     ("typed contents with a binary_data_size",
      "input 'A' carries both data and parameters.binary_data_size: send its values one way")],
)  # fmt: skip
async def test_raw_and_typed_contents_that_do_not_fit_the_inputs_are_refused_saying_why(
    contents: str, message: str
) -> None:
    request = _infer_request(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))
    if contents == "one raw contents too many":
        request.raw_input_contents.append(bytes(4))
    elif contents == "FP16 as typed contents":
        del request.raw_input_contents[0]
        request.inputs[0].datatype = "FP16"
        request.inputs[0].contents.fp32_contents.extend([1.0] * 6)
    elif contents == "INT32 as typed contents":  # a datatype the model does not take, in the field that would hold it
        del request.raw_input_contents[0]
        request.inputs[0].datatype = "INT32"
        request.inputs[0].contents.int_contents.extend([1] * 6)
    else:  # A's values twice over, B's raw contents the only ones: A took them, and B found none (INTERNAL)
        del request.raw_input_contents[0]
        request.inputs[0].contents.fp32_contents.extend([1.0] * 6)
        request.inputs[0].parameters["binary_data_size"].int64_param = 24
    async with (
        serving_in_process(_in_process_settings()) as (address, _, _),
        grpc.aio.insecure_channel(address) as channel,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


@pytest.mark.anyio
async def test_binary_metadata_beside_the_key_is_read_as_bytes(
    keyed_in_process: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    """gRPC hands "-bin" metadata values over as bytes: a call carrying some beside its key is served."""
    metadata = [("trace-context-bin", b"\x00\x01"), ("x-api-key", "first")]
    assert (await keyed_in_process.ServerMetadata(pb.ServerMetadataRequest(), metadata=metadata)).name
