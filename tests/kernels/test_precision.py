"""The precisions' roundings, emulated on the CPU, and the bound each adds (kernels/precision.py): the conversions
round to nearest, ties to even, bit for bit; every mode's product passes its own bound and fails a tighter one."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.precision import (
    BF16_UNIT_ROUNDOFF,
    FP16_UNIT_ROUNDOFF,
    TF32_UNIT_ROUNDOFF,
    Precision,
    bf16_bits,
    emulate,
    input_error,
    split_tf32,
    to_bf16,
    to_tf32,
)
from kernels.reference import BOUND_CONSTANT, Reference

F32 = np.dtype(np.float32)


def _nearest(x: np.ndarray, fraction_bits: int) -> np.ndarray:
    """Round to nearest, ties to even, at `fraction_bits`, the slow way: in float64, from the two neighbours."""
    wide = x.astype(np.float64)
    exponent = np.floor(np.log2(np.abs(wide)))
    step = 2.0 ** (exponent - fraction_bits)
    low = np.floor(wide / step) * step
    high = low + step
    below, above = wide - low, high - wide
    even_low = (np.floor(wide / step) % 2) == 0
    return np.where((below < above) | ((below == above) & even_low), low, high)


@pytest.mark.parametrize(("convert", "fraction_bits"), [(to_tf32, 10), (to_bf16, 7)])
def test_conversions_round_to_nearest_ties_to_even(convert: object, fraction_bits: int) -> None:
    rng = np.random.default_rng(61)
    x = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-20, 20, 100_000)).astype(np.float32)
    np.testing.assert_array_equal(convert(x).astype(np.float64), _nearest(x, fraction_bits))  # type: ignore[operator]


def test_ties_go_to_even_and_specials_stay() -> None:
    one = np.float32(1.0)
    tie_down = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)  # halfway between bf16 neighbours
    np.testing.assert_array_equal(to_bf16(tie_down), [one, 1 + 2 * 2.0**-7])
    specials = np.array([np.inf, -np.inf, 0.0, -0.0], np.float32)
    np.testing.assert_array_equal(to_bf16(specials), specials)
    assert np.isnan(to_tf32(np.array([np.nan], np.float32)))[0]
    largest = np.array([np.finfo(np.float32).max], np.float32)
    assert to_bf16(largest)[0] == np.inf  # rounds past bfloat16's largest finite value


def test_bf16_bits_are_the_upper_half_of_the_rounded_float32() -> None:
    x = np.random.default_rng(62).standard_normal(1000).astype(np.float32)
    bits = bf16_bits(x)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal((bits.astype(np.uint32) << 16).view(np.float32), to_bf16(x))


def test_a_tf32_split_is_exact() -> None:
    x = np.random.default_rng(63).standard_normal(100_000).astype(np.float32)
    big, small = split_tf32(x)
    np.testing.assert_array_equal(big + small, x)
    assert not np.any(big.view(np.uint32) & np.uint32(0x1FFF))  # big has TF32's 10 fraction bits only
    assert np.all(np.abs(small) <= np.abs(x) * 2.0**-11)


def test_what_each_precision_adds() -> None:
    assert input_error(Precision.FP32) == 0.0
    for precision, u in (
        (Precision.TF32, TF32_UNIT_ROUNDOFF),
        (Precision.BF16, BF16_UNIT_ROUNDOFF),
        (Precision.FP16, FP16_UNIT_ROUNDOFF),
    ):
        assert input_error(precision) == 2 * u + u * u
    assert input_error(Precision.TF32X3) == pytest.approx(3 * 2.0**-20, rel=1e-3)


SHAPES = [(1, 1, 1), (1, 5, 300), (300, 5, 1), (17, 33, 9), (64, 1000, 64), (128, 4096, 32)]


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_each_precisions_product_is_within_its_bound(precision: Precision, m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * k + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    assert Reference.of(a, b, F32, precision).error_ratio(emulate(a, b, precision)) <= BOUND_CONSTANT


@pytest.mark.parametrize(
    ("computed", "promised"),
    [
        (Precision.TF32, Precision.FP32),
        (Precision.BF16, Precision.FP16),
        (Precision.TF32, Precision.TF32X3),
        (Precision.FP16, Precision.TF32X3),
    ],
)
@pytest.mark.parametrize("k", [1, 256, 2048])
def test_a_coarser_precision_fails_a_finer_ones_bound(computed: Precision, promised: Precision, k: int) -> None:
    rng = np.random.default_rng(64)
    a, b = rng.standard_normal((64, k)).astype(np.float32), rng.standard_normal((k, 64)).astype(np.float32)
    problem = Reference.of(a, b, F32, promised).mismatch(emulate(a, b, computed))
    mode = "float32" if promised is Precision.FP32 else f"float32 {promised}"
    assert problem is not None and f"over the {mode} bound" in problem


def test_a_precision_takes_float32_operands() -> None:
    with pytest.raises(ValueError, match="precision bf16 takes float32 operands, not float64"):
        Reference.of(np.ones((2, 2)), np.ones((2, 2)), np.float64, Precision.BF16)
