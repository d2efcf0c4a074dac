"""app.client against the service running as a real process on the CPU backend: every format, both APIs, errors."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from app.client import (
    FORMATS,
    AsyncMatmulClient,
    MatmulClient,
    RequestFormat,
    RequestRejected,
    ServerError,
    Unavailable,
    encode_payload,
    parse_server_timing,
)
from kernels.reference import assert_close_to_reference
from tests.conftest import SERVED_MAX_BODY_BYTES

PHASES = ["read", "decode", "stage", "handoff", "queue", "h2d", "kernel", "d2h", "encode", "total"]


def operands(m: int, k: int, n: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(m * k * n)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


@pytest.fixture
def client(served_url: str) -> Iterator[MatmulClient]:
    with MatmulClient(served_url) as client:
        yield client


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_format_gives_the_product_and_its_metadata(
    client: MatmulClient, format: RequestFormat, dtype: str
) -> None:
    a, b = operands(33, 17, 9, dtype)
    product = client.multiply(a, b, format=format, dtype=dtype)
    assert product.c.dtype == np.dtype(dtype) and product.c.shape == (33, 9)
    assert_close_to_reference(product.c, a, b, np.dtype(dtype))
    assert (product.kernel, product.backend, product.tile) == ("numpy", "cpu", None) and product.device
    assert product.gflops is not None and product.gflops > 0
    assert list(product.timing) == PHASES
    assert all(ms >= 0 for ms in product.timing.values())
    assert product.timing["total"] >= product.timing["kernel"]


def test_npy_keeps_the_operands_dtype_and_json_works_in_float32(client: MatmulClient) -> None:
    a, b = operands(4, 3, 2, "float64")
    assert client.matmul(a, b).dtype == np.float64
    assert client.matmul(a, b, format="json").dtype == np.float32


def test_fortran_ordered_and_integer_operands(client: MatmulClient) -> None:
    a = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    b = np.arange(8).reshape(4, 2)
    for format in FORMATS:
        c = client.matmul(a, b, format=format)
        assert_close_to_reference(c, a, b, c.dtype)


def test_empty_inner_dimension(client: MatmulClient) -> None:
    c = client.matmul(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32))
    assert c.shape == (3, 4) and not c.any()


def test_nan_survives_a_json_answer(client: MatmulClient) -> None:
    a = np.array([[np.nan, 1.0], [2.0, 3.0]])
    product = client.send(encode_payload(a, np.eye(2), "npy", answer="json"))
    assert np.isnan(product.c[0]).all() and product.c[1].tolist() == [2.0, 3.0]


def test_the_options_reach_the_server(client: MatmulClient) -> None:
    a, b = operands(5, 5, 5, "float32")
    product = client.multiply(a, b, kernel="numpy", dtype="float64")
    assert product.kernel == "numpy" and product.c.dtype == np.float64


def test_info_and_readiness(client: MatmulClient) -> None:
    assert client.ready()
    info = client.info()
    assert info["backend"] == "cpu" and info["state"] == "ready"


def test_an_error_carries_the_servers_code_message_and_location(client: MatmulClient, served_url: str) -> None:
    a, b = operands(4, 3, 2, "float32")
    with pytest.raises(RequestRejected) as caught:
        client.matmul(a, b, kernel="no-such-kernel", format="json")
    said = httpx.post(
        f"{served_url}/matmul", params={"kernel": "no-such-kernel"}, json={"a": a.tolist(), "b": b.tolist()}
    ).json()
    assert caught.value.status == 422
    assert (caught.value.code, caught.value.message, caught.value.location) == (
        said["code"],
        said["message"],
        said["location"],
    )
    assert said["message"] in str(caught.value)


@pytest.mark.parametrize("format", FORMATS)
def test_shapes_that_do_not_multiply(client: MatmulClient, format: RequestFormat) -> None:
    with pytest.raises(RequestRejected, match="inner dimensions differ") as caught:
        client.matmul(np.ones((2, 3)), np.ones((4, 2)), format=format)
    assert caught.value.code == "shape_mismatch" and caught.value.location == ["b", 0]


def test_a_body_over_the_limit(client: MatmulClient) -> None:
    big = np.ones((SERVED_MAX_BODY_BYTES // 8, 1))
    with pytest.raises(RequestRejected) as caught:
        client.matmul(big, np.ones((1, 1)))
    assert (caught.value.status, caught.value.code) == (413, "payload_too_large")


def _client_answering(response: httpx.Response) -> MatmulClient:
    """A client whose every request gets `response`: for answers the CPU server cannot be made to give."""
    return MatmulClient(http=httpx.Client(transport=httpx.MockTransport(lambda request: response), base_url="http://m"))


def test_503_is_unavailable_with_retry_after() -> None:
    body = {"code": "overloaded", "message": "the worker's queue is full (64 waiting)", "location": None}
    answer = httpx.Response(503, json=body, headers={"retry-after": "2"})
    with _client_answering(answer) as client, pytest.raises(Unavailable) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert isinstance(caught.value, ServerError)
    assert (caught.value.code, caught.value.message, caught.value.retry_after_s) == ("overloaded", body["message"], 2)


def test_an_answer_not_from_the_service_is_still_a_typed_error() -> None:
    answer = httpx.Response(502, text="<html>Bad Gateway</html>")
    with _client_answering(answer) as client, pytest.raises(ServerError) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert (caught.value.status, caught.value.code, caught.value.message) == (
        502,
        "http_error",
        "<html>Bad Gateway</html>",
    )


@pytest.mark.anyio
@pytest.mark.parametrize("format", FORMATS)
async def test_async_client_every_format(served_url: str, format: RequestFormat) -> None:
    a, b = operands(20, 30, 10, "float64")
    async with AsyncMatmulClient(served_url, format=format) as client:
        assert await client.ready()
        product = await client.multiply(a, b, dtype="float64")
        assert_close_to_reference(product.c, a, b, np.dtype(np.float64))
        assert list(product.timing) == PHASES
        with pytest.raises(RequestRejected, match="inner dimensions differ"):
            await client.matmul(a, a)
        assert (await client.info())["backend"] == "cpu"


def test_parse_server_timing() -> None:
    header = 'queue;dur=0.050, cache;desc="hit", kernel ; dur=1.5 ;desc="tiled"'
    assert parse_server_timing(header) == {"queue": 0.05, "kernel": 1.5}
    assert parse_server_timing("") == {}
