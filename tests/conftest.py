"""Shared fixtures: apps on the CPU backend (and the GPU one where a device exists), clients, the edge shapes."""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import settings

from app.config import Settings
from app.dataplane.devices import gpu_unavailable
from app.main import create_app
from matmul_tools.service import free_port, running_server, uvicorn_command, wait_ready_async

GPU_MISSING = gpu_unavailable(0)

EDGE_SHAPES = [(1, 1, 1), (1, 64, 1), (1, 5, 300), (300, 5, 1), (17, 33, 9), (1000, 1, 1000)]
"""(m, k, n) that every kernel is checked on: 1x1, 1xN and Nx1 products, k = 1, sides that are not multiples of any
tile or vector width."""

# Hypothesis (the codec properties, and schemathesis's fuzzing): few examples, no per-example deadline, so
# the suite stays quick and steady on CI's two cores; HYPOTHESIS_PROFILE=thorough searches far longer.
settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("thorough", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The servers the tests start, in this process and as subprocesses (which inherit it), serve no gRPC unless a test
# gives them a port of their own: on the default port they would all share one (SO_REUSEPORT) and answer for
# each other. tests/api/test_grpc.py serves it.
os.environ.setdefault("MATMUL_GRPC_PORT", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip, saying why, where no CUDA device is usable."""
    if GPU_MISSING is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {GPU_MISSING.reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def without_garbage_collection() -> Iterator[None]:
    """The cyclic garbage collector off while the test runs: what a reference cycle holds stays held, as it may for
    long in a quiet server, where too little is allocated to start a collection. Memory lent to a request must come
    back by its references alone."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


SERVED_MAX_BODY_BYTES = 1 << 20
"""The body limit of `served_url`'s server: small, so that a test can pass it cheaply."""
SERVED_MAX_JSON_BYTES = 256 << 10
"""Its JSON limit, below the body limit, likewise."""


@pytest.fixture(scope="session")
def served_url() -> Iterator[str]:
    """The URL of the service running as a real process on the CPU backend, shared by the tests that need the wire."""
    port = free_port()
    env = {
        "MATMUL_BACKEND": "cpu",
        "MATMUL_MAX_BODY_BYTES": str(SERVED_MAX_BODY_BYTES),
        "MATMUL_MAX_JSON_BYTES": str(SERVED_MAX_JSON_BYTES),
    }
    with running_server(uvicorn_command(port), port, env=env):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def cpu_settings() -> Settings:
    return Settings(backend="cpu")


async def _client_for(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            await wait_ready_async(client, timeout_s=30)
            yield client


@pytest.fixture
async def client(cpu_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app on the CPU backend, through the ASGI interface, lifespan run."""
    async for c in _client_for(create_app(cpu_settings)):
        yield c


@pytest.fixture
async def gpu_client() -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app on the GPU backend (for tests marked `gpu`)."""
    async for c in _client_for(create_app(Settings(backend="gpu"))):
        yield c
