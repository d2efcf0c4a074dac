"""The CPU emulations of naive.cu and tiled.cu: correct on every shape the GPU kernels take, with their rounding."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.base import ProductRequest
from app.engine.cpu import CpuBackend
from app.errors import ShapeMismatch
from kernels.emulation import EMULATIONS
from kernels.registry import KERNELS, MAX_GRID_Y, LaunchConfig
from numerics.reference import assert_close_to_reference
from tests.conftest import EDGE_SHAPES

# (m, k, n): the edge shapes every kernel is checked on, the self-test's, a k that spans several tiles, and empty
# dimensions.
SHAPES = [
    *EDGE_SHAPES,
    (67, 45, 39),
    (130, 257, 70),
    (0, 3, 4),
    (3, 0, 4),
    (3, 4, 0),
]
INSTANCES = [("naive", KERNELS["naive"].configs[0])] + [("tiled", c) for c in KERNELS["tiled"].configs]
IDS = [f"{name}-{config.label}" for name, config in INSTANCES]
DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES, ids=str)
@pytest.mark.parametrize(("name", "config"), INSTANCES, ids=IDS)
def test_the_emulation_computes_the_product(
    name: str, config: LaunchConfig, m: int, k: int, n: int, dtype: np.dtype
) -> None:
    rng = np.random.default_rng(m * 31 + n)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    c = EMULATIONS[name](a, b, config)
    assert c.shape == (m, n) and c.dtype == dtype and c.flags.c_contiguous
    if k == 0:
        np.testing.assert_array_equal(c, np.zeros((m, n)))
    elif m and n:
        assert_close_to_reference(c, a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiling_changes_where_operands_come_from_not_the_rounding(dtype: np.dtype) -> None:
    """Each thread of tiled.cu runs the same FMAs as naive.cu's, in the same k order (the zero padding adds
    fma(0, 0, acc) = acc), so both give the same bits for every tile."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((45, 77)).astype(dtype), rng.standard_normal((77, 29)).astype(dtype)
    naive = EMULATIONS["naive"](a, b, KERNELS["naive"].configs[0])
    for config in KERNELS["tiled"].configs:
        np.testing.assert_array_equal(EMULATIONS["tiled"](a, b, config), naive)


@pytest.mark.parametrize(("name", "config"), INSTANCES, ids=IDS)
def test_a_float32_step_rounds_once_as_the_gpus_fma(name: str, config: LaunchConfig) -> None:
    """-(1 + 2^-11) + (1 + 2^-12)^2 is 2^-24 exactly. A fused multiply-add keeps it; rounding the product to
    float32 first (to 1 + 2^-11, the 2^-24 being half an ulp, ties to even) would give 0."""
    a = np.array([[-(1 + 2**-11), 1 + 2**-12]], np.float32)
    b = np.array([[1.0], [1 + 2**-12]], np.float32)
    assert EMULATIONS[name](a, b, config)[0, 0] == np.float32(2**-24)


@pytest.mark.parametrize("name", sorted(EMULATIONS))
def test_the_cpu_backend_refuses_a_shape_its_kernels_grid_cannot_cover(name: str) -> None:
    """As the GPU backend refuses it: more rows than CUDA's 65535 blocks along y take, whatever the tile."""
    rows = MAX_GRID_Y * max(config.tile_m for config in KERNELS[name].configs) + 1
    with pytest.raises(ShapeMismatch, match=rf"^kernel '{name}' cannot cover this shape: config \S+: {rows} rows"):
        CpuBackend("tests").plan(ProductRequest(m=rows, n=1, k=1, kernel=name))


@pytest.mark.parametrize("name", list(EMULATIONS))
def test_the_cpu_backend_plans_a_stack_past_the_grid_s_z_limit(name: str) -> None:
    """The emulations multiply a stack matrix by matrix, so no grid holds its products: a stack of more than the
    GPU's MAX_GRID_Y products is planned (on the GPU the FMA kernels refuse it and cuBLAS takes it)."""
    plan = CpuBackend("tests").plan(ProductRequest(m=1, n=1, k=1, kernel=name, batch=MAX_GRID_Y + 1))
    assert plan.kernel == name
