"""matmul_client against the service running as a real process on the CPU backend: every format, both APIs, errors."""

from __future__ import annotations

import http.client
import io
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from matmul_client.client import (
    FORMATS,
    MAX_TIMEOUT_S,
    STACK_OPERAND_BYTES,
    AnswerMemory,
    AsyncMatmulClient,
    MatmulClient,
    MatmulServiceError,
    RequestFormat,
    RequestRejected,
    ServerError,
    Unavailable,
    _whole,
    encode_payload,
    parse_server_timing,
    stacked_pairs,
)
from matmul_client.http11 import Answer
from numerics.reference import assert_close_to_reference
from tests.conftest import SERVED_MAX_BODY_BYTES, SERVED_MAX_JSON_BYTES

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


@pytest.mark.parametrize("format", FORMATS)
def test_a_stack_comes_back_as_numpy_matmul_gives_it_in_every_format(
    client: MatmulClient, format: RequestFormat
) -> None:
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((6, 5, 4)), rng.standard_normal((4, 3))  # a matrix broadcast against the stack
    product = client.multiply(a, b, format=format, dtype="float64")
    assert product.c.shape == (6, 5, 3) and product.batch_size == 6
    assert_close_to_reference(product.c, a, b, np.float64)


@pytest.mark.parametrize("format", FORMATS)
def test_many_pairs_of_one_shape_go_as_stacks_and_come_back_in_their_order(
    client: MatmulClient, format: RequestFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(10)
    pairs = [(rng.standard_normal((6, 5)), rng.standard_normal((5, 4))) for _ in range(300)]
    sent: list[tuple[int, ...]] = []
    multiply = client.multiply

    def spied(a: np.ndarray, b: np.ndarray, **kwargs: Any) -> Any:
        sent.append(a.shape)
        return multiply(a, b, **kwargs)

    monkeypatch.setattr(client, "multiply", spied)
    products = client.multiply_stacked(pairs, stack_bytes=50 * (30 + 20) * 8, format=format, dtype="float64")
    assert sorted(sent) == [(34, 6, 5)] + [(38, 6, 5)] * 7  # 50 pairs' bytes, but a stack for each connection
    sent.clear()
    client.multiply_stacked(pairs[:100], stack_bytes=10 * (30 + 20) * 8, format=format, dtype="float64")
    assert sent == [(10, 6, 5)] * 10  # 10 pairs' bytes a stack
    assert len(products) == 300
    for (a, b), c in zip(pairs, products, strict=True):
        assert_close_to_reference(c, a, b, np.float64)


def test_stacked_pairs_fill_the_connections_and_refuse_mixed_shapes() -> None:
    pairs = [(np.ones((2, 3)), np.ones((3, 4)))] * 20
    assert [a.shape[0] for a, _ in stacked_pairs(pairs, STACK_OPERAND_BYTES, connections=8)] == [3] * 6 + [2]
    assert [a.shape[0] for a, _ in stacked_pairs(pairs, 5 * 20 * 8, connections=1)] == [5] * 4
    assert stacked_pairs([], STACK_OPERAND_BYTES, connections=8) == []
    for mixed in (
        [*pairs, (np.ones((2, 3)), np.ones((3, 5)))],
        [*pairs, (np.ones((2, 3), np.float32), np.ones((3, 4)))],
    ):
        with pytest.raises(ValueError, match="one shape and dtype"):
            stacked_pairs(mixed, STACK_OPERAND_BYTES, connections=8)
    with pytest.raises(ValueError, match="matrices"):
        stacked_pairs([(np.ones((2, 2, 3)), np.ones((2, 3, 4)))], STACK_OPERAND_BYTES, connections=8)


def test_npy_keeps_the_operands_dtype_and_json_works_in_float32(client: MatmulClient) -> None:
    a, b = operands(4, 3, 2, "float64")
    assert client.matmul(a, b).dtype == np.float64
    assert client.matmul(a, b, format="json").dtype == np.float32


@pytest.mark.parametrize("format", FORMATS)
def test_two_int8_operands_come_back_as_their_exact_int32_product_in_every_format(
    client: MatmulClient, format: RequestFormat
) -> None:
    """JSON numbers carry no dtype, so the client asks for int32 for an int8 pair, as .npy and .npz bodies get it;
    a dtype or precision named is sent as it is."""
    rng = np.random.default_rng(8)
    a, b = rng.integers(-128, 128, (6, 1500), np.int8), rng.integers(-128, 128, (1500, 4), np.int8)
    a[0], b[:, 0] = -128, -128  # 1500 * 16384 > 2^24: exact in int32 alone
    product = client.multiply(a, b, format=format)
    assert product.c.dtype == np.int32 and product.precision == "int8"
    assert np.array_equal(product.c, a.astype(np.int64) @ b.astype(np.int64))
    assert client.matmul(a, b, format=format, dtype="float64").dtype == np.float64
    assert client.matmul(a, b, format=format, precision="int8").dtype == np.int32


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


def test_a_json_body_over_the_json_limit_is_refused_as_the_server_words_it(client: MatmulClient) -> None:
    """Operands whose JSON passes MATMUL_MAX_JSON_BYTES, though their .npy would not pass the body limit: the client
    sends the JSON it built and raises the server's 413, its code and message, before the server parsed a byte."""
    a = np.full((100, 100), 1 / 3)
    payload = encode_payload(a, a, "json")
    assert SERVED_MAX_JSON_BYTES < payload.size < SERVED_MAX_BODY_BYTES
    with pytest.raises(RequestRejected) as caught:
        client.send(payload)
    assert (caught.value.status, caught.value.code) == (413, "payload_too_large")
    assert caught.value.message == (
        f"the JSON body is {payload.size} bytes, over the limit of {SERVED_MAX_JSON_BYTES} (MATMUL_MAX_JSON_BYTES)"
    )
    np.testing.assert_allclose(client.matmul(a, a, format="npy"), a @ a)


class Stub:
    """A one-socket HTTP/1.1 server on loopback answering every request with `answer` (whole answer bytes), for
    answers and transport failures the real server cannot be made to give. It records each request's head and
    body, counts the connections it accepted, and closes a connection after answering when `close_after`."""

    def __init__(
        self,
        answer: bytes,
        close_after: bool = False,
        silent: bool = False,
        early: bool = False,
        pause: float = 0,
        pieces: int = 1,
    ) -> None:
        self.answer, self.close_after, self.silent, self.early = answer, close_after, silent, early
        self.pause = pause
        """Seconds before each answer."""
        self.pieces = pieces
        """Writes each answer is sent in, 20 ms apart, so that the client's reads find it in parts."""
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        with sock, sock.makefile("rb") as reader:
            while head := reader.readline():
                while (line := reader.readline()) not in (b"\r\n", b""):
                    head += line
                fields = (line.partition(b":") for line in head.split(b"\r\n"))
                length = next((int(value) for name, _, value in fields if name.lower() == b"content-length"), 0)
                if self.early:  # answer at once, the body unread, and hang up (a reset: SO_LINGER 0)
                    self.requests.append((head, b""))
                    sock.sendall(self.answer)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                self.requests.append((head, reader.read(length)))
                time.sleep(self.pause)
                if self.silent:
                    time.sleep(5)
                    return
                step = -(-len(self.answer) // self.pieces)
                for start in range(0, len(self.answer), step):
                    sock.sendall(self.answer[start : start + step])
                    time.sleep(0.02 if self.pieces > 1 else 0)
                if self.close_after:
                    return

    def close(self) -> None:
        self._listener.close()


def http_answer(status: int, body: bytes, *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
def stub() -> Iterator[Callable[..., Stub]]:
    made: list[Stub] = []

    def make(answer: bytes, **kwargs: Any) -> Stub:
        made.append(Stub(answer, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def npy_answer(c: np.ndarray, declared_bytes: int | None = None) -> bytes:
    body = io.BytesIO()
    np.save(body, c)
    data = body.getvalue()
    answer = http_answer(200, data, *product_headers(c))
    if declared_bytes is not None:
        answer = answer.replace(f"content-length: {len(data)}".encode(), f"content-length: {declared_bytes}".encode())
    return answer


def product_headers(c: np.ndarray) -> list[str]:
    """The headers of a product's `.npy` answer, as the service sends them (a stub's)."""
    return [
        "content-type: application/x-npy",
        f"x-matmul-dtype: {c.dtype}",
        f"x-matmul-shape: {c.shape[0]}x{c.shape[1]}",
        "x-matmul-kernel: numpy",
        "x-matmul-precision: fp32",
        "x-matmul-backend: cpu",
        "x-matmul-device: stub",
        "x-matmul-batch-size: 3",
        "server-timing: total;dur=1.5",
    ]


def test_after_an_answer_that_says_connection_close_the_next_product_goes_on_a_new_connection(
    stub: Callable[..., Stub],
) -> None:
    """A server that answers `connection: close` will close the connection, though its socket may still be open
    when the answer has been read: the client does not send another request on it."""
    c = np.arange(4.0).reshape(2, 2)
    server = stub(npy_answer(c).replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1))
    with MatmulClient(server.url) as client:
        for _ in range(2):
            np.testing.assert_array_equal(client.matmul(np.ones((2, 2)), np.ones((2, 2))), c)
    assert server.connections == 2 and len(server.requests) == 2


def test_503_is_unavailable_with_retry_after(stub: Callable[..., Stub]) -> None:
    body = {"code": "overloaded", "message": "the worker's queue is full (64 waiting)", "location": ["queue"]}
    server = stub(http_answer(503, orjson.dumps(body), "retry-after: 2", "content-type: application/json"))
    with MatmulClient(server.url) as client, pytest.raises(Unavailable) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert isinstance(caught.value, ServerError)
    assert (caught.value.status, caught.value.code, caught.value.message) == (503, "overloaded", body["message"])
    assert (caught.value.location, caught.value.retry_after_s) == (["queue"], 2)


@pytest.mark.parametrize(
    ("status", "family"), [(400, RequestRejected), (499, RequestRejected), (500, ServerError), (599, ServerError)]
)
def test_4xx_is_a_rejected_request_and_5xx_a_server_error(stub: Callable[..., Stub], status: int, family: type) -> None:
    body = orjson.dumps({"code": "some_code", "message": "what went wrong", "location": None})
    server = stub(http_answer(status, body, "content-type: application/json"))
    with MatmulClient(server.url) as client, pytest.raises(MatmulServiceError) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert type(caught.value) is family and caught.value.status == status


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "Bad Gateway"),  # no words of its own: the status's reason phrase
        (b"x" * 600, "x" * 500),  # a page, cut at 500 characters
        (b"bad \xff byte", "bad \ufffd byte"),  # not UTF-8: the byte replaced, not an exception of the client's
    ],
)
def test_a_proxys_answer_is_a_server_error_in_its_own_words(
    stub: Callable[..., Stub], body: bytes, message: str
) -> None:
    server = stub(http_answer(502, body, "content-type: text/html"))
    with MatmulClient(server.url) as client, pytest.raises(ServerError) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert (caught.value.status, caught.value.code, caught.value.message) == (502, "http_error", message)


@pytest.mark.parametrize("status", [101, 204, 301])
def test_an_answer_that_is_neither_a_product_nor_an_error_is_no_server_failure(
    stub: Callable[..., Stub], status: int
) -> None:
    """A redirect or a 204 is not a product, nor a failure of the server's: the family of every answer that is not a
    product, not ServerError's 5xx."""
    server = stub(http_answer(status, b"", "location: http://elsewhere/"))
    with MatmulClient(server.url) as client, pytest.raises(MatmulServiceError) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert type(caught.value) is MatmulServiceError and caught.value.status == status


def test_a_retry_after_that_is_a_date_gives_no_seconds(stub: Callable[..., Stub]) -> None:
    body = orjson.dumps({"code": "overloaded", "message": "full", "location": None})
    server = stub(http_answer(503, body, "retry-after: Fri, 27 Nov 2026 12:00:00 GMT"))
    with MatmulClient(server.url) as client, pytest.raises(Unavailable) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert caught.value.retry_after_s is None


def test_a_large_answer_arriving_in_pieces_is_read_whole(stub: Callable[..., Stub]) -> None:
    """A 2 MiB .npy answer (read into the client's kept buffers) sent in five writes, 20 ms apart: every read that
    returns part of it moves on from where the last one ended."""
    c = np.arange(256 * 1024, dtype=np.float64).reshape(256, 1024)
    server = stub(npy_answer(c), pieces=5)
    with MatmulClient(server.url) as client:
        np.testing.assert_array_equal(client.matmul(np.ones((256, 1)), np.ones((1, 1024))), c)


def test_both_npy_parts_data_start_on_64_bytes_of_the_body() -> None:
    """The server reads a large body into aligned memory and uses an operand there in place when its data is aligned:
    the second part's too, after the first part's odd size."""
    a, b = np.ones((3, 5), np.float32), np.ones((5, 7), np.float64)
    buffers = encode_payload(a, b, "npy").parts
    assert len(buffers[0]) % 64 == 0 and (len(buffers[0]) + len(buffers[1]) + len(buffers[2])) % 64 == 0
    assert bytes(buffers[3]) == b.tobytes()


def test_the_servers_error_to_an_info_request_is_raised_with_its_status(stub: Callable[..., Stub]) -> None:
    body = {"code": "unauthorized", "message": "this server needs an API key", "location": None}
    server = stub(http_answer(401, orjson.dumps(body), "content-type: application/json"))
    with MatmulClient(server.url) as client, pytest.raises(RequestRejected) as caught:
        client.info()
    assert (caught.value.status, caught.value.code, caught.value.message) == (401, "unauthorized", body["message"])


@pytest.mark.parametrize(
    ("body", "words"),
    [(b"[" + b"1," * 100 + b"1]", "a 200 answer that is not a JSON object: " + repr((b"[" + b"1," * 100)[:100])),
     (b"{not json", "a 200 answer that is not JSON: ")],
)  # fmt: skip
def test_an_info_answer_that_is_not_a_json_object_is_a_protocol_error(
    stub: Callable[..., Stub], body: bytes, words: str
) -> None:
    server = stub(http_answer(200, body, "content-type: application/json"))
    with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError) as caught:
        client.info()
    assert words in str(caught.value)


def test_an_answer_not_from_the_service_is_still_a_typed_error(stub: Callable[..., Stub]) -> None:
    server = stub(http_answer(502, b"<html>Bad Gateway</html>", "content-type: text/html"))
    with MatmulClient(server.url) as client, pytest.raises(ServerError) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert (caught.value.status, caught.value.code, caught.value.message) == (
        502,
        "http_error",
        "<html>Bad Gateway</html>",
    )


def test_the_operands_travel_as_their_own_memory() -> None:
    """A .npy payload is small headers and views of the operands: no copy of a 64 MiB operand on the way out."""
    a, b = operands(300, 200, 100, "float32")
    payload = encode_payload(a, b)
    views = [part for part in payload.parts if isinstance(part, memoryview)]
    assert [np.shares_memory(np.frombuffer(view, np.uint8), x) for view, x in zip(views, (a, b), strict=True)] == [
        True,
        True,
    ]
    assert payload.size - a.nbytes - b.nbytes < 1024 and payload.size == len(payload.content)


def test_what_the_client_sends_is_what_np_save_and_multipart_say(stub: Callable[..., Stub]) -> None:
    """The body, as the server reads it: a multipart form of two .npy files that np.load reads, each array's data
    beginning on a multiple of 64 bytes of the body."""
    server = stub(npy_answer(np.zeros((3, 2), np.float32)))
    a, b = np.asfortranarray(operands(3, 4, 2, "float64")[0]), np.arange(8, dtype=">i4").reshape(4, 2)
    with MatmulClient(server.url, api_key="k1", headers={"X-Trace": "t"}) as client:
        client.multiply(a, b, kernel="tiled", tile=8)
    ((head, body),) = server.requests
    assert head.startswith(b"POST /matmul?kernel=tiled&tile=8 HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k1\r\n" in head and b"\r\nX-Trace: t\r\n" in head
    boundary = re.search(rb"boundary=(\w+)", head).group(1)  # type: ignore[union-attr]
    parts = body.split(b"--" + boundary)
    assert parts[0] == b"" and parts[-1] == b"--\r\n" and len(parts) == 4
    for part, x in zip(parts[1:3], (a, b), strict=True):
        npy = part.split(b"\r\n\r\n", 1)[1].removesuffix(b"\r\n")
        loaded = np.load(io.BytesIO(npy), allow_pickle=False)
        assert loaded.dtype == x.dtype and loaded.flags.c_contiguous
        np.testing.assert_array_equal(loaded, x)
        assert npy.endswith(np.ascontiguousarray(x).tobytes())
        # its header as np.save writes it but for the spaces that put the data on a multiple of 64 of the body
        assert (body.index(npy) + len(npy) - x.nbytes) % 64 == 0


def test_the_answer_is_read_into_an_array_with_what_the_server_said(stub: Callable[..., Stub]) -> None:
    c = np.arange(6, dtype=np.float64).reshape(2, 3)
    server = stub(npy_answer(c))
    with MatmulClient(server.url) as client:
        product = client.multiply(np.ones((2, 1)), np.ones((1, 3)))
    np.testing.assert_array_equal(product.c, c)
    assert (product.batch_size, product.timing, product.device) == (3, {"total": 1.5}, "stub")


def npy_file(header: str, data: bytes, version: tuple[int, int] = (1, 0)) -> bytes:
    """A `.npy` file with the header text given, as a server other than NumPy might write it."""
    text = header.encode() + b"\n"
    width = 2 if version == (1, 0) else 4
    return b"\x93NUMPY" + bytes(version) + len(text).to_bytes(width, "little") + text + data


@pytest.mark.parametrize(
    ("header", "version"),
    [
        ("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }", (1, 0)),  # as NumPy writes, in Fortran order
        ("{'descr': '>f8', 'fortran_order': False, 'shape': (2, 3), }", (2, 0)),  # big-endian, format 2.0
        ("{'shape':(2,3),'fortran_order':False,'descr':'<f8'}", (1, 0)),  # not as NumPy writes: NumPy reads it
    ],
)
def test_a_npy_answer_is_read_as_numpy_reads_it_whatever_its_header(
    stub: Callable[..., Stub], header: str, version: tuple[int, int]
) -> None:
    """Headers as NumPy writes them are read by the client's own pattern, any other by NumPy's parser: each gives
    the array NumPy would."""
    c = np.arange(6, dtype=np.float64).reshape(2, 3)
    fortran = "'fortran_order': True" in header
    dtype = np.dtype(">f8" if "'>f8'" in header else "<f8")
    data = (np.asfortranarray(c) if fortran else c).astype(dtype).tobytes(order="F" if fortran else "C")
    server = stub(http_answer(200, npy_file(header, data, version), *product_headers(c)))
    with MatmulClient(server.url) as client:
        got = client.matmul(np.ones((2, 1)), np.ones((1, 3)))
    assert got.dtype == dtype and got.flags.f_contiguous == fortran
    np.testing.assert_array_equal(got, c)


def test_a_npy_answer_whose_header_claims_more_than_numpy_reads_is_refused(stub: Callable[..., Stub]) -> None:
    body = b"\x93NUMPY\x02\x00" + (1 << 30).to_bytes(4, "little") + b"{" * 64
    server = stub(http_answer(200, body, "content-type: application/x-npy"), close_after=True)
    with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError, match="over NumPy's 10000"):
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        # sizes a server claims, which were allocated (MemoryError) or overflowed (OverflowError) before a byte came
        (http_answer(500, b"").replace(b"content-length: 0", b"content-length: %d" % 2**70), "Content-Length"),
        (http_answer(500, b"short").replace(b"content-length: 5", b"content-length: 200000000000"), "IncompleteRead"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n400000000000000000\r\n", "chunk size"),
        (
            http_answer(200, b"").replace(b"content-length: 0", b"content-type: application/x-npy")
            + npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (1099511627776, 1099511627776), }", b""),
            "shape is (1099511627776, 1099511627776), not the product's (1, 1)",
        ),
        # a digit that str.isdigit takes and int() does not
        (http_answer(500, b"").replace(b"content-length: 0", "content-length: \u00b2".encode("latin-1")), "Length"),
        ("HTTP/1.1 \u00b200 OK\r\n\r\n".encode("latin-1"), "BadStatusLine"),
    ],
)
def test_a_size_a_server_claims_takes_no_memory_before_its_bytes_come(
    stub: Callable[..., Stub], answer: bytes, said: str
) -> None:
    server = stub(answer, close_after=True)
    with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError, match=re.escape(said)):
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))


def test_an_info_answer_claiming_more_than_its_bound_is_a_protocol_error(stub: Callable[..., Stub]) -> None:
    server = stub(http_answer(200, b"{}").replace(b"content-length: 2", b"content-length: 200000000000"))
    with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError, match="more than 16777216 bytes"):
        client.info()


def test_a_retry_after_in_digits_other_than_ascii_gives_no_seconds(stub: Callable[..., Stub]) -> None:
    body = orjson.dumps({"code": "overloaded", "message": "full", "location": None})
    server = stub(http_answer(503, body) + b"")
    server.answer = server.answer.replace(b"\r\n\r\n", "\r\nretry-after: \u00b2\r\n\r\n".encode("latin-1"), 1)
    with MatmulClient(server.url) as client, pytest.raises(Unavailable) as caught:
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert caught.value.retry_after_s is None


@pytest.mark.parametrize("dtype", ["<U1", "|S4", "|V4", "<M8[s]", "<m8[s]", "<c8", "|b1"])
def test_an_answer_that_is_not_an_array_of_numbers_is_a_protocol_error(stub: Callable[..., Stub], dtype: str) -> None:
    c = np.zeros((2, 2), dtype)
    server = stub(npy_answer(c))
    with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError, match="is not a number's"):
        client.matmul(np.ones((2, 2)), np.ones((2, 2)))


@pytest.mark.parametrize("format", ["npy", "json"])
def test_an_answer_of_another_shape_than_the_products_is_a_protocol_error(
    stub: Callable[..., Stub], format: RequestFormat
) -> None:
    """A 3x3 answer to a product of two 2x2 matrices, as `.npy` or as JSON (its X-Matmul-Shape the answer's), and any
    product answer to operands that do not multiply: never returned as the product."""
    c = np.arange(9.0).reshape(3, 3)
    json_answer = http_answer(200, orjson.dumps({"result": c.tolist()}), *product_headers(c)[1:])
    server = stub(npy_answer(c) if format == "npy" else json_answer)
    with MatmulClient(server.url, format=format) as client:
        with pytest.raises(httpx.RemoteProtocolError, match=r"shape is \(3, 3\), not the product's \(2, 2\)"):
            client.matmul(np.ones((2, 2)), np.ones((2, 2)))
        with pytest.raises(httpx.RemoteProtocolError, match="not operands that do not multiply"):
            client.matmul(np.ones((3, 2)), np.ones((3, 3)))
        np.testing.assert_array_equal(client.matmul(np.ones((3, 1)), np.ones((1, 3))), c)


def test_a_connection_holding_bytes_past_its_answer_serves_no_other_request(stub: Callable[..., Stub]) -> None:
    """A server that sends two answers to one request: the first is the request's, and the second, which would
    have been taken for the next request's answer (and every answer after it one behind), goes with its
    connection."""
    first, second = np.full((2, 2), 1.0), np.full((2, 2), 2.0)
    server = stub(npy_answer(first) + npy_answer(second))
    with MatmulClient(server.url) as client:
        for _ in range(3):
            np.testing.assert_array_equal(client.matmul(np.ones((2, 2)), np.ones((2, 2))), first)
    assert (server.connections, len(server.requests)) == (3, 3)


def test_a_json_answer_of_empty_rows_is_read_whatever_their_number(client: MatmulClient) -> None:
    """A stack of products with no columns: no element, but `[]` for each of its 500,000 rows (1.5 MB), which a bound
    of bytes by element alone refused."""
    payload = encode_payload(np.zeros((100, 5000, 0)), np.zeros((100, 0, 0)), "npy", answer="json")
    assert client.send(payload).c.shape == (100, 5000, 0)


@pytest.mark.parametrize(("size", "taken"), [(64, True), (65, False)])
def test_a_body_that_ends_with_its_connection_is_taken_whole_up_to_its_bound(size: int, taken: bool) -> None:
    answer = Answer(io.BufferedReader(io.BytesIO(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * size)), "GET")
    assert answer.length is None
    if taken:
        assert _whole(answer, 64) == b"x" * 64
    else:
        with pytest.raises(http.client.HTTPException, match="more than 64 bytes"):
            _whole(answer, 64)


def test_json_operands_that_json_cannot_carry_are_refused_before_sending(stub: Callable[..., Stub]) -> None:
    server = stub(npy_answer(np.ones((2, 2))))
    with MatmulClient(server.url, format="json") as client:
        for bad, said in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")):
            a = np.ones((2, 3, 2), np.float32)
            a[1, 2, 0] = bad
            with pytest.raises(ValueError, match=re.escape(f"a[1][2][0] is {said}, which JSON cannot carry")):
                client.matmul(a, np.ones((2, 2)))
    assert server.requests == []


def test_an_answers_memory_serves_the_next_answer_only_once_its_last_view_is_gone() -> None:
    memory = AnswerMemory(kept=2, min_bytes=1024)
    first = memory.take(4096).view(np.float32)
    first[:] = 1.0
    row = first.reshape(32, 32)[3]  # the caller keeps a view of the answer, not the answer
    address = first.ctypes.data
    del first
    second = memory.take(4096)
    assert second.ctypes.data != address and set(row.tolist()) == {1.0}
    del row, second
    assert memory.take(4096).ctypes.data == address  # kept, and given to the next answer of its size
    assert memory.take(512).base is None  # small answers are new arrays


def test_answers_kept_by_the_caller_stay_their_own_while_later_ones_reuse_memory(served_url: str) -> None:
    """Many products at once, answers of 1 MiB (pooled) on 4 connections: the caller keeps every third answer (or a
    view of it) and drops the rest, whose memory the next answers are read into; every answer is checked when it
    comes and every kept one again at the end."""
    pairs = [operands(512, 8 + seed % 3, 512, "float32") for seed in range(36)]
    kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    with MatmulClient(served_url, connections=4) as client:

        def one(index: int, a: np.ndarray, b: np.ndarray) -> None:
            c = client.matmul(a, b)
            assert_close_to_reference(c, a, b, np.dtype(np.float32))
            if index % 3 == 0:
                kept.append((c, a, b) if index % 2 else (c[::2], a[::2], b))

        for outcome in [client.threads().submit(one, index, *pair) for index, pair in enumerate(pairs)]:
            outcome.result()
    assert len(kept) == 12
    for c, a, b in kept:
        assert_close_to_reference(c, a, b, np.dtype(np.float32))


def test_a_npy_answer_longer_or_shorter_than_its_header_says_is_a_protocol_error(stub: Callable[..., Stub]) -> None:
    c = np.ones((2, 2), np.float32)
    for declared in (len(npy_answer(c)), 10):
        server = stub(npy_answer(c, declared_bytes=declared), close_after=True)
        refused = pytest.raises(httpx.RemoteProtocolError, match=r"describes|not a \.npy")
        with MatmulClient(server.url) as client, refused:
            client.matmul(c, c)


def test_one_connection_serves_one_product_after_another(stub: Callable[..., Stub]) -> None:
    server = stub(npy_answer(np.ones((1, 1))))
    with MatmulClient(server.url) as client:
        for _ in range(5):
            client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    assert (server.connections, len(server.requests)) == (1, 5)


def test_a_connection_the_server_closed_while_idle_is_replaced_unseen(stub: Callable[..., Stub]) -> None:
    """The server may close a kept-alive connection between two requests (uvicorn does after 5 s idle): the
    next product goes on a new connection, and the caller sees only the product."""
    server = stub(npy_answer(np.ones((1, 1))), close_after=True)
    with MatmulClient(server.url) as client:
        for _ in range(3):
            assert client.matmul(np.ones((1, 1)), np.ones((1, 1))).tolist() == [[1.0]]
            time.sleep(0.05)  # the close reaches the client's socket
    assert (server.connections, len(server.requests)) == (3, 3)


def test_transport_failures_are_httpx_errors(stub: Callable[..., Stub]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    with MatmulClient(f"http://127.0.0.1:{port}") as client, pytest.raises(httpx.ConnectError):
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    server = stub(b"", silent=True)
    with MatmulClient(server.url, timeout=0.2) as client, pytest.raises(httpx.ReadTimeout):
        client.matmul(np.ones((1, 1)), np.ones((1, 1)))
    cut = stub(npy_answer(np.ones((64, 64)))[:-100], close_after=True)
    with MatmulClient(cut.url) as client, pytest.raises(httpx.TransportError):
        client.matmul(np.ones((64, 1)), np.ones((1, 64)))


def test_an_answer_that_stops_coming_half_way_is_a_read_timeout(stub: Callable[..., Stub]) -> None:
    """A body that stops half way, on a connection the server keeps open, ends in the client's timeout."""
    server = stub(npy_answer(np.ones((256, 256)))[:300_000])  # 512 KiB of data announced
    began = time.monotonic()
    with MatmulClient(server.url, timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.matmul(np.ones((256, 1)), np.ones((1, 256)))
    assert time.monotonic() - began < 10


def test_a_request_the_server_does_not_read_is_a_write_timeout() -> None:
    """A server whose connection is made (its listener's backlog takes it) but never read: the body fills the
    sockets' buffers, and the send is given up after the client's timeout."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        big = np.ones((2048, 2048), np.float32)  # 32 MiB of body, more than loopback's buffers hold
        began = time.monotonic()
        with MatmulClient(url, timeout=0.3) as client, pytest.raises(httpx.WriteTimeout):
            client.matmul(big, big)
        assert time.monotonic() - began < 10


def test_a_url_that_is_not_http_and_headers_that_would_split_a_request_are_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        MatmulClient("ftp://host/")
    with pytest.raises(ValueError, match="connections"):
        MatmulClient(connections=0)
    for timeout in (0, -1.0, float("nan"), float("inf"), 1e30, MAX_TIMEOUT_S * 2):  # inf and 1e30 overflowed a timer
        with pytest.raises(ValueError, match="timeout must be a number of seconds over 0 and at most 86400"):
            MatmulClient(timeout=timeout)
    MatmulClient(timeout=MAX_TIMEOUT_S).close()
    for key in ("ключ-secret", "bad\nkey-secret"):  # refused without the key in the message, which logs keep
        with pytest.raises(ValueError, match="API key") as refused:
            MatmulClient(api_key=key)
        assert "secret" not in str(refused.value)
    refused = [("X-Trace", "t\r\nInjected: 1"), ("X Trace", "t"), ("X-Trace", "t\n"), ("X-Trace", "\u20ac")]
    refused += [("Host", "elsewhere"), ("content-length", "0"), ("Transfer-Encoding", "chunked")]
    for name, value in refused:
        with pytest.raises(ValueError, match="cannot be sent"):
            MatmulClient(headers={name: value})


def test_an_answer_sent_before_the_body_was_read_is_the_answer(stub: Callable[..., Stub]) -> None:
    """A server (a proxy's size limit) may answer 413 at the head and hang up while the body is still being sent:
    the caller gets that 413, not a broken pipe."""
    body = orjson.dumps({"code": "payload_too_large", "message": "too big", "location": None})
    server = stub(http_answer(413, body, "connection: close", "content-type: application/json"), early=True)
    big = np.ones((4096, 4096), np.float32)  # 64 MiB: more than the socket buffers take before the server hangs up
    with MatmulClient(server.url) as client, pytest.raises(RequestRejected) as caught:
        client.matmul(big, big)
    assert (caught.value.status, caught.value.code) == (413, "payload_too_large")


def test_a_200_that_is_not_a_product_is_a_protocol_error(stub: Callable[..., Stub]) -> None:
    for answer in (http_answer(200, b"[1, 2]", "content-type: application/json"), http_answer(200, b"ok")):
        server = stub(answer)
        with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError, match="not a product"):
            client.matmul(np.ones((1, 1)), np.ones((1, 1)), format="json")
        with MatmulClient(server.url) as client, pytest.raises(httpx.RemoteProtocolError, match="JSON"):
            client.info()


def test_many_products_end_before_the_first_error_is_raised(stub: Callable[..., Stub]) -> None:
    """multiply_many sends every pair, and raises the first error in their order only once all have ended."""
    body = orjson.dumps({"code": "shape_mismatch", "message": "no", "location": None})
    server = stub(http_answer(422, body, "content-type: application/json"), pause=0.1)
    with MatmulClient(server.url, connections=2) as client:
        with pytest.raises(RequestRejected):
            client.multiply_many([(np.ones((1, 1)), np.ones((1, 1)))] * 6)
        sent_when_raised = len(server.requests)  # before close(), which would wait for the products anyway
    assert sent_when_raised == 6 and server.connections <= 2


def test_many_products_in_their_order_on_a_bounded_number_of_connections(served_url: str) -> None:
    pairs = [operands(m, 7, 5, "float64") for m in range(1, 25)]
    with MatmulClient(served_url, connections=3) as client:
        products = client.multiply_many(pairs, dtype="float64")
        assert len(client._pool._idle) <= 3
    for (a, b), product in zip(pairs, products, strict=True):
        assert_close_to_reference(product.c, a, b, np.dtype(np.float64))


@pytest.mark.anyio
async def test_async_many_pairs_of_one_shape_go_as_stacks(served_url: str) -> None:
    rng = np.random.default_rng(11)
    pairs = [(rng.standard_normal((3, 9)), rng.standard_normal((9, 4))) for _ in range(40)]
    async with AsyncMatmulClient(served_url, connections=4) as client:
        products = await client.multiply_stacked(pairs, dtype="float64")
    assert len(products) == 40
    for (a, b), c in zip(pairs, products, strict=True):
        assert_close_to_reference(c, a, b, np.dtype(np.float64))


def test_many_products_raise_the_first_error_in_their_order(served_url: str) -> None:
    good, bad = operands(4, 3, 2, "float32"), (np.ones((2, 3)), np.ones((4, 2)))
    with MatmulClient(served_url) as client, pytest.raises(RequestRejected, match="inner dimensions"):
        client.multiply_many([good, bad, good])


@pytest.mark.anyio
async def test_async_many_products(served_url: str) -> None:
    pairs = [operands(m, 9, 4, "float64") for m in range(1, 17)]
    async with AsyncMatmulClient(served_url, connections=4) as client:
        products = await client.multiply_many(pairs, dtype="float64")
        with pytest.raises(RequestRejected):
            await client.multiply_many([pairs[0], (np.ones((2, 3)), np.ones((4, 2)))])
    for (a, b), product in zip(pairs, products, strict=True):
        assert_close_to_reference(product.c, a, b, np.dtype(np.float64))


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


@pytest.mark.anyio
async def test_async_calls_run_on_the_clients_own_threads_with_the_format_asked(stub: Callable[..., Stub]) -> None:
    """Each call of the asyncio client runs on one of its own threads (as many as its connections), and a format
    named for one call is the one its body is sent in."""
    c = np.arange(4.0).reshape(2, 2)
    server = stub(npy_answer(c))
    async with AsyncMatmulClient(server.url, connections=2) as client:
        threads = set()
        real = client._client.multiply

        def recording(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.current_thread().name)
            return real(*args, **kwargs)

        client._client.multiply = recording  # type: ignore[method-assign]
        np.testing.assert_array_equal(await client.matmul(np.ones((2, 2)), np.ones((2, 2)), format="json"), c)
        await client.multiply_many([(np.ones((2, 2)), np.ones((2, 2)))] * 4, format="npz")
    assert threads and all(name.startswith("matmul-client") for name in threads), threads
    content_types = [re.search(rb"Content-Type: ([^;\r]+)", head)[1] for head, _ in server.requests]  # type: ignore[index]
    assert content_types == [b"application/json"] + [b"application/x-npz"] * 4


@pytest.mark.anyio
async def test_both_clients_send_a_payload_and_many_products_with_the_format_and_options_asked(
    stub: Callable[..., Stub],
) -> None:
    """A payload encoded once is sent as it is, with the options of the call; `multiply_many` sends every body in the
    format named and every path with the options given, on one connection as on several."""
    c = np.arange(4.0).reshape(2, 2)
    server = stub(npy_answer(c))
    pairs = [(np.ones((2, 2)), np.ones((2, 2)))] * 3
    with MatmulClient(server.url, connections=1) as blocking:
        np.testing.assert_array_equal(blocking.send(encode_payload(*pairs[0], "npz"), kernel="tiled").c, c)
        assert [p.c.tolist() for p in blocking.multiply_many(pairs, format="json", tile=8)] == [c.tolist()] * 3
    async with AsyncMatmulClient(server.url, connections=2) as asynchronous:
        np.testing.assert_array_equal((await asynchronous.send(encode_payload(*pairs[0], "json"), tile=16)).c, c)
        await asynchronous.multiply_many(pairs, format="npz", kernel="naive")
    heads = [head for head, _ in server.requests]
    content_types = [re.search(rb"Content-Type: ([^;\r]+)", head)[1] for head in heads]  # type: ignore[index]
    assert content_types == [b"application/x-npz", *[b"application/json"] * 4, *[b"application/x-npz"] * 3]
    paths = [head.split(b" ")[1] for head in heads]
    assert paths == [
        b"/matmul?kernel=tiled",
        *[b"/matmul?tile=8"] * 3,
        b"/matmul?tile=16",
        *[b"/matmul?kernel=naive"] * 3,
    ]


def test_a_client_needs_at_least_one_connection() -> None:
    with pytest.raises(ValueError, match="connections must be at least 1, not 0"):
        MatmulClient("http://127.0.0.1:1", connections=0)
    assert MatmulClient("http://127.0.0.1:1", connections=1).connections == 1


def test_parse_server_timing() -> None:
    header = 'queue;dur=0.050, cache;desc="hit", kernel ; dur=1.5 ;desc="tiled"'
    assert parse_server_timing(header) == {"queue": 0.05, "kernel": 1.5}
    assert parse_server_timing("") == {}
    # as the service writes it, split apart; a header near that form is searched through as any other
    assert parse_server_timing("read;dur=0.021, h2d;dur=0.400, total;dur=14.100") == {
        "read": 0.021,
        "h2d": 0.4,
        "total": 14.1,
    }
    assert parse_server_timing("read;dur=1e-05, total;dur=2") == {"read": 1e-05, "total": 2.0}
    assert parse_server_timing("read;dur=0.021,total;dur=0.500") == {"read": 0.021, "total": 0.5}
