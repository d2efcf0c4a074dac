"""Converting decoded operands into the working dtype, once, into a buffer the backend chose."""

from __future__ import annotations

import numpy as np

from app.errors import InvalidMatrix


def cast_into(dst: np.ndarray, src: np.ndarray, name: str) -> None:
    """Copy `src` into `dst` (any dtype, byte order and layout in; dst's out), refusing values that overflow.

    NaN and infinities already in `src` are copied as they are; a finite value too large for dst's dtype
    (1e39 into float32) is an error, not a silent infinity.
    """
    try:
        with np.errstate(over="raise"):
            np.copyto(dst, src, casting="unsafe")
    except FloatingPointError:
        limit = np.finfo(dst.dtype).max
        with np.errstate(invalid="ignore"):
            too_large = np.isfinite(src) & (np.abs(src) > limit)
        row, col = np.unravel_index(int(np.argmax(too_large)), src.shape)
        raise InvalidMatrix(
            f"{name}[{row}][{col}] = {src[row, col].item()!r} is out of range for {dst.dtype} (largest {limit:.4g})",
            location=[name, int(row), int(col)],
        ) from None
