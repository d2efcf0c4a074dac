"""On the device: out-of-memory answers 503 and the next request works; a poisoned CUDA context ends the engine
process with exit code 75 after answering 503, and the supervisor's fresh engine serves the same HTTP worker."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from app.config import Settings
from app.main import create_app
from matmul_tools.bodies import npy_bytes
from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.reference import assert_close_to_reference
from tests.conftest import _client_for

pytestmark = pytest.mark.gpu
LIMIT = 256 << 20


@pytest.fixture
async def limited() -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(backend="gpu", device_memory_limit_bytes=LIMIT, access_log=False, retry_after_s=3)
    async for client in _client_for(create_app(settings)):
        yield client


@pytest.mark.anyio
async def test_out_of_device_memory_is_a_503_and_the_next_product_succeeds(limited: httpx.AsyncClient) -> None:
    big = np.ones((6000, 6000), np.float32)  # 144 MB each: a, b and c pass the 256 MB pool limit
    files = {"a": ("a.npy", npy_bytes(big)), "b": ("b.npy", npy_bytes(big))}
    r = await limited.post("/matmul", params={"kernel": "cublas"}, files=files)
    assert r.status_code == 503, r.text
    assert r.json()["code"] == "device_out_of_memory" and r.headers["retry-after"] == "3"
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((512, 256)).astype(np.float32), rng.standard_normal((256, 128)).astype(np.float32)
    ok = await limited.post("/matmul", files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))})
    assert ok.status_code == 200, ok.text
    assert_close_to_reference(np.array(ok.json()["result"]), a, b, np.dtype(np.float32))


def test_a_sticky_cuda_error_is_answered_then_a_fresh_engine_serves_the_same_http_worker() -> None:
    port = free_port()
    env = {"MATMUL_BACKEND": "gpu", "MATMUL_FAULT_INJECTION": "true", "MATMUL_ACCESS_LOG": "false"}
    with running_server(uvicorn_command(port), port, env=env) as client:
        before = client.get("/v1/info").json()
        r = client.post("/matmul", params={"kernel": "fault_trap"}, json={"a": [[1.0]], "b": [[1.0]]})
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "device_lost"
        deadline = time.monotonic() + 120  # a hang guard: a fresh engine compiles every kernel again
        while (after := client.get("/v1/info").json())["state"] != "ready" or after["devices"][0][
            "engine_pid"
        ] == before["devices"][0]["engine_pid"]:
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
        assert after["http_worker_pid"] == before["http_worker_pid"]
        r = client.post("/matmul", json={"a": [[1, 2], [3, 4]], "b": [[5, 6], [7, 8]]})
        assert r.status_code == 200 and r.json()["result"] == [[19, 22], [43, 50]]
