"""Converting decoded operands into the working dtype, once, into a buffer the backend chose."""

from __future__ import annotations

import itertools
import math
from concurrent.futures import Executor, wait
from typing import Any

import numpy as np

from app.errors import InvalidMatrix
from numerics.precision import INT8_OPERAND, OPERAND_FORMATS, Precision


def cast_into(
    dst: np.ndarray, src: np.ndarray, name: str, first_row: int = 0, precision: Precision = Precision.FP32
) -> None:
    """Copy `src` into `dst` (any dtype, byte order and layout in; dst's out), refusing values that overflow.

    NaN and infinities already in `src` are copied as they are; a finite value too large for dst's dtype
    (1e39 into float32), or for the format `precision` rounds operands into (7e4 in fp16), is an error, not a
    silent infinity. An integer `dst` (int8 operands of an int32 product) takes only integers in its range: 200 or
    0.5 is an error, never wrapped or truncated. `first_row` is the row of the whole matrix that `src` starts at,
    when it is a band of rows, so that the error names the right element.
    """
    if dst.dtype.kind == "i":
        check_integers(src, dst.dtype, name, first_row)
        np.copyto(dst, src, casting="unsafe")
        return
    try:
        with np.errstate(over="raise"):
            np.copyto(dst, src, casting="unsafe")
    except FloatingPointError:
        limit = np.finfo(dst.dtype).max
        with np.errstate(invalid="ignore"):
            too_large = np.isfinite(src) & (np.abs(src) > limit)
        raise _refusal(
            src, too_large, name, first_row, f"is out of range for {dst.dtype} (largest {limit:.4g})"
        ) from None
    # a float source whose largest value rounds finitely into the format cannot overflow it; fp8 refuses NaN and
    # infinities, which any float source may hold
    cannot_overflow = src.dtype.kind == "f" and float(np.finfo(src.dtype).max) < _overflow(precision)
    if precision is Precision.FP8 or not cannot_overflow:
        check_in_format(dst, name, precision, first_row=first_row)


def check_integers(x: np.ndarray, dtype: np.dtype, name: str, first_row: int = 0) -> None:
    """InvalidMatrix naming the first element of `x` that is not an integer in `dtype`'s range (an integer dtype):
    two reductions when every element is one, an element-by-element look only when one is not."""
    info = np.iinfo(dtype)
    if x.size == 0 or (x.dtype.kind in "iu" and np.can_cast(x.dtype, dtype)):
        return
    low, high = x.min(), x.max()
    with np.errstate(invalid="ignore"):
        whole = x.dtype.kind in "iu" or bool(np.all(np.floor(x) == x))  # False for NaN and infinities
    if whole and info.min <= low and high <= info.max:
        return
    with np.errstate(invalid="ignore"):
        wrong = (x < info.min) | (x > info.max)
        if x.dtype.kind == "f":
            wrong |= np.floor(x) != x  # NaN too
    raise _refusal(
        x,
        wrong,
        name,
        first_row,
        f"is not an {dtype} (an integer from {info.min} to {info.max}): an int32 product multiplies {dtype} operands "
        f"exactly; send {dtype} values or ask for a float dtype",
    )


def check_finite(x: Any, name: str, first_row: int = 0) -> None:
    """InvalidMatrix naming the first element of `x` (NumPy or CuPy, float) that is NaN or infinite: fp8 scales an
    operand by its largest magnitude, and e4m3 holds no infinity. Two reductions when every element is finite."""
    if x.size == 0 or (math.isfinite(float(x.max())) and math.isfinite(float(x.min()))):
        return
    raise _refusal(
        x,
        ~np.isfinite(x),
        name,
        first_row,
        f"is not finite: precision {Precision.FP8} scales each operand by its largest magnitude into e4m3, which "
        "has no infinity; send finite values or ask for another precision",
    )


def _refusal(x: Any, flags: Any, name: str, first_row: int, says: str) -> InvalidMatrix:
    """The InvalidMatrix naming the first element of `x` (NumPy or CuPy: a matrix or a stack of them, or a band of
    its first axis from `first_row`, rows of a matrix or matrices of a stack) where `flags` is True, in C order,
    its value, and what `says` is wrong with it."""
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(flags)), flags.shape))
    whole = (index[0] + first_row, *index[1:])
    where = "".join(f"[{i}]" for i in whole)
    return InvalidMatrix(f"{name}{where} = {x[index].item()!r} {says}", location=[name, *whole])


def _overflow(precision: Precision) -> float:
    operand_format = OPERAND_FORMATS.get(precision)
    return math.inf if operand_format is None else operand_format.overflow


def reads_elements(precision: Precision) -> bool:
    """Whether check_in_format reads the elements of an operand in `precision`; where it does not (fp32: float32
    and float64 products of the operands as they are) it returns at once."""
    return precision in (Precision.INT8, Precision.FP8) or not math.isinf(_overflow(precision))


def check_in_format(x: Any, name: str, precision: Precision, first_row: int = 0) -> None:
    """InvalidMatrix when a finite element of `x` (a NumPy or a CuPy array) would be infinite once rounded into the
    format `precision` rounds operands into (7e4 in fp16), the first of those being named. Two reductions when every
    element is finite and in range; NaN and infinities pass as they are. For int8, any element that is not an int8
    (`check_integers`); for fp8, any that is not finite (`check_finite`)."""
    if precision is Precision.INT8:
        check_integers(x, INT8_OPERAND, name, first_row)
        return
    if precision is Precision.FP8:
        check_finite(x, name, first_row)
        return
    limit = _overflow(precision)
    if math.isinf(limit) or x.size == 0:
        return
    with np.errstate(invalid="ignore"):
        if float(x.max()) < limit and float(x.min()) > -limit:  # False where NaN is: then look element by element
            return
        beyond = np.isfinite(x) & (np.abs(x) >= limit)
    if not bool(beyond.any()):
        return
    raise _refusal(
        x,
        beyond,
        name,
        first_row,
        f"is out of range for precision {precision} (largest {OPERAND_FORMATS[precision].largest:.6g}): it would be "
        "infinite there; send smaller values or ask for another precision",
    )


PARALLEL_BYTES = 8 << 20
"""Operands at least this large are copied by several threads at once, in bands of rows; below it one thread's
copy takes under about 1.5 ms and handing bands out costs more than it saves."""


def cast_into_parallel(dst: np.ndarray, src: np.ndarray, name: str, threads: Executor, bands: int) -> None:
    """`cast_into`, split into `bands` bands of rows copied by `threads` when `dst` is large: one thread moves
    about 5-6 GB/s into pinned memory (22 ms of a 4096^2 float32 product's two operands, on the H100 host), and
    NumPy copies without holding the GIL. The error of the first band with a value out of range is raised, once every
    band has ended."""
    rows = dst.shape[0]
    if dst.nbytes < PARALLEL_BYTES or rows < bands:
        cast_into(dst, src, name)
        return
    edges = [rows * i // bands for i in range(bands + 1)]
    copies = [
        threads.submit(cast_into, dst[start:stop], src[start:stop], name, start)
        for start, stop in itertools.pairwise(edges)
    ]
    wait(copies)  # every band has ended before dst or src can be given back, a refused one or not
    try:
        for copy in copies:
            copy.result()
    finally:
        # A refusal's traceback holds this frame, and the frame the futures that hold the refusal: a cycle, which
        # would keep dst and src until a garbage collection.
        del copies, copy
