"""FP8 (e4m3) as numerics/precision.py defines it: the rounding onto e4m3's values, the power-of-two scale that keeps
every element in range, and the subnormals' term of the bound (numerics/reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numerics.precision import (
    E4M3_LARGEST,
    Precision,
    e4m3_scale_exponent,
    emulate,
    input_error,
    scaled_e4m3,
    to_e4m3,
)
from numerics.reference import BOUND_CONSTANT, Reference, unit_roundoff


def e4m3_values() -> np.ndarray:
    """Every finite non-negative e4m3 value, from the format's definition: 4 exponent bits (bias 7), 3 fraction
    bits, subnormals at exponent 0, and S.1111.111 NaN (so no 480)."""
    values = {
        (fraction / 8) * 2.0**-6 if exponent == 0 else (1 + fraction / 8) * 2.0 ** (exponent - 7)
        for exponent in range(16)
        for fraction in range(8)
        if (exponent, fraction) != (15, 7)
    }
    return np.array(sorted(values))


VALUES = e4m3_values()


def nearest_even(x: float) -> float:
    """x rounded to the nearest e4m3 value by search, a tie going to the one whose last fraction bit is 0."""
    below, above = VALUES[x >= VALUES].max(), VALUES[x <= VALUES].min()
    if x - below != above - x:
        return float(below if x - below < above - x else above)
    return float(below if _last_fraction_bit(below) == 0 else above)


def _last_fraction_bit(value: float) -> int:
    """The lowest of an e4m3 value's 3 fraction bits: its position in units of its spacing (2^-9 below 2^-6)."""
    spacing = 2.0 ** (math.frexp(value)[1] - 4) if value >= 2.0**-6 else 2.0**-9
    return round(value / spacing) % 2


def test_the_format_has_126_positive_values_up_to_448() -> None:
    assert len(VALUES) == 127 and VALUES[0] == 0.0 and VALUES[1] == 2.0**-9 and VALUES[-1] == E4M3_LARGEST == 448.0


def test_every_e4m3_value_is_kept_and_every_midpoint_goes_to_the_even_neighbour() -> None:
    midpoints = (VALUES[:-1] + VALUES[1:]) / 2
    for signed in (1.0, -1.0):
        np.testing.assert_array_equal(to_e4m3((signed * VALUES).astype(np.float32)), signed * VALUES)
        rounded = to_e4m3((signed * midpoints).astype(np.float32))
        np.testing.assert_array_equal(rounded, [signed * nearest_even(float(x)) for x in midpoints])


def test_any_value_up_to_448_rounds_to_the_nearest_e4m3_value() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(0, 448, 2000), np.exp2(rng.uniform(-14, 8.8, 2000))]).astype(np.float32)
    x = x[x <= E4M3_LARGEST]
    np.testing.assert_array_equal(to_e4m3(x), [nearest_even(float(v)) for v in x])


@pytest.mark.parametrize(
    ("amax", "exponent"),
    [(0.0, 0), (448.0, 0), (449.0, -1), (224.0, 1), (224.00002, 0), (1.0, 8), (2.0**-149, 157), (3.4e38, -120)],
)
def test_the_scale_brings_the_largest_magnitude_into_224_to_448(amax: float, exponent: int) -> None:
    assert e4m3_scale_exponent(amax) == exponent
    if amax:
        assert 224 < math.ldexp(float(np.float32(amax)), exponent) <= 448


def test_no_scaled_element_can_leave_e4m3s_range_whatever_the_operands_magnitudes() -> None:
    rng = np.random.default_rng(2)
    for magnitude in (1e-40, 1e-30, 1.0, 1e30, 3.4e38):
        x = (rng.standard_normal((50, 40)) * magnitude / 5).astype(np.float32)
        x.flat[7] = np.float32(magnitude)  # the largest, at the top of float32's range for the last one
        scaled, exponent = scaled_e4m3(x)
        assert np.isfinite(scaled).all() and np.abs(scaled).max() <= E4M3_LARGEST
        assert np.abs(scaled).max() > 224 and scaled.flat[7] == to_e4m3(np.ldexp(x.flat[7:8], exponent))[0]


def test_the_subnormals_term_holds_what_the_relative_one_alone_would_not() -> None:
    """A row of A whose elements are 2^-20 of A's largest scale to under 2^-11: below half e4m3's least subnormal, they
    round to zero, an absolute error that no relative term covers; the subnormals' term does."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 256)).astype(np.float32)
    a[0] = 2.0**-20 * np.abs(a).max() * rng.uniform(0.5, 1, 256)  # all positive: their errors add up
    b = np.abs(rng.standard_normal((256, 8))).astype(np.float32)
    c = emulate(a, b, Precision.FP8)
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    relative_only = BOUND_CONSTANT * (
        input_error(Precision.FP8) * np.sqrt((wide_a * wide_a) @ (wide_b * wide_b))
        + math.sqrt(256) * unit_roundoff(np.float32) * (np.abs(wide_a) @ np.abs(wide_b))
    )
    error = np.abs(c - wide_a @ wide_b)
    assert (error[0] > relative_only[0]).all()
    assert Reference.of(a, b, np.float32, Precision.FP8).mismatch(c) is None


@pytest.mark.parametrize("k", [1, 256, 2048])
def test_fp8_fails_bf16s_bound_and_holds_its_own(k: int) -> None:
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((64, k)).astype(np.float32), rng.standard_normal((k, 64)).astype(np.float32)
    c = emulate(a, b, Precision.FP8)
    assert Reference.of(a, b, np.float32, Precision.BF16).mismatch(c) is not None
    assert Reference.of(a, b, np.float32, Precision.FP8).mismatch(c) is None
    # the relative error of rounding both operands to 3 fraction bits: about cuBLASLt's 3.8e-2
    assert 0.02 < Reference.of(a, b, np.float32, Precision.FP8).relative_error(c) < 0.05
