"""Servers started as `matmul-service` is, and client processes to load them with (matmul_tools/integrity.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from matmul_tools.integrity import client_pool
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
