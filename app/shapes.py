"""The shapes a product may have: two matrices, or stacks of them, multiplied as `numpy.matmul` multiplies them.

An operand is a matrix (m x k) or a stack of matrices with one leading, batch, dimension (B x m x k): the shape a
Triton user's batch dimension gives, and the one that lets many small products share an exchange. A stack's
matrices pair up with the other operand's one by one, and a single matrix, or a stack of one, is broadcast against
a stack, as NumPy broadcasts: (B, m, k) @ (B, k, n), (B, m, k) @ (k, n), (m, k) @ (B, k, n), (1, m, k) @ (B, k, n)
all give (B, m, n); two matrices give a matrix. More leading dimensions are refused (InvalidMatrix) where they are
decoded: `OPERAND_DIMENSIONS` says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from app.errors import InvalidMatrix, ShapeMismatch

OPERAND_DIMENSIONS = (2, 3)
"""A matrix, or a stack of matrices with one leading (batch) dimension."""


def check_dimensions(shape: tuple[int, ...], name: str, what: str = "matrix") -> None:
    """InvalidMatrix unless `shape` is that of a matrix or of a stack of matrices."""
    if len(shape) not in OPERAND_DIMENSIONS:
        raise InvalidMatrix(
            f"{what} '{name}' must be 2-D (a matrix) or 3-D (a stack of matrices, one leading batch dimension), "
            f"got {len(shape)}-D with shape {list(shape)}",
            location=[name],
        )


@dataclass(frozen=True)
class ProductShape:
    """What a @ b computes: `products` matrix products of m x k by k x n, the answer a matrix (`batch` None) or a
    stack of `batch` of them."""

    m: int
    k: int
    n: int
    batch: int | None = None

    @property
    def products(self) -> int:
        return 1 if self.batch is None else self.batch

    @property
    def result(self) -> tuple[int, ...]:
        return (self.m, self.n) if self.batch is None else (self.batch, self.m, self.n)


def product_shape(a: tuple[int, ...], b: tuple[int, ...]) -> ProductShape:
    """The shape of a @ b (each 2-D or 3-D), or ShapeMismatch saying what does not fit: the inner dimensions, or
    stacks of different sizes neither of which is one."""
    (m, k), (k2, n) = a[-2:], b[-2:]
    if k != k2:
        raise ShapeMismatch(
            f"inner dimensions differ: 'a' is {m}x{k} and 'b' is {k2}x{n}; a's columns ({k}) must equal "
            f"b's rows ({k2})",
            location=["b", len(b) - 2],
        )
    a_batch, b_batch = (a[0] if len(a) == 3 else None), (b[0] if len(b) == 3 else None)
    if a_batch is not None and b_batch is not None and a_batch != b_batch and 1 not in (a_batch, b_batch):
        raise ShapeMismatch(
            f"the stacks' batch dimensions differ: 'a' holds {a_batch} matrices and 'b' {b_batch}; they must be "
            "equal, or one of them 1 (broadcast against the other, as numpy.matmul does)",
            location=["b", 0],
        )
    batches = [batch for batch in (a_batch, b_batch) if batch is not None]
    batch = None if not batches else (min(batches) if 0 in batches else max(batches))
    return ProductShape(m, k, n, batch)


def result_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """The shape of a @ b for operands `product_shape` accepted."""
    return (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])


def products_in(a: np.ndarray, b: np.ndarray) -> int:
    """How many matrix products a @ b is: 1 for two matrices, a stack's size else."""
    return math.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))


def matrix_of(x: np.ndarray, index: int) -> np.ndarray:
    """The matrix of operand `x` that product `index` of a stack multiplies: x itself, a matrix broadcast against
    the stack; the only one of a stack of one; else x's own."""
    if x.ndim == 2:
        return x
    matrix: np.ndarray = x[0 if x.shape[0] == 1 else index]
    return matrix
