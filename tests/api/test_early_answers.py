"""Answers given before a request's body is read (413 for a Content-Length over MATMUL_MAX_BODY_BYTES, 503 while the
engine's queue is full), through a real uvicorn server in this process on each event loop, over raw sockets, to a
client that sends its whole body before it reads: it gets the answer whether the connection ends after it
(`Connection: close`, HTTP/1.0) or is kept alive. The server closed the first kind with the body unread in the socket,
and the reset that followed destroyed the answer before the client read it."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from app.api.connection import BODY_PIECE_BYTES, LINGER_BYTES
from app.dataplane.engine_client import EngineClient
from app.errors import Overloaded
from matmul_tools.raw_load import read_whole_answer
from matmul_tools.service import free_port
from tests.api.in_process import serving

MAX_BODY_BYTES = 8 << 20
SENT_BYTES = 16 << 20
"""What a client refused with 413 sends before reading: twice the limit, a quarter of what the server reads after an
answer (LINGER_BYTES)."""
ADMITTED_BYTES = 4 << 20
"""A body within the limit and longer than a piece, so that the server leaves it in the socket until the route asks."""
GUARD_S = 30
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
ENDING = [
    pytest.param(b"HTTP/1.1", b"Connection: close\r\n", id="connection-close"),
    pytest.param(b"HTTP/1.0", b"", id="http-1.0"),
]
"""The request line's version and the header that make a connection end after its answer."""


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    assert MAX_BODY_BYTES < SENT_BYTES < LINGER_BYTES and BODY_PIECE_BYTES < ADMITTED_BYTES < MAX_BODY_BYTES
    port = free_port()
    with serving(port, request.param, {"MATMUL_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}):
        yield port


def head_of(version: bytes, connection: bytes, length: int) -> bytes:
    """The head of a POST /matmul of an .npz body of `length` bytes."""
    return b"POST /matmul %s\r\nHost: t\r\nContent-Type: application/x-npz\r\nContent-Length: %d\r\n%s\r\n" % (
        version,
        length,
        connection,
    )


def answer_then_end(port: int, head: bytes, sent_bytes: int) -> tuple[int, dict[str, str]]:
    """Send `head` and `sent_bytes` of body, then read one answer and the end of the connection: its status and
    JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
        sock.sendall(head)
        sock.sendall(bytes(sent_bytes))
        answer, body = read_whole_answer(sock)
        assert sock.recv(1) == b"", "the server ends the connection after the answer"
    return answer.status, json.loads(body)


@pytest.mark.parametrize(("version", "connection"), ENDING)
def test_a_413_before_the_body_reaches_a_client_whose_connection_ends(
    port: int, version: bytes, connection: bytes
) -> None:
    status, error = answer_then_end(port, head_of(version, connection, 4 * MAX_BODY_BYTES), SENT_BYTES)
    assert status == 413 and error["code"] == "payload_too_large", error
    assert f"over the limit of {MAX_BODY_BYTES}" in error["message"]


@pytest.mark.parametrize(("version", "connection"), ENDING)
def test_a_503_before_the_body_reaches_a_client_whose_connection_ends(
    port: int, version: bytes, connection: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine says its queue is full (a queue filled by slow products would make the test one of timing)."""

    def full(self: EngineClient) -> None:
        raise Overloaded("every engine's queue is full (1 waiting); retry later")

    monkeypatch.setattr(EngineClient, "check_room", full)
    status, error = answer_then_end(port, head_of(version, connection, ADMITTED_BYTES), ADMITTED_BYTES)
    assert status == 503 and error["code"] == "overloaded", error


def test_a_413_before_the_body_on_a_kept_alive_connection_is_followed_by_the_next_answer(port: int) -> None:
    """The rest of the body is read and dropped, and the request after it served."""
    declared = 2 * MAX_BODY_BYTES
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
        sock.sendall(head_of(b"HTTP/1.1", b"", declared))
        sock.sendall(bytes(declared))
        sock.sendall(HEALTHZ)
        refused, _ = read_whole_answer(sock)
        served, _ = read_whole_answer(sock)
    assert (refused.status, served.status) == (413, 200)


def test_a_client_that_sends_on_past_the_linger_bytes_is_cut_off(port: int) -> None:
    """After an answer the server reads and drops at most LINGER_BYTES, and the socket buffers on the way hold a few
    MiB more: a client sending on is reset, not read from for the rest of the header timeout."""
    piece = bytes(1 << 20)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
        sock.sendall(head_of(b"HTTP/1.1", b"Connection: close\r\n", 1 << 40))
        try:
            while sent < 4 * LINGER_BYTES:
                sock.sendall(piece)
                sent += len(piece)
        except (ConnectionResetError, BrokenPipeError):
            pass
    assert LINGER_BYTES <= sent < LINGER_BYTES + (16 << 20)
