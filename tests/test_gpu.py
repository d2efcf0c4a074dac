"""On the device: every kernel x dtype x shape against a float64 reference, and the service on the GPU backend."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from app.engine.base import CUBLAS, Plan
from kernels.registry import KERNELS, KernelSpec, LaunchConfig, cdiv
from tests.conftest import assert_product, load_npy, npy_bytes

pytestmark = pytest.mark.gpu

# (m, k, n): sizes that are not multiples of any tile, degenerate ones (1x1, 1xN, Nx1, k=1), and a big square.
SHAPES = [
    (1, 1, 1),
    (1, 64, 1),
    (1, 5, 300),
    (300, 5, 1),
    (17, 33, 9),
    (1000, 1, 1000),
    (4095, 4097, 31),
    (2048, 2048, 2048),
]
INSTANCES = [(spec, config) for spec in KERNELS.values() for config in spec.configs]
DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]


@pytest.fixture(scope="module")
def library() -> Any:
    from kernels.cuda import KernelLibrary

    return KernelLibrary()


def fitted(config: LaunchConfig, m: int, k: int, n: int) -> tuple[int, int, int]:
    """The shape, with k and n rounded up to what a vector instance accepts (the rest stay odd)."""
    return m, cdiv(k, config.k_multiple) * config.k_multiple, cdiv(n, config.n_multiple) * config.n_multiple


def operands(m: int, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)), rng.standard_normal((k, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize(("spec", "config"), INSTANCES, ids=[f"{s.name}-{c.label}" for s, c in INSTANCES])
def test_kernel_writes_every_element_correctly(
    library: Any, spec: KernelSpec, config: LaunchConfig, m: int, k: int, n: int, dtype: np.dtype
) -> None:
    import cupy as cp

    m, k, n = fitted(config, m, k, n)
    a, b = operands(m, k, n, seed=m * 31 + n)
    a_dev, b_dev = cp.asarray(a, dtype=dtype), cp.asarray(b, dtype=dtype)
    c_dev = cp.full((m, n), cp.nan, dtype=dtype)  # poison: an element the kernel skips stays NaN
    library.launch(spec, config, a_dev, b_dev, c_dev)
    cp.cuda.get_current_stream().synchronize()
    assert_product(cp.asnumpy(c_dev), a.astype(dtype), b.astype(dtype), dtype)


BATCHED = [(spec, config) for spec, config in INSTANCES if spec.batched]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("spec", "config"), BATCHED, ids=[f"{s.name}-{c.label}" for s, c in BATCHED])
def test_a_batched_launch_computes_every_product_of_the_batch(
    library: Any, spec: KernelSpec, config: LaunchConfig, dtype: np.dtype
) -> None:
    import cupy as cp

    m, k, n = fitted(config, 67, 45, 39)
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((5, m, k)), rng.standard_normal((5, k, n))
    c_dev = cp.full((5, m, n), cp.nan, dtype=dtype)
    library.launch(spec, config, cp.asarray(a, dtype=dtype), cp.asarray(b, dtype=dtype), c_dev)
    c = cp.asnumpy(c_dev)
    for i in range(5):
        assert_product(c[i], a[i].astype(dtype), b[i].astype(dtype), dtype)


def test_a_kernel_that_does_not_batch_refuses_a_batch(library: Any) -> None:
    import cupy as cp

    spec = KERNELS["fast"]
    config = spec.config_for(64, 64, 64, None)
    x = cp.ones((2, 64, 64), dtype=cp.float32)
    with pytest.raises(ValueError, match="not a batch of 2"):
        library.launch(spec, config, x, x, x)


@pytest.mark.parametrize("kernel", [CUBLAS, "tiled"])
def test_the_engine_path_batches(backend: Any, kernel: str) -> None:
    rng = np.random.default_rng(12)
    pairs = [(rng.standard_normal((33, 17)), rng.standard_normal((17, 9))) for _ in range(4)]
    plan = backend.plan(kernel, None, 33, 9, 17)
    products, timing = backend.multiply(pairs, np.dtype(np.float32), plan)
    for (a, b), c in zip(pairs, products, strict=True):
        assert_product(c, a, b, np.dtype(np.float32))
    assert timing.kernel_ms > 0


@pytest.fixture(scope="module")
def backend() -> Any:
    from app.engine.gpu import GpuBackend

    gpu = GpuBackend(0)
    gpu.prepare()
    return gpu


PLANS = [Plan(kernel=CUBLAS)] + [
    Plan(kernel=spec.name, tile=int(c.label) if spec.tiles else None, config=c) for spec, c in INSTANCES
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.kernel}-{p.config.label if p.config else ''}")
def test_the_engine_path_converts_stages_and_times(backend: Any, plan: Plan, dtype: np.dtype) -> None:
    m, k, n = fitted(plan.config, 129, 77, 65) if plan.config else (129, 77, 65)
    a = np.asfortranarray(np.random.default_rng(5).integers(-50, 50, (m, k)).astype(">i4"))
    b = np.random.default_rng(6).standard_normal((k, n)).astype(">f8")
    (c,), timing = backend.multiply([(a, b)], dtype, plan)
    assert c.dtype == dtype and c.flags.c_contiguous
    assert_product(c, a.astype(np.float64), b.astype(dtype), dtype)
    assert timing.kernel_ms > 0 and timing.h2d_ms > 0 and timing.d2h_ms > 0


@pytest.mark.parametrize("shape", [(0, 3, 4), (3, 4, 0), (3, 0, 4)])
def test_empty_products(backend: Any, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    (c,), _ = backend.multiply([(np.ones((m, k)), np.ones((k, n)))], np.dtype(np.float32), Plan(kernel=CUBLAS))
    np.testing.assert_array_equal(c, np.zeros((m, n), np.float32))


@pytest.mark.anyio
async def test_the_service_on_the_gpu_backend(gpu_client: httpx.AsyncClient) -> None:
    info = (await gpu_client.get("/v1/info")).json()
    assert info["backend"] == "gpu" and info["state"] == "ready"
    device = info["devices"][0]
    assert device["compute_capability"] and device["memory_total_bytes"] > 0 and device["state"] == "ready"
    listing = (await gpu_client.get("/v1/kernels")).json()
    names = [k["name"] for k in listing["kernels"]]
    assert {"auto", "naive", "tiled", "cublas", *KERNELS} == set(names)
    assert [choice["shape_class"] for choice in listing["auto"]] == ["small", "medium", "large", "huge"]
    for choice in listing["auto"]:
        assert set(choice["probe_ms"]) == set(names) - {"auto"}
        assert choice["probe_ms"][choice["kernel"]] == min(choice["probe_ms"].values())

    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((333, 257)).astype(np.float32), rng.standard_normal((257, 129)).astype(np.float32)
    files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))}
    for kernel in names:
        r = await gpu_client.post(
            "/matmul", params={"kernel": kernel}, files=files, headers={"accept": "application/x-npy"}
        )
        assert r.status_code == 200, r.text
        assert_product(load_npy(r.content), a, b, np.dtype(np.float32))
        assert r.headers["x-matmul-backend"] == "gpu" and r.headers["x-matmul-device"] in {
            d["name"] for d in info["devices"]
        }
    for tile in (8, 16, 32):
        r = await gpu_client.post(
            "/matmul", params={"kernel": "tiled", "tile": tile}, json={"a": a.tolist(), "b": b.tolist()}
        )
        assert r.json()["tile"] == tile and r.json()["kernel"] == "tiled"
        assert_product(np.array(r.json()["result"]), a, b, np.dtype(np.float32))
        assert r.json()["timing"]["kernel_ms"] > 0 and r.json()["gflops"] > 0
    r = await gpu_client.post("/matmul", params={"kernel": "tiled", "tile": 12}, json={"a": [[1]], "b": [[1]]})
    assert r.status_code == 422 and r.json()["code"] == "invalid_parameter"
