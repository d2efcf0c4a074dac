"""POST /matmul through the real ASGI app on the CPU backend: every format, the numbers, every error path."""

from __future__ import annotations

import asyncio
import io
import logging
import zipfile
from collections.abc import Callable
from typing import Any, NoReturn

import httpx
import numpy as np
import pytest

from app import codecs
from app.api import exchange
from app.config import Settings
from app.dataplane.engine_client import EngineClient
from app.engine import Plan
from app.engine.cpu import CpuBackend
from app.main import create_app
from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, load_npy, multipart_body, npy_bytes, npz_bytes
from matmul_tools.service import wait_ready_async
from numerics.reference import assert_close_to_reference

pytestmark = pytest.mark.anyio

TIMING_FIELDS = [
    "read_ms",
    "decode_ms",
    "stage_ms",
    "handoff_ms",
    "queue_ms",
    "h2d_ms",
    "kernel_ms",
    "d2h_ms",
    "encode_ms",
    "total_ms",
]
SHAPES = [(1, 1, 1), (1, 7, 1), (5, 1, 3), (17, 33, 9), (64, 64, 64), (3, 0, 4), (0, 3, 2), (2, 3, 0)]


def operands(m: int, k: int, n: int, dtype: str = "float32", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


async def test_json_example_from_the_readme(client: httpx.AsyncClient) -> None:
    r = await client.post("/matmul", json={"a": [[1, 2], [3, 4]], "b": [[5, 6], [7, 8]]})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["result"] == [[19, 22], [43, 50]]
    assert doc["shape"] == [2, 2] and doc["dtype"] == "float32"
    assert doc["kernel"] == "numpy" and doc["backend"] == "cpu" and doc["tile"] is None
    assert list(doc["timing"]) == TIMING_FIELDS
    assert all(v >= 0 for v in doc["timing"].values())
    assert doc["gflops"] > 0
    names = [part.split(";")[0] for part in r.headers["server-timing"].split(", ")]
    assert names == [f.removesuffix("_ms") for f in TIMING_FIELDS]
    assert r.headers["x-matmul-kernel"] == "numpy"


@pytest.mark.parametrize(("m", "k", "n"), [s for s in SHAPES if s[0] > 0 and s[1] > 0])  # JSON has no 0-row matrix
@pytest.mark.parametrize("dtype", ["float32", "float64"])
async def test_json_numbers(client: httpx.AsyncClient, m: int, k: int, n: int, dtype: str) -> None:
    a, b = operands(m, k, n, dtype)
    r = await client.post("/matmul", params={"dtype": dtype}, json={"a": a.tolist(), "b": b.tolist()})
    assert r.status_code == 200, r.text
    assert r.json()["dtype"] == dtype
    assert_close_to_reference(np.array(r.json()["result"], dtype=np.float64).reshape(m, n), a, b, np.dtype(dtype))


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
async def test_multipart_npy_in_npy_out(client: httpx.AsyncClient, m: int, k: int, n: int, dtype: str) -> None:
    a, b = operands(m, k, n, dtype)
    r = await client.post(
        "/matmul",
        files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
        headers={"accept": "application/x-npy"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-npy"
    c = load_npy(r.content)
    assert c.dtype == np.dtype(dtype)
    assert_close_to_reference(c, a, b, np.dtype(dtype))
    assert r.headers["x-matmul-shape"] == f"{m}x{n}" and r.headers["x-matmul-dtype"] == dtype
    assert "kernel;dur=" in r.headers["server-timing"]


@pytest.mark.parametrize(
    ("kernel", "tile", "ran_tile"), [("naive", None, None), ("tiled", None, 16), ("tiled", 8, 8), ("tiled", 32, 32)]
)
@pytest.mark.parametrize("accept", ["application/json", "application/x-npy"])
async def test_the_teaching_kernels_run_on_the_cpu_as_emulations(
    client: httpx.AsyncClient, kernel: str, tile: int | None, ran_tile: int | None, accept: str
) -> None:
    a, b = operands(37, 21, 19, "float32")
    params = {"kernel": kernel} | ({"tile": tile} if tile else {})
    files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))}
    r = await client.post("/matmul", params=params, files=files, headers={"accept": accept})
    assert r.status_code == 200, r.text
    if accept == "application/x-npy":
        c = load_npy(r.content)
        header_tile = r.headers.get("x-matmul-tile")
        assert (r.headers["x-matmul-kernel"], header_tile) == (kernel, None if ran_tile is None else str(ran_tile))
    else:
        c = np.array(r.json()["result"], np.float32)
        assert (r.json()["kernel"], r.json()["tile"]) == (kernel, ran_tile)
    assert_close_to_reference(c, a, b, np.dtype(np.float32))


async def test_queued_emulated_products_run_as_one_batch() -> None:
    app = create_app(Settings(backend="cpu", batching=True, max_queue_delay_us=200_000, access_log=False))
    pairs = [operands(9, 20, 7, "float64", seed) for seed in range(4)]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await wait_ready_async(client, timeout_s=30)
            answers = await asyncio.gather(
                *(
                    client.post(
                        "/matmul", params={"kernel": "tiled", "tile": 8}, json={"a": a.tolist(), "b": b.tolist()}
                    )
                    for a, b in pairs
                )
            )
    for (a, b), r in zip(pairs, answers, strict=True):
        assert r.status_code == 200, r.text
        assert (r.json()["kernel"], r.json()["tile"], r.json()["batch_size"]) == ("tiled", 8, 4)
        assert_close_to_reference(np.array(r.json()["result"]), a, b, np.dtype(np.float32))


async def test_npz_body(client: httpx.AsyncClient) -> None:
    a, b = operands(6, 5, 4, "float64")
    r = await client.post(
        "/matmul", content=npz_bytes(a=a, b=b), headers={"content-type": "application/x-npz"}, params={"kernel": "auto"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["dtype"] == "float64"
    assert_close_to_reference(np.array(r.json()["result"]), a, b, np.dtype(np.float64))


async def test_integers_big_endian_and_fortran_inputs_are_converted(client: httpx.AsyncClient) -> None:
    a = np.asfortranarray(np.arange(12, dtype=">i4").reshape(3, 4))
    b = np.arange(8, dtype=">f8").reshape(4, 2)
    r = await client.post(
        "/matmul",
        params={"dtype": "float32"},
        files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
        headers={"accept": "application/x-npy"},
    )
    assert r.status_code == 200, r.text
    c = load_npy(r.content)
    assert c.dtype == np.float32
    np.testing.assert_array_equal(c, (a @ b).astype(np.float32))


async def test_dtype_follows_the_npy_files(client: httpx.AsyncClient) -> None:
    a, b = operands(2, 2, 2, "float64")
    r = await client.post("/matmul", files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))})
    assert r.json()["dtype"] == "float64"


async def test_options_in_the_json_body(client: httpx.AsyncClient) -> None:
    r = await client.post("/matmul", json={"a": [[1]], "b": [[2]], "dtype": "float64", "kernel": "numpy"})
    assert r.status_code == 200, r.text
    assert r.json()["dtype"] == "float64" and r.json()["kernel"] == "numpy"


async def test_nan_from_npy_propagates_and_is_null_in_json(client: httpx.AsyncClient) -> None:
    a = np.array([[np.nan, 1.0]], np.float32)
    b = np.ones((2, 1), np.float32)
    r = await client.post("/matmul", files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))})
    assert r.json()["result"] == [[None]]


def test_the_cpu_backend_multiplies_infinities_without_runtime_warnings() -> None:
    """inf * 0 and inf - inf are NaN, float32 sums past its range infinite: no RuntimeWarning (errors in tests)."""
    a = np.array([[np.inf, 1.0], [np.inf, -np.inf], [3e38, 3e38]], np.float32)
    b = np.array([[0.0], [1.0]], np.float32), np.array([[1.0], [1.0]], np.float32)
    finished = CpuBackend(reason="test").submit(
        [(a, b[0]), (a, b[1])], np.dtype(np.float32), Plan(kernel="numpy"), lambda: None
    )
    products = finished.products
    assert np.isnan(products[0][:2]).all()
    assert np.isnan(products[1][1, 0]) and products[1][2, 0] == np.inf


async def test_infinities_from_npy_leave_no_warning_in_the_log(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = np.array([[np.inf, 1.0]]), np.array([[0.0], [1.0]])
    r = await client.post("/matmul", files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))})
    assert r.status_code == 200, r.text
    assert r.json()["result"] == [[None]]
    assert [record.message for record in caplog.records if record.levelno >= logging.WARNING] == []


def _error(r: httpx.Response, status: int, code: str, words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code, body
    assert words in body["message"], body


@pytest.mark.parametrize(
    ("request_kwargs", "status", "code", "words"),
    [
        ({"json": {"a": [[1, 2]], "b": [[1, 2]]}}, 422, "shape_mismatch", "'a' is 1x2 and 'b' is 1x2"),
        ({"json": {"a": [[1, 2], [1]], "b": [[1]]}}, 422, "invalid_matrix", "ragged"),
        ({"json": {"a": [["x"]], "b": [[1]]}}, 422, "invalid_matrix", "a[0][0] is a string"),
        ({"json": {"a": [[1]], "b": [[1]]}, "params": {"kernel": "warp9"}}, 422, "unknown_kernel", "'warp9'"),
        (
            {"json": {"a": [[1]], "b": [[1]]}, "params": {"kernel": "fast"}},
            422,
            "unknown_kernel",
            "runs on the CPU; this server has ['auto', 'naive', 'tiled', 'numpy']",
        ),
        (
            {"json": {"a": [[1]], "b": [[1]]}, "params": {"kernel": "naive", "tile": 16}},
            422,
            "invalid_parameter",
            "tile 16 is not valid for kernel 'naive'",
        ),
        (
            {"json": {"a": [[1]], "b": [[1]]}, "params": {"kernel": "tiled", "tile": 12}},
            422,
            "invalid_parameter",
            "one of [8, 16, 32]",
        ),
        ({"json": {"a": [[1]], "b": [[1]]}, "params": {"kernel": "cublas"}}, 422, "unknown_kernel", "needs the GPU"),
        ({"json": {"a": [[1]], "b": [[1]]}, "params": {"tile": 16}}, 422, "invalid_parameter", "tile"),
        ({"json": {"a": [[1]], "b": [[1]]}, "params": {"tile": "big"}}, 422, "invalid_parameter", "query.tile"),
        ({"json": {"a": [[1]], "b": [[1]]}, "params": {"tile": 10**30}}, 422, "invalid_parameter", "query.tile"),
        ({"json": {"a": [[1]], "b": [[1]]}, "params": {"dtype": "int8"}}, 422, "invalid_parameter", "query.dtype"),
        ({"json": {"a": [[1]], "b": [[1]], "dtype": "int8"}}, 422, "invalid_parameter", "'int8' is not supported"),
        (
            {"json": {"a": [[1]], "b": [[1]], "dtype": "float64"}, "params": {"dtype": "float32"}},
            422,
            "invalid_parameter",
            "given twice",
        ),
        ({"content": b"{oops", "headers": {"content-type": "application/json"}}, 422, "malformed_payload", "JSON"),
        ({"content": b"", "headers": {"content-type": "application/json"}}, 422, "malformed_payload", "empty"),
        ({"content": b"a,b", "headers": {"content-type": "text/csv"}}, 415, "unsupported_media_type", "text/csv"),
        ({"content": b"x"}, 415, "unsupported_media_type", "(none)"),
        ({"json": {"a": [[1]], "b": [[1]]}, "headers": {"accept": "text/html"}}, 406, "not_acceptable", "text/html"),
        (
            {"files": {"a": ("a.npy", b"\x93NUMPY garbage"), "b": ("b.npy", npy_bytes(np.eye(2)))}},
            422,
            "malformed_payload",
            "'a' is not a valid .npy",
        ),
        ({"files": {"a": ("a.npy", npy_bytes(np.eye(2)))}}, 422, "invalid_matrix", "missing ['b']"),
        (
            {"files": {"a": ("a.npy", npy_bytes(np.eye(2))), "b": ("b.npy", npy_bytes(np.eye(2))), "c": ("c", b"")}},
            422,
            "invalid_matrix",
            "unexpected ['c']",
        ),
        (
            {"files": {"b": ("b.npy", npy_bytes(np.eye(2)))}, "data": {"a": "1,2"}},
            422,
            "invalid_matrix",
            "part 'a' is a text field",
        ),
        (
            {"content": b"--xx\r\n", "headers": {"content-type": "multipart/form-data"}},
            422,
            "malformed_payload",
            "has no boundary",
        ),
        (
            {
                "content": b"--xx\r\nContent-Disposition: attachment\r\n\r\nabc\r\n--xx--\r\n",
                "headers": {"content-type": "multipart/form-data; boundary=xx"},
            },
            422,
            "malformed_payload",
            "no Content-Disposition: form-data",
        ),
        (
            {
                "content": b"--xx\r\nbroken header line\r\n",
                "headers": {"content-type": "multipart/form-data; boundary=xx"},
            },
            422,
            "malformed_payload",
            "multipart body cannot be parsed",
        ),
        ({"content": b"not a zip", "headers": {"content-type": "application/x-npz"}}, 422, "malformed_payload", "npz"),
        (
            {"content": npz_bytes(a=np.eye(2)), "headers": {"content-type": "application/x-npz"}},
            422,
            "invalid_matrix",
            "missing ['b']",
        ),
    ],
)
async def test_errors(
    client: httpx.AsyncClient, request_kwargs: dict[str, object], status: int, code: str, words: str
) -> None:
    _error(await client.post("/matmul", **request_kwargs), status, code, words)  # type: ignore[arg-type]


async def test_truncated_multipart_body(client: httpx.AsyncClient) -> None:
    body = b'--xx\r\nContent-Disposition: form-data; name="a"; filename="a.npy"\r\n\r\n' + npy_bytes(np.eye(2))
    headers = {"content-type": "multipart/form-data; boundary=xx"}
    _error(await client.post("/matmul", content=body, headers=headers), 422, "malformed_payload", "closing boundary")


async def test_pickled_npy_is_refused(client: httpx.AsyncClient) -> None:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([[1, None]], dtype=object), allow_pickle=True)
    files = {"a": ("a.npy", buffer.getvalue()), "b": ("b.npy", npy_bytes(np.eye(2)))}
    _error(await client.post("/matmul", files=files), 422, "invalid_matrix", "pickled Python objects")


async def test_float32_overflow_is_refused_not_turned_into_infinity(client: httpx.AsyncClient) -> None:
    r = await client.post("/matmul", json={"a": [[1.0, 1e39]], "b": [[1.0], [1.0]]})
    _error(r, 422, "invalid_matrix", "a[0][1] = 1e+39 is out of range for float32")
    assert r.json()["location"] == ["a", 0, 1]
    ok = await client.post("/matmul", json={"a": [[1.0, 1e39]], "b": [[1.0], [1.0]], "dtype": "float64"})
    assert ok.status_code == 200


async def test_body_over_the_limit_is_refused_before_reading(cpu_settings: object) -> None:
    from app.config import Settings
    from app.main import create_app
    from tests.conftest import _client_for

    app = create_app(Settings(backend="cpu", max_body_bytes=2048))
    async for client in _client_for(app):
        r = await client.post("/matmul", json={"a": [[1.0] * 300], "b": [[1.0]] * 300})
        _error(r, 413, "payload_too_large", "over the limit of 2048")

        async def stream() -> object:
            for _ in range(10):
                yield b" " * 1000

        r = await client.post("/matmul", content=stream(), headers={"content-type": "application/json"})
        _error(r, 413, "payload_too_large", "passed the limit of 2048")


@pytest.mark.parametrize(
    ("parts", "code", "words"),
    [
        (
            [("a", npy_bytes(np.eye(2))), ("a", npy_bytes(np.eye(2))), ("b", npy_bytes(np.eye(2)))],
            "invalid_matrix",
            "sent twice",
        ),
        ([(f"p{i}", b"") for i in range(9)], "malformed_payload", "more than 8 parts"),
    ],
)
async def test_multipart_framing_errors(
    client: httpx.AsyncClient, parts: list[tuple[str, bytes]], code: str, words: str
) -> None:
    headers = {"content-type": MULTIPART_CONTENT_TYPE}
    _error(await client.post("/matmul", content=multipart_body(parts, "f.npy"), headers=headers), 422, code, words)


def _npy_with_shape(shape: str) -> bytes:
    """A float32 .npy file whose header says `shape` as written, and 64 bytes of data."""
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }"
    text += " " * (-(len(text) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode() + bytes(64)


HOSTILE_HEADERS = [
    pytest.param(_npy_with_shape("(True, 4)"), "'True' in the shape", id="boolean"),
    pytest.param(_npy_with_shape("(" + "-" * 5000 + "2, 2)"), "something NumPy does not write", id="minus-tower"),
    pytest.param(_npy_with_shape("(" + "+" * 5000 + "2, 2)"), "something NumPy does not write", id="plus-tower"),
]


@pytest.mark.parametrize(("hostile", "words"), HOSTILE_HEADERS)
async def test_hostile_npy_headers_are_422_in_multipart_parts_and_npz_members(
    client: httpx.AsyncClient, hostile: bytes, words: str
) -> None:
    """They were 500s (TypeError at reshape, RecursionError in the literal parser); in an .npz the RecursionError
    was a 422 saying the archive was not a valid .npz."""
    files = {"a": ("a.npy", hostile), "b": ("b.npy", npy_bytes(np.eye(2)))}
    _error(
        await client.post("/matmul", files=files),
        422,
        "malformed_payload",
        f"'a' is not a valid .npy file: its header has {words}",
    )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as npz:
        npz.writestr("a.npy", hostile)
        npz.writestr("b.npy", npy_bytes(np.eye(2)))
    r = await client.post("/matmul", content=buffer.getvalue(), headers={"content-type": "application/x-npz"})
    _error(r, 422, "malformed_payload", f"'a' is not a valid .npy file: its header has {words}")


async def test_npy_format_version_3_is_accepted(client: httpx.AsyncClient) -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.eye(2, dtype=np.float32), version=(3, 0))
    files = {"a": ("a.npy", buffer.getvalue()), "b": ("b.npy", npy_bytes(np.full((2, 2), 3.0)))}
    r = await client.post("/matmul", files=files)
    assert r.status_code == 200, r.text
    assert r.json()["result"] == [[3.0, 3.0], [3.0, 3.0]]


async def test_a_multipart_preamble_and_epilogue_are_accepted(client: httpx.AsyncClient) -> None:
    parts = [("a", npy_bytes(np.eye(2))), ("b", npy_bytes(np.eye(2)))]
    body = multipart_body(parts, preamble=b"This is a preamble.\r\n", epilogue=b"This is an epilogue.\r\n")
    r = await client.post("/matmul", content=body, headers={"content-type": MULTIPART_CONTENT_TYPE})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("length", [71, 300])
async def test_a_multipart_boundary_over_70_characters_is_422(client: httpx.AsyncClient, length: int) -> None:
    """Over 256 characters it was a 500 (python-multipart's constructor raised outside the error handling)."""
    boundary = "b" * length
    body = multipart_body([("a", npy_bytes(np.eye(2))), ("b", npy_bytes(np.eye(2)))], boundary=boundary)
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    r = await client.post("/matmul", content=body, headers=headers)
    _error(r, 422, "malformed_payload", f"boundary is {length} characters; RFC 2046 allows 1 to 70")


async def test_a_parameter_sent_as_a_form_field_is_pointed_to_the_query_string(client: httpx.AsyncClient) -> None:
    """curl -F a=@a.npy -F b=@b.npy -F kernel=numpy: the advice was to send kernel.npy as a file."""
    files = {"a": ("a.npy", npy_bytes(np.eye(2))), "b": ("b.npy", npy_bytes(np.eye(2)))}
    r = await client.post("/matmul", files=files, data={"kernel": "numpy"})
    _error(r, 422, "invalid_parameter", "parameters belong in the query string (POST /matmul?kernel=numpy)")
    assert r.json()["location"] == ["kernel"]


@pytest.mark.parametrize("preamble", [b"", b"a preamble\r\n"], ids=["npy-parts", "searched"])
async def test_a_large_body_of_npy_parts_is_decoded_on_the_loop_and_any_other_in_a_thread(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, preamble: bytes
) -> None:
    """.npy parts found by their headers' lengths take microseconds whatever their size: a thread's round trip took
    2.3 ms a request under load (64^2 x 1,000 stacks, H200), the whole decode; a body to be searched (a preamble
    here) still goes to a thread past the threshold."""
    off_loop: list[str] = []
    run_in_threadpool = exchange.run_in_threadpool

    async def recorded(function: Callable[..., Any], *args: Any) -> Any:
        off_loop.append(function.__qualname__)
        return await run_in_threadpool(function, *args)

    monkeypatch.setattr(exchange, "run_in_threadpool", recorded)
    a, b = np.arange(2 * 300 * 200, dtype=np.float32).reshape(2, 300, 200), np.eye(200, dtype=np.float32)
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))], preamble=preamble)
    assert len(body) > Settings().inline_codec_bytes
    r = await client.post(
        "/matmul", content=body, headers={"content-type": MULTIPART_CONTENT_TYPE, "accept": codecs.NPY_MEDIA_TYPE}
    )
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(load_npy(r.content), a @ b)
    assert off_loop == ([] if not preamble else ["decode"])


async def test_whatever_a_decoder_raises_is_the_clients_422_naming_it(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The one place that decides: a failure mode of a parser nobody foresaw is a 422, not a 500, and is logged."""

    def unforeseen(*args: object) -> NoReturn:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(codecs.json, "decode_json", unforeseen)
    r = await client.post("/matmul", json={"a": [[1]], "b": [[1]]})
    _error(r, 422, "malformed_payload", "the JSON body cannot be decoded: maximum recursion depth exceeded")
    records = [record for record in caplog.records if record.exc_info is not None]
    assert len(records) == 1 and "RecursionError" in records[0].getMessage()


async def test_an_unexpected_error_is_a_500_in_the_error_format_that_shows_nothing_of_it(
    cpu_settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception the service does not know, raised inside the engine, is answered 500 with the generic error
    body: neither its text nor a traceback reaches the client; the server's log keeps them, in one record. The app
    does not raise it on to the server (which would log the traceback a second time)."""

    async def broken(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("secret-internal-detail /srv/app/engine/device_worker.py")

    monkeypatch.setattr(EngineClient, "matmul", broken)
    app = create_app(cpu_settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            await wait_ready_async(client, timeout_s=30)
            r = await client.post("/matmul", json={"a": [[1.0]], "b": [[2.0]]})
            v2 = await client.post(
                "/v2/models/matmul/infer",
                json={"inputs": [{"name": n, "shape": [1, 1], "datatype": "FP32", "data": [1]} for n in "AB"]},
            )
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"code": "internal_error", "message": "internal server error", "location": None}
    assert v2.status_code == 500 and v2.json() == {"error": "internal server error"}
    for leak in ("secret-internal-detail", "worker.py", "RuntimeError", "Traceback"):
        assert leak not in r.text + v2.text
    logged = [record for record in caplog.records if record.exc_info is not None]
    assert len(logged) == 2, "one record for each 500"
    assert "secret-internal-detail" in caplog.text and "Traceback" in caplog.text
