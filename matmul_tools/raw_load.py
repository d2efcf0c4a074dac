"""Closed-loop load from raw keep-alive sockets, for benchmarks where the client must cost less than the server.

Every client process builds its requests once (whole HTTP requests as bytes, by a function given to `LoadPool`);
each of its connections is a thread that sends one request again and again until a shared deadline and reads
each answer, framed by Content-Length, into one reusable buffer. Per byte the client spends a `sendall` and a
`recv_into`, both outside the GIL. httpx spends more per byte than the service does: against one CPU worker
echoing 128 MiB bodies it took 1.2 s a request where these sockets took 0.3 s (docs/throughput.md).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import Pool
from typing import Any

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


def read_answer(sock: socket.socket, buffer: bytearray) -> Answer:
    """Read one HTTP/1.1 answer framed by Content-Length from `sock`, its body into `buffer` (overwritten)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        received += chunk
    head, _, start = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    answer = Answer(status, head, b"", 0)
    length = int(answer.header(b"content-length") or b"0")
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


@dataclass
class Tally:
    """What some connections did: answers by status, bytes moved both ways, and a figure read from each 200."""

    answers: dict[int, int] = field(default_factory=dict)
    moved_bytes: int = 0
    figures: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.answers.get(200, 0)

    def add(self, other: Tally) -> None:
        for status, count in other.answers.items():
            self.answers[status] = self.answers.get(status, 0) + count
        self.moved_bytes += other.moved_bytes
        self.figures += other.figures


Figure = Callable[[Answer], float | None]
"""Reads a figure from a 200 answer (the batch size it ran in, say), or None where it has none."""


@dataclass(frozen=True)
class Share:
    """What one client process does: `connections` sockets sending the request named `request` until `until`
    (time.time(), the same instant for every process)."""

    port: int
    request: str
    connections: int
    until: float
    figure: Figure | None = None


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
                figure = share.figure(answer) if share.figure is not None and answer.status == 200 else None
                if figure is not None:
                    tally.figures.append(figure)
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
        self, port: int, request: str, connections: int, duration_s: float, figure: Figure | None = None
    ) -> tuple[Tally, float]:
        """Send `request` on `connections` connections, spread over the processes, for `duration_s`; the tally of
        every answer and the seconds it took (the last answer may end after the deadline)."""
        per_process = [
            connections // self.processes + (i < connections % self.processes) for i in range(self.processes)
        ]
        until = time.time() + duration_s
        shares = [Share(port, request, count, until, figure) for count in per_process if count]
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
