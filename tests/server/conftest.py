"""Servers started as `matmul-service` is, and client processes to load them with (matmul_tools/integrity.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import pytest

from matmul_tools.integrity import client_pool
from matmul_tools.prometheus import sample_sums
from matmul_tools.service import LocalService, free_port

CLIENTS = 6
"""Client processes of a checked load: more than the two cores of CI's machine, so that requests overlap."""
SHAPES = (
    (2048, 8, 2048),
    (1024, 16, 1024),
    (512, 32, 512),
    (384, 512, 384),
    (256, 256, 256),
    (200, 96, 160),
    (128, 128, 128),
)
"""(m, k, n): products of 16, 4 and 1 MiB, answers far larger than their operands (so that answers are what fills the
shared memory, and a 16 MiB one is more than the kernel's socket buffers take from the server at once); binary
bodies of 1.5 MiB, read into the shared memory itself where it has room (operands the engine reads in place); and
shapes small enough for the JSON ways."""
STACK_SHAPES = ((64, 32, 16, 24), (8, 256, 64, 128))
"""(batch, m, k, n): a stack of 64 small products that the JSON ways carry too, and one of 8 of 1 MiB each."""
GPU_SHAPES = ((4096, 4096, 4096), (512, 1024, 512), *SHAPES, (64, 64, 64))
"""(m, k, n) of the GPU loads: a 4096^2 product (192 MiB moved) among the CPU loads' shapes, 64^2 to 2048^2."""
Serve = Callable[[Mapping[str, str], int], LocalService]


@pytest.fixture(scope="session")
def clients() -> Iterator[ProcessPoolExecutor]:
    """Client processes, started once (spawning one costs a second of imports on two cores)."""
    with client_pool(CLIENTS) as processes:
        yield processes


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Starts `matmul-service --workers N` with the variables given, ready; stops what it started after the test."""
    started: list[LocalService] = []

    def start(env: Mapping[str, str], workers: int) -> LocalService:
        with_grpc = {"MATMUL_GRPC_PORT": str(free_port()), **env}  # for the load's gRPC way
        service = LocalService.matmul_service(free_port(), with_grpc, tmp_path / f"server-{len(started)}.log", workers)
        started.append(service)
        service.wait_ready(120)
        return service

    yield start
    for service in started:
        service.stop()


def requests_in_flight(url: str) -> float:
    """The server's matmul_requests_in_flight gauge (of every HTTP worker), which counts the scrape that reads it."""
    gauge = "matmul_requests_in_flight"
    return sample_sums(httpx.get(f"{url}/metrics").text, [gauge])[gauge]


class HeldProduct:
    """A JSON product, [[1, 2]] @ [[3], [4]], sent on a thread with its body stopped halfway until `finish`: a request
    in flight for as long as a test needs one. Its answer lands in `answers`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rest_of_body = threading.Event()
        self.answers: list[httpx.Response] = []
        self.sender = threading.Thread(target=self._send)

    def _body(self) -> Iterator[bytes]:
        yield b'{"a": [[1.0, 2.0]], '
        self.rest_of_body.wait(30)
        yield b'"b": [[3.0], [4.0]]}'

    def _send(self) -> None:
        headers = {"content-type": "application/json"}
        self.answers.append(httpx.post(f"{self.url}/matmul", content=self._body(), timeout=30, headers=headers))

    def start(self, guard_s: float = 10) -> None:
        """Send it, and return once the server holds it."""
        self.sender.start()
        deadline = time.monotonic() + guard_s
        while requests_in_flight(self.url) < 2:  # our request and this scrape
            assert time.monotonic() < deadline and self.sender.is_alive(), "the request never reached the app"

    @property
    def answered(self) -> bool:
        return bool(self.answers) or not self.sender.is_alive()

    def finish(self) -> None:
        """Send the rest of the body and wait for the answer."""
        self.rest_of_body.set()
        self.sender.join(30)

    def assert_answered_right(self) -> None:
        assert self.answers and self.answers[0].status_code == 200, self.answers
        assert self.answers[0].json()["result"] == [[11.0]]
