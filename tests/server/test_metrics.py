"""`/metrics` of `matmul-service --workers 2` (CPU backend) says what the whole server holds now, whichever worker
answers: the requests in flight once a worker that held some was killed, and the shared memory a request holds on
the other worker."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from matmul_tools.prometheus import sample_sums
from matmul_tools.service import LocalService, free_port

pytestmark = pytest.mark.timeout(180)

GUARD_S = 60
"""How long a test waits for the server to change: a hang guard, far longer than it takes."""
IN_FLIGHT = "matmul_requests_in_flight"
SLAB_USED = "matmul_slab_used_bytes"
BODY_BYTES = 4 << 20
"""A multipart body this large is read into the worker's shared memory (lent at its head, until it ends)."""


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "metrics"
    directory.mkdir()
    return directory


@pytest.fixture
def service(tmp_path: Path, metrics_dir: Path) -> Iterator[LocalService]:
    env = {
        "MATMUL_BACKEND": "cpu",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_SLAB_BYTES": str(64 << 20),
        # the held requests' bodies never time out while a test runs, however slow the machine (a default's 30 s)
        "MATMUL_BODY_TIMEOUT_S": "600",
        # a hand-off far wider than its default, so that both workers take connections on a loaded machine
        "MATMUL_ACCEPT_HANDOFF_MS": "200",
        "PROMETHEUS_MULTIPROC_DIR": os.fspath(metrics_dir),
    }
    service = LocalService.matmul_service(free_port(), env, tmp_path / "service.log", workers=2)
    try:
        service.wait_ready(GUARD_S)
        yield service
    finally:
        service.stop()


class Connection:
    """One connection to the server, and the pid of the HTTP worker that accepted it."""

    def __init__(self, service: LocalService) -> None:
        self.socket = socket.create_connection(("127.0.0.1", service.port), timeout=GUARD_S)
        self.pid = int(self.info()["http_worker_pid"])

    def get(self, path: str) -> bytes:
        """GET `path` on this connection: the answer's body (the server sends a Content-Length)."""
        self.socket.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        received = b""
        while b"\r\n\r\n" not in received:
            received += self._receive()
        head, _, body = received.partition(b"\r\n\r\n")
        fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
        length = int({name.strip().lower(): value for name, value in fields.items()}[b"content-length"])
        while len(body) < length:
            body += self._receive()
        assert head.startswith(b"HTTP/1.1 200"), f"GET {path}: {head!r} {body!r}"
        return body

    def _receive(self) -> bytes:
        chunk = self.socket.recv(1 << 16)
        assert chunk, "the server closed the connection"
        return chunk

    def info(self) -> dict[str, object]:
        answer: dict[str, object] = orjson.loads(self.get("/v1/info"))
        return answer

    def slab_used_bytes(self) -> int:
        """The shared memory this connection's worker holds now, as its /v1/info says."""
        return int(self.info()["slabs"]["used_bytes"])  # type: ignore[index]

    def gauge(self, name: str) -> float:
        """One gauge of the server's /metrics, scraped on this connection."""
        return sample_sums(self.get("/metrics").decode(), [name])[name]

    def hold_a_product(self) -> None:
        """Send the head of a product and the first quarter of its multipart body, and no more: a request in flight
        on this connection's worker, holding shared memory for its body, until the connection closes."""
        head = (
            "POST /matmul HTTP/1.1\r\nHost: test\r\nContent-Type: multipart/form-data; boundary=held\r\n"
            f"Content-Length: {BODY_BYTES}\r\n\r\n"
        )
        self.socket.sendall(head.encode() + b"--held\r\n" + bytes(BODY_BYTES // 4))

    def close(self) -> None:
        self.socket.close()


@contextlib.contextmanager
def connections_to_both_workers(service: LocalService) -> Iterator[dict[int, list[Connection]]]:
    """Connections opened until each of the two workers holds at least two, by worker pid; closed at the end."""
    opened: list[Connection] = []
    by_worker: dict[int, list[Connection]] = {}
    deadline = time.monotonic() + GUARD_S
    try:
        while len(by_worker) < 2 or min(map(len, by_worker.values())) < 2:
            assert time.monotonic() < deadline, f"connections by worker: { {p: len(c) for p, c in by_worker.items()} }"
            opened.append(connection := Connection(service))
            by_worker.setdefault(connection.pid, []).append(connection)
        yield by_worker
    finally:
        for connection in opened:
            connection.close()


def scraped(service: LocalService, name: str) -> float:
    """One gauge of /metrics over a new connection (any worker answers for all); nan while no worker answers."""
    try:
        return sample_sums(httpx.get(f"{service.url}/metrics", timeout=10).text, [name])[name]
    except httpx.TransportError:  # a connection the killed worker had accepted
        return float("nan")


def replacement(service: LocalService) -> int | None:
    """The pid of the worker that accepts a new connection; None where the connection fails (the killed worker had
    accepted it)."""
    try:
        connection = Connection(service)
    except (OSError, AssertionError):
        return None
    connection.close()
    return connection.pid


def live_gauge_files(metrics_dir: Path, pid: int) -> list[str]:
    return sorted(path.name for path in metrics_dir.glob(f"gauge_live*_{pid}.db"))


def test_a_killed_workers_requests_leave_the_in_flight_gauge(service: LocalService, metrics_dir: Path) -> None:
    """Each worker holds a request in flight; one is killed with SIGKILL and uvicorn starts another: the in-flight
    gauge comes back to the survivor's request (and the scrape), and the dead worker's live gauges are gone."""
    with connections_to_both_workers(service) as by_worker:
        victim, survivor = sorted(by_worker)
        for pid in (victim, survivor):
            by_worker[pid][0].hold_a_product()
        watcher = by_worker[survivor][1]
        deadline = time.monotonic() + GUARD_S
        while watcher.gauge(IN_FLIGHT) != 3:  # the two held and this scrape
            assert time.monotonic() < deadline, f"{IN_FLIGHT} {watcher.gauge(IN_FLIGHT)}, not 3"
        assert live_gauge_files(metrics_dir, victim)

        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + GUARD_S
        while replacement(service) in (None, victim, survivor):
            assert time.monotonic() < deadline, "no worker replaced the killed one"
        while (in_flight := watcher.gauge(IN_FLIGHT)) != 2:  # the survivor's held request and this scrape
            assert time.monotonic() < deadline, f"{IN_FLIGHT} {in_flight} after the kill, not 2"
        assert live_gauge_files(metrics_dir, victim) == []
    deadline = time.monotonic() + GUARD_S
    while (in_flight := scraped(service, IN_FLIGHT)) != 1:  # the survivor's request ended with its connection
        assert time.monotonic() < deadline, f"{IN_FLIGHT} {in_flight} with nothing held, not 1"


def test_shared_memory_held_on_one_worker_is_in_the_others_scrape(service: LocalService) -> None:
    """A request on one worker holds shared memory for its body: a scrape answered by the other worker counts it,
    and counts 0 once the request has ended."""
    with connections_to_both_workers(service) as by_worker:
        holder, scraper = sorted(by_worker)
        holding, asking = by_worker[holder]
        watcher = by_worker[scraper][0]
        holding.hold_a_product()
        deadline = time.monotonic() + GUARD_S
        while (held := asking.slab_used_bytes()) < BODY_BYTES:
            assert time.monotonic() < deadline, f"worker {holder} holds {held} bytes, not the body's"
        assert watcher.slab_used_bytes() == 0
        assert watcher.gauge(SLAB_USED) == held

        holding.close()
        while (used := watcher.gauge(SLAB_USED)) != 0:
            assert time.monotonic() < deadline, f"{SLAB_USED} {used} once the request ended, not 0"
        assert asking.slab_used_bytes() == 0
