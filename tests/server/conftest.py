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
GPU_SHAPES = (
    (4096, 4096, 4096),
    (2048, 8, 2048),
    (1024, 16, 1024),
    (512, 1024, 512),
    (256, 256, 256),
    (128, 128, 128),
    (64, 64, 64),
)
"""(m, k, n) of the GPU loads, 64^2 to 4096^2: a 4096^2 product (192 MiB moved) among small ones, and thin products
whose answers are far larger than their operands."""
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
