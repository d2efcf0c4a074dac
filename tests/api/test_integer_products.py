"""Exact integer products through the real ASGI app: int8 operands multiplied into int32 in every body and answer
format, on the inference protocol, how a request asks for them, and every refusal; on a GPU, every kernel that computes
them, bit for bit against the int64 product."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from app.config import Settings
from app.main import create_app
from matmul_tools.bodies import inference_v2_body, load_npy, npy_bytes, npz_bytes
from numerics.precision import INT8_MAX_K
from tests.conftest import _client_for

pytestmark = pytest.mark.anyio
EXACT = {"constant": 4.0, "input_error": 0.0, "sums": 1.0, "unit_roundoff": 0.0}
"""The error bound of an int32 product: 0, every element exact."""
WIDE_MAX_DIM = 1 << 18
"""A dimension limit past the longest k int32 holds, so that k's own limit is the one met."""


@pytest.fixture
def cpu_settings() -> Settings:
    return Settings(backend="cpu", max_dim=WIDE_MAX_DIM)


def int8_operands(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(-128, 128, (m, k), np.int8), rng.integers(-128, 128, (k, n), np.int8)


def exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.int64) @ b.astype(np.int64)


async def post_npy(
    client: httpx.AsyncClient, a: np.ndarray, b: np.ndarray, params: dict[str, str] | None = None, accept: str = "npy"
) -> httpx.Response:
    """a and b as multipart .npy parts; the answer as .npy or JSON."""
    return await client.post(
        "/matmul",
        params=params or {},
        files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
        headers={"accept": "application/x-npy" if accept == "npy" else "application/json"},
    )


def answer_matrix(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    if answer.headers["content-type"] == "application/x-npy":
        return load_npy(answer.content)
    body = answer.json()
    return np.array(body["result"], np.dtype(body["dtype"])).reshape(body["shape"])


def says_int32(answer: httpx.Response) -> None:
    """The answer describes an exact int32 product, in its headers and (JSON) its body."""
    assert answer.headers["x-matmul-dtype"] == "int32" and answer.headers["x-matmul-precision"] == "int8"
    assert answer.headers["x-matmul-error-bound-unit-roundoff"] == "0.0"
    if answer.headers["content-type"] == "application/json":
        body = answer.json()
        assert (body["dtype"], body["precision"], body["error_bound"]) == ("int32", "int8", EXACT)


# ----------------------------------------------------------------------------------------- how it is asked


@pytest.mark.parametrize("body", ["npy", "npz"])
@pytest.mark.parametrize("accept", ["npy", "json"])
async def test_two_int8_operands_multiply_exactly_into_int32(client: httpx.AsyncClient, body: str, accept: str) -> None:
    """An int8 pair with no other word is their exact product, never a float one: values across int8's range, a k
    whose sums pass float32's 24 bits (2^24 / 128^2 = 1024)."""
    a, b = int8_operands(9, 3000, 11)
    a[0], b[:, 0] = -128, -128  # C[0, 0] = 3000 * 16384: exact in int32, not in float32
    if body == "npy":
        answer = await post_npy(client, a, b, accept=accept)
    else:
        answer = await client.post(
            "/matmul",
            content=npz_bytes(a=a, b=b),
            headers={
                "content-type": "application/x-npz",
                "accept": f"application/{'x-npy' if accept == 'npy' else 'json'}",
            },
        )
    c = answer_matrix(answer)
    assert c.dtype == np.int32 and np.array_equal(c, exact(a, b)) and c[0, 0] == 3000 * 16384
    says_int32(answer)


@pytest.mark.parametrize(
    "asked",
    [{"dtype": "int32"}, {"precision": "int8"}, {"dtype": "int32", "precision": "int8"}],
)
async def test_json_numbers_are_multiplied_exactly_when_asked_in_words(
    client: httpx.AsyncClient, asked: dict[str, str]
) -> None:
    """JSON numbers carry no dtype: dtype int32 or precision int8 (in the body or the query) asks for their exact
    product; without either they are float32, as they always were."""
    a, b = int8_operands(4, 2048, 3, seed=1)
    a[1], b[:, 2] = 127, -128
    in_body = await client.post("/matmul", json={"a": a.tolist(), "b": b.tolist(), **asked})
    in_query = await client.post("/matmul", params=asked, json={"a": a.tolist(), "b": b.tolist()})
    for answer in (in_body, in_query):
        assert np.array_equal(answer_matrix(answer), exact(a, b))
        says_int32(answer)
    unasked = (await client.post("/matmul", json={"a": a.tolist(), "b": b.tolist()})).json()
    assert (unasked["dtype"], unasked["precision"]) == ("float32", "fp32")


async def test_int8_operands_with_a_float_dtype_asked_are_multiplied_in_it(client: httpx.AsyncClient) -> None:
    a, b = int8_operands(3, 5, 2, seed=2)
    answer = await post_npy(client, a, b, {"dtype": "float64"}, accept="json")
    body = answer.json()
    assert (body["dtype"], body["precision"]) == ("float64", "fp32")
    assert np.array_equal(np.array(body["result"]), exact(a, b))


async def test_wider_integers_holding_int8_values_multiply_exactly_when_asked(client: httpx.AsyncClient) -> None:
    """int16 and uint8 operands and whole-number floats: each value is an int8, so each is staged as one."""
    a, b = int8_operands(6, 40, 5, seed=3)
    answer = await post_npy(client, a.astype(">i2"), b.astype(np.float32), {"dtype": "int32"})
    assert np.array_equal(answer_matrix(answer), exact(a, b))
    says_int32(answer)


@pytest.mark.parametrize(
    ("send", "code", "message", "location"),
    [
        (
            {"json": {"a": [[1, 128]], "b": [[1], [1]], "dtype": "int32"}},
            "invalid_matrix",
            "a[0][1] = 128 is not an int8 (an integer from -128 to 127): an int32 product multiplies int8 operands "
            "exactly; send int8 values or ask for a float dtype",
            ["a", 0, 1],
        ),
        (
            {"json": {"a": [[1]], "b": [[0.5]], "precision": "int8"}},
            "invalid_matrix",
            "b[0][0] = 0.5 is not an int8",
            ["b", 0, 0],
        ),
        (
            {"npy": (np.array([[1, 2], [3, -300]], np.int16), np.ones((2, 1), np.int8)), "params": {"dtype": "int32"}},
            "invalid_matrix",
            "a[1][1] = -300 is not an int8",
            ["a", 1, 1],
        ),
        (
            {"json": {"a": [[1]], "b": [[1]], "dtype": "float32", "precision": "int8"}},
            "invalid_parameter",
            "precision int8 multiplies int8 operands into an exact int32 product, and this product's dtype is "
            "float32: ask for dtype int32, or leave dtype out",
            ["precision"],
        ),
        (
            {"npy": (np.ones((1, 1), np.int8), np.ones((1, 1), np.int8)), "params": {"precision": "bf16"}},
            "invalid_parameter",
            "precision bf16 computes from float32 operands, and this product's dtype is int32",
            ["precision"],
        ),
        (
            {"npy": (np.ones((1, 1), np.int8), np.ones((1, 1), np.int8)), "params": {"kernel": "tiled"}},
            "invalid_parameter",
            "kernel 'tiled' computes in fp32 only; precision int8 runs on 'numpy' (or auto)",
            ["precision"],
        ),
    ],
)  # fmt: skip
async def test_what_an_int32_product_cannot_take_is_refused_saying_where(
    client: httpx.AsyncClient, send: dict[str, Any], code: str, message: str, location: list[str | int]
) -> None:
    if "json" in send:
        answer = await client.post("/matmul", json=send["json"])
    else:
        a, b = send["npy"]
        answer = await post_npy(client, a, b, send["params"])
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert body["code"] == code and body["message"].startswith(message) and body["location"] == location


async def test_k_up_to_int32s_limit_is_exact_and_one_more_is_refused_before_launch(client: httpx.AsyncClient) -> None:
    """k = 131071 with every term (-128)(-128) or (-128)(127): the largest and least sums int32 holds, exact; one
    more term could pass int32, so k = 131072 is a 422 naming k and the limit, whatever the values."""
    a = np.full((2, INT8_MAX_K), -128, np.int8)
    b = np.empty((INT8_MAX_K, 2), np.int8)
    b[:, 0], b[:, 1] = -128, 127
    c = answer_matrix(await post_npy(client, a, b))
    assert c.tolist() == [[INT8_MAX_K * 16384, -INT8_MAX_K * 16256]] * 2 == exact(a, b).tolist()
    longer = np.zeros((1, INT8_MAX_K + 1), np.int8)
    answer = await post_npy(client, longer, longer.T.copy())
    assert answer.status_code == 422, answer.text
    assert answer.json() == {
        "code": "shape_mismatch",
        "message": "k = 131072: an int32 product of int8 operands sums k products of up to 128 * 128, which int32 "
        "holds for k up to 131071; split the product along k",
        "location": ["a", 1],
    }
    floats = await post_npy(client, longer, longer.T.copy(), {"dtype": "float32"})
    assert answer_matrix(floats).tolist() == [[0.0]]  # the limit is int32's alone


async def test_the_kernel_listing_says_which_kernels_compute_int32_in_int8(client: httpx.AsyncClient) -> None:
    listing = {k["name"]: k for k in (await client.get("/v1/kernels")).json()["kernels"]}
    for name in ("auto", "numpy"):
        assert "int32" in listing[name]["dtypes"] and "int8" in listing[name]["precisions"]
    assert "int32" not in listing["tiled"]["dtypes"]


# ------------------------------------------------------------------------------------ the inference protocol


V2_DATATYPES = {"int8": "INT8", "float32": "FP32"}


async def _v2_infer(
    client: httpx.AsyncClient, a: np.ndarray, b: np.ndarray, binary: bool, **parameters: Any
) -> httpx.Response:
    """a @ b on the inference protocol, each input in the datatype of its dtype: as binary tensors (C asked for in
    binary), or as JSON data (C as JSON)."""
    if binary:
        body, header_length = inference_v2_body(a, b, parameters or None)
        headers = {"inference-header-content-length": str(header_length), "content-type": "application/octet-stream"}
        return await client.post("/v2/models/matmul/infer", content=body, headers=headers)
    inputs = [
        {"name": name, "datatype": V2_DATATYPES[x.dtype.name], "shape": list(x.shape), "data": x.ravel().tolist()}
        for name, x in (("A", a), ("B", b))
    ]
    return await client.post("/v2/models/matmul/infer", json={"inputs": inputs, "parameters": parameters})


def _v2_output(answer: httpx.Response) -> tuple[dict[str, Any], np.ndarray]:
    assert answer.status_code == 200, answer.text
    if "inference-header-content-length" in answer.headers:
        split = int(answer.headers["inference-header-content-length"])
        header = orjson.loads(answer.content[:split])
        output = header["outputs"][0]
        return header, np.frombuffer(answer.content[split:], "<i4").reshape(output["shape"])
    header = answer.json()
    output = header["outputs"][0]
    return header, np.array(output["data"], np.int64).reshape(output["shape"])


@pytest.mark.parametrize("binary", [True, False])
async def test_int8_inputs_answer_an_int32_output(client: httpx.AsyncClient, binary: bool) -> None:
    a, b = int8_operands(7, 300, 5, seed=4)
    header, c = _v2_output(await _v2_infer(client, a, b, binary))
    assert header["outputs"][0]["datatype"] == "INT32" and header["parameters"]["precision"] == "int8"
    assert np.array_equal(c, exact(a, b))


async def test_float_inputs_holding_int8_values_multiply_exactly_with_precision_int8(client: httpx.AsyncClient) -> None:
    """A mixed pair is a float32 product unless precision int8 is asked for; then the FP32 tensor's values are staged
    as int8, each checked to be one."""
    a, b = int8_operands(3, 9, 4, seed=5)
    header, c = _v2_output(await _v2_infer(client, a.astype(np.float32), b, True, precision="int8"))
    assert header["outputs"][0]["datatype"] == "INT32" and np.array_equal(c, exact(a, b))
    unasked = await _v2_infer(client, a.astype(np.float32), b, False)
    assert unasked.status_code == 200 and unasked.json()["outputs"][0]["datatype"] == "FP32"


async def test_an_int8_input_out_of_range_is_refused_in_the_protocols_format(client: httpx.AsyncClient) -> None:
    answer = await client.post(
        "/v2/models/matmul/infer",
        json={
            "inputs": [
                {"name": "A", "datatype": "INT8", "shape": [1, 2], "data": [3, 4]},
                {"name": "B", "datatype": "INT8", "shape": [2, 1], "data": [1, 300]},
            ]
        },
    )
    assert answer.status_code == 422
    assert answer.json() == {"error": "input 'B' is INT8: B[1][0] = 300 is not an int8 (an integer from -128 to 127)"}


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.fixture
async def wide_gpu_client() -> AsyncIterator[httpx.AsyncClient]:
    """The app on the GPU backend with room for k past int32's limit."""
    async for c in _client_for(create_app(Settings(backend="gpu", max_dim=WIDE_MAX_DIM))):
        yield c


GPU_SHAPES = [(1, 16, 1), (3, 5, 7), (67, 45, 39), (129, 4100, 257), (256, 1024, 256), (5, 0, 7), (0, 8, 4)]
"""(m, k, n): one element, k under one k-step of 16 bytes, odd sides, k far past a 128-wide tile, whole tiles, no
sum, no rows."""


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma_sync", "wgmma", "cublas", "auto"])
@pytest.mark.parametrize(("m", "k", "n"), GPU_SHAPES)
async def test_on_the_gpu_int8_products_are_exact_on_every_kernel(
    wide_gpu_client: httpx.AsyncClient, kernel: str, m: int, k: int, n: int
) -> None:
    """Through the data plane and the engine process: each kernel that computes int32 products, bit for bit the
    int64 product; cuBLAS refuses a k it cannot take (not a multiple of 4), saying what to ask instead."""
    a, b = int8_operands(m, k, n, seed=m + k + n)
    answer = await post_npy(wide_gpu_client, a, b, {"kernel": kernel})
    if kernel == "cublas" and k % 4:
        assert answer.status_code == 422
        assert answer.json()["message"] == (
            f"cuBLAS's int8 GEMM takes k a multiple of 4, and k is {k}: ask for kernel mma_sync or wgmma or auto"
        )
        return
    c = answer_matrix(answer)
    assert c.dtype == np.int32 and np.array_equal(c, exact(a, b)), (kernel, m, k, n)
    says_int32(answer)
    if kernel != "auto":
        assert answer.headers["x-matmul-kernel"] == kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["wgmma", "auto"])
async def test_on_the_gpu_the_longest_k_sums_exactly_and_one_more_is_refused(
    wide_gpu_client: httpx.AsyncClient, kernel: str
) -> None:
    a = np.full((3, INT8_MAX_K), -128, np.int8)
    b = np.empty((INT8_MAX_K, 2), np.int8)
    b[:, 0], b[:, 1] = -128, 127
    c = answer_matrix(await post_npy(wide_gpu_client, a, b, {"kernel": kernel}))
    assert c.tolist() == [[INT8_MAX_K * 16384, -INT8_MAX_K * 16256]] * 3
    longer = np.ones((1, INT8_MAX_K + 1), np.int8)
    answer = await post_npy(wide_gpu_client, longer, longer.T.copy(), {"kernel": kernel})
    assert answer.status_code == 422 and answer.json()["location"] == ["a", 1]


@pytest.mark.gpu
@pytest.mark.parametrize("binary", [True, False])
async def test_on_the_gpu_int8_inputs_answer_an_int32_output(gpu_client: httpx.AsyncClient, binary: bool) -> None:
    a, b = int8_operands(130, 777, 260, seed=6)
    header, c = _v2_output(await _v2_infer(gpu_client, a, b, binary))
    assert header["outputs"][0]["datatype"] == "INT32" and np.array_equal(c, exact(a, b))


@pytest.mark.gpu
async def test_on_the_gpu_auto_has_measured_int8_choices(gpu_client: httpx.AsyncClient) -> None:
    """auto's start-up probe timed cuBLAS's int8 GEMM against mma_sync's and wgmma's int8 instances for every shape
    class."""
    kernels = (await gpu_client.get("/v1/kernels")).json()
    int8 = [choice for choice in kernels["auto"] if choice["precision"] == "int8"]
    assert int8 and all(choice["dtype"] == "int32" for choice in int8)
    assert all(set(choice["probe_ms"]) == {"cublas", "mma_sync", "wgmma"} for choice in int8)
    listing = {k["name"]: k for k in kernels["kernels"]}
    for name in ("auto", "mma_sync", "wgmma", "cublas"):
        assert "int32" in listing[name]["dtypes"] and "int8" in listing[name]["precisions"]
