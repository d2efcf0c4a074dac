"""Bodies received straight into a route's memory (app.api.connection.DirectBody), through a real uvicorn server in
this process on each event loop (uvloop and asyncio's own), over raw sockets: the bytes that arrive that way are
counted by a spy on DirectBody, every body is checked byte for byte, and the connection goes on serving the
requests that follow one (kept alive, pipelined in the same read, sent in pieces), or ends after one that stopped
half-way (408) or whose client left."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from app.api.connection import BODY_PIECE_BYTES, READ_BYTES, DirectBody, GuardedHttpProtocol, HttpConnection
from matmul_tools.prometheus import sample_sums
from matmul_tools.raw_http import read_until_closed
from matmul_tools.raw_load import post_request, read_whole_answer, v2_infer_request
from matmul_tools.service import free_port
from tests.api.in_process import serving

BODY_TIMEOUT_S = 1.0
GUARD_S = 30
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"


@dataclass
class Served:
    port: int
    direct_bytes: list[int] = field(default_factory=list)
    """The sizes of the reads that went straight into a route's memory, in order."""

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=GUARD_S)

    def received_directly(self) -> int:
        return sum(self.direct_bytes)


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    found = Served(free_port())
    arrived = DirectBody.arrived

    def spied(self: DirectBody, nbytes: int) -> bool:
        found.direct_bytes.append(nbytes)
        return arrived(self, nbytes)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DirectBody, "arrived", spied)
        with serving(
            found.port, request.param, {"MATMUL_ECHO_ROUTE": "true", "MATMUL_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
        ):
            yield found


def echo_request(body: bytes, *headers: bytes) -> bytes:
    head, _, rest = post_request("/v1/echo", "application/octet-stream", body).partition(b"\r\n\r\n")
    return b"\r\n".join([head, *headers]) + b"\r\n\r\n" + rest


def a_body(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()


def test_the_event_loop_hands_the_protocol_memory_to_receive_into() -> None:
    """uvloop receives into a protocol's memory only when it is not an asyncio.Protocol (uvicorn's protocols are)."""
    assert issubclass(GuardedHttpProtocol, asyncio.BufferedProtocol)
    assert not issubclass(GuardedHttpProtocol, asyncio.Protocol)


@pytest.mark.parametrize(
    ("nbytes", "before_the_route"),
    [
        (BODY_PIECE_BYTES, BODY_PIECE_BYTES + READ_BYTES),  # read on until a piece waits for the route
        ((5 << 20) + 3, READ_BYTES),  # longer than a piece: the reading pauses with the head's read
    ],
)
def test_a_body_is_received_straight_into_the_routes_memory_and_the_connection_serves_on(
    served: Served, nbytes: int, before_the_route: int
) -> None:
    bodies = [a_body(nbytes, seed) for seed in (1, 2)]
    before = served.received_directly()
    with served.connect() as sock:
        for body in bodies:
            sock.sendall(echo_request(body))
            answer, echoed = read_whole_answer(sock)
            assert answer.status == 200 and echoed == body
        sock.sendall(HEALTHZ)
        answer, said = read_whole_answer(sock)
        assert answer.status == 200 and said == b'{"status":"ok"}'
    # what came before the route asked went the usual way, the rest straight into its memory
    assert served.received_directly() - before >= len(bodies) * (nbytes - before_the_route)


@pytest.mark.parametrize(("nbytes", "paused"), [(BODY_PIECE_BYTES, False), (BODY_PIECE_BYTES + 1, True)])
def test_a_body_longer_than_a_piece_waits_in_the_socket_until_the_route_asks(
    served: Served, monkeypatch: pytest.MonkeyPatch, nbytes: int, paused: bool
) -> None:
    reading_paused_at_the_head: list[bool] = []
    headers_complete = HttpConnection.on_headers_complete

    def spied(self: HttpConnection) -> None:
        headers_complete(self)
        reading_paused_at_the_head.append(self.flow.read_paused)

    monkeypatch.setattr(HttpConnection, "on_headers_complete", spied)
    body = a_body(nbytes, 8)
    with served.connect() as sock:
        sock.sendall(echo_request(body))
        answer, echoed = read_whole_answer(sock)
    assert answer.status == 200 and echoed == body
    assert reading_paused_at_the_head == [paused]


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """The (status, body) of the next `count` answers, framed by Content-Length (one read may hold several)."""
    received, found = b"", []
    while len(found) < count:
        head, blank, rest = received.partition(b"\r\n\r\n")
        if blank:
            fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
            length = int(fields[b"content-length"])
            if len(rest) >= length:
                found.append((int(head.split(b" ", 2)[1]), rest[:length]))
                received = rest[length:]
                continue
        chunk = sock.recv(1 << 20)
        assert chunk, "the server closed the connection"
        received += chunk
    return found


def test_the_request_after_a_body_in_the_same_read_is_parsed_from_its_first_byte(served: Served) -> None:
    body = a_body(3 << 20, 3)
    with served.connect() as sock:
        sock.sendall(echo_request(body) + HEALTHZ + echo_request(body[: 1 << 20]))
        answers = read_answers(sock, 3)
    assert answers == [(200, body), (200, b'{"status":"ok"}'), (200, body[: 1 << 20])]


def test_a_body_sent_in_pieces_with_pauses_arrives_whole(served: Served) -> None:
    body = a_body(4 << 20, 4)
    request = echo_request(body)
    with served.connect() as sock:
        for start, end in ((0, 1000), (1000, 3 << 20), (3 << 20, len(request) - 1), (len(request) - 1, None)):
            sock.sendall(request[start:end])
            time.sleep(0.2)
        answer, echoed = read_whole_answer(sock)
    assert answer.status == 200 and echoed == body


def test_a_body_slower_in_all_than_the_timeout_arrives_whole_while_no_pause_reaches_it(served: Served) -> None:
    body = a_body(4 << 20, 7)
    request = echo_request(body)
    pieces = np.linspace(0, len(request), 5, dtype=int)
    started = time.monotonic()
    with served.connect() as sock:
        for start, end in itertools.pairwise(pieces):
            sock.sendall(request[start:end])
            time.sleep(BODY_TIMEOUT_S * 0.6)
        answer, echoed = read_whole_answer(sock)
    assert time.monotonic() - started > 2 * BODY_TIMEOUT_S  # the quiet is timed from the last bytes, not the first
    assert answer.status == 200 and echoed == body


def test_a_body_that_stops_half_way_is_408_and_its_connection_ends(served: Served) -> None:
    request = echo_request(a_body(4 << 20, 5))
    with served.connect() as sock:
        sock.sendall(request[: len(request) // 2])
        answered = read_until_closed(sock)  # a hang would raise the socket's timeout
    head, _, said = answered.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"body_timeout" in said
    assert f"nothing for {BODY_TIMEOUT_S:g} s after".encode() in said


def test_a_client_that_leaves_half_way_leaves_the_server_serving(served: Served) -> None:
    body = a_body(4 << 20, 6)
    with served.connect() as sock:
        sock.sendall(echo_request(body)[: 2 << 20])
    with served.connect() as sock:
        sock.sendall(echo_request(body))
        answer, echoed = read_whole_answer(sock)
    assert answer.status == 200 and echoed == body


def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body(served: Served) -> None:
    body = a_body(2 << 20, 7)
    head, _, _ = echo_request(body, b"Expect: 100-continue").partition(b"\r\n\r\n")
    with served.connect() as sock:
        sock.sendall(head + b"\r\n\r\n")
        assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        answer, echoed = read_whole_answer(sock)
    assert answer.status == 200 and echoed == body


def test_the_bytes_received_directly_are_counted_in_the_metrics(served: Served) -> None:
    def echoed_bytes() -> float:
        with served.connect() as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            _, text = read_whole_answer(sock)
        found = sample_sums(text.decode(), ["matmul_request_bytes_total"], {"route": "/v1/echo"})
        return found.get("matmul_request_bytes_total", 0.0)

    def settled() -> float:
        """The count once no request still being answered adds to it (those of the tests before)."""
        last, now = -1.0, echoed_bytes()
        while now != last:
            time.sleep(0.3)
            last, now = now, echoed_bytes()
        return now

    before = settled()
    body = a_body(3 << 20, 8)
    with served.connect() as sock:
        sock.sendall(echo_request(body))
        assert read_whole_answer(sock)[0].status == 200
    deadline = time.monotonic() + GUARD_S  # counted once the answer is sent: a moment after the client has it
    while echoed_bytes() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled() - before == len(body)


def test_binary_tensors_received_into_shared_memory_multiply_right(served: Served) -> None:
    rng = np.random.default_rng(9)
    a = rng.standard_normal((700, 600), np.float32)
    b = rng.standard_normal((600, 500), np.float32)
    before = served.received_directly()
    with served.connect() as sock:
        sock.sendall(v2_infer_request(a, b))
        answer, body = read_whole_answer(sock)
    assert answer.status == 200
    split = int(answer.header(b"inference-header-content-length") or b"0")
    c = np.frombuffer(body, "<f4", offset=split).reshape(700, 500)
    expected = a.astype(np.float64) @ b
    assert np.linalg.norm(c - expected) / np.linalg.norm(expected) < 1e-6  # float32, k = 600
    assert served.received_directly() > before
