"""On the device: every kernel x dtype x shape against a float64 reference (k = 0 included), the engine path with
its outputs NaN-poisoned and different operands for every kernel, and the service on the GPU backend."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest

from app.engine.base import Plan, ProductRequest
from kernels.catalogue import CUBLAS
from kernels.cublas import cublas_product
from kernels.emulation import EMULATIONS
from kernels.registry import KERNELS, KernelSpec, LaunchConfig, cdiv
from matmul_tools.bodies import load_npy, npy_bytes
from numerics.precision import FLOAT_PRECISIONS, Precision
from numerics.reference import Reference, assert_close_to_reference
from numerics.roofline import FMA_LANES
from tests.conftest import EDGE_SHAPES

pytestmark = pytest.mark.gpu

# (m, k, n): the edge shapes, k = 0 (no term to sum: every element an exact 0, where the output was NaN), a long k
# whose sides are not multiples of any tile, and a big square.
SHAPES = [
    *EDGE_SHAPES,
    (67, 0, 39),
    (4095, 4097, 31),
    (2048, 2048, 2048),
]
INSTANCES = [(spec, config) for spec in KERNELS.values() for config in spec.configs]
DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]


@pytest.fixture(scope="module")
def launcher() -> Any:
    from kernels.cuda import Launcher

    return Launcher()


def fitted(config: LaunchConfig, m: int, k: int, n: int) -> tuple[int, int, int]:
    """The shape, with k and n rounded up to what a vector instance accepts (the rest stay odd)."""
    return m, cdiv(k, config.k_multiple) * config.k_multiple, cdiv(n, config.n_multiple) * config.n_multiple


def _nothing() -> None:
    """on_done for launches whose result the test waits for at once."""


def operands(m: int, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)), rng.standard_normal((k, n))


def launch_and_check(launcher: Any, spec: KernelSpec, config: LaunchConfig, a: np.ndarray, b: np.ndarray) -> None:
    """One launch of the instance on a and b (of the working dtype) into an output poisoned with NaN, so that an
    element the kernel skips stays NaN, checked against the float64 product."""
    import cupy as cp

    c_dev = cp.full((a.shape[0], b.shape[1]), cp.nan, dtype=a.dtype)
    launcher.launch(spec.name, cp.asarray(a), cp.asarray(b), c_dev, config=config)
    cp.cuda.get_current_stream().synchronize()
    assert_close_to_reference(cp.asnumpy(c_dev), a, b, a.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize(("spec", "config"), INSTANCES, ids=[f"{s.name}-{c.label}" for s, c in INSTANCES])
def test_kernel_writes_every_element_correctly(
    launcher: Any, spec: KernelSpec, config: LaunchConfig, m: int, k: int, n: int, dtype: np.dtype
) -> None:
    m, k, n = fitted(config, m, k, n)
    a, b = operands(m, k, n, seed=m * 31 + n)
    launch_and_check(launcher, spec, config, a.astype(dtype), b.astype(dtype))


EMULATED = [(spec, config) for spec, config in INSTANCES if spec.name in EMULATIONS]


@pytest.mark.parametrize(("m", "k", "n"), [(67, 45, 39), (1, 300, 1), (130, 1000, 70)], ids=str)
@pytest.mark.parametrize(("spec", "config"), EMULATED, ids=[f"{s.name}-{c.label}" for s, c in EMULATED])
def test_the_cpu_emulation_gives_the_kernels_float32_bits(
    launcher: Any, spec: KernelSpec, config: LaunchConfig, m: int, k: int, n: int
) -> None:
    """float32: the emulation's single rounding per step is the kernel's FFMA, so the bits agree; float64 rounds
    once more per step than DFMA (kernels/emulation.py), so only the bound of the dtype is asserted."""
    import cupy as cp

    a, b = operands(m, k, n, seed=k)
    for dtype in DTYPES:
        a_typed, b_typed = a.astype(dtype), b.astype(dtype)
        c_dev = cp.full((m, n), cp.nan, dtype=dtype)
        launcher.launch(spec.name, cp.asarray(a_typed), cp.asarray(b_typed), c_dev, config=config)
        on_gpu, emulated = cp.asnumpy(c_dev), EMULATIONS[spec.name](a_typed, b_typed, config)
        if dtype == np.float32:
            np.testing.assert_array_equal(emulated, on_gpu)
        assert_close_to_reference(emulated, a_typed, b_typed, dtype)


BATCHED = [(spec, config) for spec, config in INSTANCES if spec.batched]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("spec", "config"), BATCHED, ids=[f"{s.name}-{c.label}" for s, c in BATCHED])
def test_a_batched_launch_computes_every_product_of_the_batch(
    launcher: Any, spec: KernelSpec, config: LaunchConfig, dtype: np.dtype
) -> None:
    import cupy as cp

    m, k, n = fitted(config, 67, 45, 39)
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((5, m, k)), rng.standard_normal((5, k, n))
    c_dev = cp.full((5, m, n), cp.nan, dtype=dtype)
    launcher.launch(spec.name, cp.asarray(a, dtype=dtype), cp.asarray(b, dtype=dtype), c_dev, config=config)
    c = cp.asnumpy(c_dev)
    for i in range(5):
        assert_close_to_reference(c[i], a[i].astype(dtype), b[i].astype(dtype), dtype)


def test_the_launcher_refuses_what_a_rung_does_not_compute(launcher: Any) -> None:
    """A precision an FMA kernel does not compute in, float64 in a tensor-core precision, a name not in the
    catalogue: each a ValueError before anything launches, never a product in another mode."""
    import cupy as cp

    x32, x64 = cp.ones((64, 64), dtype=cp.float32), cp.ones((64, 64), dtype=cp.float64)
    with pytest.raises(ValueError, match="'fast' does not compute float32 in precision tf32"):
        launcher.launch("fast", x32, x32, x32, precision=Precision.TF32)
    with pytest.raises(ValueError, match="'cublas' does not compute float64 in precision bf16"):
        launcher.launch(CUBLAS, x64, x64, x64, precision=Precision.BF16)
    with pytest.raises(ValueError, match="'strassen' does not run on this device"):
        launcher.launch("strassen", x32, x32, x32)
    i8, i32 = cp.ones((64, 64), dtype=cp.int8), cp.ones((64, 64), dtype=cp.int32)
    with pytest.raises(ValueError, match="'cublas' does not compute float32 in precision int8"):
        launcher.launch(CUBLAS, i8, i8, x32, precision=Precision.INT8)
    with pytest.raises(ValueError, match="int32 products take int8 operands, not float32, float32"):
        launcher.launch(CUBLAS, x32, x32, i32, precision=Precision.INT8)


@pytest.mark.parametrize(("seed", "kernel"), [(12, CUBLAS), (13, "tiled")])
def test_the_engine_path_batches(backend: Any, seed: int, kernel: str) -> None:
    rng = np.random.default_rng(seed)
    pairs = [(rng.standard_normal((33, 17)), rng.standard_normal((17, 9))) for _ in range(4)]
    plan = backend.plan(ProductRequest(33, 9, 17, kernel=kernel))
    products, timing = backend.submit(pairs, np.dtype(np.float32), plan, on_done=_nothing).result()
    for (a, b), c in zip(pairs, products, strict=True):
        assert_close_to_reference(c, a, b, np.dtype(np.float32))
    assert timing.kernel_ms > 0


def test_a_batch_in_pinned_memory_is_copied_from_and_into_where_it_lies(backend: Any) -> None:
    """The engine process's path: operands and products of every product at their own places in memory given to
    `pin`, each copied on its own, in order, between there and its part of the device's stack."""
    f32 = np.dtype(np.float32)
    m, k, n, count = 33, 17, 9, 5
    memory = np.zeros(count * (m * k + k * n + m * n) + 7, f32)  # 7: the places do not line up with the stack
    backend.pin(memory)
    try:
        rng = np.random.default_rng(21)
        places = iter(np.split(memory[7:], np.cumsum([m * k, k * n, m * n] * count)[:-1]))
        pairs, outputs = [], []
        for _ in range(count):
            a, b, c = next(places).reshape(m, k), next(places).reshape(k, n), next(places).reshape(m, n)
            a[:], b[:] = rng.standard_normal((m, k)), rng.standard_normal((k, n))
            pairs.append((a, b))
            outputs.append(c)
        products, _ = backend.submit(
            pairs, f32, backend.plan(ProductRequest(m, n, k, kernel=CUBLAS)), on_done=_nothing, outputs=outputs
        ).result()
        for (a, b), c, given in zip(pairs, products, outputs, strict=True):
            assert c is given
            assert_close_to_reference(c, a, b, f32)
        misshapen = [np.zeros((n, m), f32)]
        with pytest.raises(ValueError, match="C-contiguous float32 array of shape"):
            backend.submit(
                pairs[:1],
                f32,
                backend.plan(ProductRequest(m, n, k, kernel=CUBLAS)),
                on_done=_nothing,
                outputs=misshapen,
            )
    finally:
        backend.unpin(memory)


@pytest.fixture(scope="module")
def backend() -> Any:
    """The engine's GPU backend with its outputs NaN-poisoned before every launch: the pools hand the same blocks
    from launch to launch, so without it a kernel that wrote nothing would return what the block last held."""
    from app.engine.gpu import GpuBackend

    gpu = GpuBackend(0, poison_outputs=True)
    gpu.prepare()
    return gpu


def test_with_batching_auto_times_kernels_that_batch_on_a_batch_and_small_products_get_one() -> None:
    """With a batch of 32 allowed, the small class's probe times a kernel that batches on 32 products in one
    launch, per product: one of those is the fastest there (a launch per 256^3 product costs more than its share
    of a batched one), while `fast`, which cannot batch, is timed alone on every class."""
    from app.engine.gpu import GpuBackend

    gpu = GpuBackend(0, auto_batch=32)
    gpu.prepare()
    try:
        small = gpu.auto_choices()[0]
        assert small.shape_class.name == "small"
        assert gpu.batchable(gpu.plan(ProductRequest(256, 256, 256, kernel=small.kernel))), small.probe_ms
        assert small.probe_ms[small.kernel] < small.probe_ms["fast"]
    finally:
        gpu.close()


PLANS = [Plan(kernel=CUBLAS)] + [
    Plan(kernel=spec.name, tile=int(c.label) if spec.tiles else None, config=c) for spec, c in INSTANCES
]
PLAN_IDS = [f"{p.kernel}-{p.config.label if p.config else ''}" for p in PLANS]


def engine_shape(plan: Plan, m: int, k: int, n: int) -> tuple[int, int, int]:
    return fitted(plan.config, m, k, n) if plan.config else (m, k, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("seed", "plan"), list(enumerate(PLANS)), ids=PLAN_IDS)
def test_the_engine_path_converts_stages_and_times(backend: Any, seed: int, plan: Plan, dtype: np.dtype) -> None:
    """Each plan multiplies operands of its own (all of one shape): a kernel that left a reused block as the
    previous plan's product wrote would fail even without the poison."""
    m, k, n = engine_shape(plan, 129, 77, 65)
    rng = np.random.default_rng(seed)
    a = np.asfortranarray(rng.integers(-50, 50, (m, k)).astype(">i4"))
    b = rng.standard_normal((k, n)).astype(">f8")
    (c,), timing = backend.submit([(a, b)], dtype, plan, on_done=_nothing).result()
    assert c.dtype == dtype and c.flags.c_contiguous
    assert_close_to_reference(c, a, b, dtype)
    assert timing.kernel_ms > 0 and timing.h2d_ms > 0 and timing.d2h_ms > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_the_engine_path_gives_zeros_for_k_zero(backend: Any, plan: Plan, dtype: np.dtype) -> None:
    m, k, n = engine_shape(plan, 129, 0, 65)
    a, b = np.ones((m, k)), np.ones((k, n))
    (c,), _ = backend.submit([(a, b)], dtype, plan, on_done=_nothing).result()
    assert c.dtype == dtype and c.shape == (m, n)
    assert_close_to_reference(c, a, b, dtype)


def test_a_launch_that_writes_nothing_reads_as_nan_not_as_the_last_product(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the poison is for: the second launch gets the blocks the first one's product was in, and its kernel
    (replaced by nothing) writes no element."""
    f32 = np.dtype(np.float32)
    rng = np.random.default_rng(17)
    a, b = rng.standard_normal((96, 64)), rng.standard_normal((64, 80))
    (c,), _ = backend.submit([(a, b)], f32, Plan(kernel=CUBLAS), on_done=_nothing).result()
    assert_close_to_reference(c, a, b, f32)
    del c
    monkeypatch.setattr(backend, "_launch", lambda *launched: None)
    (unwritten,), _ = backend.submit([(a, b)], f32, Plan(kernel=CUBLAS), on_done=_nothing).result()
    assert np.isnan(unwritten).all()


def test_launches_in_flight_each_get_their_own_product(backend: Any) -> None:
    """Four launches queued on the streams before any is collected: no launch's buffers are handed to
    another while it still uses them."""
    rng = np.random.default_rng(14)
    f32 = np.dtype(np.float32)
    cases = [(CUBLAS, (256, 128, 64)), ("tiled", (100, 37, 3)), ("fast", (512, 512, 512)), ("naive", (1, 1, 1))]
    submitted = []
    for kernel, (m, k, n) in cases:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        launch = backend.submit([(a, b)], f32, backend.plan(ProductRequest(m, n, k, kernel=kernel)), on_done=_nothing)
        submitted.append((a, b, launch))
    for a, b, launch in submitted:
        (c,), _ = launch.result()
        assert_close_to_reference(c, a, b, f32)


def test_the_next_launch_copies_while_the_previous_one_computes(backend: Any) -> None:
    """The copy-in, compute and copy-out streams overlap: read from the launches' own events, not a clock."""
    import cupy

    f64 = np.dtype(np.float64)
    rng = np.random.default_rng(15)

    def operands(kernel: str, m: int, k: int, n: int) -> tuple[str, np.ndarray, np.ndarray]:
        return kernel, rng.standard_normal((m, k)), rng.standard_normal((k, n))

    def submit(kernel: str, a: np.ndarray, b: np.ndarray) -> Any:
        (m, k), n = a.shape, b.shape[1]
        return backend.submit([(a, b)], f64, backend.plan(ProductRequest(m, n, k, "float64", kernel)), on_done=_nothing)

    def ms(origin: Any, event: Any) -> float:
        return float(cupy.cuda.get_elapsed_time(origin, event))

    def warm(*jobs: tuple[str, np.ndarray, np.ndarray]) -> None:
        """Run the launches once, keeping nothing, so that the measured ones find their pinned buffers pooled
        (a fresh cudaHostAlloc of 32 MB takes milliseconds and would delay the next submit)."""
        for launch in [submit(*job) for job in jobs]:
            launch.result()

    # operands drawn before the launches: drawing 2 x 64K normals between two submits takes a millisecond or two,
    # as long as the copy out the second kernel must start under
    slow_job, quick_job = operands("naive", 2048, 2048, 2048), operands(CUBLAS, 8, 8, 8)
    warm(slow_job, quick_job)
    slow, quick = submit(*slow_job), submit(*quick_job)
    for launch in (slow, quick):
        launch.result()
    # the small product's copy in finished while the long kernel before it still ran
    assert ms(slow.events.copy_in, quick.events.copied_in) < ms(slow.events.copy_in, slow.events.launched)
    del slow, quick, launch
    first_job, second_job = operands("naive", 4096, 16, 4096), operands("naive", 4096, 16, 4096)
    warm(first_job, second_job)
    first, second = submit(*first_job), submit(*second_job)
    for launch in (first, second):
        launch.result()
    # 128 MB of the first product were still being copied out when the second kernel began
    assert ms(first.events.copy_in, second.events.launch) < ms(first.events.copy_in, first.events.copied_out)


def test_no_thread_spins_while_a_launch_runs(backend: Any) -> None:
    """The watcher thread sleeps in its wait for a launch: the process's CPU time over the wait is a small part of
    it, where a spinning wait on the event would take one core for all of it."""
    f64 = np.dtype(np.float64)
    rng = np.random.default_rng(16)
    a, b = rng.standard_normal((4096, 4096)), rng.standard_normal((4096, 4096))
    plan = backend.plan(ProductRequest(4096, 4096, 4096, "float64", "naive"))
    backend.submit([(a, b)], f64, plan, on_done=_nothing).result()  # pinned buffers pooled, the kernel loaded
    called_back = threading.Event()
    launch = backend.submit([(a, b)], f64, plan, on_done=called_back.set)
    cpu_began, wall_began = time.process_time(), time.perf_counter()
    assert called_back.wait(timeout=60)
    cpu_s, wall_s = time.process_time() - cpu_began, time.perf_counter() - wall_began
    (c,), timing = launch.result()
    assert timing.kernel_ms > 20, f"the naive float64 product took {timing.kernel_ms:.1f} ms: too short to tell"
    assert cpu_s < 0.25 * wall_s, f"{cpu_s * 1e3:.0f} ms of CPU over a wait of {wall_s * 1e3:.0f} ms"
    assert_close_to_reference(c, a, b, f64)


def _two_launches_in_flight(backend: Any, plan: Plan, a: np.ndarray, b: np.ndarray) -> None:
    launches = [backend.submit([(a, b)], np.dtype(np.float32), plan, on_done=_nothing) for _ in range(2)]
    for launch in launches:
        (c,), _ = launch.result()
        assert_close_to_reference(c, a, b, np.dtype(np.float32))


def test_after_the_first_launches_pinned_buffers_are_reused(backend: Any) -> None:
    import cupy

    allocated: list[int] = []

    def counting_allocator(size: int) -> Any:
        allocated.append(size)
        return cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(size), 0)

    pool = cupy.cuda.PinnedMemoryPool(counting_allocator)
    cupy.cuda.set_pinned_memory_allocator(pool.malloc)
    try:
        rng = np.random.default_rng(16)
        a, b = rng.standard_normal((512, 384)), rng.standard_normal((384, 256))
        plan = backend.plan(ProductRequest(512, 256, 384, kernel=CUBLAS))
        _two_launches_in_flight(backend, plan, a, b)
        assert len(allocated) == 6  # A, B and C of each launch in flight
        for _ in range(10):
            _two_launches_in_flight(backend, plan, a, b)
        assert len(allocated) == 6
    finally:
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
        pool.free_all_blocks()


@pytest.mark.parametrize("shape", [(0, 3, 4), (3, 4, 0), (3, 0, 4)])
def test_empty_products(backend: Any, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    (c,), _ = backend.submit(
        [(np.ones((m, k)), np.ones((k, n)))], np.dtype(np.float32), Plan(kernel=CUBLAS), on_done=_nothing
    ).result()
    np.testing.assert_array_equal(c, np.zeros((m, n), np.float32))


def test_the_device_attributes_give_the_roofs(backend: Any) -> None:
    """Clocks, bus width and SM count are read with cudaDeviceGetAttribute (CUDA 13's cudaDeviceProp lacks the
    clocks); an H100 SXM gives 66.9 TFLOP/s float32, 33.5 float64 and about 3.35 TB/s."""
    import cupy

    properties = cupy.cuda.runtime.getDeviceProperties(0)
    described = backend.describe()
    assert described["clock_khz"] > 0 and described["memory_clock_khz"] > 0 and described["memory_bus_width_bits"] > 0
    assert backend.peaks.dram_bytes_per_s > 1e11 and described["dram_gbps"] > 100
    if (properties["major"], properties["minor"]) in FMA_LANES:
        assert backend.peaks.flops_per_s["float32"] > 1e12 and backend.peaks.flops_per_s["float64"] > 0
        assert described["peak_gflops"]["float32"] > 1000


@pytest.mark.anyio
async def test_the_service_on_the_gpu_backend(gpu_client: httpx.AsyncClient) -> None:
    info = (await gpu_client.get("/v1/info")).json()
    assert info["backend"] == "gpu" and info["state"] == "ready"
    device = info["devices"][0]
    assert device["compute_capability"] and device["memory_total_bytes"] > 0 and device["state"] == "ready"
    listing = (await gpu_client.get("/v1/kernels")).json()
    # the fp32 kernels of float32 products; the tensor-core kernels are tests/kernels/test_tensor_core_gpu.py's
    names = [k["name"] for k in listing["kernels"] if "fp32" in k["precisions"] and "float32" in k["dtypes"]]
    assert {"auto", "naive", "tiled", "cublas", *KERNELS} == set(names)
    fp32_choices = [c for c in listing["auto"] if c["precision"] == "fp32" and c["dtype"] == "float32"]
    assert [choice["shape_class"] for choice in fp32_choices] == ["small", "medium", "large", "huge"]
    for choice in listing["auto"]:
        assert choice["probe_ms"][choice["kernel"]] == min(choice["probe_ms"].values())
    for choice in fp32_choices:
        assert set(choice["probe_ms"]) == set(names) - {"auto"}

    rng = np.random.default_rng(9)

    def operands() -> tuple[np.ndarray, np.ndarray]:
        """Different for every request, so that no kernel can pass with a product an earlier one left behind."""
        return rng.standard_normal((333, 257)).astype(np.float32), rng.standard_normal((257, 129)).astype(np.float32)

    for kernel in names:
        a, b = operands()
        files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))}
        r = await gpu_client.post(
            "/matmul", params={"kernel": kernel}, files=files, headers={"accept": "application/x-npy"}
        )
        assert r.status_code == 200, r.text
        assert_close_to_reference(load_npy(r.content), a, b, np.dtype(np.float32))
        assert r.headers["x-matmul-backend"] == "gpu" and r.headers["x-matmul-device"] in {
            d["name"] for d in info["devices"]
        }
        assert float(r.headers["x-matmul-roofline-peak-fraction"]) > 0
        assert float(r.headers["x-matmul-roofline-dram-gbps"]) == pytest.approx(device["dram_gbps"], rel=1e-5)
    for tile in (8, 16, 32):
        a, b = operands()
        r = await gpu_client.post(
            "/matmul", params={"kernel": "tiled", "tile": tile}, json={"a": a.tolist(), "b": b.tolist()}
        )
        assert r.json()["tile"] == tile and r.json()["kernel"] == "tiled"
        assert_close_to_reference(np.array(r.json()["result"]), a, b, np.dtype(np.float32))
        assert r.json()["timing"]["kernel_ms"] > 0 and r.json()["gflops"] > 0
        line, config = r.json()["roofline"], KERNELS["tiled"].config_for(333, 129, 257, tile)
        assert line["global_bytes"] == 4 * config.global_elements(333, 129, 257)
        assert line["peak_gflops"] == pytest.approx(device["peak_gflops"]["float32"])
        assert 0 < line["peak_fraction"] < 1
    r = await gpu_client.post("/matmul", params={"kernel": "tiled", "tile": 12}, json={"a": [[1]], "b": [[1]]})
    assert r.status_code == 422 and r.json()["code"] == "invalid_parameter"


@pytest.mark.parametrize("precision", FLOAT_PRECISIONS)
@pytest.mark.parametrize(("m", "k", "n"), [(256, 256, 256), (17, 33, 9), (1, 5, 300), (1000, 1, 1000), (300, 4099, 65)])
def test_cublas_in_each_precision_is_within_its_bound(precision: Precision, m: int, k: int, n: int) -> None:
    """The library every tensor-core rung is measured against, checked as the rungs will be: every element of an
    output poisoned with NaN within the precision's bound (numerics/precision.py)."""
    import cupy as cp

    rng = cp.random.default_rng(m + k + n)
    a, b = rng.standard_normal((m, k), dtype=cp.float32), rng.standard_normal((k, n), dtype=cp.float32)
    c = cp.full((m, n), cp.nan, dtype=cp.float32)
    cublas_product(a, b, c, precision)
    problem = Reference.of(a, b, np.float32, precision).mismatch(c)
    assert problem is None, problem


def test_the_precisions_errors_are_in_their_order() -> None:
    """At 1024^3 on standard normal operands: fp32 < 3xtf32 < tf32 and fp16 < bf16, relative to the float64 product."""
    import cupy as cp

    rng = cp.random.default_rng(7)
    a, b = rng.standard_normal((1024, 1024), dtype=cp.float32), rng.standard_normal((1024, 1024), dtype=cp.float32)
    reference = Reference.of(a, b, np.float32)
    errors = {}
    for precision in FLOAT_PRECISIONS:
        c = cp.empty((1024, 1024), cp.float32)
        cublas_product(a, b, c, precision)
        errors[precision] = reference.relative_error(c)
    assert errors[Precision.FP32] < errors[Precision.TF32X3] < errors[Precision.TF32] < errors[Precision.BF16]
    assert errors[Precision.FP16] < errors[Precision.BF16]


def test_the_precisions_device_conversions_round_as_the_array_ones() -> None:
    import cupy as cp

    from kernels.cublas import _device_conversion
    from numerics.precision import bf16_bits, split_tf32

    rng = np.random.default_rng(65)
    x = (rng.standard_normal(1 << 20) * 10.0 ** rng.integers(-30, 30, 1 << 20)).astype(np.float32)
    x[:4] = [np.inf, -np.inf, np.nan, np.finfo(np.float32).max]
    on_device = cp.asarray(x)
    np.testing.assert_array_equal(cp.asnumpy(_device_conversion("bf16_bits")(on_device)), bf16_bits(x))
    big, small = _device_conversion("split_tf32")(on_device)
    expected_big, expected_small = split_tf32(x)
    np.testing.assert_array_equal(cp.asnumpy(big), expected_big)
    subnormal = np.abs(expected_small) < np.finfo(np.float32).tiny  # the device flushes these to zero
    np.testing.assert_array_equal(cp.asnumpy(small), np.where(subnormal, np.float32(0), expected_small))


def test_a_launcher_compiles_once_and_the_next_loads_what_it_kept(tmp_path: Any) -> None:
    """The first Launcher on an empty cache compiles every program its device loads; a second one, on the same
    cache, compiles none, and what it loaded computes the same products."""
    import cupy

    from kernels.binaries import KernelBinaries
    from kernels.cuda import Launcher, programs_on

    major, minor = divmod(int(cupy.cuda.Device().compute_capability), 10)
    cold = Launcher(KernelBinaries(cache=tmp_path, shipped=tmp_path / "none"))
    assert cold.binaries.compiled == len(programs_on((major, minor)))
    warm = Launcher(KernelBinaries(cache=tmp_path, shipped=tmp_path / "none"))
    assert warm.binaries.compiled == 0
    a, b = operands(67, 48, 40, seed=3)
    modes = [(r.name, p) for r in warm.rungs for p in FLOAT_PRECISIONS if r.computes("float32", p)]
    assert {rung.launcher for rung in warm.rungs if rung.name in dict(modes)} >= {"fma", "cublas"}
    for kernel, precision in modes:
        products = []
        for launcher in (cold, warm):
            c = cupy.empty((67, 40), np.float32)
            a_device, b_device = cupy.asarray(a, np.float32), cupy.asarray(b, np.float32)
            launcher.launch(kernel, a_device, b_device, c, precision=precision)
            products.append(c.get())
        assert_close_to_reference(products[1], a, b, "float32", precision)
        np.testing.assert_array_equal(products[0], products[1], err_msg=f"{kernel} in {precision}")
