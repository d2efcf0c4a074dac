"""The body-limit middleware on its own, around an app that reads the body and then waits for the client to leave:
its refusals by their whole message, and no body timeout once the body has ended (an ended body is signalled by
`more_body` false or absent)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from app.api.limits import BodyLimitMiddleware
from app.config import Settings
from app.errors import BodyTimeout, PayloadTooLarge

pytestmark = pytest.mark.anyio

BODY_TIMEOUT_S = 0.05
LATER_S = 0.25
"""How long after its body the client below leaves: well past the body timeout."""
SETTINGS = Settings(
    backend="cpu", max_body_bytes=2048, max_json_bytes=1024, body_timeout_s=BODY_TIMEOUT_S, access_log=False
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ReadsThenWaits:
    """Reads the body, then waits for the disconnect, as a product route does while its product is computed."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            self.seen.append(message)
            if message["type"] == "http.disconnect":
                return


def scope(content_length: bytes | None, content_type: bytes, path: str) -> Scope:
    headers = [(b"content-type", content_type)]
    headers += [] if content_length is None else [(b"content-length", content_length)]
    return {
        "type": "http", "method": "POST", "path": path, "headers": headers,
        "app": SimpleNamespace(state=SimpleNamespace(settings=SETTINGS)),
    }  # fmt: skip


async def answer(
    content_length: bytes | None,
    messages: list[Message],
    content_type: bytes = b"application/json",
    path: str = "/matmul",
) -> tuple[list[Message], ReadsThenWaits]:
    inner = ReadsThenWaits()
    sent: list[Message] = []
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(LATER_S)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(BodyLimitMiddleware(inner)(scope(content_length, content_type, path), receive, send), 10)
    return sent, inner


@pytest.mark.parametrize(
    "last", [{"type": "http.request", "body": b"}"}, {"type": "http.request", "body": b"}", "more_body": False}]
)
async def test_after_the_body_the_client_may_stay_past_the_body_timeout(last: Message) -> None:
    sent, inner = await answer(b"3", [{"type": "http.request", "body": b"{}", "more_body": True}, last])
    assert sent == []
    assert [m["type"] for m in inner.seen] == ["http.request", "http.request", "http.disconnect"]


async def test_a_body_that_stops_names_the_timeout_and_the_bytes_received() -> None:
    with pytest.raises(BodyTimeout) as caught:
        await answer(None, [{"type": "http.request", "body": b"{}", "more_body": True}])
    assert caught.value.message == "the body stopped arriving: nothing for 0.05 s after 2 bytes"


JSON_LIMIT = "over the limit of 1024 (MATMUL_MAX_JSON_BYTES)"
BODY_LIMIT = "over the limit of 2048 (MATMUL_MAX_BODY_BYTES)"


@pytest.mark.parametrize(
    ("declared", "content_type", "status", "message"),
    [
        (b"x" * 50, b"application/json", 422, f"Content-Length {'x' * 40!r} is not a byte count"),
        (b"9" * 50, b"application/json", 413, f"the JSON body is a 50-digit number of bytes, {JSON_LIMIT}"),
        (b"1025", b"application/json", 413, f"the JSON body is 1025 bytes, {JSON_LIMIT}"),
        (b"01025", b"Application/JSON; charset=utf-8", 413, f"the JSON body is 1025 bytes, {JSON_LIMIT}"),
        (b"0" * 60 + b"1025", b"application/json", 413, f"the JSON body is 1025 bytes, {JSON_LIMIT}"),
        (b"2049", b"application/x-npz", 413, f"the body is 2049 bytes, {BODY_LIMIT}"),
        (b"2049", b"", 413, f"the body is 2049 bytes, {BODY_LIMIT}"),
    ],
)
async def test_a_declared_size_is_refused_before_reading(
    declared: bytes, content_type: bytes, status: int, message: str
) -> None:
    sent, inner = await answer(declared, [{"type": "http.request", "body": b"", "more_body": False}], content_type)
    assert sent[0]["status"] == status and inner.seen == []
    assert orjson.loads(sent[1]["body"])["message"] == message


@pytest.mark.parametrize(
    ("content_type", "limit"), [(b"application/json", 1024), (b"application/octet-stream", 2048), (b"", 2048)]
)
async def test_a_declared_size_of_exactly_the_limit_is_read(content_type: bytes, limit: int) -> None:
    body = [{"type": "http.request", "body": b"x" * limit, "more_body": False}]
    sent, inner = await answer(str(limit).encode(), body, content_type)
    assert sent == [] and inner.seen[0]["body"] == b"x" * limit


@pytest.mark.parametrize("path", ["/v2/systemsharedmemory/region/r/register", "/v2/models/matmul/infer", "/v1/echo"])
async def test_every_route_holds_a_json_body_to_the_json_limit(path: str) -> None:
    """Whichever route a JSON body goes to, more than MATMUL_MAX_JSON_BYTES is refused, declared or as it came."""
    sent, inner = await answer(b"1025", [{"type": "http.request", "body": b"", "more_body": False}], path=path)
    assert sent[0]["status"] == 413 and inner.seen == []
    assert orjson.loads(sent[1]["body"])["error" if path.startswith("/v2") else "message"] == (
        f"the JSON body is 1025 bytes, {JSON_LIMIT}"
    )
    pieces: list[Message] = [{"type": "http.request", "body": b"x" * 1024, "more_body": True}]
    pieces.append({"type": "http.request", "body": b"x", "more_body": False})
    with pytest.raises(PayloadTooLarge) as caught:
        await answer(None, pieces, path=path)
    assert caught.value.message == "the JSON body passed the limit of 1024 bytes (MATMUL_MAX_JSON_BYTES)"
