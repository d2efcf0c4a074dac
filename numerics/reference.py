"""How close a product must be to a float64 one: the one per-element error bound, for the engine's self-test, the
tests, the kernel benchmark and the soak.

The bound. C = A @ B computed in a working dtype of unit roundoff u (2^-24 for float32, 2^-53 for float64), with
A and B as the product saw them (already in that dtype), is checked element by element against R = A @ B computed
in float64::

    |C[i, j] - R[i, j]| <= c * sqrt(k) * u * (|A| @ |B|)[i, j],        c = BOUND_CONSTANT = 4

Why this form. Element (i, j) is a sum of k rounded products. Whatever the order of the sum (a kernel's FMA chain,
cuBLAS's split-k or tree reductions, the CPU BLAS's blocks), its error is at most gamma_k * (|A| @ |B|)[i, j] with
gamma_k = k*u / (1 - k*u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1): the
deterministic bound, which grows as k. Rounding errors of either sign add up like a random walk, so the error
actually met grows as sqrt(k): c * sqrt(k) * u * (|A| @ |B|) is the statistical estimate (Higham, section 2.8;
Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 2019), which holds
with a probability that tends to 1 as c grows. Per element and scaled by |A| @ |B|, it judges every element on its
own terms: an element with a large cancellation is not held to the norm of the whole product, and one output
element wrong by one term of its dot product cannot hide in a norm over millions of correct ones.

Why c = 4. The worst ratio |C - R| / (sqrt(k) * u * (|A| @ |B|)) over all elements, measured with NumPy for standard
normal and uniform [0, 1) operands, each product summed in six orders (NumPy's BLAS, the sequential FMA chain of
kernels/emulation.py, sequential with each product rounded before the add, the same backwards, pairwise, and k split
in 16 FMA chains added at the end), k = 1 to 8 on 16 million elements per k, 12 to 64 on a million, 256 to 8192 on
4096:

- float32: at most 1.88 (k = 5); at most 0.91 for k from 256 to 8192.
- float64: at most 2.65 (k = 5). R is itself a float64 product here, as rounded as C, so the ratio holds the
  errors of both, which is why it is larger than float32's; at most 1.24 for k from 256 to 8192.
- For small k the bound is the deterministic one: c * sqrt(k) >= k (one product rounded, float32) for k <= 16 and
  c * sqrt(k) >= 2k (two, float64) for k <= 4, so those products cannot fail by bad luck at all.

c = 4 leaves 2.1x headroom over the worst float32 ratio and 1.5x over float64's on 16 million elements. A product
that misses the term t of element (i, j) errs by |t|, so it fails when |t| > 4 * sqrt(k) * u * (|A| @ |B|)[i, j],
that is when |t| is more than 4 * sqrt(k) * u * k times the mean |term| of its sum: 0.022 of it at k = 2048 in
float32, 0.18 at k = 8192, under 1e-9 in float64. For standard normal operands 95% of the single terms one could
drop at 2048^3 in float32 fail the bound (the relative Frobenius tolerance of 3e-5 used before caught 2.5%, the terms
over 2.8), 76% at 8192^3 (before: none); in float64 practically every one. An element never written is NaN in every
check (outputs are NaN-poisoned first).

What else an element may be:
- (|A| @ |B|)[i, j] = 0: every term is an exact zero, so is the element (the bound is 0).
- a reference that is not finite (NaN or Inf operands): the element must be NaN where R is NaN and the same infinity
  where R is one; elsewhere a NaN or Inf in C fails.
- JSON answers: the service writes the shortest decimal that reads back as the same float32, so a float32 product
  read back as float64 holds exactly the float32 values; no allowance is needed.
- The model assumes no underflow: terms far below 2^-126 (float32) lose relative accuracy. The checks draw normal,
  uniform or integer operands.

The functions take NumPy arrays or CuPy ones (the benchmark checks on the device, where 8192^3 references are
cheap); nothing here imports CuPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from numerics.precision import (
    E4M3_ABSOLUTE_ERROR,
    E4M3_UNIT_ROUNDOFF,
    PRECISIONS_OF,
    Precision,
    e4m3_scale_exponent,
    float32_sums,
    input_error,
    largest_magnitude,
)

BOUND_CONSTANT = 4.0
"""c of the bound |C - R| <= c * sqrt(k) * u * (|A| @ |B|); see the module's docstring for why 4."""
UNIT_ROUNDOFF = MappingProxyType(
    {
        **{np.dtype(dtype): 2.0 ** -(np.finfo(dtype).nmant + 1) for dtype in (np.float32, np.float64)},
        np.dtype(np.int32): 0.0,
    }
)
"""u of each working dtype: half the distance from 1 to the next number, the largest relative rounding error (2^-24
and 2^-53, from the stored fraction bits); 0 for int32, whose sums of int8 products are exact (the bound is 0)."""


def unit_roundoff(dtype: DTypeLike) -> float:
    """UNIT_ROUNDOFF of `dtype` (a dtype, its type or its name)."""
    return UNIT_ROUNDOFF[np.dtype(dtype)]


@dataclass(frozen=True)
class Reference:
    """A @ B in float64 and the scale of its error bound, computed once for any number of products of the same
    operands: `Reference.of(a, b, dtype).mismatch(c)`."""

    product: Any
    """R = A @ B in float64 (a NumPy or CuPy array, as the operands were)."""
    scale: Any
    """sqrt(k) * u * (|A| @ |B|): the error each element may have, before c (with a precision's own term)."""
    dtype: np.dtype
    precision: Precision = Precision.FP32

    @classmethod
    def of(cls, a: Any, b: Any, dtype: DTypeLike, precision: Precision = Precision.FP32) -> Reference:
        """The reference of a product computed in `dtype` from a and b (2-D, or stacks of them): the operands are
        cast into `dtype` first, as the engine casts them, so that their own rounding is not counted as error.
        A `precision` other than fp32 (float32 only) rounds the operands further on the way into the multiplier:
        that rounding is the product's error, and its term is added (numerics/precision.py says why this form):

            |C - R| <= c * (input_error * sqrt((A*A) @ (B*B)) + sums * sqrt(k) * u * (|A| @ |B|))

        and for fp8 the subnormals' absolute term too (`e4m3_subnormal_term`).
        """
        working = np.dtype(dtype)
        if precision not in PRECISIONS_OF[working.name]:
            raise ValueError(f"a {working} product is not computed in precision {precision}")
        a_wide, b_wide = (x.astype(working).astype(np.float64) for x in (a, b))
        with np.errstate(invalid="ignore"):  # NaN or Inf operands: Inf * 0, Inf - Inf
            product, scale = a_wide @ b_wide, abs(a_wide) @ abs(b_wide)
        scale *= float32_sums(precision) * math.sqrt(a.shape[-1]) * unit_roundoff(working)
        if input_error(precision):
            with np.errstate(invalid="ignore"):
                scale += input_error(precision) * ((a_wide * a_wide) @ (b_wide * b_wide)) ** 0.5
        if precision is Precision.FP8:
            scale += e4m3_subnormal_term(a_wide, b_wide)
        return cls(product=product, scale=scale, dtype=working, precision=precision)

    @property
    def mode(self) -> str:
        return self.dtype.name if self.precision is Precision.FP32 else f"{self.dtype.name} {self.precision}"

    def relative_error(self, c: Any) -> float:
        """||C - R|| / ||R|| (Frobenius), the figure the benchmarks compare between precisions."""
        reference_norm = float(np.linalg.norm(self.product))
        difference = float(np.linalg.norm(c.astype(np.float64) - self.product))
        return difference / reference_norm if reference_norm else difference

    def ratios(self, c: Any) -> Any:
        """|c - R| / scale per element, in float64: within the bound where at most BOUND_CONSTANT. 0 where c is
        exactly R (a zero scale included, and NaN where R is NaN, the same infinity where R is one); Inf where c
        is NaN or Inf and R is not the same."""
        if c.shape != self.product.shape:
            raise ValueError(f"a product of shape {tuple(c.shape)} against a reference of {tuple(self.product.shape)}")
        wide, reference = c.astype(np.float64), self.product
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = abs(wide - reference) / self.scale
        exact = (wide == reference) | ((wide != wide) & (reference != reference))  # x != x: x is NaN
        ratios[exact] = 0.0
        ratios[ratios != ratios] = np.inf
        return ratios

    def error_ratio(self, c: Any) -> float:
        """The largest of `ratios(c)` (0 for an empty product): c is within the bound when it is at most
        BOUND_CONSTANT."""
        ratios = self.ratios(c)
        return float(ratios.max()) if ratios.size else 0.0

    def mismatch(self, c: Any) -> str | None:
        """What is wrong with c, naming its worst element, or None when every element is within the bound."""
        ratios = self.ratios(c)
        if not ratios.size:
            return None
        worst = int(ratios.argmax())
        ratio = float(ratios.ravel()[worst])
        if ratio <= BOUND_CONSTANT:
            return None
        where = tuple(int(i) for i in np.unravel_index(worst, ratios.shape))
        value, expected = float(c.ravel()[worst]), float(self.product.ravel()[worst])
        allowed = BOUND_CONSTANT * float(self.scale.ravel()[worst])
        return (
            f"element {where} is {value!r}, the float64 product {expected!r}: off by {abs(value - expected):.3g}, "
            f"over the {self.mode} bound {allowed:.3g} ({ratio:.3g} x sqrt(k) u |A||B|, c = {BOUND_CONSTANT:g})"
        )


def e4m3_subnormal_term(a: Any, b: Any) -> Any:
    """What fp8's subnormals add to the bound of each element of a @ b (float64 operands, 2-D or stacks). Below 2^-6
    (scaled) e4m3 rounds to a grid of 2^-9, so an operand element moves by at most u |x| + eta, eta = 2^-10 * 2^-e
    (its scale's exponent e), not u |x| alone; the term a b then errs by at most
    (2u + u^2) |a b| + (1 + u) (eta_A |b| + eta_B |a|) + eta_A eta_B. The first part is `input_error`'s; the rest,
    summed over k as a random walk as that one is, is at most (1 + u) (eta_A ||B[:, j]|| + eta_B ||A[i, :]||) +
    eta_A eta_B sqrt(k) (Minkowski)."""
    eta_a, eta_b = (math.ldexp(E4M3_ABSOLUTE_ERROR, -e4m3_scale_exponent(largest_magnitude(x))) for x in (a, b))
    rows = ((a * a).sum(axis=-1, keepdims=True)) ** 0.5
    columns = ((b * b).sum(axis=-2, keepdims=True)) ** 0.5
    return (1 + E4M3_UNIT_ROUNDOFF) * (eta_a * columns + eta_b * rows) + eta_a * eta_b * math.sqrt(a.shape[-1])


def max_error_ratio(c: Any, a: Any, b: Any, dtype: DTypeLike) -> float:
    """The largest |C - R| / (sqrt(k) * u * (|A| @ |B|)) of c, a product of a and b computed in `dtype`."""
    return Reference.of(a, b, dtype).error_ratio(c)


def assert_close_to_reference(c: Any, a: Any, b: Any, dtype: DTypeLike, precision: Precision = Precision.FP32) -> None:
    """c is a @ b computed in `dtype` (and `precision`), every element within the bound; AssertionError naming the
    worst one if not."""
    problem = Reference.of(a, b, dtype, precision).mismatch(c)
    if problem is not None:
        raise AssertionError(problem)
