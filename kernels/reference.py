"""How close a product must be to a float64 one: the one tolerance table and the error it bounds, for the engine's
self-test, the tests, the kernel benchmark and the soak.

The measure is the relative Frobenius error ||C - R|| / ||R|| against R = A @ B computed in float64. A correct dot
product of k terms rounded in working precision errs about sqrt(k) * u (u the unit roundoff: 2^-24 for float32,
2^-53 for float64) for operands drawn from a standard normal, whatever order the sum is taken in; an element that
was never written or came from the wrong place errs near 1.

- float32: 3e-5. The largest k checked is 8192 (the benchmark's square sizes; the tests go to 4097), where
  sqrt(k) * 2^-24 is 5.4e-6: headroom of about 5x. A product that travels as JSON (the soak checks those) needs no
  looser entry: the service writes the shortest decimal that reads back as the same float32, which, read as a
  float64, differs from it by under half a float32 ulp, at most 2^-24 of each element.
- float64: 1e-13. sqrt(8192) * 2^-53 is 1.0e-14: headroom of about 10x.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
from numpy.typing import DTypeLike

REL_TOLERANCE = MappingProxyType({np.dtype(np.float32): 3e-5, np.dtype(np.float64): 1e-13})
"""Relative Frobenius error allowed against a float64 reference, by the dtype the product was computed in."""


def tolerance(dtype: DTypeLike) -> float:
    """REL_TOLERANCE of `dtype` (a dtype, its type or its name)."""
    return REL_TOLERANCE[np.dtype(dtype)]


def relative_error(c: np.ndarray, reference: np.ndarray) -> float:
    """||c - reference|| / ||reference|| (Frobenius, in float64); the absolute error where the reference is zero."""
    scale = float(np.linalg.norm(reference))
    return float(np.linalg.norm(c.astype(np.float64) - reference)) / (scale if scale else 1.0)
