"""Triton's shared-memory extensions, driven by tritonclient's own HTTP client and shared-memory utilities against
the service running as a real process (CPU backend), with MATMUL_SHARED_MEMORY=system,cuda: system shared memory
end to end, and what the CPU backend answers to CUDA shared memory (tests/api/test_cuda_shared_memory.py drives that
on a GPU)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from matmul_tools.service import LocalService, free_port, running_server, uvicorn_command
from numerics.reference import assert_close_to_reference

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the test extra")
shm = pytest.importorskip("tritonclient.utils.shared_memory", reason="tritonclient[http] is in the test extra")
from tritonclient.utils import InferenceServerException  # noqa: E402


class Server:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpclient.InferenceServerClient(url=url.removeprefix("http://"))

    def engine_pid(self) -> int:
        pid: int = httpx.get(f"{self.url}/v1/info").json()["devices"][0]["engine_pid"]
        return pid


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    port = free_port()
    env = {"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false", "MATMUL_SHARED_MEMORY": "system,cuda"}
    with running_server(uvicorn_command(port), port, env=env):
        running = Server(f"http://127.0.0.1:{port}")
        yield running
        running.client.close()


@pytest.fixture
def region() -> Iterator[tuple[str, str, object]]:
    """A fresh shared-memory object of 4096 bytes: (region name, key, tritonclient's handle)."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    key = f"/{name}"
    handle = shm.create_shared_memory_region(name, key, 4096)
    yield name, key, handle
    shm.destroy_shared_memory_region(handle)


def _mapped_in(pid: int, key: str) -> bool:
    return f"/dev/shm{key}" in Path(f"/proc/{pid}/maps").read_text()


def test_the_server_metadata_lists_the_extensions(server: Server) -> None:
    extensions = server.client.get_server_metadata()["extensions"]
    assert "system_shared_memory" in extensions and "cuda_shared_memory" in extensions


def test_register_status_unregister(server: Server, region: tuple[str, str, object]) -> None:
    name, key, _ = region
    server.client.register_system_shared_memory(name, key, 1024, offset=512)
    try:
        assert server.client.get_system_shared_memory_status(name) == [
            {"name": name, "key": key, "offset": 512, "byte_size": 1024}
        ]
        assert {"name": name, "key": key, "offset": 512, "byte_size": 1024} in (
            server.client.get_system_shared_memory_status()
        )
        assert _mapped_in(server.engine_pid(), key)
    finally:
        server.client.unregister_system_shared_memory(name)
    assert name not in [status["name"] for status in server.client.get_system_shared_memory_status()]
    assert not _mapped_in(server.engine_pid(), key)
    server.client.unregister_system_shared_memory(name)  # unregistering a name not registered is no error


def test_unregister_all(server: Server, region: tuple[str, str, object]) -> None:
    name, key, _ = region
    server.client.register_system_shared_memory(name, key, 4096)
    server.client.register_system_shared_memory(f"{name}-again", key, 64, offset=64)
    server.client.unregister_system_shared_memory()
    assert server.client.get_system_shared_memory_status() == []
    assert not _mapped_in(server.engine_pid(), key)


@pytest.mark.parametrize(
    ("key", "offset", "byte_size", "problem"),
    [
        (None, 0, 64, "already registered"),
        ("/no-such-object-of-these-tests", 0, 64, "cannot be opened: No such file"),
        ("/../etc/passwd", 0, 64, "does not name a shared-memory object"),
        ("/sub/name", 0, 64, "does not name a shared-memory object"),
        ("..", 0, 64, "does not name a shared-memory object"),
        (None, 4000, 200, "has 4096 bytes; the region of 200 bytes at offset 4000 passes its end"),
    ],
)
def test_registration_errors_name_the_problem(
    server: Server, region: tuple[str, str, object], key: str | None, offset: int, byte_size: int, problem: str
) -> None:
    name, own_key, _ = region
    server.client.register_system_shared_memory(name, own_key, 64)
    try:
        target = name if problem == "already registered" else f"{name}-other"
        with pytest.raises(InferenceServerException, match=problem) as raised:
            server.client.register_system_shared_memory(target, key or own_key, byte_size, offset=offset)
        assert raised.value.status() == "400"
        assert server.client.is_server_live() and server.client.is_server_ready()
    finally:
        server.client.unregister_system_shared_memory(name)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"key": "/x", "offset": 0, "byte_size": 0}, "byte_size"),
        ({"key": "/x", "offset": -1, "byte_size": 8}, "offset"),
        ({"offset": 0, "byte_size": 8}, "key"),
        ({"key": "/x", "byte_size": 8, "handle": 1}, "handle"),
        # counts are integers: pydantic's lax mode read true as 1 byte and "64" or 64.0 as 64
        ({"key": "/x", "byte_size": True}, "byte_size: Input should be a valid integer"),
        ({"key": "/x", "byte_size": "64"}, "byte_size: Input should be a valid integer"),
        ({"key": "/x", "byte_size": 64.0}, "byte_size: Input should be a valid integer"),
        ({"key": "/x", "offset": "0", "byte_size": 64}, "offset: Input should be a valid integer"),
    ],
)
def test_malformed_registrations_are_400(server: Server, body: dict[str, object], problem: str) -> None:
    answer = httpx.post(f"{server.url}/v2/systemsharedmemory/region/r/register", json=body)
    assert answer.status_code == 400 and problem in answer.json()["error"]


def test_the_status_of_an_unknown_region_is_400(server: Server) -> None:
    with pytest.raises(InferenceServerException, match="no shared-memory region named 'nothing-here'"):
        server.client.get_system_shared_memory_status("nothing-here")


# ------------------------------------------------------------------------------------------------------ infer


def _infer_input(name: str, array: np.ndarray, region: tuple[str, int] | None = None) -> object:
    """An input named `name`: in the region (name, offset) when given, else as binary data."""
    tensor = httpclient.InferInput(name, list(array.shape), {"float32": "FP32", "float64": "FP64"}[array.dtype.name])
    if region is None:
        tensor.set_data_from_numpy(array, binary_data=True)
    else:
        tensor.set_shared_memory(region[0], array.nbytes, offset=region[1])
    return tensor


@pytest.fixture
def big_region() -> Iterator[tuple[str, str, object]]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 1 << 20)
    yield name, f"/{name}", handle
    shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_infer_reads_and_writes_shared_memory(server: Server, big_region: tuple[str, str, object], dtype: type) -> None:
    name, key, handle = big_region
    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((33, 17)).astype(dtype), rng.standard_normal((17, 9)).astype(dtype)
    b_at, c_at = 8192, 16384  # A takes 4488 bytes in float64
    shm.set_shared_memory_region(handle, [a])
    shm.set_shared_memory_region(handle, [b], offset=b_at)
    shm.set_shared_memory_region(handle, [np.full((33, 9), np.nan, dtype)], offset=c_at)
    server.client.register_system_shared_memory(name, key, 1 << 20)
    try:
        output = httpclient.InferRequestedOutput("C")
        output.set_shared_memory(name, 33 * 9 * np.dtype(dtype).itemsize + 100, offset=c_at)
        result = server.client.infer(
            "matmul_numpy", [_infer_input("A", a, (name, 0)), _infer_input("B", b, (name, b_at))], outputs=[output]
        )
        described = result.get_output("C")  # C is in the region, not in the answer
        assert "data" not in described
        assert (
            described["shape"] == [33, 9] and described["datatype"] == {np.float32: "FP32", np.float64: "FP64"}[dtype]
        )
        assert described["parameters"] == {
            "shared_memory_region": name,
            "shared_memory_offset": c_at,
            "shared_memory_byte_size": 33 * 9 * np.dtype(dtype).itemsize,
        }
        c = shm.get_contents_as_numpy(handle, dtype, [33, 9], offset=c_at)
        assert_close_to_reference(c, a, b, np.dtype(dtype))
    finally:
        server.client.unregister_system_shared_memory(name)


def test_a_stack_in_shared_memory_is_multiplied_into_a_stack_there(
    server: Server, big_region: tuple[str, str, object]
) -> None:
    """A, a stack of 3 in the region; B, one matrix as binary data, broadcast against it; C, a stack, written back
    into the region."""
    name, key, handle = big_region
    rng = np.random.default_rng(32)
    a, b = rng.standard_normal((3, 8, 5)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    c_at = 4096
    shm.set_shared_memory_region(handle, [a])
    shm.set_shared_memory_region(handle, [np.full((3, 8, 4), np.nan, np.float32)], offset=c_at)
    server.client.register_system_shared_memory(name, key, 1 << 20)
    try:
        output = httpclient.InferRequestedOutput("C")
        output.set_shared_memory(name, 3 * 8 * 4 * 4, offset=c_at)
        result = server.client.infer(
            "matmul_numpy", [_infer_input("A", a, (name, 0)), _infer_input("B", b)], outputs=[output]
        )
        described = result.get_output("C")
        assert described["shape"] == [3, 8, 4] and described["parameters"]["shared_memory_byte_size"] == 3 * 8 * 4 * 4
        c = shm.get_contents_as_numpy(handle, np.float32, [3, 8, 4], offset=c_at)
        assert_close_to_reference(c, a, b, np.float32)
    finally:
        server.client.unregister_system_shared_memory(name)


def test_shared_memory_mixes_with_binary_tensors(server: Server, big_region: tuple[str, str, object]) -> None:
    """A from shared memory, B as binary data, C back as binary data; then B from shared memory, A as binary data,
    C into shared memory."""
    name, key, handle = big_region
    rng = np.random.default_rng(32)
    a, b = rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    shm.set_shared_memory_region(handle, [a])
    shm.set_shared_memory_region(handle, [b], offset=1024)
    server.client.register_system_shared_memory(name, key, 4096)
    try:
        inputs = [_infer_input("A", a, (name, 0)), _infer_input("B", b)]
        answered = server.client.infer("matmul_numpy", inputs, outputs=[httpclient.InferRequestedOutput("C")])
        assert_close_to_reference(answered.as_numpy("C"), a, b, np.dtype(np.float32))
        output = httpclient.InferRequestedOutput("C")
        output.set_shared_memory(name, 8 * 3 * 4, offset=2048)
        server.client.infer(
            "matmul_numpy", [_infer_input("A", a), _infer_input("B", b, (name, 1024))], outputs=[output]
        )
        c = shm.get_contents_as_numpy(handle, np.float32, [8, 3], offset=2048)
        assert_close_to_reference(c, a, b, np.dtype(np.float32))
    finally:
        server.client.unregister_system_shared_memory(name)


def test_an_operand_in_a_region_beyond_the_precisions_range_is_refused(
    server: Server, big_region: tuple[str, str, object]
) -> None:
    """No HTTP worker stages an operand that lies in a region: the engine process checks it there, as staging checks
    the others (7e4 would be infinite in fp16)."""
    name, key, handle = big_region
    a = np.ones((4, 4), np.float32)
    a[2, 3] = 7e4
    shm.set_shared_memory_region(handle, [a])
    server.client.register_system_shared_memory(name, key, 1 << 20)
    try:
        b = np.ones((4, 2), np.float32)
        said = r"a\[2\]\[3\] = 70000.0 is out of range for precision fp16 \(largest 65504\)"
        inputs = [_infer_input("A", a, (name, 0)), _infer_input("B", b)]
        with pytest.raises(InferenceServerException, match=said):
            server.client.infer("matmul", inputs, parameters={"precision": "fp16"})
        a[2, 3] = 1.0
        shm.set_shared_memory_region(handle, [a])
        answered = server.client.infer("matmul", [_infer_input("A", a, (name, 0)), _infer_input("B", b)])
        np.testing.assert_array_equal(answered.as_numpy("C"), np.full((4, 2), 4.0, np.float32))
    finally:
        server.client.unregister_system_shared_memory(name)


def _infer_body(a_parameters: dict[str, object], c_parameters: dict[str, object] | None = None) -> dict[str, object]:
    return {
        "inputs": [
            {"name": "A", "shape": [4, 4], "datatype": "FP32", "parameters": a_parameters},
            {"name": "B", "shape": [4, 4], "datatype": "FP32", "data": list(range(16))},
        ],
        "outputs": [{"name": "C", "parameters": c_parameters or {}}],
    }


@pytest.mark.parametrize(
    ("a_parameters", "c_parameters", "problem"),
    [
        ({"shared_memory_region": "nowhere", "shared_memory_byte_size": 64}, None, "no shared-memory region named"),
        ({"shared_memory_region": "{name}", "shared_memory_byte_size": 60}, None, "shared_memory_byte_size is 60"),
        (
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64, "shared_memory_offset": 4090},
            None,
            "64 bytes at offset 4090 of region '{name}' pass its end",
        ),
        ({"shared_memory_region": "{name}"}, None, "both shared_memory_region and shared_memory_byte_size"),
        ({"shared_memory_byte_size": 64}, None, "both shared_memory_region and shared_memory_byte_size"),
        ({"shared_memory_offset": 8}, None, "a shared_memory_offset but no shared_memory_region"),
        ({"shared_memory_region": 3, "shared_memory_byte_size": 64}, None, "must be a region's name"),
        ({"shared_memory_region": "{name}", "shared_memory_byte_size": -64}, None, "must be a byte count"),
        (
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64},
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 63, "shared_memory_offset": 64},
            "more than the 63 bytes its shared_memory_byte_size gives",
        ),
        (
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64},
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64, "shared_memory_offset": 32},
            "output 'C' at bytes 32 to 96 of region '{name}' overlaps input 'A' at bytes 0 to 64",
        ),
        (
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64},
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64, "shared_memory_offset": 4064},
            "64 bytes at offset 4064 of region '{name}' pass its end",
        ),
        (
            {"shared_memory_region": "{name}", "shared_memory_byte_size": 64},
            {"shared_memory_region": "elsewhere", "shared_memory_byte_size": 64},
            "no shared-memory region named 'elsewhere'",
        ),
    ],
)
def test_infer_misuses_of_shared_memory_are_400(
    server: Server,
    region: tuple[str, str, object],
    a_parameters: dict[str, object],
    c_parameters: dict[str, object] | None,
    problem: str,
) -> None:
    name, key, _ = region
    server.client.register_system_shared_memory(name, key, 4096)
    try:
        fill = {k: v.replace("{name}", name) if isinstance(v, str) else v for k, v in a_parameters.items()}
        c_fill = {k: v.replace("{name}", name) if isinstance(v, str) else v for k, v in (c_parameters or {}).items()}
        answer = httpx.post(f"{server.url}/v2/models/matmul_numpy/infer", json=_infer_body(fill, c_fill))
        assert answer.status_code == 400, answer.text
        assert problem.replace("{name}", name) in answer.json()["error"]
        assert server.client.is_server_ready()
    finally:
        server.client.unregister_system_shared_memory(name)


def test_an_input_in_shared_memory_carries_no_data(server: Server) -> None:
    body = _infer_body({"shared_memory_region": "r", "shared_memory_byte_size": 64})
    body["inputs"][0]["data"] = list(range(16))  # type: ignore[index]
    answer = httpx.post(f"{server.url}/v2/models/matmul_numpy/infer", json=body)
    assert answer.status_code == 400 and "must carry neither data nor binary_data_size" in answer.json()["error"]


# ------------------------------------------------------------------------------------ CUDA, on the CPU backend

HANDLE = base64.b64encode(bytes(range(64))).decode()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"raw_handle": {"b64": HANDLE}, "device_id": 0, "byte_size": 64}, "CUDA shared memory needs the GPU backend"),
        ({"raw_handle": {"b64": "not base64!"}, "device_id": 0, "byte_size": 64}, "raw_handle.b64 is not base64"),
        ({"raw_handle": {"b64": HANDLE[:40]}, "device_id": 0, "byte_size": 64}, "a CUDA IPC handle has 64"),
        ({"raw_handle": HANDLE, "device_id": 0, "byte_size": 64}, "raw_handle"),
        ({"raw_handle": {"b64": HANDLE}, "device_id": -1, "byte_size": 64}, "device_id"),
        ({"raw_handle": {"b64": HANDLE}, "device_id": 0}, "byte_size"),
    ],
)
def test_cuda_registrations_on_the_cpu_backend_are_400(server: Server, body: dict[str, object], problem: str) -> None:
    answer = httpx.post(f"{server.url}/v2/cudasharedmemory/region/c/register", json=body)
    assert answer.status_code == 400 and problem in answer.json()["error"], answer.text
    assert server.client.get_cuda_shared_memory_status() == []
    server.client.unregister_cuda_shared_memory("c")  # no error: nothing of that name


def test_a_cuda_status_does_not_list_system_regions(server: Server, region: tuple[str, str, object]) -> None:
    name, key, _ = region
    server.client.register_system_shared_memory(name, key, 64)
    try:
        assert server.client.get_cuda_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match=f"no shared-memory region of this kind is named '{name}'"):
            server.client.get_cuda_shared_memory_status(name)
        server.client.unregister_cuda_shared_memory(name)  # a system region is not unregistered as a CUDA one
        assert [status["name"] for status in server.client.get_system_shared_memory_status()] == [name]
    finally:
        server.client.unregister_system_shared_memory(name)


def test_every_http_worker_serves_a_region_registered_through_any_of_them(
    big_region: tuple[str, str, object], tmp_path: Path
) -> None:
    """`matmul-service --workers 2`: the regions live in the engine process, so a product naming one is served by the
    worker it was registered through and by the other. The registering connection stays open, so the next one goes
    to the other worker, which holds none (app.api.accepting)."""
    name, key, handle = big_region
    env = {
        "MATMUL_BACKEND": "cpu",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_SHARED_MEMORY": "system",
        "MATMUL_ACCEPT_HANDOFF_MS": "200",  # wide: the worker that holds none gets its turn on a loaded machine
    }
    service = LocalService.matmul_service(free_port(), env, tmp_path / "server.log", workers=2)
    try:
        service.wait_ready(60)
        a, b = np.eye(4, dtype=np.float32) * 3, np.arange(16, dtype=np.float32).reshape(4, 4)
        shm.set_shared_memory_region(handle, [a, b])
        body = {
            "inputs": [
                {"name": "A", "shape": [4, 4], "datatype": "FP32", "parameters": _region(name, 0, 64)},
                {"name": "B", "shape": [4, 4], "datatype": "FP32", "parameters": _region(name, 64, 64)},
            ]
        }
        with httpx.Client(base_url=service.url) as registering, httpx.Client(base_url=service.url) as other:
            registered = registering.post(
                f"/v2/systemsharedmemory/region/{name}/register", json={"key": key, "offset": 0, "byte_size": 4096}
            )
            assert registered.status_code == 200, registered.text
            workers = [connection.get("/v1/info").json()["http_worker_pid"] for connection in (registering, other)]
            assert workers[0] != workers[1]
            for connection in (registering, other):
                answer = connection.post("/v2/models/matmul_numpy/infer", json=body)
                assert answer.status_code == 200, answer.text
                np.testing.assert_array_equal(np.reshape(answer.json()["outputs"][0]["data"], (4, 4)), a @ b)
            assert other.post(f"/v2/systemsharedmemory/region/{name}/unregister").status_code == 200
    finally:
        service.stop()


def _region(name: str, offset: int, byte_size: int) -> dict[str, object]:
    return {"shared_memory_region": name, "shared_memory_offset": offset, "shared_memory_byte_size": byte_size}
