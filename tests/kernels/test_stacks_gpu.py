"""Stacks of products on the device (app/shapes.py): every rung that takes stacks, in every dtype and precision it
computes in, on stacks, a matrix or a stack of one broadcast on either side, B = 1, B = 0 and degenerate matrices,
each element against the float64 product of its own matrices on an output poisoned beforehand; the rungs that do
not take stacks refused by the launcher and by the plan, naming those that do; and stacks through the service on
the GPU backend, every encoding's answer checked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from app.engine.base import Plan, ProductRequest
from app.errors import InvalidParameter, ShapeMismatch
from app.shapes import result_shape
from kernels.catalogue import CUBLAS, RUNGS
from kernels.registry import KERNELS, KernelSpec, LaunchConfig, cdiv
from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, load_npy, multipart_body, npy_bytes
from numerics.precision import INT8_PRODUCT, Precision, operand_dtype
from numerics.reference import assert_close_to_reference

pytestmark = pytest.mark.gpu

M, K, N = 33, 20, 12
"""One matrix's shape: no side a multiple of a tile, k a multiple of 4 (cuBLAS's int8 GEMM)."""
BATCH = 5
# (a's leading dimensions, b's): a stack on both sides, a matrix or a stack of one broadcast on either side
PAIRINGS = [((BATCH,), (BATCH,)), ((BATCH,), ()), ((), (BATCH,)), ((1,), (BATCH,)), ((BATCH,), (1,)), ((1,), (1,))]
PAIRING_IDS = ["stacks", "b-matrix", "a-matrix", "a-one", "b-one", "both-one"]
BATCHED = [(spec, config) for spec in KERNELS.values() if spec.batched for config in spec.configs]
CUBLAS_MODES = RUNGS[CUBLAS].modes()


def _nothing() -> None:
    """on_done for launches whose result the test waits for at once."""


def stack_operands(
    lead_a: tuple[int, ...], lead_b: tuple[int, ...], m: int, k: int, n: int, dtype: str, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Operands of (*lead_a, m, k) and (*lead_b, k, n) in the operand dtype of `dtype` products."""
    rng = np.random.default_rng(seed)
    if dtype == INT8_PRODUCT:
        return rng.integers(-128, 128, (*lead_a, m, k), np.int8), rng.integers(-128, 128, (*lead_b, k, n), np.int8)
    operands = rng.standard_normal((*lead_a, m, k)), rng.standard_normal((*lead_b, k, n))
    return operands[0].astype(dtype), operands[1].astype(dtype)


def launch_stack(launcher: Any, kernel: str, a: np.ndarray, b: np.ndarray, dtype: str, **how: Any) -> np.ndarray:
    """One launch of `kernel` on the stack a @ b into an output poisoned first (NaN, or int32's least value, which
    no sum of int8 products reaches), copied back."""
    import cupy as cp

    shape = result_shape(a, b)
    poison = np.iinfo(np.int32).min if dtype == INT8_PRODUCT else np.nan
    c_dev = cp.full(shape, poison, dtype=dtype)
    launcher.launch(kernel, cp.asarray(a), cp.asarray(b), c_dev, **how)
    return cp.asnumpy(c_dev)


@pytest.fixture(scope="module")
def launcher() -> Any:
    from kernels.cuda import Launcher

    return Launcher()


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    from app.engine.gpu import GpuBackend

    gpu = GpuBackend(0, poison_outputs=True)
    gpu.prepare()
    yield gpu
    gpu.close()


@pytest.mark.parametrize(("lead_a", "lead_b"), PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize(("dtype", "precision"), CUBLAS_MODES, ids=[f"{d}-{p}" for d, p in CUBLAS_MODES])
def test_cublas_computes_a_stack_in_every_mode_in_one_call(
    launcher: Any, dtype: str, precision: Precision, lead_a: tuple[int, ...], lead_b: tuple[int, ...]
) -> None:
    a, b = stack_operands(lead_a, lead_b, M, K, N, dtype, seed=len(lead_a) * 7 + len(lead_b))
    c = launch_stack(launcher, CUBLAS, a, b, dtype, precision=precision)
    assert_close_to_reference(c, a, b, dtype, precision)


@pytest.mark.parametrize(("lead_a", "lead_b"), PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("spec", "config"), BATCHED, ids=[f"{s.name}-{c.label}" for s, c in BATCHED])
def test_an_fma_kernel_that_batches_computes_a_stack_in_one_launch(
    launcher: Any,
    spec: KernelSpec,
    config: LaunchConfig,
    dtype: str,
    lead_a: tuple[int, ...],
    lead_b: tuple[int, ...],
) -> None:
    k, n = (cdiv(side, multiple) * multiple for side, multiple in ((K, config.k_multiple), (N, config.n_multiple)))
    a, b = stack_operands(lead_a, lead_b, M, k, n, dtype, seed=3)
    c = launch_stack(launcher, spec.name, a, b, dtype, config=config)
    assert_close_to_reference(c, a, b, dtype)


@pytest.mark.parametrize("kernel", [CUBLAS, *(spec.name for spec in KERNELS.values() if spec.batched)])
def test_a_broadcast_matrix_is_read_where_it_lies_not_copied_into_a_stack(launcher: Any, kernel: str) -> None:
    """A matrix shared by a stack of 4,096 products costs no device memory of its own: the launch allocates nothing
    (a copy into a stack would take 4,096 times the matrix), and every product is still its own."""
    import cupy as cp

    batch, m, k, n = 4096, 1, 64, 64
    a, b = stack_operands((batch,), (), m, k, n, "float32", seed=11)
    a_dev, b_dev = cp.asarray(a), cp.asarray(b)
    c_dev = cp.full((batch, m, n), np.nan, dtype=np.float32)
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()  # so that a copy could not reuse a block freed by an earlier test unseen
    held = pool.total_bytes()
    launcher.launch(kernel, a_dev, b_dev, c_dev)
    assert pool.total_bytes() == held
    assert_close_to_reference(cp.asnumpy(c_dev), a, b, "float32")


@pytest.mark.parametrize("kernel", [name for name, rung in RUNGS.items() if not rung.stacks])
def test_the_launcher_refuses_a_stack_to_a_rung_that_computes_one_product_a_launch(launcher: Any, kernel: str) -> None:
    import cupy as cp

    if not launcher.runs(kernel):
        pytest.skip(f"{kernel} does not run on this device")
    dtype, precision = RUNGS[kernel].modes()[0]
    x = cp.ones((2, 64, 64), dtype=operand_dtype(np.dtype(dtype)))
    with pytest.raises(ValueError, match=f"'{kernel}' computes one product a launch, not a stack"):
        launcher.launch(kernel, x, x, cp.empty((2, 64, 64), dtype), precision=precision)


def test_the_plan_of_a_stack_names_the_kernels_that_take_stacks(backend: Any) -> None:
    """A rung that does not take stacks is refused naming those that do; a precision no such rung computes in, and
    int8 stacks of a k cuBLAS's GEMM does not take, say so; auto picks a kernel that takes stacks."""
    stack = ProductRequest(64, 64, 64, batch=10)
    for rung in (r for r in RUNGS.values() if not r.stacks and r.runs_on(backend._compute_capability)):
        with pytest.raises(InvalidParameter, match=f"kernel '{rung.name}' computes one product a launch") as refused:
            backend.plan(ProductRequest(64, 64, 64, rung.dtypes[0], rung.name, batch=10))
        assert refused.value.location == ["kernel"] and CUBLAS in str(refused.value) and "tiled" in str(refused.value)
    assert RUNGS[backend.plan(stack).kernel].stacks
    for precision in (Precision.TF32, Precision.BF16):
        assert backend.plan(ProductRequest(64, 64, 64, precision=precision, batch=10)).kernel == CUBLAS
    if backend._tensor_core_rungs():
        with pytest.raises(InvalidParameter, match="no kernel on this device computes a stack of float32 products in"):
            backend.plan(ProductRequest(64, 64, 64, precision=Precision.FP8, batch=10))
    with pytest.raises(InvalidParameter, match="no kernel here computes int8 stacks of other k"):
        backend.plan(ProductRequest(64, 64, 63, INT8_PRODUCT, precision=Precision.INT8, batch=10))


@pytest.mark.parametrize(
    ("lead_a", "lead_b"), [*PAIRINGS, ((0,), (0,)), ((0,), ())], ids=[*PAIRING_IDS, "B=0", "B=0-b"]
)
@pytest.mark.parametrize("kernel", [CUBLAS, "tiled", "blocktile2d"])
def test_the_engine_path_stages_launches_and_answers_a_stack(
    backend: Any, kernel: str, lead_a: tuple[int, ...], lead_b: tuple[int, ...]
) -> None:
    """Operands in another dtype and byte order, staged into pinned memory; the answer one array of the whole
    stack's shape; an empty stack answered without a launch."""
    a, b = stack_operands(lead_a, lead_b, 67, 45, 39, "float64", seed=5)
    a, b = a.astype(">f8"), np.asfortranarray(b)
    request = ProductRequest.of(a, b, np.float32, kernel)
    plan = backend.plan(request)
    (c,), timing = backend.submit([(a, b)], np.dtype(np.float32), plan, on_done=_nothing).result()
    assert c.shape == request.shape.result and c.dtype == np.float32
    assert_close_to_reference(c, a, b, np.float32)
    assert (timing.kernel_ms > 0) == (c.size > 0)


@pytest.mark.parametrize(("m", "k", "n"), [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_a_stack_of_degenerate_matrices_is_answered_as_numpy_answers_it(backend: Any, m: int, k: int, n: int) -> None:
    a, b = np.ones((3, m, k)), np.ones((3, k, n))
    plan = backend.plan(ProductRequest.of(a, b, np.float32, CUBLAS))
    (c,), _ = backend.submit([(a, b)], np.dtype(np.float32), plan, on_done=_nothing).result()
    np.testing.assert_array_equal(c, np.matmul(a, b))


@pytest.mark.anyio
async def test_the_service_on_the_gpu_backend_answers_stacks(gpu_client: httpx.AsyncClient) -> None:
    """JSON and .npy stacks through the app on the GPU backend; GET /v1/kernels says which kernels take stacks, and
    a stack asking for one that does not is a 422 naming those that do."""
    listing = (await gpu_client.get("/v1/kernels")).json()["kernels"]
    takes = {kernel["name"]: kernel["stacks"] for kernel in listing}
    assert takes[CUBLAS] and takes["tiled"] and not takes["fast"]
    a, b = stack_operands((BATCH,), (), 33, 20, 12, "float32", seed=8)
    r = await gpu_client.post("/matmul", json={"a": a.tolist(), "b": b.tolist()})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["shape"] == [BATCH, 33, 12] and doc["batch_size"] == BATCH and takes[doc["kernel"]]
    assert_close_to_reference(np.array(doc["result"], np.float32), a, b, np.float32)
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(np.stack([b] * BATCH)))])
    headers = {"content-type": MULTIPART_CONTENT_TYPE, "accept": "application/x-npy"}
    r = await gpu_client.post("/matmul?kernel=tiled", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert_close_to_reference(load_npy(r.content), a, b, np.float32)
    r = await gpu_client.post("/matmul?kernel=fast", content=body, headers=headers)
    assert r.status_code == 422, r.text
    assert "'fast' computes one product a launch" in r.json()["message"] and r.json()["location"] == ["kernel"]


def test_a_plan_from_a_stack_request_carries_the_stack(backend: Any) -> None:
    """The stack's size reaches the plan's grid check: a batch past CUDA's 65535 blocks along z is refused for an
    FMA kernel, naming cuBLAS, which takes it."""
    plan = backend.plan(ProductRequest(8, 8, 8, kernel="tiled", batch=65_535))
    assert isinstance(plan, Plan) and plan.kernel == "tiled"
    with pytest.raises(ShapeMismatch, match="over CUDA's 65535 blocks along z; 'cublas' can"):
        backend.plan(ProductRequest(8, 8, 8, kernel="tiled", batch=65_536))
    assert backend.plan(ProductRequest(8, 8, 8, batch=65_536)).kernel == CUBLAS  # auto: among those that can


def test_an_empty_int8_stack_is_planned_whatever_its_k(backend: Any) -> None:
    """No products, no GEMM call: cuBLAS's rule on k does not apply (as for a matrix with no elements)."""
    request = ProductRequest(64, 64, 63, INT8_PRODUCT, precision=Precision.INT8, batch=0)
    assert backend.plan(request).kernel == CUBLAS
