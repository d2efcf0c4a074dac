"""The precisions a float32 product may run in, what rounding each adds, and cuBLAS in each (the library every
rung of the tensor-core ladder is measured against, in the same mode); and int8, the exact integer product.

Operands stay float32; a precision says how the multiplier sees them. The products are summed in float32 in every
mode, so a precision adds to the float32 product's error one term, from rounding the operands, and 3xtf32 adds two
more float32 sums:

- fp32: the operands as they are (the FMA units, or cuBLAS SGEMM): no term.
- tf32: each operand rounded to TF32 (10 fraction bits) by the tensor cores; u = 2^-10, the truncation unit,
  since neither the PTX conversion cuBLAS uses nor cuBLAS's documentation promises rounding to nearest. The own
  kernels round to nearest before the tensor cores read an operand: truncating errs one way, and for operands of
  one sign that error grows with k, not as the random walk below (emulated, uniform [0, 1) operands, both
  truncated: the worst element at 4.6 at k = 256 and 15 at k = 4096, where the bound allows c = 4).
- bf16: each operand rounded to nearest bfloat16 here (7 fraction bits): u = 2^-8.
- fp16: each operand rounded to nearest float16 (10 fraction bits): u = 2^-11, for values inside float16's range.
- fp8: each operand multiplied by a power of two 2^e of its own, chosen from its largest magnitude so that it lands
  in (224, 448] (`e4m3_scale_exponent`), then rounded to nearest e4m3 (3 fraction bits: u = 2^-4; values below 2^-6
  onto the subnormals' grid of 2^-9, so also an absolute error of at most 2^-10 * 2^-e, `E4M3_ABSOLUTE_ERROR`); the
  product of the rounded operands is scaled back by 2^-(e_A + e_B). Scaling by a power of two rounds nothing, and no
  element can round past e4m3's largest value, 448, since the largest magnitude lands at or below it: out of range
  is impossible by construction. e4m3 has no infinity, so fp8 takes finite operands only.
- 3xtf32: each operand split into a TF32 big part and the TF32 rounding of what is left, x = big + small; the
  product is big·big + big·small + small·big, three TF32 products summed in float32, which drops small·small and
  the rounding of the small parts: at most about 3u^2 of each term, with the tf32 u (`float32_sums` says what
  the three sums add).

The bound of that term. A term t = a·b computed from rounded operands a(1 + d1)·b(1 + d2), |d| <= u, errs by at
most e = 2u + u^2 of itself (`input_error`). Summed over k terms, the errors are at most e * (|A| @ |B|) per element,
but they have either sign and add like a random walk, as the sum's own roundings do (numerics/reference.py), so what
is met is about e times the 2-norm of the terms, sqrt((A*A) @ (B*B)): the probabilistic form (Higham and Mary,
2019), exact for k = 1. numerics/reference.py checks

    |C - R| <= c * (e * sqrt((A*A) @ (B*B)) + sums * sqrt(k) * u32 * (|A| @ |B|)),   c = 4.

Measured on the CPU (`emulate`, 64x64 products of standard normal and uniform [0, 1) operands, k = 1 to 4096; the
float32 sums exact there), the largest |C - R| / (e * sqrt((A*A) @ (B*B))) was 0.60 for tf32 (rounded to nearest,
against the truncation unit), 1.09 for bf16, 1.22 for fp16 and 0.14 for 3xtf32, about the same for every k: c = 4
leaves 3.3x headroom. The 1-norm form, e * (|A| @ |B|), would be as safe and, at k = 4096, sqrt(k)/c = 16 times too
loose to tell bf16 from tf32.

int8 is not a rounding: int8 operands multiplied on the integer tensor cores into int32 sums, exactly, for a product
of dtype int32 (`PRECISIONS_OF`). Every term is at most 128 * 128 in magnitude, so k terms fit int32 while
k * 128 * 128 <= 2^31 - 1 (`int8_fits`: k up to 131,071); past that a sum could wrap, and the product is refused.

The conversions here use only array operations on the float32 bits, so they run as they are on NumPy and CuPy
arrays (the tests emulate every mode on the CPU with them). cuBLAS in each mode is kernels/cublas.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np


class Precision(StrEnum):
    FP32 = "fp32"
    TF32 = "tf32"
    TF32X3 = "3xtf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"


FLOAT_PRECISIONS = tuple(precision for precision in Precision if precision is not Precision.INT8)
"""The precisions of a float32 product: its own, and the tensor cores' roundings of its operands."""
INT8_PRODUCT = "int32"
"""The dtype of the exact product of int8 operands (precision int8): its int32 sums."""
PRECISIONS_OF: dict[str, tuple[Precision, ...]] = {
    "float32": FLOAT_PRECISIONS,
    "float64": (Precision.FP32,),
    INT8_PRODUCT: (Precision.INT8,),
}
"""Product dtype -> the precisions it may be computed in: float64 in its own alone ("fp32": no operand rounding),
int32 from int8 operands alone."""
INT8_OPERAND = np.dtype(np.int8)
OPERAND_DTYPES: dict[str, np.dtype] = {INT8_PRODUCT: INT8_OPERAND}
"""Product dtype -> the dtype its operands are multiplied in, where that is not the product's own."""


def operand_dtype(product: np.dtype) -> np.dtype:
    """The dtype a product's operands are staged and multiplied in: int8 for int32, else the product's own."""
    return OPERAND_DTYPES.get(product.name, product)


INT8_LARGEST_PRODUCT = 128 * 128
"""The largest magnitude of a product of two int8 values, (-128) * (-128): k of them must fit an int32."""
INT32_MAX = 2**31 - 1
INT8_MAX_K = INT32_MAX // INT8_LARGEST_PRODUCT
"""131,071: the longest sum of int8 products that int32 holds whatever the operands."""


def int8_fits(k: int) -> bool:
    """Whether every int32 sum of k int8 products is exact: k * 128 * 128 <= 2^31 - 1."""
    return k <= INT8_MAX_K


@dataclass(frozen=True)
class Format:
    """A binary floating-point format an operand is rounded into: its stored fraction bits and largest exponent."""

    fraction_bits: int
    max_exponent: int

    @property
    def unit_roundoff(self) -> float:
        """The largest relative error of rounding to nearest: half the distance from 1 to the next value."""
        return 2.0 ** -(self.fraction_bits + 1)

    @property
    def largest(self) -> float:
        """The largest finite value."""
        return (2.0 - 2.0**-self.fraction_bits) * 2.0**self.max_exponent

    @property
    def overflow(self) -> float:
        """The smallest magnitude that rounding to nearest makes infinite: halfway from the largest finite value to
        the next power of two."""
        return (2.0 - self.unit_roundoff) * 2.0**self.max_exponent


FLOAT32_FRACTION_BITS = 23
TF32 = Format(fraction_bits=10, max_exponent=127)
"""NVIDIA's TensorFloat-32: float32's 8 exponent bits, float16's 10 fraction bits (19 bits in all)."""
BF16 = Format(fraction_bits=7, max_exponent=127)
"""bfloat16: the upper half of a float32 (sign, 8 exponent bits, 7 fraction bits)."""
FP16 = Format(fraction_bits=10, max_exponent=15)
"""IEEE binary16."""
E4M3_FRACTION_BITS = 3
E4M3_LARGEST = 448.0
"""e4m3's largest finite value, 1.75 * 2^8: the format has no infinity, and S.1111.111 is NaN."""
E4M3_SMALLEST_NORMAL = 2.0**-6
E4M3_SUBNORMAL_SPACING = 2.0**-9
E4M3_UNIT_ROUNDOFF = 2.0 ** -(E4M3_FRACTION_BITS + 1)
E4M3_ABSOLUTE_ERROR = E4M3_SUBNORMAL_SPACING / 2
"""The most rounding to nearest moves a value below 2^-6, where e4m3's values are 2^-9 apart: 2^-10."""
TF32_UNIT_ROUNDOFF = 2 * TF32.unit_roundoff
"""2^-10, the truncation unit: twice rounding to nearest's, since the tensor cores may truncate (module docstring)."""
BF16_UNIT_ROUNDOFF = BF16.unit_roundoff
FP16_UNIT_ROUNDOFF = FP16.unit_roundoff
OPERAND_FORMATS: dict[Precision, Format] = {
    Precision.TF32: TF32,
    Precision.TF32X3: TF32,
    Precision.BF16: BF16,
    Precision.FP16: FP16,
}
"""The format each precision rounds float32 operands into (3xtf32: its big part): a float32 operand at or beyond the
format's `overflow` would be infinite there. fp16's range ends at 65504; bf16's and tf32's a sliver below float32's."""


UNIT_ROUNDOFFS: dict[Precision, float] = {
    Precision.TF32: TF32_UNIT_ROUNDOFF,
    Precision.BF16: BF16_UNIT_ROUNDOFF,
    Precision.FP16: FP16_UNIT_ROUNDOFF,
    Precision.FP8: E4M3_UNIT_ROUNDOFF,
}
"""u of the format each precision rounds operands into (3xtf32's terms are `input_error`'s own)."""


def input_error(precision: Precision) -> float:
    """The most the operands' rounding in `precision` adds to an element, relative to (|A| @ |B|) there."""
    if precision in (Precision.FP32, Precision.INT8):
        return 0.0
    if precision is Precision.TF32X3:
        u = TF32_UNIT_ROUNDOFF
        return 3 * u * u * (1 + u)
    u = UNIT_ROUNDOFFS[precision]
    return 2 * u + u * u


def float32_sums(precision: Precision) -> float:
    """How much float32 summing makes the element, in sums of its k terms: one, or for 3xtf32 1.25. There the
    big·big sum is the one that counts; the two others sum terms under 2^-10 of its own, and the two additions of
    the three results round at most u32 * |C| each, within a quarter of c * sqrt(k) * u32 * (|A| @ |B|) from k = 4
    on (and for k < 4 the big·big sum of so few terms errs far less than its bound)."""
    return 1.25 if precision is Precision.TF32X3 else 1.0


def _round_bits(x: Any, dropped_bits: int) -> Any:
    """float32 `x` with its lowest `dropped_bits` fraction bits rounded away, to nearest, ties to even (NaN and
    infinities stay as they are; a value that rounds past the largest finite becomes infinite, as it should)."""
    bits = x.astype(np.float32).view(np.uint32)
    half = np.uint32((1 << (dropped_bits - 1)) - 1)
    odd = (bits >> np.uint32(dropped_bits)) & np.uint32(1)
    rounded = (bits + half + odd) & np.uint32(~((1 << dropped_bits) - 1) & 0xFFFFFFFF)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    return (rounded * finite + bits * ~finite).view(np.float32)


def to_tf32(x: Any) -> Any:
    """float32 values rounded to nearest TF32 (kept in float32)."""
    return _round_bits(x, FLOAT32_FRACTION_BITS - TF32.fraction_bits)


def to_bf16(x: Any) -> Any:
    """float32 values rounded to nearest bfloat16 (kept in float32; `bf16_bits` gives the 16-bit form)."""
    return _round_bits(x, FLOAT32_FRACTION_BITS - BF16.fraction_bits)


def bf16_bits(x: Any) -> Any:
    """The bfloat16 encodings (uint16) of float32 values rounded to nearest."""
    return (to_bf16(x).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def to_fp16(x: Any) -> Any:
    """float32 values rounded to nearest float16 (kept in float32)."""
    return x.astype(np.float16).astype(np.float32)


def split_tf32(x: Any) -> tuple[Any, Any]:
    """x = big + small: the TF32 rounding of x, and what is left (exact in float32)."""
    big = to_tf32(x)
    with np.errstate(invalid="ignore"):  # infinite x: inf - inf is NaN, as the device computes it too
        return big, x - big


def e4m3_scale_exponent(amax: float) -> int:
    """The exponent e of the power of two that brings an operand's largest magnitude `amax` (finite) to at most 448,
    e4m3's largest value, and as near it as a power of two can: amax * 2^e in (224, 448]; 0 for amax = 0.
    kernels/e4m3_scale.cuh computes the same on the device."""
    if amax == 0:
        return 0
    fraction, exponent = math.frexp(float(np.float32(amax)))  # amax = fraction * 2^exponent, fraction in [0.5, 1)
    return (9 if fraction <= 0.875 else 8) - exponent  # 448 = 0.875 * 2^9


def largest_magnitude(x: Any) -> float:
    """max |x| (0 for an empty x): what an operand's FP8 scale comes from."""
    return float(abs(x).max()) if x.size else 0.0


def to_e4m3(y: Any) -> Any:
    """float32 values (at most 448 in magnitude, as scaled ones are) rounded to nearest e4m3, ties to even, kept in
    float32: 3 fraction bits from 2^-6 up, multiples of 2^-9 below it."""
    y = y.astype(np.float32)
    subnormal = np.round(y / np.float32(E4M3_SUBNORMAL_SPACING)) * np.float32(E4M3_SUBNORMAL_SPACING)
    normal = _round_bits(y, FLOAT32_FRACTION_BITS - E4M3_FRACTION_BITS)
    return np.where(abs(y) < E4M3_SMALLEST_NORMAL, subnormal, normal)


def scaled_e4m3(x: Any) -> tuple[Any, int]:
    """x scaled by its power of two and rounded to e4m3 (in float32), and the exponent e of that scale: x is about
    2^-e times the first."""
    exponent = e4m3_scale_exponent(largest_magnitude(x))
    return to_e4m3(np.ldexp(x.astype(np.float32), np.int32(exponent))), exponent


_ROUNDING: dict[Precision, Callable[[Any], Any]] = {
    Precision.FP32: lambda x: x,
    Precision.TF32: to_tf32,
    Precision.BF16: to_bf16,
    Precision.FP16: to_fp16,
}
"""How each single-product mode rounds an operand on its way into the multiplier."""


def emulate(a: Any, b: Any, precision: Precision) -> Any:
    """a @ b as `precision` computes it, with the float32 sums done in float64 (NumPy or CuPy): what the bound
    allows for the rounding of the operands, and nothing for the sums; for tests of the bound. int8: the exact
    product, in int64, summed by float64 BLAS (`exact_int8_product` says why that is exact)."""
    if precision is Precision.INT8:
        return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)
    if precision is Precision.FP32:
        return a.astype(np.float64) @ b.astype(np.float64)
    if precision is Precision.TF32X3:
        (a_big, a_small), (b_big, b_small) = split_tf32(a), split_tf32(b)
        wide = [to_tf32(x).astype(np.float64) for x in (a_big, a_small, b_big, b_small)]
        return wide[0] @ wide[2] + wide[0] @ wide[3] + wide[1] @ wide[2]
    if precision is Precision.FP8:
        (a_e4m3, a_exponent), (b_e4m3, b_exponent) = scaled_e4m3(a), scaled_e4m3(b)
        return np.ldexp(a_e4m3.astype(np.float64) @ b_e4m3.astype(np.float64), -(a_exponent + b_exponent))
    return _ROUNDING[precision](a).astype(np.float64) @ _ROUNDING[precision](b).astype(np.float64)


def float32_emulation(a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """a @ b as `precision` rounds it, on float32 hardware (the CPU backend): the operands rounded as the tensor
    cores see them, the sums in float32 (3xtf32: the three products summed small ones first). Not the tensor
    cores' bits, whose order of summing differs, but within the same bound (numerics/reference.py)."""
    if precision is Precision.TF32X3:
        (a_big, a_small), (b_big, b_small) = split_tf32(a), split_tf32(b)
        a_small, b_small = to_tf32(a_small), to_tf32(b_small)
        result: np.ndarray = a_big @ b_small + a_small @ b_big + a_big @ b_big
        return result
    if precision is Precision.FP8:
        (a_e4m3, a_exponent), (b_e4m3, b_exponent) = scaled_e4m3(a), scaled_e4m3(b)
        scaled_back: np.ndarray = np.ldexp(a_e4m3 @ b_e4m3, np.int32(-(a_exponent + b_exponent)))
        return scaled_back
    rounded: np.ndarray = _ROUNDING[precision](a) @ _ROUNDING[precision](b)
    return rounded


def exact_int8_product(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out (int32) = a @ b for int8 a and b, exactly, through float64 BLAS: every term and partial sum is an integer
    of magnitude at most k * 128 * 128 <= 2^31 - 1 (`int8_fits`), far inside the 2^53 that float64 holds exactly, so
    no sum rounds; NumPy's own integer matmul is exact too, but has no BLAS behind it."""
    np.copyto(out, a.astype(np.float64) @ b.astype(np.float64), casting="unsafe")
