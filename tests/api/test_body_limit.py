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
from app.errors import BodyTimeout

pytestmark = pytest.mark.anyio

BODY_TIMEOUT_S = 0.05
LATER_S = 0.25
"""How long after its body the client below leaves: well past the body timeout."""
SETTINGS = Settings(backend="cpu", max_body_bytes=1024, body_timeout_s=BODY_TIMEOUT_S, access_log=False)


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


def scope(content_length: bytes | None) -> Scope:
    headers = [] if content_length is None else [(b"content-length", content_length)]
    return {
        "type": "http", "method": "POST", "path": "/matmul", "headers": headers,
        "app": SimpleNamespace(state=SimpleNamespace(settings=SETTINGS)),
    }  # fmt: skip


async def answer(content_length: bytes | None, messages: list[Message]) -> tuple[list[Message], ReadsThenWaits]:
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

    await asyncio.wait_for(BodyLimitMiddleware(inner)(scope(content_length), receive, send), 10)
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


@pytest.mark.parametrize(
    ("declared", "status", "message"),
    [
        (b"x" * 50, 422, f"Content-Length {'x' * 40!r} is not a byte count"),
        (b"9" * 50, 413, f"the body is {'9' * 40} bytes, over the limit of 1024"),
        (b"1025", 413, "the body is 1025 bytes, over the limit of 1024"),
        (b"01025", 413, "the body is 01025 bytes, over the limit of 1024"),
    ],
)
async def test_a_declared_size_is_refused_before_reading(declared: bytes, status: int, message: str) -> None:
    sent, inner = await answer(declared, [{"type": "http.request", "body": b"", "more_body": False}])
    assert sent[0]["status"] == status and inner.seen == []
    assert orjson.loads(sent[1]["body"])["message"] == message


async def test_a_declared_size_of_exactly_the_limit_is_read() -> None:
    sent, inner = await answer(b"1024", [{"type": "http.request", "body": b"x" * 1024, "more_body": False}])
    assert sent == [] and inner.seen[0]["body"] == b"x" * 1024
