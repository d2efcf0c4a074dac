"""A product's precision, asked per request on /matmul (query or JSON body) and v2 (`parameters.precision`): the
answer says which ran and what it promises, the product keeps that promise, and every wrong ask is a 422 naming it.
On the CPU backend the precisions are emulated (the operands rounded as the tensor cores round them, float32 sums);
the GPU tests at the end run cuBLAS in each."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, inference_v2_body, load_npy, multipart_body, npy_bytes
from numerics.precision import FLOAT_PRECISIONS, Precision, input_error
from numerics.reference import BOUND_CONSTANT, Reference

pytestmark = pytest.mark.anyio

F32 = np.dtype(np.float32)


def _operands(seed: int, m: int = 33, k: int = 257, n: int = 9) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


async def _json_product(client: httpx.AsyncClient, a: np.ndarray, b: np.ndarray, **options: Any) -> httpx.Response:
    return await client.post("/matmul", json={"a": a.tolist(), "b": b.tolist(), **options})


@pytest.mark.parametrize("precision", FLOAT_PRECISIONS)
async def test_each_precision_runs_says_so_and_keeps_its_bound(client: httpx.AsyncClient, precision: Precision) -> None:
    a, b = _operands(1)
    answer = await client.post(f"/matmul?precision={precision}", json={"a": a.tolist(), "b": b.tolist()})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["precision"] == precision and answer.headers["x-matmul-precision"] == precision
    assert body["error_bound"] == {
        "constant": BOUND_CONSTANT,
        "input_error": input_error(precision),
        "sums": 1.25 if precision is Precision.TF32X3 else 1.0,
        "unit_roundoff": 2.0**-24,
    }
    c = np.array(body["result"], np.float32)
    assert Reference.of(a, b, F32, precision).mismatch(c) is None
    if precision in (Precision.TF32, Precision.BF16, Precision.FP16):  # rounded operands: past fp32's own bound
        assert Reference.of(a, b, F32).mismatch(c) is not None


async def test_the_default_is_fp32_and_float64_products_say_fp32(client: httpx.AsyncClient) -> None:
    a, b = _operands(2)
    answer = (await _json_product(client, a, b)).json()
    assert answer["precision"] == "fp32" and answer["error_bound"]["input_error"] == 0.0
    wide = (await _json_product(client, a, b, dtype="float64")).json()
    assert wide["precision"] == "fp32" and wide["error_bound"]["unit_roundoff"] == 2.0**-53


async def test_the_json_body_may_carry_the_precision(client: httpx.AsyncClient) -> None:
    a, b = _operands(3)
    answer = await _json_product(client, a, b, precision="bf16")
    assert answer.status_code == 200 and answer.json()["precision"] == "bf16"


async def test_npy_operands_and_answer_in_a_precision(client: httpx.AsyncClient) -> None:
    a, b = _operands(4)
    answer = await client.post(
        "/matmul?precision=fp16",
        content=multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))]),
        headers={"content-type": MULTIPART_CONTENT_TYPE, "accept": "application/x-npy"},
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-matmul-precision"] == "fp16"
    assert Reference.of(a, b, F32, Precision.FP16).mismatch(load_npy(answer.content)) is None


async def _float16_npy_product(client: httpx.AsyncClient, ask: str) -> tuple[np.ndarray, np.ndarray, httpx.Response]:
    a, b = (x.astype(np.float16) for x in _operands(10, 17, 300, 5))
    answer = await client.post(
        f"/matmul{ask}",
        content=multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))]),
        headers={"content-type": MULTIPART_CONTENT_TYPE, "accept": "application/x-npy"},
    )
    assert answer.status_code == 200, answer.text
    return a.astype(np.float32), b.astype(np.float32), answer


@pytest.mark.parametrize(("ask", "precision"), [("", Precision.FP16), ("?precision=fp32", Precision.FP32)])
async def test_float16_npy_operands_run_in_fp16_unless_told_otherwise(
    client: httpx.AsyncClient, ask: str, precision: Precision
) -> None:
    a, b, answer = await _float16_npy_product(client, ask)
    assert answer.headers["x-matmul-precision"] == precision and answer.headers["x-matmul-dtype"] == "float32"
    c = load_npy(answer.content)
    assert c.dtype == F32 and Reference.of(a, b, F32, precision).mismatch(c) is None


async def test_v2_fp16_inputs_run_in_fp16_and_answer_fp32(client: httpx.AsyncClient) -> None:
    a, b = (x.astype(np.float16) for x in _operands(11, 8, 64, 4))
    body, header_length = inference_v2_body(a, b)
    answer = await client.post(
        "/v2/models/matmul/infer",
        content=body,
        headers={"content-type": "application/octet-stream", "inference-header-content-length": str(header_length)},
    )
    assert answer.status_code == 200, answer.text
    header = orjson.loads(answer.content[: int(answer.headers["inference-header-content-length"])])
    assert header["parameters"]["precision"] == "fp16" and header["outputs"][0]["datatype"] == "FP32"
    c = np.frombuffer(answer.content[len(answer.content) - 32 * 4 :], "<f4").reshape(8, 4)
    assert Reference.of(a.astype(np.float32), b.astype(np.float32), F32, Precision.FP16).mismatch(c) is None


@pytest.mark.parametrize(
    ("ask", "body_options", "code", "problem", "location"),
    [
        ("?precision=fp4", {}, "invalid_parameter", "precision", ["query", "precision"]),
        ("", {"precision": "fp4"}, "invalid_parameter", "precision 'fp4' is not supported; choose one of", None),
        ("", {"precision": 16}, "invalid_parameter", "'precision' must be a string", None),
        ("?precision=tf32", {"precision": "bf16"}, "invalid_parameter", "'precision' is given twice", None),
        ("?precision=tf32&dtype=float64", {}, "invalid_parameter", "computes from float32 operands", None),
        ("?precision=bf16&kernel=tiled", {}, "invalid_parameter", "kernel 'tiled' computes in fp32 only", None),
    ],
)
async def test_a_wrong_ask_is_a_422_naming_it(
    client: httpx.AsyncClient,
    ask: str,
    body_options: dict[str, object],
    code: str,
    problem: str,
    location: list[str] | None,
) -> None:
    a, b = _operands(5, 4, 4, 4)
    answer = await client.post(f"/matmul{ask}", json={"a": a.tolist(), "b": b.tolist(), **body_options})
    assert answer.status_code == 422, answer.text
    error = answer.json()
    assert error["code"] == code and problem in error["message"]
    if location is not None:
        assert error["location"] == location
    else:
        assert error["location"][-1] == "precision"


async def test_float64_npy_operands_in_a_tensor_core_precision_are_refused(client: httpx.AsyncClient) -> None:
    a, b = (x.astype(np.float64) for x in _operands(6, 4, 4, 4))
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))])
    answer = await client.post("/matmul?precision=tf32", content=body, headers={"content-type": MULTIPART_CONTENT_TYPE})
    assert answer.status_code == 422
    assert "precision tf32 computes from float32 operands, and this product's dtype is float64" in answer.text


@pytest.mark.parametrize("precision", ["3xtf32", "bf16"])
async def test_v2_parameters_carry_the_precision(client: httpx.AsyncClient, precision: str) -> None:
    a, b = _operands(7, 8, 64, 4)
    request = {
        "inputs": [
            {"name": "A", "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()},
            {"name": "B", "shape": list(b.shape), "datatype": "FP32", "data": b.ravel().tolist()},
        ],
        "parameters": {"precision": precision},
    }
    answer = await client.post("/v2/models/matmul/infer", json=request)
    assert answer.status_code == 200, answer.text
    parameters = answer.json()["parameters"]
    assert parameters["precision"] == precision and parameters["error_bound_input"] == input_error(Precision(precision))
    c = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(8, 4)
    assert Reference.of(a, b, F32, Precision(precision)).mismatch(c) is None
    request["parameters"] = {"precision": 3}
    refused = await client.post("/v2/models/matmul/infer", json=request)
    assert refused.status_code == 422 and "parameters.precision must be a string" in refused.text


# ----------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("precision", "kernel"),
    # not fp8 on cuBLAS, whose GemmEx has no FP8 (its refusal: tests/kernels/test_tensor_core_gpu.py)
    [(p, kernel) for p in FLOAT_PRECISIONS for kernel in ("cublas", "auto") if (p, kernel) != ("fp8", "cublas")],
    ids=str,
)
async def test_on_the_gpu_each_precision_runs_on_cublas_or_auto(
    gpu_client: httpx.AsyncClient, precision: Precision, kernel: str
) -> None:
    a, b = _operands(8, 300, 129, 65)
    answer = await gpu_client.post(
        f"/matmul?precision={precision}&kernel={kernel}", json={"a": a.tolist(), "b": b.tolist()}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["precision"] == precision
    if precision is not Precision.FP32:
        # auto may also pick a tensor-core kernel of ours where one computes in this precision and measured faster
        listing = (await gpu_client.get("/v1/kernels")).json()
        computing = {k["name"] for k in listing["kernels"] if precision in k["precisions"] and k["name"] != "auto"}
        assert body["kernel"] == "cublas" if kernel == "cublas" else body["kernel"] in computing
    assert Reference.of(a, b, F32, precision).mismatch(np.array(body["result"], np.float32)) is None


@pytest.mark.gpu
async def test_on_the_gpu_float16_npy_operands_run_in_fp16(gpu_client: httpx.AsyncClient) -> None:
    a, b, answer = await _float16_npy_product(gpu_client, "")
    assert answer.headers["x-matmul-precision"] == "fp16"
    assert Reference.of(a, b, F32, Precision.FP16).mismatch(load_npy(answer.content)) is None


@pytest.mark.gpu
async def test_on_the_gpu_our_fp32_kernels_refuse_a_tensor_core_precision(gpu_client: httpx.AsyncClient) -> None:
    a, b = _operands(9, 4, 4, 4)
    answer = await gpu_client.post("/matmul?precision=tf32&kernel=fast", json={"a": a.tolist(), "b": b.tolist()})
    assert answer.status_code == 422
    assert "kernel 'fast' computes in fp32 only; precision tf32 runs on 'cublas' (or auto)" in answer.text


@pytest.mark.parametrize(
    ("precision", "value", "largest"),
    [("fp16", 70000.0, "65504"), ("fp16", -65520.0, "65504"), ("bf16", 3.4e38, "3.38953e+38")],
)
async def test_an_operand_beyond_the_precisions_range_is_refused_not_turned_into_infinity(
    client: httpx.AsyncClient, precision: str, value: float, largest: str
) -> None:
    """As 1e39 in float32: an element that rounding into the precision's format makes infinite is a 422 naming the
    operand, the element and the precision, on /matmul (JSON and .npy) and the inference protocol."""
    said = f"is out of range for precision {precision} (largest {largest}): it would be infinite there"
    answer = await client.post("/matmul", json={"a": [[1.0, value]], "b": [[1.0], [1.0]], "precision": precision})
    assert answer.status_code == 422 and answer.json()["code"] == "invalid_matrix"
    assert said in answer.json()["message"] and answer.json()["location"] == ["a", 0, 1]

    b = np.array([[1.0], [value]], np.float32)
    files = {"a": ("a.npy", npy_bytes(np.ones((1, 2), np.float32))), "b": ("b.npy", npy_bytes(b))}
    answer = await client.post("/matmul", params={"precision": precision}, files=files)
    assert answer.status_code == 422 and answer.json()["location"] == ["b", 1, 0] and said in answer.text

    body, header_length = inference_v2_body(b.T.copy(), np.ones((2, 1), np.float32), {"precision": precision})
    answer = await client.post(
        "/v2/models/matmul/infer", content=body, headers={"inference-header-content-length": str(header_length)}
    )
    assert answer.status_code == 422 and "a[0][1]" in answer.text and said in answer.text  # A, the left operand


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
async def test_an_fp8_operand_that_is_not_finite_is_refused(client: httpx.AsyncClient, value: float) -> None:
    """fp8 scales each operand by its largest magnitude and e4m3 has no infinity: a NaN or an infinity is a 422
    naming the element, on /matmul (.npy) and the inference protocol, where the other precisions multiply it; any
    finite value is taken, up to float32's largest."""
    said = "is not finite: precision fp8 scales each operand by its largest magnitude into e4m3"
    b = np.array([[1.0], [value]], np.float32)
    files = {"a": ("a.npy", npy_bytes(np.ones((1, 2), np.float32))), "b": ("b.npy", npy_bytes(b))}
    answer = await client.post("/matmul", params={"precision": "fp8"}, files=files)
    assert answer.status_code == 422 and answer.json()["location"] == ["b", 1, 0] and said in answer.text
    body, header_length = inference_v2_body(b.T.copy(), np.ones((2, 1), np.float32), {"precision": "fp8"})
    answer = await client.post(
        "/v2/models/matmul/infer", content=body, headers={"inference-header-content-length": str(header_length)}
    )
    assert answer.status_code == 422 and "a[0][1]" in answer.text and said in answer.text
    huge = np.array([[3.4e38, -3.4e38]], np.float32)
    answer = await _json_product(client, huge, np.full((2, 1), 0.5, np.float32), precision="fp8")
    assert answer.status_code == 200 and answer.json()["result"] == [[0.0]]


async def test_the_largest_values_that_stay_finite_in_fp16_are_multiplied(client: httpx.AsyncClient) -> None:
    """65519 rounds to float16's largest, 65504; NaN and infinities already there propagate as in fp32."""
    a = [[65519.0, -65519.0]]
    answer = await _json_product(client, np.array(a, np.float32), np.ones((2, 1), np.float32), precision="fp16")
    assert answer.status_code == 200 and answer.json()["result"] == [[0.0]]
    files = {
        "a": ("a.npy", npy_bytes(np.array([[np.inf, 1.0]], np.float32))),
        "b": ("b.npy", npy_bytes(np.ones((2, 1), np.float32))),
    }
    answer = await client.post("/matmul?precision=fp16", files=files, headers={"accept": "application/x-npy"})
    assert answer.status_code == 200 and load_npy(answer.content).tolist() == [[np.inf]]


WORST_ROUNDINGS = [
    # (precision, dtype, a, b, the share of the promised term reached): a and b sit where rounding loses the most
    ("fp16", "float32", 1 + 2.0**-11, 1 + 2.0**-11, (0.99, 1.0)),  # ties between 1 and the next float16: 1
    # scaled by 2^8 to 272, a tie between 256 and 288 (e4m3's 3 fraction bits): 1; the error (2u + u^2) / (1 + u)^2
    ("fp8", "float32", 1 + 2.0**-4, 1 + 2.0**-4, (0.88, 0.89)),
    ("bf16", "float32", 1 + 2.0**-8, 1 + 2.0**-8, (0.98, 1.0)),  # the same for bfloat16
    # the CPU rounds to nearest and reaches half of tf32's term, which is the truncation unit's (the GPU may truncate)
    ("tf32", "float32", 1 + 2.0**-11, 1 + 2.0**-11, (0.49, 0.5)),
    # the largest big part and the largest rounding of the small one at once: 2^-21 of the 3u^2 promised
    ("3xtf32", "float32", 1 + 2.0**-11 + 2.0**-23, 1 + 2.0**-11 + 2.0**-23, (0.16, 1 / 6)),
    ("fp32", "float32", 1 + 2.0**-12, 1 + 2.0**-12, (0.99, 1.0)),  # the product itself a float32 tie
    ("fp32", "float64", 1 + 2.0**-27, 1 + 2.0**-26, (0.99, 1.0)),  # and a float64 one
]


@pytest.mark.parametrize(("precision", "dtype", "a", "b", "reached"), WORST_ROUNDINGS, ids=lambda x: str(x)[:8])
async def test_the_promised_bound_is_reached_on_the_worst_rounding_and_never_passed(
    client: httpx.AsyncClient, precision: str, dtype: str, a: float, b: float, reached: tuple[float, float]
) -> None:
    """The answer's own error_bound (input_error in a tensor-core precision; unit_roundoff, for the sum, in fp32) is
    tight: operands at the worst rounding case make the error reach the stated share of it, exactly known, so that a
    promise twice too loose fails this as a promise twice too tight does (which the random products also fail)."""
    answer = await client.post("/matmul", json={"a": [[a]], "b": [[b]], "precision": precision, "dtype": dtype})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    bound = body["error_bound"]
    exact = Fraction(a) * Fraction(b)
    computed = np.array(body["result"], dtype)[0, 0]  # JSON's shortest text of a float32, read back as one
    error = abs(Fraction(float(computed)) - exact) / exact
    promised = bound["input_error"] if precision != "fp32" else bound["sums"] * bound["unit_roundoff"]
    assert reached[0] <= error / Fraction(promised) <= reached[1], float(error / Fraction(promised))
