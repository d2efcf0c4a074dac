"""Size and time limits on request bodies, decided before a large body is read or a large array made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from fastapi import FastAPI

from app.config import Settings
from app.main import create_app
from matmul_tools.bodies import npy_bytes
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


def _refused(r: httpx.Response, status: int, code: str, words: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["code"] == code and words in r.json()["message"], r.json()


async def test_json_bodies_have_their_own_smaller_limit(small: tuple[FastAPI, httpx.AsyncClient]) -> None:
    _, client = small
    body = orjson.dumps({"a": [[1.0] * 20] * 20, "b": [[1.0] * 20] * 20})
    assert 2048 < len(body) < 8192
    _refused(await client.post("/matmul", content=body, headers={"content-type": "application/json"}), 413,
             "payload_too_large", "JSON body is")  # fmt: skip

    async def chunked() -> AsyncIterator[bytes]:
        yield body

    _refused(await client.post("/matmul", content=chunked(), headers={"content-type": "application/json"}), 413,
             "payload_too_large", "JSON body passed the limit of 2048")  # fmt: skip


async def test_every_body_has_the_general_limit(small: tuple[FastAPI, httpx.AsyncClient]) -> None:
    _, client = small
    r = await client.post("/v2/models/matmul/infer", content=b"x" * 9000)
    assert r.status_code == 413 and "9000 bytes" in r.json()["error"]  # the protocol's own error format


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "words"),
    [((101, 1), (1, 1), "dimension 0 of 'a' is 101, over the limit of 100"),
     ((40, 30), (30, 1), "'a' has 1200 elements, over the limit of 1000"),
     ((30, 1), (1, 30), "'result' has 900 elements, over the limit of 400")],
)  # fmt: skip
async def test_shape_limits(small: tuple[FastAPI, httpx.AsyncClient], a_shape: tuple[int, int],
                            b_shape: tuple[int, int], words: str) -> None:  # fmt: skip
    import numpy as np

    _, client = small
    files = {
        "a": ("a.npy", npy_bytes(np.ones(a_shape, np.float32))),
        "b": ("b.npy", npy_bytes(np.ones(b_shape, np.float32))),
    }
    _refused(await client.post("/matmul", files=files), 422, "shape_mismatch", words)


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
