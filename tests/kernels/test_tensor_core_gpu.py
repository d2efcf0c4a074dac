"""On an H100 or H200: kernels/wgmma.cu and kernels/mma_sync.cu in each of their tensor-core precisions against a
float64 product, within the bound numerics/precision.py derives per mode, and kernels/dmma.cu's float64 products within
float64's, on square, odd and degenerate shapes; kernels/operands.cu's conversions bit for bit against
numerics/precision.py's (FP8's scales and e4m3 rounding too); own 3xTF32 as accurate as SGEMM, own FP8 as cuBLASLt;
and the service running them."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from kernels import tensorcore
from kernels.registry import KERNELS
from numerics.precision import (
    E4M3_LARGEST,
    Precision,
    bf16_bits,
    emulate,
    scaled_e4m3,
    split_tf32,
    to_fp16,
    to_tf32,
)
from numerics.reference import Reference
from tests.conftest import EDGE_SHAPES

pytestmark = pytest.mark.gpu

TENSOR_CORE_PRECISIONS = list(tensorcore.WGMMA_CONFIGS)
KERNEL_PRECISIONS = [(tensorcore.WGMMA, precision) for precision in tensorcore.WGMMA_CONFIGS] + [
    (tensorcore.MMA_SYNC, precision) for precision in tensorcore.MMA_SYNC_CONFIGS if precision is not Precision.INT8
]
"""Every kernel and float precision: int8's exact products are tested apart."""
INT8_KERNELS = [tensorcore.WGMMA, tensorcore.MMA_SYNC]
# the edge shapes; k = 0; k a multiple of 4 (TF32 reads A as it is) and not; several tiles with ragged edges
SHAPES = [*EDGE_SHAPES, (67, 0, 39), (256, 256, 256), (129, 4099, 257), (1000, 1024, 999), (2048, 2048, 2048)]


@pytest.fixture(scope="module")
def launcher() -> Any:
    from kernels.cuda import Launcher

    launcher = Launcher()
    if launcher.tensor_cores is None:
        pytest.skip("the tensor-core kernels are sm_90a machine code: they run on compute capability 9.0 only")
    return launcher


@pytest.mark.parametrize(("kernel", "precision"), KERNEL_PRECISIONS, ids=str)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES, ids=str)
def test_every_element_is_within_the_precisions_bound(
    launcher: Any, kernel: str, precision: Precision, m: int, k: int, n: int
) -> None:
    import cupy as cp

    rng = cp.random.default_rng(m * 7 + k * 3 + n)
    a, b = rng.standard_normal((m, k), dtype=cp.float32), rng.standard_normal((k, n), dtype=cp.float32)
    c = cp.full((m, n), cp.nan, dtype=cp.float32)  # an element never written stays NaN and fails
    launcher.launch(kernel, a, b, c, precision=precision)
    problem = Reference.of(a, b, np.float32, precision).mismatch(c)
    assert problem is None, problem


@pytest.mark.parametrize(
    ("kernel", "precision"),
    [*KERNEL_PRECISIONS, *(("cublas", p) for p in TENSOR_CORE_PRECISIONS if p is not Precision.FP8)],
    ids=str,
)
def test_operands_of_one_sign_hold_the_bound_at_a_long_k(launcher: Any, kernel: str, precision: Precision) -> None:
    """Uniform [0, 1) operands: an operand truncated rather than rounded errs one way, by an error that grows with
    k past the bound (4.35 at k = 1024 and 7.8 at 4096 with A truncated, emulated; the bound allows 4). cuBLAS, whose
    answers the service gives in these precisions too, is held to it as well."""
    import cupy as cp

    rng = cp.random.default_rng(4)
    a, b = rng.random((64, 4096), dtype=cp.float32), rng.random((4096, 96), dtype=cp.float32)
    c = cp.full((64, 96), cp.nan, dtype=cp.float32)
    launcher.launch(kernel, a, b, c, precision=precision)
    problem = Reference.of(a, b, np.float32, precision).mismatch(c)
    assert problem is None, problem


@pytest.mark.parametrize(("kernel", "precision"), KERNEL_PRECISIONS, ids=str)
def test_a_product_missing_one_term_fails_the_bound(launcher: Any, kernel: str, precision: Precision) -> None:
    """The bound is tight enough to catch a kernel that skips one k step: the check above can fail. An FP8 step is
    one instruction's 32 terms: its bound, 4 * 0.129 * sqrt(sum of squared terms), is wider than one term."""
    import cupy as cp

    rng = cp.random.default_rng(3)
    a, b = rng.standard_normal((256, 512), dtype=cp.float32), rng.standard_normal((512, 256), dtype=cp.float32)
    short = cp.empty((256, 256), cp.float32)
    skipped = 32 if precision is Precision.FP8 else 1
    launcher.launch(kernel, a[:, skipped:].copy(), b[skipped:].copy(), short, precision=precision)
    assert Reference.of(a, b, np.float32, precision).mismatch(short) is not None


# the edge shapes; k = 0; k a multiple of 16 (A read as it is) and not; k far past a tile of 128; ragged edges
INT8_SHAPES = [*EDGE_SHAPES, (67, 0, 39), (3, 17, 5), (129, 100, 257), (255, 129, 511), (64, 5000, 96),
               (33, 12345, 65), (1000, 1024, 999), (2048, 2048, 2048)]  # fmt: skip


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("shape", [(67, 45), (67, 36)], ids=str)  # rows copied one element a thread, or four
def test_int8_operands_are_copied_as_they_are_into_rows_of_16_elements(
    launcher: Any, transposed: bool, shape: tuple[int, int]
) -> None:
    import cupy as cp

    x = np.random.default_rng(12).integers(-128, 128, shape, np.int8)
    (part,) = launcher.tensor_cores.converted(tensorcore.WGMMA_INT8, cp.asarray(x), transposed=transposed)
    source = x.T if transposed else x
    rows, k = source.shape
    assert part.dtype == np.int8 and part.shape == (rows, -(-k // 16) * 16)  # k padded to 16 elements
    np.testing.assert_array_equal(cp.asnumpy(part)[:, :k], source)


@pytest.mark.parametrize("kernel", INT8_KERNELS)
@pytest.mark.parametrize("values", ["uniform", "extremes"])
@pytest.mark.parametrize(("m", "k", "n"), INT8_SHAPES, ids=str)
def test_int8_products_are_exact(launcher: Any, kernel: str, m: int, k: int, n: int, values: str) -> None:
    """int8 @ int8 into int32 equals the exact product bit for bit (float64 BLAS's: NumPy's int64 matmul took a
    minute at 2048^3), for values across int8's range and for -128 and 127 alone (the largest products)."""
    import cupy as cp

    rng = np.random.default_rng(m * 7 + k * 3 + n)
    if values == "uniform":
        a, b = rng.integers(-128, 128, (m, k), np.int8), rng.integers(-128, 128, (k, n), np.int8)
    else:
        extremes = np.array([-128, 127], np.int8)
        a, b = rng.choice(extremes, (m, k)), rng.choice(extremes, (k, n))
    c = cp.full((m, n), -7, cp.int32)  # an element never written stays -7, which no product here is everywhere
    launcher.launch(kernel, cp.asarray(a), cp.asarray(b), c, precision=Precision.INT8)
    np.testing.assert_array_equal(cp.asnumpy(c), emulate(a, b, Precision.INT8))


INT8_INSTANCE_SHAPES = [*INT8_SHAPES, (4093, 4096, 4099), (1, 8192, 1), (2000, 48, 3000), (4096, 300, 4096),
                        (2000, 640, 3000)]  # fmt: skip
"""INT8_SHAPES, a tail of rows and columns on a large product, one long k, and k of 1, 3 and 5 tiles (fewer than the
six stages of the instance in turns) with many tiles a block, so that its ring holds both consumers' tiles at once."""


@pytest.mark.parametrize("config", tensorcore.WGMMA_INT8_INSTANCES.values(), ids=list(tensorcore.WGMMA_INT8_INSTANCES))
@pytest.mark.parametrize(("m", "k", "n"), INT8_INSTANCE_SHAPES, ids=str)
def test_both_int8_instances_are_exact_whatever_k_chooses(launcher: Any, config: Any, m: int, k: int, n: int) -> None:
    """Each wgmma int8 instance on every shape, B given as B^T too, whichever `wgmma_int8_config` would choose for k:
    in turns, a block takes many tiles, a few or one, and its second consumer none where there are fewer tiles than
    twice the SMs."""
    import cupy as cp

    rng = np.random.default_rng(m * 5 + k * 11 + n)
    a, b = rng.integers(-128, 128, (m, k), np.int8), rng.integers(-128, 128, (k, n), np.int8)
    exact = emulate(a, b, Precision.INT8)
    for b_given, transposed in ((b, False), (np.ascontiguousarray(b.T), True)):
        c = cp.full((m, n), -7, cp.int32)
        launcher.tensor_cores.wgmma_int8(cp.asarray(a), cp.asarray(b_given), c, b_transposed=transposed, config=config)
        np.testing.assert_array_equal(cp.asnumpy(c), exact)


def test_wgmma_int8_refuses_an_instance_of_another_kind(launcher: Any) -> None:
    import cupy as cp

    a = cp.ones((4, 16), cp.int8)
    bf16 = tensorcore.WGMMA_CONFIGS[Precision.BF16]
    with pytest.raises(ValueError, match=r"matmul_wgmma<0, 256, 4, false> is not a wgmma int8 instance"):
        launcher.tensor_cores.wgmma_int8(a, a.T.copy(), cp.zeros((4, 4), cp.int32), config=bf16)


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_sums_up_to_the_longest_k_that_fits_and_refuses_one_more(launcher: Any, kernel: str) -> None:
    import cupy as cp

    longest = 131_071  # (-128) * (-128) * k <= 2^31 - 1
    a, b = cp.full((3, longest), -128, cp.int8), cp.full((longest, 5), -128, cp.int8)
    c = cp.zeros((3, 5), cp.int32)
    launcher.launch(kernel, a, b, c, precision=Precision.INT8)
    assert (cp.asnumpy(c) == longest * 16_384).all()
    longer = cp.ones((1, longest + 1), cp.int8)
    with pytest.raises(ValueError, match="k = 131072: sums of int8 products pass int32 beyond k = 131071"):
        launcher.launch(kernel, longer, longer.T.copy(), cp.zeros((1, 1), cp.int32), precision=Precision.INT8)


@pytest.mark.parametrize("precision", list(tensorcore.MMA_SYNC_PORTABLE_CONFIGS), ids=str)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (67, 0, 39), (129, 4099, 257), (1000, 1024, 999)], ids=str)
def test_the_library_of_other_gpus_computes_each_precision_on_mma_sync(
    portable: Any, precision: Precision, m: int, k: int, n: int
) -> None:
    """What a GPU of compute capability 8.0 to 8.9 (or past 9.0) loads: mma_sync's 128 x 128 instances and the
    conversions as PTX for compute_80, run here by the driver's compilation of it: within each precision's bound,
    int8 exactly."""
    import cupy as cp

    rng = np.random.default_rng(m + 3 * k + 7 * n)
    if precision is Precision.INT8:
        a, b = rng.integers(-128, 128, (m, k), np.int8), rng.integers(-128, 128, (k, n), np.int8)
        c = cp.full((m, n), -7, cp.int32)
        portable.mma_sync(cp.asarray(a), cp.asarray(b), c, precision)
        np.testing.assert_array_equal(cp.asnumpy(c), emulate(a, b, Precision.INT8))
        return
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    c = cp.full((m, n), cp.nan, cp.float32)
    portable.mma_sync(cp.asarray(a), cp.asarray(b), c, precision)
    problem = Reference.of(a, b, np.float32, precision).mismatch(cp.asnumpy(c))
    assert problem is None, problem


@pytest.fixture(scope="module")
def portable(launcher: Any) -> Any:
    """The tensor-core library a GPU other than an H100 or H200 builds, built here."""
    from kernels.cuda import TensorCoreLibrary

    library = TensorCoreLibrary(tensorcore.PORTABLE_COMPUTE_CAPABILITY)
    assert library.mma_sync_configs is tensorcore.MMA_SYNC_PORTABLE_CONFIGS
    return library


# odd k or n take the 8-byte copies, even both the 16-byte ones; several tiles of either instance
FLOAT64_SHAPES = [*EDGE_SHAPES, (67, 0, 39), (130, 17, 258), (300, 2, 301), (257, 64, 129), (1000, 1001, 999)]


@pytest.mark.parametrize(("m", "k", "n"), FLOAT64_SHAPES, ids=str)
def test_dmma_float64_products_are_within_float64s_bound(launcher: Any, m: int, k: int, n: int) -> None:
    import cupy as cp

    rng = cp.random.default_rng(m * 5 + k * 3 + n)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    c = cp.full((m, n), cp.nan)
    launcher.launch(tensorcore.DMMA, a, b, c)
    problem = Reference.of(a, b, np.float64).mismatch(c)
    assert problem is None, problem


@pytest.mark.parametrize("k", [512, 511])
def test_a_dmma_product_missing_one_term_fails_float64s_bound(launcher: Any, k: int) -> None:
    import cupy as cp

    rng = cp.random.default_rng(k)
    a, b = rng.standard_normal((256, k)), rng.standard_normal((k, 256))
    short = cp.empty((256, 256))
    launcher.launch(tensorcore.DMMA, a[:, 1:].copy(), b[1:].copy(), short)
    assert Reference.of(a, b, np.float64).mismatch(short) is not None


E4M3_VALUES = {
    "normal": lambda rng, shape: rng.standard_normal(shape),
    "tiny": lambda rng, shape: rng.standard_normal(shape) * 1e-30,
    "huge": lambda rng, shape: rng.standard_normal(shape) * 1e37,
    # 24 octaves down from the largest: e4m3's normals, its subnormals and what rounds to zero
    "spread": lambda rng, shape: rng.standard_normal(shape) * np.exp2(rng.uniform(-24, 0, shape)),
    "448 and zeros": lambda rng, shape: np.where(rng.uniform(size=shape) < 0.5, E4M3_LARGEST, 0.0),
}


@pytest.mark.parametrize("values", E4M3_VALUES)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
# rows of 45, 1 and 33 are converted one element a thread, of 48 and 32 four at a time
@pytest.mark.parametrize("shape", [(67, 45), (3, 1), (1000, 33), (67, 48), (1000, 32)], ids=str)
def test_fp8_operands_are_scaled_and_rounded_to_e4m3_as_numerics_does(
    launcher: Any, values: str, transposed: bool, shape: tuple[int, int]
) -> None:
    """The largest magnitude measured on the device, the power of two from it, and every element's e4m3 bits."""
    import cupy as cp

    x = E4M3_VALUES[values](np.random.default_rng(13), shape).astype(np.float32)
    device_x = cp.asarray(x)
    amax = launcher.tensor_cores.largest_magnitudes(device_x)
    assert cp.asnumpy(amax).view(np.float32)[0] == np.abs(x).max()
    config = tensorcore.WGMMA_CONFIGS[Precision.FP8]
    (part,) = launcher.tensor_cores.converted(config, device_x, transposed=transposed, amax=amax)
    source = x.T if transposed else x
    rows, k = source.shape
    assert part.dtype == np.uint8 and part.shape == (rows, -(-k // 16) * 16)
    expected, _ = scaled_e4m3(source)
    np.testing.assert_array_equal(E4M3_DECODED[cp.asnumpy(part)[:, :k]], expected)


def _e4m3_values() -> np.ndarray:
    """Each of the 256 e4m3 encodings' value (NaN for S.1111.111), from the format's definition."""
    bits = np.arange(256)
    sign, exponent, fraction = np.where(bits >> 7, -1.0, 1.0), (bits >> 3) & 15, bits & 7
    magnitude = np.where(exponent == 0, fraction / 8 * 2.0**-6, (1 + fraction / 8) * 2.0 ** (exponent - 7))
    return np.where((exponent == 15) & (fraction == 7), np.nan, sign * magnitude).astype(np.float32)


E4M3_DECODED = _e4m3_values()


def test_the_largest_magnitude_is_measured_from_any_start_and_length(launcher: Any) -> None:
    """16 bytes at a time where the operand starts on 16 bytes, one element at a time elsewhere and for the tail."""
    import cupy as cp

    x = cp.asarray(np.random.default_rng(14).standard_normal(100_003).astype(np.float32))
    x[77_777] = -1e6
    for start, stop in [(0, 100_003), (1, 100_003), (3, 77_778), (77_777, 77_778), (0, 77_777), (5, 5)]:
        part = x[start:stop]
        want = float(cp.abs(part).max()) if part.size else 0.0
        assert cp.asnumpy(launcher.tensor_cores.largest_magnitudes(part)).view(np.float32)[0] == want


@pytest.mark.parametrize(
    "scale_a", [1.0, 1e-30, 1e30, 3e38 / 4096], ids=["unit", "tiny", "huge", "near the float32 limit"]
)
def test_fp8_products_hold_the_bound_whatever_the_operands_scale(launcher: Any, scale_a: float) -> None:
    """The scales bring any finite operands into e4m3's range and the product back: magnitudes from 1e-30 to
    float32's largest, with elements spread over 24 octaves, and B 2^-10 of A (the products stay inside float32's
    range: the bound, as float32's own, assumes no underflow)."""
    import cupy as cp

    rng = np.random.default_rng(15)
    a = (rng.standard_normal((130, 300)) * np.exp2(rng.uniform(-24, 0, (130, 300))) * scale_a).astype(np.float32)
    b = (rng.standard_normal((300, 70)) * 2.0**-10).astype(np.float32)
    c = cp.full((130, 70), cp.nan, cp.float32)
    launcher.launch(tensorcore.WGMMA, cp.asarray(a), cp.asarray(b), c, precision=Precision.FP8)
    problem = Reference.of(a, b, np.float32, Precision.FP8).mismatch(cp.asnumpy(c))
    assert problem is None, problem


WIDE_FP8_INSTANCES = {label: config for label, config in tensorcore.WGMMA_FP8_INSTANCES.items() if config.block_n > 128}


@pytest.mark.parametrize("wide", WIDE_FP8_INSTANCES.values(), ids=list(WIDE_FP8_INSTANCES))
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(300, 129, 129), (129, 700, 640), (17, 9, 33), (1000, 1000, 1), (256, 384, 8192), (130, 360, 300),
     (128, 176, 256), (128, 208, 256), (1500, 2500, 300), (1500, 2500, 1)],
    ids=str,
)  # fmt: skip
def test_fp8_wide_tiles_compute_what_the_narrow_ones_do(
    launcher: Any, wide: tensorcore.WgmmaConfig, m: int, n: int, k: int
) -> None:
    """Each wide instance that large FP8 products run on (128 x 176, 192 or 208 tiles, `tensorcore.wgmma_fp8_config`),
    a block a tile or as a persistent grid, sums each tile of K as the 128-wide one does, so their products are the
    same bit for bit, within the bound: across tile edges in m and n, k shorter than a tile and many tiles long, and
    (1500 x 2500: 156 to 180 tiles) blocks of the persistent grid that take two tiles on an SM count of 132."""
    import cupy as cp

    rng = np.random.default_rng(16)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    tensor_cores = launcher.tensor_cores
    operands = tensor_cores.e4m3_operands(cp.asarray(a), cp.asarray(b))
    narrow_c, wide_c = (cp.full((m, n), cp.nan, cp.float32) for _ in range(2))
    tensor_cores.wgmma_e4m3(*operands, k, narrow_c, config=tensorcore.WGMMA_CONFIGS[Precision.FP8])
    tensor_cores.wgmma_e4m3(*operands, k, wide_c, config=wide)
    np.testing.assert_array_equal(cp.asnumpy(wide_c), cp.asnumpy(narrow_c))
    problem = Reference.of(a, b, np.float32, Precision.FP8).mismatch(cp.asnumpy(wide_c))
    assert problem is None, problem
    if wide.persistent and (m, n) == (1500, 2500):
        assert wide.blocks(m, n, cp.cuda.Device().attributes["MultiProcessorCount"]) < wide.tiles(m, n)


def test_fp8_products_run_as_the_persistent_grid_give_what_the_narrow_tiles_give(launcher: Any) -> None:
    """A product that the rule sends to the persistent grid, whose blocks take several tiles each, and five stages
    of K a tile (not a multiple of the four stages): a stage counted wrong across a block's tiles would show."""
    import cupy as cp

    m = n = 4096
    k = 640
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    chosen_config = tensorcore.wgmma_fp8_config(m, n, k, sms)
    assert chosen_config.persistent and chosen_config.tiles(m, n) >= 3 * sms
    rng = np.random.default_rng(17)
    a, b = (cp.asarray(rng.standard_normal(shape).astype(np.float32)) for shape in ((m, k), (k, n)))
    tensor_cores = launcher.tensor_cores
    operands = tensor_cores.e4m3_operands(a, b)
    chosen, narrow = (cp.full((m, n), cp.nan, cp.float32) for _ in range(2))
    tensor_cores.wgmma_e4m3(*operands, k, chosen)
    tensor_cores.wgmma_e4m3(*operands, k, narrow, config=tensorcore.WGMMA_CONFIGS[Precision.FP8])
    assert bool(cp.array_equal(chosen, narrow))


def test_fp8_refuses_an_instance_of_another_kind(launcher: Any) -> None:
    import cupy as cp

    a, b = cp.ones((8, 8), cp.float32), cp.ones((8, 8), cp.float32)
    operands = launcher.tensor_cores.e4m3_operands(a, b)
    with pytest.raises(ValueError, match="not a wgmma FP8 instance"):
        launcher.tensor_cores.wgmma_e4m3(
            *operands, 8, cp.empty((8, 8), cp.float32), config=tensorcore.WGMMA_CONFIGS[Precision.BF16]
        )


# TF32 from the rows: k or n not a multiple of 4 (A's or B's rows copied, padded; C's rows odd or even), tile edges in
# m and n (a tile of C^T is 128 of n by 256 of m), k shorter than a tile of 32 and many tiles long
TF32_ROWS_SHAPES = [(1, 1, 1), (1, 1, 4), (17, 36, 12), (17, 36, 13), (129, 33, 132), (129, 33, 131), (256, 32, 128),
                    (257, 100, 388), (300, 8192, 260), (300, 259, 258), (1500, 700, 2500), (4093, 4096, 4100),
                    (4093, 4097, 4099)]  # fmt: skip


def _same_bits_or_both_nan(x: np.ndarray, y: np.ndarray) -> bool:
    nan = np.isnan(x)
    return bool(np.array_equal(nan, np.isnan(y)) and np.array_equal(x.view(np.uint32)[~nan], y.view(np.uint32)[~nan]))


@pytest.mark.parametrize(("m", "k", "n"), TF32_ROWS_SHAPES, ids=str)
def test_tf32_from_the_rows_computes_what_the_passes_feed(launcher: Any, m: int, k: int, n: int) -> None:
    """The TF32 instance reading A and B where they lie, rounded to TF32 by the copies into shared memory, gives the
    product of the instance fed by the rounding passes bit for bit (the same operands, rounded alike, summed in the
    same order): with NaN, infinities, float32's largest (rounded up to infinity), subnormals and zeros of either sign
    among the operands."""
    import cupy as cp

    rng = np.random.default_rng(m + 3 * k + 7 * n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    largest = np.finfo(np.float32).max
    specials = np.array([np.nan, np.inf, -np.inf, largest, 1e-40, -1e-41, 0.0, -0.0], np.float32)
    if m * n >= 64:  # a product so small that the specials would reach every element takes none
        a.flat[: specials.size] = specials[: a.size]
        b.flat[:3] = np.array([largest, 1e-40, -0.0], np.float32)[: b.size]
    a_device, b_device = cp.asarray(a), cp.asarray(b)
    tensor_cores = launcher.tensor_cores
    rows, passes = (cp.full((m, n), cp.nan, cp.float32) for _ in range(2))
    tensor_cores.wgmma_tf32(a_device, b_device, rows, config=tensorcore.WGMMA_TF32_ROWS)
    tensor_cores.wgmma_tf32(a_device, b_device, passes, config=tensorcore.WGMMA_CONFIGS[Precision.TF32])
    assert _same_bits_or_both_nan(cp.asnumpy(rows), cp.asnumpy(passes))
    assert int(cp.count_nonzero(cp.isfinite(rows))) > m * n // 2  # the specials reach a few rows and columns only


@pytest.mark.parametrize(("m", "k", "n"), [(17, 33, 13), (129, 35, 131), (300, 259, 258)], ids=str)
def test_tf32_from_the_rows_never_reads_the_padding_of_its_copies(
    launcher: Any, monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int
) -> None:
    """Rows that are not whole 16-byte units are copied into padded ones, whose padding `converted` leaves as the
    allocator had it. The tensor maps' widths are the operands' own, so the copies fill zeros past them and never
    read the padding: poisoned with NaN here, it changes no element of the product."""
    import cupy as cp

    tensor_cores = launcher.tensor_cores
    converted = tensor_cores.converted

    def poisoned(config: Any, x: Any, *, transposed: bool, amax: Any = None) -> list[Any]:
        parts = converted(config, x, transposed=transposed, amax=amax)
        width = x.shape[0] if transposed else x.shape[1]
        for part in parts:
            part[:, width:] = cp.nan
        return parts

    rng = np.random.default_rng(m + k + n)
    a, b = (cp.asarray(rng.standard_normal(shape).astype(np.float32)) for shape in ((m, k), (k, n)))
    clean = cp.full((m, n), cp.nan, cp.float32)
    tensor_cores.wgmma_tf32(a, b, clean)
    monkeypatch.setattr(tensor_cores, "converted", poisoned)
    padded = cp.full((m, n), cp.nan, cp.float32)
    tensor_cores.wgmma_tf32(a, b, padded)
    assert bool(cp.all(cp.isfinite(clean)))
    assert bool(cp.array_equal(padded, clean))


def test_the_copies_round_to_tf32_as_numerics_does(launcher: Any) -> None:
    """A @ I through the instance reading the rows is A as its tensor maps' copies rounded it: to nearest, ties to
    even, as numerics/precision.py's to_tf32 (and the pass) rounds. Half the columns are exact ties, where rounding
    ties away from zero and truncation would each differ on about half of them (truncation on nearly every other
    element too); float32's largest rounds up to infinity
    (whose products with the identity's zeros make its row NaN, as in float64)."""
    import cupy as cp

    rng = np.random.default_rng(5)
    size = 64
    magnitudes = rng.integers(0x00800000, 0x7F000000, (size, size), dtype=np.uint32)  # normal, finite
    bits = magnitudes | (rng.integers(0, 2, (size, size), dtype=np.uint32) << np.uint32(31))
    bits[:, : size // 2] = (bits[:, : size // 2] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
    bits[0, -1] = 0x7F7FFFFF
    a = bits.view(np.float32)
    c = cp.full((size, size), cp.nan, cp.float32)
    launcher.tensor_cores.wgmma_tf32(
        cp.asarray(a), cp.eye(size, dtype=cp.float32), c, config=tensorcore.WGMMA_TF32_ROWS
    )
    with np.errstate(invalid="ignore"):  # the infinity times the identity's zeros: row 0 is NaN but its last column
        expected = (to_tf32(a).astype(np.float64) @ np.eye(size)).astype(np.float32)
    assert expected[0, -1] == np.inf
    assert _same_bits_or_both_nan(cp.asnumpy(c), expected)


def test_tf32_refuses_an_instance_of_another_kind(launcher: Any) -> None:
    import cupy as cp

    a = cp.ones((8, 8), cp.float32)
    bf16 = tensorcore.WGMMA_CONFIGS[Precision.BF16]
    with pytest.raises(ValueError, match="not a wgmma TF32 instance"):
        launcher.tensor_cores.wgmma_tf32(a, a, cp.empty((8, 8), cp.float32), config=bf16)


@pytest.mark.parametrize("precision", [p for p in TENSOR_CORE_PRECISIONS if p is not Precision.FP8])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("width", [45, 48])  # rows converted one element a thread, or four at a time
def test_the_operand_conversions_round_as_kernels_precision_does(
    launcher: Any, precision: Precision, transposed: bool, width: int
) -> None:
    import cupy as cp

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((67, width)) * 10.0 ** rng.integers(-20, 20, (67, width))).astype(np.float32)
    x.flat[:3] = [np.inf, -np.inf, np.nan]
    config = tensorcore.WGMMA_CONFIGS[precision]
    converted = launcher.tensor_cores.converted(config, cp.asarray(x), transposed=transposed)
    parts = [cp.asnumpy(part) for part in converted]
    source = x.T if transposed else x
    k = source.shape[1]
    got = [part[:, :k] for part in parts]
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows to infinity; inf - inf is NaN
        if precision is Precision.BF16:
            expected = [bf16_bits(source)]
        elif precision is Precision.FP16:
            # compared as float16 values: a NaN's encoding differs (the device writes the canonical 0x7fff)
            expected = [to_fp16(source).astype(np.float16)]
            got = [got[0].view(np.float16)]
        elif precision is Precision.TF32:
            expected = [to_tf32(source)]
        else:
            big, small = split_tf32(source)
            expected = [big, to_tf32(small)]
            # the device flushes subnormal small parts to zero
            got[1] = np.where(np.abs(expected[1]) < np.finfo(np.float32).tiny, expected[1], got[1])
    for actual, wanted in zip(got, expected, strict=True):
        # bf16 encodings bit for bit; float16 and float32 as values, where a NaN matches any NaN
        np.testing.assert_array_equal(actual, wanted)


def test_own_3xtf32_is_as_accurate_as_sgemm(launcher: Any) -> None:
    """The issue's bar: own 3xTF32 within 2x SGEMM's relative error (2048^3, standard normal operands). The tensor
    cores' sums round toward zero, so a kernel that let them sum all of K would err about 9x SGEMM's."""
    import cupy as cp

    rng = cp.random.default_rng(5)
    a, b = rng.standard_normal((2048, 2048), dtype=cp.float32), rng.standard_normal((2048, 2048), dtype=cp.float32)
    reference = Reference.of(a, b, np.float32)
    own = cp.empty((2048, 2048), cp.float32)
    launcher.launch(tensorcore.WGMMA, a, b, own, precision=Precision.TF32X3)
    sgemm_error = reference.relative_error(cp.matmul(a, b))
    assert reference.relative_error(own) <= 2 * sgemm_error


def test_own_fp8_errs_only_by_the_rounding_of_its_operands(launcher: Any) -> None:
    """FP8's error against float64 (3.8e-2 relative for standard normal operands, cuBLASLt's too) is the rounding of
    the operands to e4m3. The tensor cores keep FP8 sums short; own adds each tile's sums in float32, so at k = 16384
    its relative error is that of the exact product of the rounded operands to 0.1%."""
    import cupy as cp

    rng = cp.random.default_rng(6)
    a, b = rng.standard_normal((512, 16384), dtype=cp.float32), rng.standard_normal((16384, 512), dtype=cp.float32)
    reference = Reference.of(a, b, np.float32, Precision.FP8)
    own = cp.full((512, 512), cp.nan, cp.float32)
    launcher.launch(tensorcore.WGMMA, a, b, own, precision=Precision.FP8)
    rounding_alone = reference.relative_error(emulate(a, b, Precision.FP8))
    assert 0.03 < rounding_alone < 0.045
    assert reference.relative_error(own) == pytest.approx(rounding_alone, rel=1e-3)


@pytest.mark.anyio
async def test_the_service_runs_the_tensor_core_kernels_and_auto_chooses_per_precision_and_dtype(
    gpu_client: httpx.AsyncClient,
) -> None:
    import cupy as cp

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the tensor-core kernels run on compute capability 9.0 only")
    listing = (await gpu_client.get("/v1/kernels")).json()
    offered = {kernel["name"]: kernel for kernel in listing["kernels"]}
    assert offered["wgmma"]["precisions"] == ["tf32", "3xtf32", "bf16", "fp16", "fp8", "int8"]
    assert "fp8" not in offered["cublas"]["precisions"]
    assert offered["mma_sync"]["precisions"] == ["tf32", "bf16", "fp16", "int8"]
    assert offered["wgmma"]["dtypes"] == ["float32", "int32"] and offered["mma_sync"]["dtypes"] == ["float32", "int32"]
    assert offered["dmma"]["dtypes"] == ["float64"] and offered["dmma"]["precisions"] == ["fp32"]
    for precision, dtype, kernels in [
        ("tf32", "float32", {"cublas", "mma_sync", "wgmma"}),
        ("3xtf32", "float32", {"cublas", "wgmma"}),
        ("bf16", "float32", {"cublas", "mma_sync", "wgmma"}),
        ("fp16", "float32", {"cublas", "mma_sync", "wgmma"}),
        ("fp8", "float32", {"wgmma"}),
        ("fp32", "float64", {"cublas", "dmma", *KERNELS}),
        ("int8", "int32", {"cublas", "mma_sync", "wgmma"}),
    ]:
        choices = [c for c in listing["auto"] if c["precision"] == precision and c["dtype"] == dtype]
        assert [c["shape_class"] for c in choices] == ["small", "medium", "large", "huge"]
        assert all(set(c["probe_ms"]) == kernels for c in choices)

    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((130, 70)).astype(np.float32), rng.standard_normal((70, 260)).astype(np.float32)
    operands = {"a": a.tolist(), "b": b.tolist()}
    for kernel, precision in KERNEL_PRECISIONS:
        r = await gpu_client.post("/matmul", params={"kernel": kernel, "precision": precision}, json=operands)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["kernel"] == kernel and body["precision"] == precision
        c = np.array(body["result"], dtype=np.float32)
        assert Reference.of(a, b, np.float32, precision).mismatch(c) is None
    for dtype_kernel in ["dmma", "auto"]:
        r = await gpu_client.post("/matmul", params={"kernel": dtype_kernel, "dtype": "float64"}, json=operands)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["dtype"] == "float64" and body["kernel"] in offered
        c = np.array(body["result"], dtype=np.float64)
        assert Reference.of(a.astype(np.float64), b.astype(np.float64), np.float64).mismatch(c) is None

    for params, location, message in [
        ({"kernel": "wgmma"}, "precision", "computes float32 in precision tf32, 3xtf32, bf16, fp16, fp8, not fp32"),
        ({"kernel": "cublas", "precision": "fp8"}, "precision", "'cublas' does not compute float32 in precision fp8"),
        ({"kernel": "mma_sync", "precision": "3xtf32"}, "precision", "computes float32 in precision tf32, bf16, fp16"),
        ({"kernel": "dmma"}, "dtype", "kernel 'dmma' computes in float64; this product's dtype is float32"),
        ({"kernel": "wgmma", "precision": "tf32", "dtype": "float64"}, "precision", "computes from float32"),
        ({"kernel": "wgmma", "precision": "bf16", "tile": 16}, "tile", "tile does not apply"),
    ]:
        r = await gpu_client.post("/matmul", params=params, json={"a": [[1]], "b": [[1]]})
        assert r.status_code == 422, (params, r.text)
        assert r.json()["location"] == [location] and message in r.json()["message"], r.text
