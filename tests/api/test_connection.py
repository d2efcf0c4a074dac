"""The connection's bounds, over raw sockets to a real server: a request head over MATMUL_MAX_HEADER_BYTES is a 431
before any body is read, and a connection that does not deliver its headers within MATMUL_HEADER_TIMEOUT_S (here
0.5 s) is closed, whether it sent part of a request, nothing at all, or began a second one after keep-alive."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from matmul_tools.raw_http import read_until_closed, status_of_a_large_header
from matmul_tools.service import free_port, running_server, uvicorn_command

MAX_HEADER_BYTES = 16 * 1024
GUARD_S = 10
"""How long a test waits for the server to close a connection: far longer than the 0.5 s timeout."""


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    env = {
        "MATMUL_BACKEND": "cpu",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_ECHO_ROUTE": "true",
        "MATMUL_HEADER_TIMEOUT_S": "0.5",
        "MATMUL_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
    }
    with running_server(uvicorn_command(port), port, env=env):
        yield port


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)


def answers(received: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each answer in `received`, in order (bodies framed by Content-Length)."""
    found = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        length = int(fields[b"content-length"])
        found.append((int(head.split(b" ", 2)[1]), rest[:length]))
        received = rest[length:]
    return found


def test_headers_under_the_limit_are_served(port: int) -> None:
    assert status_of_a_large_header(port, MAX_HEADER_BYTES - 200)[0] == 200


def head_of(size: int) -> bytes:
    """A GET /healthz whose request line and headers, up to and with the blank line, are `size` bytes."""
    start, end = b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Big: ", b"\r\n\r\n"
    return start + b"x" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize(("size", "status"), [(MAX_HEADER_BYTES, 200), (MAX_HEADER_BYTES + 1, 431)])
def test_a_head_of_exactly_the_limit_is_served_and_one_byte_more_is_431(port: int, size: int, status: int) -> None:
    with connect(port) as sock:
        sock.sendall(head_of(size))
        ((answered, _),) = answers(read_until_closed(sock))
    assert answered == status


def test_headers_over_the_limit_are_a_431_in_the_error_format(port: int) -> None:
    status, body = status_of_a_large_header(port, MAX_HEADER_BYTES)
    assert status == 431
    error = json.loads(body)
    assert error["code"] == "headers_too_large" and f"limit of {MAX_HEADER_BYTES} bytes" in error["message"]
    status, body = status_of_a_large_header(port, MAX_HEADER_BYTES, path="/v2/models/matmul/infer")
    assert status == 431 and set(json.loads(body)) == {"error"}, "under /v2 in the protocol's format"


def test_a_head_sent_in_small_pieces_is_counted_whole(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        for i in range(2 * MAX_HEADER_BYTES // 1024):
            try:
                sock.sendall(b"X-Piece-%d: %s\r\n" % (i, b"y" * 1000))
            except OSError:  # the server answered and closed while more was coming
                break
        ((status, _),) = answers(read_until_closed(sock))
    assert status == 431


def test_a_431_comes_before_the_body_is_read(port: int) -> None:
    """A POST that declares 100 MB and sends none of it is answered from its headers alone."""
    head = b"POST /v1/echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100000000\r\nX-Big: %s\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(head % (b"x" * MAX_HEADER_BYTES))
        ((status, _),) = answers(read_until_closed(sock))
    assert status == 431


def test_a_body_is_not_counted_against_the_headers_even_in_the_same_read(port: int) -> None:
    """Headers just under the limit and a body many times larger, in one send: the server reads them together."""
    body = bytes(range(256)) * 1024
    head = b"POST /v1/echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: %d\r\nX-Big: %s\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(head % (len(body), b"x" * (MAX_HEADER_BYTES - 300)) + body)
        ((status, echoed),) = answers(read_until_closed(sock))
    assert status == 200 and echoed == body


def test_half_sent_headers_are_answered_408_and_closed(port: int) -> None:
    """Such a connection was held open for good."""
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Half: ")
        ((status, body),) = answers(read_until_closed(sock))
    assert status == 408 and json.loads(body)["code"] == "header_timeout"


def test_a_connection_that_never_sends_a_byte_is_closed(port: int) -> None:
    with connect(port) as sock:
        assert read_until_closed(sock) == b""


def test_a_second_request_begun_after_keep_alive_is_timed_out_too(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        ((status, _),) = answers(read_until_closed(sock))
    assert status == 408


def test_an_ambiguous_head_is_refused_over_the_wire_too(port: int) -> None:
    """Two Content-Type headers and a content coding, as uvicorn hands them to the app."""
    body = b'{"a": [[1.0]], "b": [[2.0]]}'
    for extra, status in ((b"Content-Type: application/x-npz\r\n", 400), (b"Content-Encoding: gzip\r\n", 415)):
        request = b"POST /matmul HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\n"
        request += extra + b"Content-Length: %d\r\n\r\n" % len(body) + body
        with connect(port) as sock:
            sock.sendall(request)
            ((answered, _),) = answers(read_until_closed(sock))
        assert answered == status
