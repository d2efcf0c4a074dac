"""The precisions' roundings, emulated on the CPU, and the bound each adds (numerics/precision.py): the conversions
round to nearest, ties to even, bit for bit; every mode's product passes its own bound and fails a tighter one."""

from __future__ import annotations

import numpy as np
import pytest

from numerics.precision import (
    BF16,
    BF16_UNIT_ROUNDOFF,
    FLOAT_PRECISIONS,
    FP16,
    FP16_UNIT_ROUNDOFF,
    INT8_MAX_K,
    TF32,
    TF32_UNIT_ROUNDOFF,
    Precision,
    bf16_bits,
    emulate,
    exact_int8_product,
    float32_emulation,
    input_error,
    int8_fits,
    split_tf32,
    to_bf16,
    to_fp16,
    to_tf32,
)
from numerics.reference import BOUND_CONSTANT, Reference, unit_roundoff

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


@pytest.mark.parametrize("convert", [to_tf32, to_bf16, to_fp16])
def test_conversions_keep_float32_and_every_nan(convert: object) -> None:
    """A NaN whose payload lies only in the bits a conversion drops is still a NaN, never an infinity."""
    payloads = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F801FFF], np.uint32).view(np.float32)
    converted = convert(payloads)  # type: ignore[operator]
    assert converted.dtype == np.float32 and np.isnan(converted).all()


def test_a_split_of_an_infinity_is_infinite_and_nan_without_a_warning() -> None:
    big, small = split_tf32(np.array([np.inf, -np.inf], np.float32))  # warnings are errors in the tests
    assert np.isinf(big).all() and np.isnan(small).all()


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


FLOAT32_EXPONENT_BITS = 8
FORMAT_BITS = {
    # IEEE binary16: what NumPy's float16 is
    "fp16": (np.finfo(np.float16).nmant, np.finfo(np.float16).maxexp - 1),
    # bfloat16: the upper 16 bits of a float32, 1 sign and 8 exponent bits among them
    "bf16": (16 - 1 - FLOAT32_EXPONENT_BITS, np.finfo(np.float32).maxexp - 1),
    # NVIDIA's TensorFloat-32: 19 bits, float32's exponent and float16's fraction
    "tf32": (19 - 1 - FLOAT32_EXPONENT_BITS, np.finfo(np.float32).maxexp - 1),
}
"""(fraction bits, largest exponent) of each operand format, from its definition."""
FORMATS = {"fp16": (FP16, to_fp16), "bf16": (BF16, to_bf16), "tf32": (TF32, to_tf32)}


@pytest.mark.parametrize("name", list(FORMAT_BITS))
def test_each_format_is_its_definition_and_its_rounding_keeps_exactly_its_bits(name: str) -> None:
    """The fraction bits a rounding keeps, counted: 1 + 2^-p survives it for p up to the format's bits, and 1 plus
    half that step (a tie) rounds to 1, the even neighbour."""
    fraction_bits, max_exponent = FORMAT_BITS[name]
    operand_format, rounding = FORMATS[name]
    assert (operand_format.fraction_bits, operand_format.max_exponent) == (fraction_bits, max_exponent)
    kept = [p for p in range(1, 24) if rounding(np.array([1 + 2.0**-p], np.float32))[0] == 1 + 2.0**-p]
    assert kept == list(range(1, fraction_bits + 1))
    assert rounding(np.array([1 + 2.0 ** -(fraction_bits + 1)], np.float32))[0] == 1.0


def test_each_unit_roundoff_is_derived_from_its_formats_bits() -> None:
    """u = 2^-(fraction bits + 1), the largest relative error of rounding to nearest; tf32 promises the truncation
    unit, 2^-10, twice that (numerics/precision.py says why); 3xtf32's split drops terms of u^2 each, three of them."""
    u = {name: 2.0 ** -(bits + 1) for name, (bits, _) in FORMAT_BITS.items()}
    assert (u["fp16"], u["bf16"], 2 * u["tf32"]) == (FP16_UNIT_ROUNDOFF, BF16_UNIT_ROUNDOFF, TF32_UNIT_ROUNDOFF)
    for precision in (Precision.FP16, Precision.BF16, Precision.TF32):
        promised = {"fp16": u["fp16"], "bf16": u["bf16"], "tf32": 2 * u["tf32"]}[precision.value]
        assert input_error(precision) == 2 * promised + promised**2
    tf32_unit = 2 * u["tf32"]
    assert input_error(Precision.TF32X3) == 3 * tf32_unit**2 * (1 + tf32_unit)
    assert input_error(Precision.FP32) == 0.0
    # IEEE binary32 and binary64 store 23 and 52 fraction bits
    assert (unit_roundoff(np.float32), unit_roundoff(np.float64)) == (2.0**-24, 2.0**-53)


SHAPES = [(1, 1, 1), (1, 5, 300), (300, 5, 1), (17, 33, 9), (64, 1000, 64), (128, 4096, 32)]


@pytest.mark.parametrize("precision", FLOAT_PRECISIONS)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_each_precisions_product_is_within_its_bound(precision: Precision, m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * k + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    assert Reference.of(a, b, F32, precision).error_ratio(emulate(a, b, precision)) <= BOUND_CONSTANT


@pytest.mark.parametrize("precision", FLOAT_PRECISIONS)
def test_the_cpu_backends_float32_emulation_rounds_as_the_precision_and_keeps_its_bound(precision: Precision) -> None:
    """What the CPU backend answers in each precision: the operands rounded as the precision rounds them, summed in
    float32: within the precision's bound; within float32's own only for fp32 and 3xtf32 (its point)."""
    rng = np.random.default_rng(65)
    a, b = rng.standard_normal((40, 300)).astype(np.float32), rng.standard_normal((300, 30)).astype(np.float32)
    c = float32_emulation(a, b, precision)
    assert c.dtype == np.float32 and c.shape == (40, 30)
    assert Reference.of(a, b, F32, precision).mismatch(c) is None
    off = Reference.of(a, b, F32).mismatch(c)
    assert (off is None) == (precision in (Precision.FP32, Precision.TF32X3)), off


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


@pytest.mark.parametrize(
    ("dtype", "precision"),
    [
        (np.float64, Precision.BF16),
        (np.float32, Precision.INT8),
        (np.int32, Precision.FP32),
        (np.int32, Precision.TF32),
    ],
)
def test_a_precision_goes_with_its_products_dtype(dtype: type, precision: Precision) -> None:
    with pytest.raises(ValueError, match=f"a {np.dtype(dtype)} product is not computed in precision {precision}"):
        Reference.of(np.ones((2, 2)), np.ones((2, 2)), dtype, precision)


def test_int8_sums_fit_int32_up_to_k_131071() -> None:
    """(-128) * (-128) * 131071 = 2,147,467,264 <= 2^31 - 1 < that plus 16384."""
    assert INT8_MAX_K == 131_071 and int8_fits(131_071) and not int8_fits(131_072)
    assert INT8_MAX_K * 128 * 128 <= 2**31 - 1 < (INT8_MAX_K + 1) * 128 * 128


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (3, 0, 2), (17, 33, 9), (64, 1000, 64), (2, INT8_MAX_K, 3)])
@pytest.mark.parametrize("values", ["random", "extremes"])
def test_the_exact_int8_product_is_the_int64_product(m: int, k: int, n: int, values: str) -> None:
    """The CPU backend's int8 product through float64 BLAS, element for element the int64 product, also where every
    sum is the largest or least one int32 holds (-128 * -128 and -128 * 127 all along k = 131071)."""
    rng = np.random.default_rng(m + k + n)
    if values == "random":
        a, b = rng.integers(-128, 128, (m, k), np.int8), rng.integers(-128, 128, (k, n), np.int8)
    else:
        a = np.full((m, k), -128, np.int8)
        b = np.where(np.arange(n) % 2 == 0, np.int8(-128), np.int8(127)) * np.ones((k, n), np.int8)
    c = np.empty((m, n), np.int32)
    exact_int8_product(a, b, c)
    expected = emulate(a, b, Precision.INT8)
    assert expected.dtype == np.int64 and np.array_equal(c, expected)
    assert Reference.of(a, b, np.int32, Precision.INT8).mismatch(c) is None


def test_the_int32_bound_is_zero_an_answer_off_by_one_fails_it() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.integers(-128, 128, (8, 40), np.int8), rng.integers(-128, 128, (40, 8), np.int8)
    c = emulate(a, b, Precision.INT8).astype(np.int32)
    c[5, 2] += 1
    problem = Reference.of(a, b, np.int32, Precision.INT8).mismatch(c)
    assert problem is not None and problem.startswith("element (5, 2) is") and "over the int32 int8 bound 0" in problem
    assert unit_roundoff(np.int32) == 0.0 and input_error(Precision.INT8) == 0.0
