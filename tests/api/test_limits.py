"""Size and time limits on request bodies, decided before a large body is read or a large array made."""

from __future__ import annotations

import asyncio
import io
import math
import zipfile
from collections.abc import AsyncIterator

import httpx
import numpy as np
import orjson
import pytest
from fastapi import FastAPI

from app.api.exchange import POOLED_BODY_BYTES, BodyBuffers
from app.config import Settings
from app.main import create_app
from matmul_tools.bodies import MULTIPART_BOUNDARY, multipart_body, npy_bytes, npz_bytes
from numerics.reference import assert_close_to_reference
from tests.conftest import _client_for

pytestmark = pytest.mark.anyio


@pytest.fixture
async def small() -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    settings = Settings(
        backend="cpu", max_body_bytes=8192, max_json_bytes=2048, max_dim=100, max_elements=1000,
        max_result_elements=400, body_timeout_s=0.2, access_log=False,
    )  # fmt: skip
    app = create_app(settings)
    async for client in _client_for(app):
        yield app, client


SHAPED = Settings(
    backend="cpu", max_dim=100, max_elements=1000, max_result_elements=399, max_json_bytes=1 << 16, access_log=False
)
"""Shape limits that a shape can meet exactly and pass by one: 100 = 100x1, 1000 = 10x100 (1001 = 11x91), 399 = 19x21
(400 = 20x20)."""
SHAPE_BOUNDS = [
    # (a's shape, b's shape, the refusal's words when one past the bound)
    pytest.param((100, 1), (1, 1), None, id="rows at max_dim"),
    pytest.param((101, 1), (1, 1), "dimension 0 of 'a' is 101, over the limit of 100", id="rows past max_dim"),
    pytest.param((1, 1), (1, 100), None, id="columns at max_dim"),
    pytest.param((1, 1), (1, 101), "dimension 1 of 'b' is 101, over the limit of 100", id="columns past max_dim"),
    pytest.param((10, 100), (100, 1), None, id="at max_elements"),
    pytest.param((11, 91), (91, 1), "matrix 'a' has 1001 elements, over the limit of 1000", id="past max_elements"),
    pytest.param((19, 1), (1, 21), None, id="at max_result_elements"),
    pytest.param((20, 1), (1, 20), "matrix 'result' has 400 elements, over the limit of 399", id="past the result's"),
]
DECODERS = ["json", "multipart", "npz", "v2 json", "v2 binary"]
INFER = "/v2/models/matmul/infer"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def shaped() -> AsyncIterator[httpx.AsyncClient]:
    async for client in _client_for(create_app(SHAPED)):
        yield client


def _v2_tensor(name: str, array: np.ndarray, binary: bool) -> dict[str, object]:
    datatype = {"float32": "FP32", "float64": "FP64"}[array.dtype.name]
    tensor: dict[str, object] = {"name": name, "shape": list(array.shape), "datatype": datatype}
    if binary:
        tensor["parameters"] = {"binary_data_size": array.nbytes}
    else:
        tensor["data"] = array.reshape(-1).tolist()
    return tensor


async def _post(client: httpx.AsyncClient, decoder: str, a: np.ndarray, b: np.ndarray) -> httpx.Response:
    """a @ b requested through `decoder`; the answer's product (JSON) is `result` or, on /v2, output C's data."""
    if decoder == "json":
        return await client.post("/matmul", json={"a": a.tolist(), "b": b.tolist()})
    if decoder == "multipart":
        return await client.post("/matmul", files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))})
    if decoder == "npz":
        return await client.post("/matmul", content=npz_bytes(a=a, b=b), headers={"content-type": "application/x-npz"})
    binary = decoder == "v2 binary"
    header = orjson.dumps({"inputs": [_v2_tensor("A", a, binary), _v2_tensor("B", b, binary)]})
    if not binary:
        return await client.post("/v2/models/matmul/infer", content=header)
    headers = {"inference-header-content-length": str(len(header)), "content-type": "application/octet-stream"}
    return await client.post("/v2/models/matmul/infer", content=header + a.tobytes() + b.tobytes(), headers=headers)


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize(("a_shape", "b_shape", "refused"), SHAPE_BOUNDS)
async def test_each_shape_limit_admits_its_bound_and_refuses_one_past_it(
    shaped: httpx.AsyncClient, decoder: str, a_shape: tuple[int, int], b_shape: tuple[int, int], refused: str | None
) -> None:
    a = np.arange(math.prod(a_shape), dtype=np.float32).reshape(a_shape) % 7
    b = np.arange(math.prod(b_shape), dtype=np.float32).reshape(b_shape) % 5
    r = await _post(shaped, decoder, a, b)
    v2 = decoder.startswith("v2")
    if refused is None:
        assert r.status_code == 200, r.text
        if decoder == "v2 json":
            (output,) = r.json()["outputs"]
            assert output["shape"] == [a_shape[0], b_shape[1]]
            assert_close_to_reference(np.array(output["data"]).reshape(output["shape"]), a, b, np.dtype(np.float32))
        elif not v2:
            assert_close_to_reference(np.array(r.json()["result"]), a, b, np.dtype(np.float32))
    else:
        assert r.status_code == 422, r.text
        if v2:  # the protocol's inputs are A and B
            assert refused.replace("'a'", "'A'").replace("'b'", "'B'") in r.json()["error"]
        else:
            assert refused in r.json()["message"] and r.json()["code"] == "shape_mismatch"


def _body_of_size(kind: str, size: int) -> tuple[str, bytes, dict[str, str], float]:
    """A valid product request of exactly `size` bytes (JSON whitespace, a multipart epilogue or a zip comment as
    padding): its path, body and headers, and the value of every element of its product. A "v2 binary" body is
    mostly tensor bytes, after a JSON header of 400 bytes or so."""
    a, b = np.full((2, 3), 2.0, np.float32), np.full((3, 1), 3.0, np.float32)
    path, headers = "/matmul", {"content-type": "application/json"}
    if kind == "json" or kind.startswith("v2 json"):
        doc: dict[str, object] = {"a": a.tolist(), "b": b.tolist()}
        if kind != "json":
            path, doc = INFER, {"inputs": [_v2_tensor("A", a, False), _v2_tensor("B", b, False)]}
        if kind == "v2 json, no Content-Type":
            headers = {}
        body = orjson.dumps(doc)
        body += b" " * (size - len(body))
    elif kind == "v2 binary":
        k = (size - 1000) // 88  # A is 10 x k, B k x 1: 88 k bytes of FP64
        a, b = np.full((10, k), 2.0), np.full((k, 1), 3.0)
        header = orjson.dumps({"inputs": [_v2_tensor("A", a, True), _v2_tensor("B", b, True)]})
        header += b" " * (size - a.nbytes - b.nbytes - len(header))
        path, body = INFER, header + a.tobytes() + b.tobytes()
        headers = {"content-type": "application/octet-stream", "inference-header-content-length": str(len(header))}
    elif kind == "multipart":
        parts = [("a", npy_bytes(a)), ("b", npy_bytes(b))]
        body = multipart_body(parts, epilogue=b" " * (size - len(multipart_body(parts))))
        headers = {"content-type": f"multipart/form-data; boundary={MULTIPART_BOUNDARY}"}
    else:
        archive = io.BytesIO(npz_bytes(a=a, b=b))
        with zipfile.ZipFile(archive, "a") as padded:
            padded.comment = b" " * (size - len(archive.getvalue()))
        body, headers = archive.getvalue(), {"content-type": "application/x-npz"}
    assert len(body) == size
    return path, body, headers, a @ b


async def _pieces(body: bytes) -> AsyncIterator[bytes]:
    """The body sent chunked, in two pieces, with no Content-Length: only the bytes received count."""
    yield body[: len(body) // 2]
    yield body[len(body) // 2 :]


JSON_WORDS = (
    "the JSON body is 2049 bytes, over the limit of 2048 (MATMUL_MAX_JSON_BYTES)",
    "the JSON body passed the limit of 2048 bytes (MATMUL_MAX_JSON_BYTES)",
)
BODY_WORDS = ("the body is 8193 bytes, over the limit of 8192 (MATMUL_MAX_BODY_BYTES)",
              "the body passed the limit of 8192 bytes (MATMUL_MAX_BODY_BYTES)")  # fmt: skip


@pytest.mark.parametrize("streamed", [False, True], ids=["declared", "streamed"])
@pytest.mark.parametrize(
    ("kind", "limit", "words"),
    [("json", 2048, JSON_WORDS), ("multipart", 8192, BODY_WORDS), ("npz", 8192, BODY_WORDS),
     ("v2 json", 2048, JSON_WORDS), ("v2 json, no Content-Type", 2048, JSON_WORDS), ("v2 binary", 8192, BODY_WORDS)],
)  # fmt: skip
async def test_each_body_limit_admits_its_bound_and_refuses_one_byte_more(
    small: tuple[FastAPI, httpx.AsyncClient], kind: str, limit: int, words: tuple[str, str], streamed: bool
) -> None:
    """MATMUL_MAX_JSON_BYTES for JSON bodies, on /matmul and the inference protocol alike (whose JSON needs no
    Content-Type), MATMUL_MAX_BODY_BYTES for the others: exactly `limit` bytes are multiplied, `limit` + 1 are 413
    with the same words on every route, whether the size was declared up front or only counted as the body came."""
    _, client = small
    for size in (limit, limit + 1):
        path, body, headers, product = _body_of_size(kind, size)
        r = await client.post(path, content=_pieces(body) if streamed else body, headers=headers)
        v2 = path == INFER
        if size == limit:
            assert r.status_code == 200, r.text
            answer = r.json()["outputs"][0]["data"] if v2 else r.json()["result"]
            assert answer == (product.ravel() if v2 else product).tolist()
        else:
            assert r.status_code == 413, r.text
            said = r.json()["error"] if v2 else r.json()["message"]
            assert said == words[streamed], said
            if not v2:
                assert r.json()["code"] == "payload_too_large"


@pytest.mark.parametrize("content_type", [None, "application/octet-stream", "application/json"])
async def test_a_shared_memory_registration_has_the_json_limit_whatever_its_content_type(
    content_type: str | None,
) -> None:
    """A registration is read as JSON whatever it is labelled (tritonclient labels it nothing), so MATMUL_MAX_JSON_BYTES
    holds for it whatever it is labelled: one byte more than the limit is 413, the limit itself is read."""
    settings = Settings(
        backend="cpu", max_body_bytes=8192, max_json_bytes=2048, shared_memory="system", access_log=False
    )
    headers = {} if content_type is None else {"content-type": content_type}
    async for client in _client_for(create_app(settings)):
        for size in (2048, 2049):
            body = orjson.dumps({"key": "/no-such-object", "byte_size": 64})
            r = await client.post(
                "/v2/systemsharedmemory/region/r/register", content=body + b" " * (size - len(body)), headers=headers
            )
            if size == 2048:  # read, and refused for what it names
                assert r.status_code == 400 and "/no-such-object" in r.json()["error"], r.text
            else:
                assert r.status_code == 413, r.text
                assert (
                    r.json()["error"] == "the JSON body is 2049 bytes, over the limit of 2048 (MATMUL_MAX_JSON_BYTES)"
                )


@pytest.mark.parametrize("streamed", [False, True], ids=["declared", "streamed"])
async def test_the_json_header_before_binary_tensors_has_the_json_limit(
    small: tuple[FastAPI, httpx.AsyncClient], streamed: bool
) -> None:
    """An inference request's JSON header may be MATMUL_MAX_JSON_BYTES long, whatever the binary data after it; one
    declaring a byte more is refused before its body is read."""
    _, client = small
    a, b = np.full((2, 3), 2.0, np.float32), np.full((3, 1), 3.0, np.float32)
    for size in (2048, 2049):
        header = orjson.dumps({"inputs": [_v2_tensor("A", a, True), _v2_tensor("B", b, True)]})
        header += b" " * (size - len(header))
        body = header + a.tobytes() + b.tobytes()
        headers = {"content-type": "application/octet-stream", "inference-header-content-length": str(size)}
        r = await client.post(INFER, content=_pieces(body) if streamed else body, headers=headers)
        if size == 2048:
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [18.0, 18.0], r.text
        else:
            assert r.status_code == 413, r.text
            assert r.json()["error"] == "the JSON header is 2049 bytes, over the limit of 2048 (MATMUL_MAX_JSON_BYTES)"


@pytest.mark.parametrize(("sent", "accepted"), [("86400", True), ("86400.001", False), ("1e-300", True), ("0", False)])
async def test_the_request_timeout_header_takes_seconds_in_0_to_86400(
    shaped: httpx.AsyncClient, sent: str, accepted: bool
) -> None:
    """(0, 86400]: a day is the longest a request may ask to wait (the settings cap it lower), and any positive
    time is a deadline, though one too short to reach the device is a 504."""
    r = await shaped.post("/matmul", json={"a": [[2.0]], "b": [[3.0]]}, headers={"x-request-timeout": sent})
    if accepted:
        assert r.status_code in (200, 504), r.text
    else:
        assert r.status_code == 422 and r.json()["location"] == ["X-Request-Timeout"], r.text
        assert f"X-Request-Timeout must be a number of seconds in (0, 86400], not '{sent}'" in r.json()["message"]


async def test_a_body_that_stops_arriving_gets_408_not_a_hang(small: tuple[FastAPI, httpx.AsyncClient]) -> None:
    app, _ = small
    sent: list[dict[str, object]] = []
    pieces = [{"type": "http.request", "body": b'{"a": [[1', "more_body": True}]

    async def receive() -> dict[str, object]:
        if pieces:
            return pieces.pop()
        await asyncio.sleep(3600)  # the client declared more than it sends
        raise AssertionError("unreachable")

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/matmul", "raw_path": b"/matmul", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {},
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert sent[0]["status"] == 408
    assert orjson.loads(sent[1]["body"])["code"] == "body_timeout"  # type: ignore[arg-type]


async def test_the_echo_route_is_off_unless_asked_for(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/echo", content=b"abc")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


async def test_the_echo_route_answers_with_what_it_read() -> None:
    app = create_app(Settings(backend="cpu", echo_route=True, access_log=False))
    async for client in _client_for(app):
        body = bytes(range(256)) * 1000
        r = await client.post("/v1/echo", content=body)
        assert r.status_code == 200 and r.content == body


@pytest.mark.parametrize(
    ("body_bytes", "answer_bytes"),
    # a body joined from its pieces, and one read into a lent buffer
    [(1000, 0), (1000, 1), (1000, 1000), (2 << 20, 0), (2 << 20, 1000), (2 << 20, (2 << 20) - 1), (2 << 20, 2 << 20)],
)
async def test_the_echo_answers_with_the_first_answer_bytes_of_its_body(body_bytes: int, answer_bytes: int) -> None:
    """As a product's exchange moves its operands in and its answer out: 128 MiB in and 64 MiB out at 4096^2."""
    app = create_app(Settings(backend="cpu", echo_route=True, access_log=False))
    body = np.random.default_rng(answer_bytes).integers(0, 256, body_bytes, np.uint8).tobytes()
    async for client in _client_for(app):
        r = await client.post("/v1/echo", params={"answer_bytes": answer_bytes}, content=body)
        assert r.status_code == 200 and r.content == body[:answer_bytes]


@pytest.mark.parametrize(("answer_bytes", "words"), [(1001, "longer than the body's 1000 bytes"), (-1, "greater")])
@pytest.mark.parametrize("body_bytes", [1000, 2 << 20])
async def test_an_echo_asked_for_more_than_its_body_or_fewer_than_none_is_refused(
    body_bytes: int, answer_bytes: int, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """422 naming the parameter; a body read into a lent buffer gives it back."""
    given: list[int] = []
    give = BodyBuffers.give
    monkeypatch.setattr(BodyBuffers, "give", lambda buffers, buffer: given.append(len(buffer)) or give(buffers, buffer))
    app = create_app(Settings(backend="cpu", echo_route=True, access_log=False))
    answer_bytes = body_bytes + 1 if answer_bytes > 0 else answer_bytes
    async for client in _client_for(app):
        r = await client.post("/v1/echo", params={"answer_bytes": answer_bytes}, content=bytes(body_bytes))
        assert r.status_code == 422
        assert r.json()["location"] == ["query", "answer_bytes"]
        assert words.replace("1000", str(body_bytes)) in r.json()["message"]
    assert given == ([body_bytes] if answer_bytes > 0 and body_bytes >= POOLED_BODY_BYTES else [])


async def test_a_client_that_leaves_during_the_upload_is_not_an_error(small: tuple[FastAPI, httpx.AsyncClient]) -> None:
    app, _ = small
    sent: list[dict[str, object]] = []
    pieces = [{"type": "http.disconnect"}, {"type": "http.request", "body": b'{"a": [[1', "more_body": True}]

    async def receive() -> dict[str, object]:
        return pieces.pop()

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/matmul", "raw_path": b"/matmul", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80),
        "state": {},
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert sent[0]["status"] == 499
    assert orjson.loads(sent[1]["body"])["code"] == "client_gone"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("declared", "status", "words"),
    [(b"9" * 5000, 413, "over the limit"), (b"\xc2\xb2", 422, "not a byte count"), (b"12x", 422, "not a byte count")],
)
async def test_a_content_length_that_is_not_a_sane_number(
    small: tuple[FastAPI, httpx.AsyncClient], declared: bytes, status: int, words: str
) -> None:
    app, _ = small
    for path, body_key in (("/matmul", "message"), ("/v2/models/matmul/infer", "error")):
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, object], into: list[dict[str, object]] = sent) -> None:
            into.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "state": {},
            "headers": [(b"content-type", b"application/json"), (b"content-length", declared)],
            "client": ("127.0.0.1", 1), "server": ("t", 80),
        }  # fmt: skip
        await app(scope, receive, send)
        assert sent[0]["status"] == status, path
        assert words in orjson.loads(sent[1]["body"])[body_key]  # type: ignore[arg-type]
