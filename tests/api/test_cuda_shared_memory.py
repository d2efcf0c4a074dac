"""Triton's CUDA shared-memory extension on a GPU: tritonclient's own HTTP and gRPC clients and CUDA shared-memory
utilities (which need cuda-python) against the service running as a real process, MATMUL_SHARED_MEMORY=system,cuda.
The operands are read from, and the product written into, the client's device memory by the engine process."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import httpx
import numpy as np
import pytest

from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.reference import assert_close_to_reference

pytestmark = pytest.mark.gpu
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the test extra")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the test extra")
try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except RuntimeError as missing:  # tritonclient says so when cuda-python is not installed
    pytest.skip(str(missing), allow_module_level=True)
from tritonclient.utils import InferenceServerException  # noqa: E402

DATATYPE = {np.float32: "FP32", np.float64: "FP64"}


class Served(NamedTuple):
    url: str
    client: Any
    """tritonclient's HTTP client of the server."""
    grpc_url: str


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    port, grpc_port = free_port(), free_port()
    env = {
        "MATMUL_BACKEND": "gpu",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_SHARED_MEMORY": "system,cuda",
        "MATMUL_GRPC_PORT": str(grpc_port),
        "MATMUL_GRPC_HOST": "127.0.0.1",
    }
    with running_server(uvicorn_command(port), port, env=env):
        client = httpclient.InferenceServerClient(url=f"127.0.0.1:{port}")
        yield Served(f"http://127.0.0.1:{port}", client, f"127.0.0.1:{grpc_port}")
        client.close()


MakeRegion = Callable[[int], tuple[str, object]]


@pytest.fixture
def regions() -> Iterator[MakeRegion]:
    """Device memory the test allocates with tritonclient (name, handle); destroyed after the test."""
    made: list[tuple[str, object]] = []

    def make(byte_size: int) -> tuple[str, object]:
        name = f"cuda-{uuid.uuid4().hex[:12]}"
        made.append((name, cudashm.create_shared_memory_region(name, byte_size, 0)))
        return made[-1]

    yield make
    for _, handle in made:
        cudashm.destroy_shared_memory_region(handle)


def _register(client: Any, name: str, handle: object, byte_size: int) -> None:
    client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, byte_size)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_operands_and_product_in_the_clients_device_memory(server: Served, regions: MakeRegion, dtype: type) -> None:
    client = server.client
    rng = np.random.default_rng(51)
    a, b = rng.standard_normal((300, 200)).astype(dtype), rng.standard_normal((200, 100)).astype(dtype)
    inputs_name, inputs_handle = regions(a.nbytes + b.nbytes)
    output_name, output_handle = regions(300 * 100 * np.dtype(dtype).itemsize)
    cudashm.set_shared_memory_region(inputs_handle, [a, b])
    _register(client, inputs_name, inputs_handle, a.nbytes + b.nbytes)
    _register(client, output_name, output_handle, 300 * 100 * np.dtype(dtype).itemsize)
    try:
        statuses = client.get_cuda_shared_memory_status()
        assert {"name": inputs_name, "device_id": 0, "byte_size": a.nbytes + b.nbytes} in statuses
        tensors = [
            httpclient.InferInput("A", [300, 200], DATATYPE[dtype]),
            httpclient.InferInput("B", [200, 100], DATATYPE[dtype]),
        ]
        tensors[0].set_shared_memory(inputs_name, a.nbytes)
        tensors[1].set_shared_memory(inputs_name, b.nbytes, offset=a.nbytes)
        output = httpclient.InferRequestedOutput("C")
        output.set_shared_memory(output_name, 300 * 100 * np.dtype(dtype).itemsize)
        for kernel in ("cublas", "auto"):
            result = client.infer("matmul", tensors, outputs=[output], parameters={"kernel": kernel})
            assert result.get_output("C")["parameters"]["shared_memory_region"] == output_name
            c = cudashm.get_contents_as_numpy(output_handle, dtype, [300, 100])
            assert_close_to_reference(c, a, b, np.dtype(dtype))
            cudashm.set_shared_memory_region(output_handle, [np.full((300, 100), np.nan, dtype)])
    finally:
        client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == []


def test_device_memory_mixes_with_binary_tensors_and_odd_offsets(server: Served, regions: MakeRegion) -> None:
    """A at an offset no kernel could read in place (copied on the device first), B as binary data, C back as
    binary data."""
    client = server.client
    rng = np.random.default_rng(52)
    a, b = rng.standard_normal((65, 33)).astype(np.float32), rng.standard_normal((33, 17)).astype(np.float32)
    name, handle = regions(a.nbytes + 4)
    cudashm.set_shared_memory_region(handle, [np.zeros(1, np.float32), a])
    _register(client, name, handle, a.nbytes + 4)
    try:
        tensors = [httpclient.InferInput("A", [65, 33], "FP32"), httpclient.InferInput("B", [33, 17], "FP32")]
        tensors[0].set_shared_memory(name, a.nbytes, offset=4)
        tensors[1].set_data_from_numpy(b, binary_data=True)
        for kernel in ("fast", "tiled", "cublas"):
            c = client.infer("matmul", tensors, parameters={"kernel": kernel}).as_numpy("C")
            assert_close_to_reference(c, a, b, np.dtype(np.float32))
    finally:
        client.unregister_cuda_shared_memory(name)


def test_a_handle_that_does_not_open_a_size_past_the_allocation_a_device_not_served_and_a_misaligned_tensor_are_400(
    server: Served, regions: MakeRegion
) -> None:
    url, client = server.url, server.client
    answer = httpx.post(
        f"{url}/v2/cudasharedmemory/region/x/register",
        json={"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0, "byte_size": 64},
    )
    assert answer.status_code == 400 and "the CUDA IPC handle does not open here" in answer.json()["error"]
    name, handle = regions(64)
    with pytest.raises(InferenceServerException, match=r"byte_size is 16777216, but the device allocation the handle"):
        client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, 1 << 24)
    with pytest.raises(InferenceServerException, match="no engine process of this server serves device 7"):
        client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 7, 64)
    _register(client, name, handle, 64)
    try:
        tensors = [httpclient.InferInput("A", [2, 2], "FP64"), httpclient.InferInput("B", [2, 2], "FP64")]
        tensors[0].set_shared_memory(name, 32, offset=4)
        tensors[1].set_data_from_numpy(np.eye(2), binary_data=True)
        with pytest.raises(InferenceServerException, match="must start at a multiple of 8 bytes"):
            client.infer("matmul", tensors)
    finally:
        client.unregister_cuda_shared_memory(name)
    assert client.is_server_ready()


def test_grpc_reads_the_operands_from_and_writes_the_product_into_the_clients_device_memory(
    server: Served, regions: MakeRegion
) -> None:
    """The same registration, status, product and unregistration through tritonclient.grpc, whose register call
    sends the IPC handle as raw bytes rather than base64; a handle that does not open is INVALID_ARGUMENT."""
    client = grpcclient.InferenceServerClient(url=server.grpc_url)
    rng = np.random.default_rng(53)
    a, b = rng.standard_normal((257, 129)).astype(np.float32), rng.standard_normal((129, 65)).astype(np.float32)
    c_bytes = 257 * 65 * 4
    inputs_name, inputs_handle = regions(a.nbytes + b.nbytes)
    output_name, output_handle = regions(c_bytes)
    cudashm.set_shared_memory_region(inputs_handle, [a, b])
    _register(client, inputs_name, inputs_handle, a.nbytes + b.nbytes)
    _register(client, output_name, output_handle, c_bytes)
    try:
        status = client.get_cuda_shared_memory_status(inputs_name)
        assert status.regions[inputs_name].byte_size == a.nbytes + b.nbytes
        assert status.regions[inputs_name].device_id == 0
        tensors = [grpcclient.InferInput("A", [257, 129], "FP32"), grpcclient.InferInput("B", [129, 65], "FP32")]
        tensors[0].set_shared_memory(inputs_name, a.nbytes)
        tensors[1].set_shared_memory(inputs_name, b.nbytes, offset=a.nbytes)
        output = grpcclient.InferRequestedOutput("C")
        output.set_shared_memory(output_name, c_bytes)
        for kernel in ("fast", "cublas"):
            result = client.infer("matmul", tensors, outputs=[output], parameters={"kernel": kernel})
            assert result.get_output("C").parameters["shared_memory_region"].string_param == output_name
            c = cudashm.get_contents_as_numpy(output_handle, np.float32, [257, 65])
            assert_close_to_reference(c, a, b, np.dtype(np.float32))
            cudashm.set_shared_memory_region(output_handle, [np.full((257, 65), np.nan, np.float32)])
        with pytest.raises(InferenceServerException, match="the CUDA IPC handle does not open here") as refused:
            client.register_cuda_shared_memory("x", base64.b64encode(bytes(64)), 0, 64)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status().regions == {}
        client.close()
