"""Triton's own Python client (tritonclient[http]) against the service running as a real process."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.reference import assert_close_to_reference

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the test extra")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def triton() -> Iterator[object]:
    port = free_port()
    with running_server(uvicorn_command(port), port, env={"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false"}):
        client = httpclient.InferenceServerClient(url=f"127.0.0.1:{port}")
        yield client
        client.close()


def inputs(a: np.ndarray, b: np.ndarray, binary: bool) -> list[object]:
    datatype = {"float32": "FP32", "float64": "FP64"}[a.dtype.name]
    tensors = [httpclient.InferInput("A", list(a.shape), datatype), httpclient.InferInput("B", list(b.shape), datatype)]
    tensors[0].set_data_from_numpy(a, binary_data=binary)
    tensors[1].set_data_from_numpy(b, binary_data=binary)
    return tensors


def test_health_and_metadata(triton: httpclient.InferenceServerClient) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("matmul")
    assert "binary_tensor_data" in triton.get_server_metadata()["extensions"]
    meta = triton.get_model_metadata("matmul_numpy")
    assert [t["name"] for t in meta["inputs"]] == ["A", "B"]
    assert triton.get_model_config("matmul")["max_batch_size"] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("binary", [True, False])
def test_infer(triton: httpclient.InferenceServerClient, dtype: type, binary: bool) -> None:
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((33, 17)).astype(dtype), rng.standard_normal((17, 9)).astype(dtype)
    outputs = [httpclient.InferRequestedOutput("C", binary_data=binary)]
    result = triton.infer("matmul", inputs(a, b, binary), outputs=outputs, parameters={"kernel": "numpy"})
    c = result.as_numpy("C")
    assert c.dtype == dtype
    assert_close_to_reference(c, a, b, np.dtype(dtype))


def test_infer_with_the_clients_defaults(triton: httpclient.InferenceServerClient) -> None:
    a, b = np.eye(4, dtype=np.float32), np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(triton.infer("matmul_numpy", inputs(a, b, True)).as_numpy("C"), b)


def test_errors_reach_the_client_with_the_servers_message(triton: httpclient.InferenceServerClient) -> None:
    a, b = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    with pytest.raises(InferenceServerException, match="inner dimensions differ: 'a' is 2x3 and 'b' is 2x3"):
        triton.infer("matmul", inputs(a, b, True))
    with pytest.raises(InferenceServerException, match="unknown model 'matmul_warp'"):
        triton.get_model_metadata("matmul_warp")


def test_statistics(triton: httpclient.InferenceServerClient) -> None:
    a = np.ones((2, 2), np.float32)
    triton.infer("matmul", inputs(a, a, True))
    (stats,) = triton.get_inference_statistics("matmul")["model_stats"]
    assert stats["inference_count"] >= 1 and stats["inference_stats"]["compute_infer"]["count"] >= 1


def test_shared_memory_is_off_unless_enabled(triton: httpclient.InferenceServerClient) -> None:
    """MATMUL_SHARED_MEMORY is not set for this server: the extension is not listed, registering is 404 naming
    the setting, and an infer naming a region is refused by the engine with 400."""
    assert "system_shared_memory" not in triton.get_server_metadata()["extensions"]
    with pytest.raises(InferenceServerException, match="MATMUL_SHARED_MEMORY=system enables it") as raised:
        triton.register_system_shared_memory("r", "/some-object", 64)
    assert raised.value.status() == "404"
    tensor = httpclient.InferInput("A", [4, 4], "FP32")
    tensor.set_shared_memory("r", 64)
    with pytest.raises(InferenceServerException, match="shared memory is off") as refused:
        triton.infer(
            "matmul_numpy", [tensor, inputs(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32), True)[1]]
        )
    assert refused.value.status() == "400"
