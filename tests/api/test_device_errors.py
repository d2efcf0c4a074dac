"""A device that runs out of memory or is lost, through the real app with a backend that raises what the GPU
backend raises: 503 with Retry-After and the error's code, on every surface, in CI (the `gpu` tests see the real
ones)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from app.config import Settings
from app.engine import DeviceWorker, LocalEngine
from app.errors import DeviceLost, DeviceOutOfMemory
from app.main import create_app
from matmul_tools.service import wait_ready_async
from tests.fakes import SteeredBackend

pytestmark = pytest.mark.anyio

BODY = {"a": [[1.0, 2.0]], "b": [[3.0], [4.0]]}
INFER = {"inputs": [
    {"name": "A", "shape": [1, 2], "datatype": "FP64", "data": [1.0, 2.0]},
    {"name": "B", "shape": [2, 1], "datatype": "FP64", "data": [3.0, 4.0]},
]}  # fmt: skip
OUT_OF_MEMORY = "the product does not fit in device memory now: out of memory allocating 144 MB"
LOST = "cudaErrorIllegalInstruction; the CUDA context is unusable"


@dataclass(frozen=True)
class Steered:
    """The app's client, and the backend under its engine that a test makes fail."""

    backend: SteeredBackend
    client: httpx.AsyncClient

    async def retry_later(self, error: Exception, path: str, body: object) -> httpx.Response:
        """The answer to a product whose launch raises `error`: a 503 with the settings' Retry-After."""
        self.backend.fail_next = error
        r = await self.client.post(path, json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        return r


@pytest.fixture
async def steered() -> AsyncIterator[Steered]:
    """The app, its engine one worker over a SteeredBackend (no restart is asked for when the device is lost)."""
    backend = SteeredBackend()
    engine = LocalEngine(DeviceWorker(backend, queue_size=4))
    app = create_app(Settings(backend="cpu", retry_after_s=7, access_log=False))
    async with app.router.lifespan_context(app):
        app.state.engine = engine  # in place of the lifespan's, which the lifespan still stops
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                await wait_ready_async(client, timeout_s=30)
                yield Steered(backend, client)
        finally:
            await engine.stop()


async def test_out_of_device_memory_is_a_503_with_retry_after_and_the_next_product_runs(steered: Steered) -> None:
    r = await steered.retry_later(DeviceOutOfMemory(OUT_OF_MEMORY), "/matmul", BODY)
    assert r.json() == {"code": "device_out_of_memory", "message": OUT_OF_MEMORY, "location": None}
    r = await steered.retry_later(DeviceOutOfMemory(OUT_OF_MEMORY), "/v2/models/matmul/infer", INFER)
    assert r.json() == {"error": OUT_OF_MEMORY}
    r = await steered.client.post("/matmul", json=BODY)
    assert r.status_code == 200 and r.json()["result"] == [[11.0]]


async def test_a_lost_device_is_a_503_with_retry_after_and_the_engine_is_not_ready_after_it(steered: Steered) -> None:
    client = steered.client
    r = await steered.retry_later(DeviceLost(LOST), "/matmul", BODY)
    assert r.json() == {"code": "device_lost", "message": LOST, "location": None}
    for answer in (await client.post("/matmul", json=BODY), await client.get("/readyz")):
        assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
        assert answer.json()["code"] == "not_ready" and "the device was lost" in answer.json()["message"]
    r = await client.post("/v2/models/matmul/infer", json=INFER)
    assert r.status_code == 503 and r.headers["retry-after"] == "7" and "the device was lost" in r.json()["error"]
