"""Products with nothing to sum (k = 0) or nothing to write (m or n = 0) answer the zero matrix of their shape in
every kernel, precision and dtype a backend lists, and on the inference protocol: no launch and no library call
(cuBLAS refuses k = 0 in its tensor-core modes, which was a 500 on the GPU backend).

Each empty sum comes right after a product of the same shape of C whose every element is 6, asked the same way: an
answer left unwritten would show the memory that product's answer used (the slab's, the device pool's), not zeros
that happened to be there."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from matmul_tools.bodies import inference_v2_body, load_npy, npy_bytes
from numerics.precision import PRECISIONS_OF, Precision

pytestmark = pytest.mark.anyio
SHAPES = [(5, 0, 7), (0, 3, 4), (4, 3, 0), (0, 0, 0)]
"""(m, k, n)."""


async def _every_way_asked(client: httpx.AsyncClient) -> list[tuple[str, str, str]]:
    """(kernel, precision, dtype) for every kernel the backend lists, in each precision and dtype it takes (the
    tensor-core precisions take float32 operands only, int8 is int32's alone)."""
    listing = (await client.get("/v1/kernels")).json()["kernels"]
    return [
        (kernel["name"], precision, dtype)
        for kernel in listing
        for precision in kernel["precisions"]
        for dtype in kernel["dtypes"]
        if Precision(precision) in PRECISIONS_OF[dtype]
    ]


async def _product(client: httpx.AsyncClient, a: np.ndarray, b: np.ndarray, kernel: str, precision: str) -> np.ndarray:
    """a @ b asked of `kernel` in `precision` and a's dtype, as multipart .npy; the .npy answer."""
    answer = await client.post(
        "/matmul",
        params={"kernel": kernel, "precision": precision, "dtype": a.dtype.name},
        files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
        headers={"accept": "application/x-npy"},
    )
    assert answer.status_code == 200, f"{kernel} {precision} {a.dtype} {a.shape} @ {b.shape}: {answer.text}"
    return load_npy(answer.content)


async def _every_empty_product_is_zero(client: httpx.AsyncClient) -> int:
    asked = 0
    for kernel, precision, dtype in await _every_way_asked(client):
        for m, k, n in SHAPES:
            if m and n:  # a C of the same shape, all 2 * 3 + 0 * 3 * 3 (exact in every precision), just before
                twos = np.zeros((m, 4), dtype)  # k = 4: one that cuBLAS's int8 GEMM takes too
                twos[:, 0] = 2
                sixes = await _product(client, twos, np.full((4, n), 3, dtype), kernel, precision)
                assert sixes.tolist() == [[6.0] * n] * m, (kernel, precision, dtype, (m, 4, n))
            c = await _product(client, np.ones((m, k), dtype), np.ones((k, n), dtype), kernel, precision)
            assert (c.shape, c.dtype.name) == ((m, n), dtype) and not c.any(), (kernel, precision, dtype, (m, k, n))
            asked += 1
    return asked


async def test_every_kernel_precision_and_dtype_answers_zeros_for_an_empty_sum(client: httpx.AsyncClient) -> None:
    assert await _every_empty_product_is_zero(client) >= 4 * len(SHAPES)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
async def test_the_inference_protocol_answers_zeros_for_an_empty_sum(client: httpx.AsyncClient, precision: str) -> None:
    await _v2_empty_sum(client, precision)


async def _v2_empty_sum(client: httpx.AsyncClient, precision: str) -> None:
    """5x0 @ 0x7 over the inference protocol, just after 5x1 @ 1x7 whose C is all 6."""
    for k, expected in ((1, 6.0), (0, 0.0)):
        a, b = np.full((5, k), 2, np.float32), np.full((k, 7), 3, np.float32)
        body, header_length = inference_v2_body(a, b, {"precision": precision})
        answer = await client.post(
            "/v2/models/matmul/infer", content=body, headers={"inference-header-content-length": str(header_length)}
        )
        assert answer.status_code == 200, answer.text
        split = int(answer.headers["inference-header-content-length"])
        assert np.frombuffer(answer.content[split:], "<f4").tolist() == [expected] * 35, (precision, k)


@pytest.mark.gpu
async def test_on_the_gpu_every_kernel_precision_and_dtype_answers_zeros_for_an_empty_sum(
    gpu_client: httpx.AsyncClient,
) -> None:
    assert await _every_empty_product_is_zero(gpu_client) >= 10 * len(SHAPES)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "3xtf32", "bf16", "fp16"])
async def test_on_the_gpu_the_inference_protocol_answers_zeros_for_an_empty_sum(
    gpu_client: httpx.AsyncClient, precision: str
) -> None:
    await _v2_empty_sum(gpu_client, precision)
