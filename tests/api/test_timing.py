"""The figures an answer reports, checked against a backend whose device times are known: Server-Timing equals the
body's `timing` (milliseconds), GFLOP/s is 2*m*n*k / kernel time, the roofline agrees with both; and the deadline a
request asks for is capped at MATMUL_REQUEST_TIMEOUT_S, seen in the deadline the engine is handed and in the 504
of a product held in the queue. Nothing here reads a clock: the device times are the backend's, the waits are
events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from app.config import Settings
from app.engine import DeviceTiming, DeviceWorker, LocalEngine
from app.errors import Overloaded
from app.main import create_app
from matmul_tools.bodies import load_npy, npy_bytes
from matmul_tools.service import wait_ready_async
from numerics.reference import assert_close_to_reference
from numerics.roofline import DevicePeaks
from tests.fakes import RecordingEngine, SteeredBackend, until

pytestmark = pytest.mark.anyio

KNOWN = DeviceTiming(h2d_ms=0.25, kernel_ms=0.002, d2h_ms=0.125)
"""What the backend says its device took, in milliseconds."""
PEAKS = DevicePeaks(flops_per_s={"float32": 2e12, "float64": 1e12, "bf16": 16e12}, dram_bytes_per_s=3e12)
M, K, N = 10, 30, 20
FLOPS = 2 * M * N * K
GFLOPS = FLOPS / (KNOWN.kernel_ms * 1e6)
"""12000 FLOPs in 2 microseconds: 6 GFLOP/s."""
GUARD_S = 30
"""How long a test waits for an answer it expects: only a hang guard, far longer than any of them takes."""


async def _serving(app: FastAPI, engine: LocalEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        app.state.engine = engine  # in place of the lifespan's, which the lifespan still stops
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await wait_ready_async(client, timeout_s=GUARD_S)
            yield client
        await engine.stop()


@pytest.fixture
async def known() -> AsyncIterator[httpx.AsyncClient]:
    engine = LocalEngine(DeviceWorker(SteeredBackend(KNOWN, PEAKS), queue_size=4))
    async for client in _serving(create_app(Settings(backend="cpu", access_log=False)), engine):
        yield client


def _operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(17)
    return rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)


def _server_timing(r: httpx.Response) -> dict[str, float]:
    """Server-Timing's durations by name: `kernel;dur=0.002, ...` -> {"kernel_ms": 0.002, ...}."""
    durations = {}
    for entry in r.headers["server-timing"].split(", "):
        name, _, value = entry.partition(";dur=")
        durations[f"{name}_ms"] = float(value)
    return durations


def _check_roofline(line: dict[str, float], kernel_ms: float, global_bytes: int) -> None:
    """The roofline of the M x K x N product of NumPy (A and B read once, C written once) in float32 at KNOWN's
    kernel time, on a device of PEAKS."""
    assert line["flops"] == FLOPS and global_bytes == (M * K + K * N + M * N) * 4
    assert line["intensity"] == pytest.approx(FLOPS / global_bytes, rel=1e-6)
    assert line["peak_gflops"] == pytest.approx(2000.0) and line["dram_gbps"] == pytest.approx(3000.0)
    assert line["peak_fraction"] == pytest.approx(GFLOPS / 2000.0, rel=1e-6)
    assert line["global_gbps"] == pytest.approx(global_bytes / (kernel_ms * 1e6), rel=1e-6)


async def test_a_json_answer_reports_the_device_times_in_milliseconds_in_its_body_and_server_timing(
    known: httpx.AsyncClient,
) -> None:
    a, b = _operands()
    r = await known.post("/matmul", json={"a": a.tolist(), "b": b.tolist()})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert_close_to_reference(np.array(doc["result"]), a, b, np.dtype(np.float32))
    timing = doc["timing"]
    assert (timing["h2d_ms"], timing["kernel_ms"], timing["d2h_ms"]) == (0.25, 0.002, 0.125)
    assert _server_timing(r) == pytest.approx({name: round(value, 3) for name, value in timing.items()}, abs=5e-4)
    assert doc["gflops"] == pytest.approx(GFLOPS, rel=1e-12) and r.headers["x-matmul-gflops"] == "6.000"
    _check_roofline(doc["roofline"], timing["kernel_ms"], doc["roofline"]["global_bytes"])


async def test_a_tensor_core_precision_is_rated_against_its_own_roof(known: httpx.AsyncClient) -> None:
    a, b = _operands()
    r = await known.post("/matmul?precision=bf16", json={"a": a.tolist(), "b": b.tolist()})
    assert r.status_code == 200, r.text
    line = r.json()["roofline"]
    assert line["peak_gflops"] == pytest.approx(16000.0)
    assert line["peak_fraction"] == pytest.approx(GFLOPS / 16000.0, rel=1e-6)


async def test_a_npy_answer_carries_the_same_figures_in_its_headers(known: httpx.AsyncClient) -> None:
    a, b = _operands()
    files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))}
    r = await known.post("/matmul", files=files, headers={"accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    assert_close_to_reference(load_npy(r.content), a, b, np.dtype(np.float32))
    durations = _server_timing(r)
    assert (durations["h2d_ms"], durations["kernel_ms"], durations["d2h_ms"]) == (0.25, 0.002, 0.125)
    assert durations["total_ms"] >= durations["read_ms"] + durations["decode_ms"] - 2e-3  # each rounded to 1 us
    assert float(r.headers["x-matmul-gflops"]) == pytest.approx(GFLOPS, abs=5e-4)
    line = {
        name: float(r.headers[f"x-matmul-roofline-{name.replace('_', '-')}"])
        for name in ("flops", "global_bytes", "intensity", "peak_gflops", "peak_fraction", "global_gbps", "dram_gbps")
    }
    _check_roofline(line, durations["kernel_ms"], int(line["global_bytes"]))


async def test_an_inference_answer_carries_them_in_its_parameters_and_server_timing(known: httpx.AsyncClient) -> None:
    a, b = _operands()
    inputs = [
        {"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}
        for name, x in (("A", a), ("B", b))
    ]
    r = await known.post("/v2/models/matmul/infer", json={"inputs": inputs})
    assert r.status_code == 200, r.text
    durations = _server_timing(r)
    assert (durations["h2d_ms"], durations["kernel_ms"], durations["d2h_ms"]) == (0.25, 0.002, 0.125)
    parameters = r.json()["parameters"]
    line = {name.removeprefix("roofline_"): value for name, value in parameters.items() if name.startswith("roofline_")}
    _check_roofline(line, durations["kernel_ms"], line["global_bytes"])


async def test_the_deadline_a_request_asks_for_is_capped_at_the_request_timeout() -> None:
    engine = RecordingEngine(DeviceWorker(SteeredBackend(KNOWN, PEAKS), queue_size=4))
    app = create_app(Settings(backend="cpu", request_timeout_s=2.5, access_log=False))
    async for client in _serving(app, engine):
        for sent in (None, "1", "2.5", "2.5001", "86400"):
            headers = {} if sent is None else {"x-request-timeout": sent}
            r = await client.post("/matmul", json={"a": [[2.0]], "b": [[3.0]]}, headers=headers)
            assert r.status_code == 200, r.text
    assert [deadline for _, deadline in engine.calls] == [2.5, 1.0, 2.5, 2.5, 2.5]


async def test_a_product_held_in_the_queue_gets_504_at_the_capped_deadline_not_the_one_asked_for() -> None:
    """A day asked for, a quarter of a second allowed: the product queued behind a held launch is dropped with 504
    once the settings' deadline passes (without the cap the test would hang until its guard)."""
    backend = SteeredBackend(KNOWN, PEAKS)
    backend.gate.clear()
    engine = LocalEngine(DeviceWorker(backend, queue_size=4))
    app = create_app(Settings(backend="cpu", request_timeout_s=0.25, access_log=False))
    async for client in _serving(app, engine):
        running = asyncio.create_task(client.post("/matmul", json={"a": [[1.0]], "b": [[1.0]]}))
        assert await asyncio.to_thread(backend.entered.acquire, True, GUARD_S)
        queued = client.post("/matmul", json={"a": [[2.0]], "b": [[3.0]]}, headers={"x-request-timeout": "86400"})
        late = await asyncio.wait_for(queued, GUARD_S)
        assert late.status_code == 504, late.text
        assert "still queued after its deadline of 0.25 s and was dropped" in late.json()["message"]
        backend.gate.set()
        assert (await asyncio.wait_for(running, GUARD_S)).json()["result"] == [[1.0]]


async def test_the_queue_holds_exactly_queue_size_products() -> None:
    """MATMUL_QUEUE_SIZE = 2: with one product on the device, two more wait and the third is 503 at once."""
    backend = SteeredBackend(KNOWN, PEAKS)
    backend.gate.clear()
    engine = LocalEngine(DeviceWorker(backend, queue_size=2))
    app = create_app(Settings(backend="cpu", retry_after_s=7, access_log=False))
    async for client in _serving(app, engine):
        products = [asyncio.create_task(client.post("/matmul", json={"a": [[1.0]], "b": [[1.0]]}))]
        assert await asyncio.to_thread(backend.entered.acquire, True, GUARD_S)
        for waiting, value in enumerate((2.0, 3.0), start=1):
            engine.check_room()  # room for one more
            products.append(asyncio.create_task(client.post("/matmul", json={"a": [[value]], "b": [[1.0]]})))
            await until(lambda depth=waiting: engine.queue_depth == depth, GUARD_S)
        with pytest.raises(Overloaded):
            engine.check_room()
        refused = await asyncio.wait_for(client.post("/matmul", json={"a": [[4.0]], "b": [[1.0]]}), GUARD_S)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "7"
        assert "queue is full (2 waiting)" in refused.json()["message"]
        backend.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(*products), GUARD_S)
        assert [r.json()["result"] for r in answers] == [[[1.0]], [[2.0]], [[3.0]]]
