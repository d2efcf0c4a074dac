"""Closed-loop load from raw keep-alive sockets, for benchmarks where the client must cost less than the server.

Every client process builds its requests once (whole HTTP requests as bytes, by a function given to `LoadPool`);
each of its connections is a thread that sends one request again and again until a shared deadline and reads
each answer, framed by Content-Length, into one reusable buffer. Per byte the client spends a `sendall` and a
`recv_into`, both outside the GIL. httpx spends more per byte than the service does: against one CPU worker
echoing 128 MiB bodies it took 1.2 s a request where these sockets took 0.3 s (docs/throughput.md).

`post_request`, `npy_matmul_body` and `v2_infer_request` build the products' requests (/matmul with `.npy` parts,
/v2/models/matmul/infer with binary tensors) for a LoadPool's `make_requests` or any other raw sender;
`read_whole_answer` reads an answer to be checked.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import Pool
from typing import Any

import numpy as np

from matmul_client.client import encode_payload
from matmul_tools.bodies import inference_v2_body

OPENING_BYTES = 4096
"""How much of an answer's body `Answer.opening` keeps, for figures written there (a v2 answer's JSON header)."""


@dataclass(frozen=True)
class Answer:
    status: int
    head: bytes
    """The status line and headers, without the blank line."""
    opening: bytes
    """The first bytes of the body, at most OPENING_BYTES."""
    size: int
    """Bytes of the whole answer: head, blank line and body."""

    def header(self, name: bytes) -> bytes | None:
        """The value of the header `name` (lower case), if the answer has it."""
        prefix = name + b":"
        for line in self.head.split(b"\r\n")[1:]:
            if line.lower().startswith(prefix):
                return line[len(prefix) :].strip()
        return None


def post_request(path: str, content_type: str, body: bytes, accept: str | None = None) -> bytes:
    """A whole POST request of `body` to `path`, to be sent as it is on a keep-alive connection."""
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    if accept is not None:
        head += f"Accept: {accept}\r\n"
    return head.encode() + b"\r\n" + body


def npy_matmul_body(a: np.ndarray, b: np.ndarray) -> tuple[bytes, str]:
    """The multipart body of /matmul with `a` and `b` as `.npy` parts, and its Content-Type: the very bytes
    `MatmulClient` sends (each part's data aligned in the body), so that the two are measured on the same request."""
    payload = encode_payload(a, b, "npy")
    return payload.content, payload.content_type


def v2_infer_request(a: np.ndarray, b: np.ndarray) -> bytes:
    """A whole POST /v2/models/matmul/infer of `a` and `b` as binary tensors, the answer asked for in binary."""
    body, header_length = inference_v2_body(a, b)
    head = (
        f"POST /v2/models/matmul/infer HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {header_length}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _read_head(sock: socket.socket) -> tuple[Answer, int, bytes]:
    """An answer's head (as an Answer without opening or size), its Content-Length, and the body's bytes read with
    it."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        received += chunk
    head, _, start = received.partition(b"\r\n\r\n")
    answer = Answer(int(head.split(b" ", 2)[1]), head, b"", 0)
    return answer, int(answer.header(b"content-length") or b"0"), start


def read_answer(sock: socket.socket, buffer: bytearray) -> Answer:
    """Read one HTTP/1.1 answer framed by Content-Length from `sock`, its body into `buffer` (overwritten)."""
    answer, length, start = _read_head(sock)
    status, head = answer.status, answer.head
    left = length - len(start)
    opening = bytearray(start[:OPENING_BYTES])
    view = memoryview(buffer)
    while left > 0:
        got = sock.recv_into(view[: min(left, len(view))])
        if not got:
            raise ConnectionError("the server closed the connection mid-answer")
        if len(opening) < OPENING_BYTES:
            opening += view[: min(got, OPENING_BYTES - len(opening))]
        left -= got
    return Answer(status, head, bytes(opening), len(head) + 4 + length)


def read_whole_answer(sock: socket.socket) -> tuple[Answer, bytearray]:
    """As `read_answer`, the body kept whole: for an answer to be checked."""
    answer, length, start = _read_head(sock)
    body = bytearray(length)
    view = memoryview(body)
    got = min(len(start), length)
    view[:got] = start[:got]
    while got < length:
        received = sock.recv_into(view[got:])
        if not received:
            raise ConnectionError("the server closed the connection mid-answer")
        got += received
    whole = Answer(answer.status, answer.head, bytes(body[:OPENING_BYTES]), len(answer.head) + 4 + length)
    return whole, body


@dataclass
class Tally:
    """What some connections did: answers by status, bytes moved both ways, and the figures read from each 200
    (by name: each figure's values, one from every answer that had it)."""

    answers: dict[int, int] = field(default_factory=dict)
    moved_bytes: int = 0
    figures: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return self.answers.get(200, 0)

    def add(self, other: Tally) -> None:
        for status, count in other.answers.items():
            self.answers[status] = self.answers.get(status, 0) + count
        self.moved_bytes += other.moved_bytes
        for name, values in other.figures.items():
            self.figures.setdefault(name, []).extend(values)

    def mean(self, figure: str) -> float | None:
        """The mean of a figure over the answers that had it, None where none had."""
        values = self.figures.get(figure)
        return sum(values) / len(values) if values else None


Figures = Callable[[Answer], Mapping[str, float]]
"""Reads figures from a 200 answer by name (the batch size it ran in, say): those it has."""


@dataclass(frozen=True)
class Share:
    """What one client process does: `connections` sockets sending the request named `request` until `until`
    (time.time(), the same instant for every process)."""

    port: int
    request: str
    connections: int
    until: float
    figures: Figures | None = None


_requests: dict[str, bytes] = {}
"""The requests of this client process, built once by LoadPool's initializer."""


def _build(make_requests: Callable[..., Mapping[str, bytes]], args: tuple[Any, ...]) -> None:
    _requests.update(make_requests(*args))


def _drive(share: Share) -> Tally:
    request = _requests[share.request]
    total = Tally()
    lock = threading.Lock()

    def connection() -> None:
        tally = Tally()
        buffer = bytearray(1 << 20)
        with socket.create_connection(("127.0.0.1", share.port), timeout=600) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while time.time() < share.until:
                sock.sendall(request)
                answer = read_answer(sock, buffer)
                tally.answers[answer.status] = tally.answers.get(answer.status, 0) + 1
                tally.moved_bytes += len(request) + answer.size
                if share.figures is not None and answer.status == 200:
                    for name, value in share.figures(answer).items():
                        tally.figures.setdefault(name, []).append(value)
                if answer.header(b"connection") == b"close":
                    break
        with lock:
            total.add(tally)

    threads = [threading.Thread(target=connection) for _ in range(share.connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return total


class LoadPool:
    """`processes` client processes, each holding the requests `make_requests(*args)` returns (name -> bytes)."""

    def __init__(
        self, processes: int, make_requests: Callable[..., Mapping[str, bytes]], args: tuple[Any, ...] = ()
    ) -> None:
        self.processes = processes
        self._pool = Pool(processes, initializer=_build, initargs=(make_requests, args))

    def run(
        self, port: int, request: str, connections: int, duration_s: float, figures: Figures | None = None
    ) -> tuple[Tally, float]:
        """Send `request` on `connections` connections, spread over the processes, for `duration_s`; the tally of
        every answer and the seconds it took (the last answer may end after the deadline)."""
        per_process = [
            connections // self.processes + (i < connections % self.processes) for i in range(self.processes)
        ]
        until = time.time() + duration_s
        shares = [Share(port, request, count, until, figures) for count in per_process if count]
        started = time.perf_counter()
        tallies = self._pool.map(_drive, shares)
        elapsed = time.perf_counter() - started
        total = Tally()
        for tally in tallies:
            total.add(tally)
        return total, elapsed

    def close(self) -> None:
        self._pool.close()
        self._pool.join()

    def __enter__(self) -> LoadPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
