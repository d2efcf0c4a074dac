"""The values every decoder produces, and the checks each applies while decoding.

`Operands` are the two matrices as they were sent (dtype, byte order and layout kept): the engine converts them
once, into its own buffers, to the working dtype. Every problem is raised as an `InvalidInput` that says which
matrix and where, before any array of a refused size is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.errors import InvalidMatrix, InvalidParameter, ShapeMismatch
from app.shapes import check_dimensions
from app.shared_memory import Matrix

OPERANDS = ("a", "b")
Body = bytes | bytearray | memoryview
"""A request body as read: bytes, a kept buffer, or a view of memory lent for it (shared memory the engine reads)."""
SUPPORTED_DTYPES = "supported are float16, float32, float64 and integers"


@dataclass(frozen=True)
class Limits:
    """Size limits applied while decoding, before any array of that size is allocated."""

    max_dim: int
    max_elements: int
    max_result_elements: int


@dataclass(frozen=True)
class RequestOptions:
    """Options a request gives in its query string or, for JSON, in the body beside the matrices."""

    kernel: str | None = None
    tile: int | None = None
    dtype: str | None = None
    precision: str | None = None

    def merged_with(self, other: RequestOptions) -> RequestOptions:
        """Both sets of options in one; a value given twice must agree."""
        merged: dict[str, Any] = {}
        for key in ("kernel", "tile", "dtype", "precision"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine is not None and theirs is not None and mine != theirs:
                raise InvalidParameter(
                    f"'{key}' is given twice with different values: {mine!r} and {theirs!r}", location=[key]
                )
            merged[key] = mine if mine is not None else theirs
        return RequestOptions(**merged)


@dataclass(frozen=True)
class Operands:
    """The two matrices of a request, and the options a JSON body may carry beside them."""

    a: Matrix
    b: Matrix
    options: RequestOptions = RequestOptions()
    typed: bool = True
    """Whether the operands' dtypes were chosen by the client (.npy) rather than inferred from JSON numbers."""


def _kind_name(dtype: np.dtype) -> str:
    return "pickled Python objects" if dtype.hasobject else str(dtype)


def check_matrix(array: np.ndarray, name: str, limits: Limits) -> np.ndarray:
    """A matrix, or a stack of matrices (app/shapes.py), of integers or float16/32/64 within the limits, or
    InvalidMatrix/ShapeMismatch."""
    check_dimensions(tuple(array.shape), name)
    check_dtype(array.dtype, name)
    check_shape(tuple(array.shape), name, limits)
    return array


def check_dtype(dtype: np.dtype, name: str) -> None:
    if (
        dtype.names is not None
        or dtype.hasobject
        or not (dtype.kind in "iu" or (dtype.kind == "f" and dtype.itemsize in (2, 4, 8)))
    ):
        raise InvalidMatrix(
            f"matrix '{name}' has dtype {_kind_name(dtype)}; {SUPPORTED_DTYPES} (converted to the requested float "
            "dtype)",
            location=[name],
        )


def check_shape(shape: tuple[int, ...], name: str, limits: Limits, max_elements: int | None = None) -> None:
    """Every dimension within max_dim and the element count within max_elements (or the limit given)."""
    for axis, size in enumerate(shape):
        if size > limits.max_dim:
            raise ShapeMismatch(
                f"dimension {axis} of '{name}' is {size}, over the limit of {limits.max_dim}", location=[name]
            )
    bound = limits.max_elements if max_elements is None else max_elements
    if math.prod(shape) > bound:
        raise ShapeMismatch(
            f"matrix '{name}' has {math.prod(shape)} elements, over the limit of {bound}", location=[name]
        )


MAX_DECLARED_DIGITS = 19
"""The most significant digits of a size a header declares that is read (an int64's): Python's int() refuses 4,301
digits and more, and no body is larger."""


def declared_size(value: str) -> int | None:
    """The size a header declares (Content-Length, Inference-Header-Content-Length): ASCII digits (str.isdigit also
    takes '²'), leading zeros aside, at most MAX_DECLARED_DIGITS of them; None for any other value."""
    digits = value.lstrip("0")
    if value.isascii() and value.isdigit() and len(digits) <= MAX_DECLARED_DIGITS:
        return int(digits or "0")
    return None


def require_operands(names: Iterable[str], container: str) -> None:
    present = set(names)
    missing = [name for name in OPERANDS if name not in present]
    extra = sorted(present - set(OPERANDS))
    if missing or extra:
        said = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else ""]
        raise InvalidMatrix(
            f"the {container} must hold exactly 'a' and 'b': " + ", ".join(s for s in said if s),
            location=[(missing or extra)[0]],
        )
