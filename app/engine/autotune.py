"""How `auto` chooses: shapes fall into classes by size, and each class runs the kernel measured fastest on it.

The GPU backend times every kernel once at start-up on one square probe per class, per product (with batching
on, a kernel that batches is timed on a batch); the table is then in `GET /v1/kernels`. A request's class is
the first whose bound its size does not pass, its size being the cube root of m*n*k (the side of the cube with
as many multiply-adds).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from numerics.precision import Precision

AUTO_REPEATS = 5
"""Launches timed per kernel and class, after one untimed warm-up launch and one timed alone."""
AUTO_BEATEN = 2.0
"""A kernel whose first timed launch takes this many times the fastest so far of its class is timed no further:
on an H100 the FMA ladder's slow rungs at 2048^3 and 4096^3 were half of a start's probe."""


@dataclass(frozen=True)
class ShapeClass:
    name: str
    up_to: int | None
    """Largest size in the class (None: no bound)."""
    probe: int
    """Side of the square product timed for this class at start-up."""


SHAPE_CLASSES = (
    ShapeClass("small", up_to=384, probe=256),
    ShapeClass("medium", up_to=1536, probe=1024),
    ShapeClass("large", up_to=3072, probe=2048),
    ShapeClass("huge", up_to=None, probe=4096),
)


@dataclass(frozen=True)
class AutoChoice:
    shape_class: ShapeClass
    kernel: str
    probe_ms: Mapping[str, float]
    """Milliseconds per product of every kernel on the class's probe (a batched launch's over its products)."""
    precision: Precision = Precision.FP32
    """The precision the probe ran in: each precision has its own choices, among the kernels that compute in it."""
    dtype: str = "float32"
    """The dtype the probe ran in: float64 has its own choices where a kernel computes in float64 alone."""


def shape_class_of(m: int, n: int, k: int) -> ShapeClass:
    size = (m * n * k) ** (1 / 3)
    return next(c for c in SHAPE_CLASSES if c.up_to is None or size <= c.up_to)


def pick_auto(
    choices: list[AutoChoice],
    m: int,
    n: int,
    k: int,
    fallback: str,
    precision: Precision = Precision.FP32,
    dtype: str = "float32",
    among: Collection[str] | None = None,
) -> str:
    """The kernel `auto` runs for an m x k @ k x n product in `precision` and `dtype`: the one measured fastest for
    the shape's class in that dtype, else in float32 (where float64 was not measured apart), else `fallback`; for a
    stack, `among` the kernels that take stacks (the fastest per product of them measured, a kernel that batches
    timed on a batch, as a stack runs it), else `fallback`."""
    wanted = shape_class_of(m, n, k)
    measured = {
        choice.dtype: choice for choice in choices if choice.shape_class == wanted and choice.precision is precision
    }
    choice = measured.get(dtype, measured.get("float32"))
    if choice is None:
        return fallback
    if among is None:
        return choice.kernel
    timed = {name: ms for name, ms in choice.probe_ms.items() if name in among}
    return min(timed, key=timed.__getitem__, default=fallback)
