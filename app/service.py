"""The product service: decoded operands in, a computed and described product out, with no HTTP in between.

A route reads and decodes a body, hands the operands to `MatmulService.run` and encodes what it returns; the
service owns what lies between: the size limits, the checks that the operands multiply, the working dtype, the
engine call under the request's deadline, the stopwatch of every stage, and the metadata and roofline an
answer carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import cast

import numpy as np

from app.codecs import Limits, Operands, RequestOptions
from app.codecs.operands import check_shape
from app.config import Settings
from app.engine import EngineFront, Outcome, ProductRequest
from app.engine.base import AUTO
from app.errors import InvalidParameter, ShapeMismatch
from app.product import BackendName, DtypeName, ErrorBound, MatmulMetadata, RooflineModel, Timing
from app.shapes import ProductShape, product_shape
from app.shared_memory import Matrix, SharedOutput
from numerics.precision import (
    INT8_MAX_K,
    INT8_PRODUCT,
    PRECISIONS_OF,
    Precision,
    float32_sums,
    input_error,
    int8_fits,
)
from numerics.reference import BOUND_CONSTANT, unit_roundoff
from numerics.roofline import roofline

WORKING_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    INT8_PRODUCT: np.dtype(np.int32),
}
DEFAULT_DTYPE = "float32"
INT8 = np.dtype(np.int8)


def requested_precision(requested: str | None, working: np.dtype, operands: Operands) -> Precision:
    """The precision asked for, which must be one the working dtype is computed in (numerics/precision.py's
    `PRECISIONS_OF`): the tensor-core ones take float32 operands, int8 is int32's own. When none is asked for: fp16
    for two float16 operands multiplied in float32 (their natural precision, in which rounding them changes nothing),
    int8 for an int32 product, else fp32."""
    if requested is None:
        if working.name == INT8_PRODUCT:
            return Precision.INT8
        float16 = np.dtype(np.float16)
        natural = working == np.dtype(np.float32) and all(
            m.dtype.newbyteorder("=") == float16 for m in (operands.a, operands.b)
        )
        return Precision.FP16 if natural else Precision.FP32
    try:
        precision = Precision(requested)
    except ValueError:
        raise InvalidParameter(
            f"precision '{requested}' is not supported; choose one of {[str(p) for p in Precision]}",
            location=["precision"],
        ) from None
    if precision is Precision.INT8 and working.name != INT8_PRODUCT:
        raise InvalidParameter(
            f"precision int8 multiplies int8 operands into an exact {INT8_PRODUCT} product, and this product's dtype "
            f"is {working}: ask for dtype {INT8_PRODUCT}, or leave dtype out",
            location=["precision"],
        )
    if precision not in PRECISIONS_OF[working.name]:
        raise InvalidParameter(
            f"precision {precision} computes from float32 operands, and this product's dtype is {working}: send "
            "float32 operands or ask for dtype float32",
            location=["precision"],
        )
    return precision


def check_product(a: Matrix, b: Matrix, limits: Limits) -> ProductShape:
    """What a @ b computes (app/shapes.py: inner dimensions that agree, stacks that pair up), its result within the
    limits."""
    shape = product_shape(tuple(a.shape), tuple(b.shape))
    check_shape(shape.result, "result", limits, max_elements=limits.max_result_elements)
    return shape


def check_sums_fit(k: int, working: np.dtype) -> None:
    """An int32 product's sums of k int8 products cannot pass int32's range (numerics/precision.py), before launch."""
    if working.name == INT8_PRODUCT and not int8_fits(k):
        raise ShapeMismatch(
            f"k = {k}: an {INT8_PRODUCT} product of int8 operands sums k products of up to 128 * 128, which int32 "
            f"holds for k up to {INT8_MAX_K}; split the product along k",
            location=["a", 1],
        )


def working_dtype(requested: str | None, precision: str | None, operands: Operands) -> np.dtype:
    """The dtype the product is computed in: the one requested; else int32 when precision int8 is asked for or both
    operands were sent as int8 (their exact product: an int8 pair never silently becomes float); else float64 if a
    typed operand is; else float32."""
    if requested is not None:
        try:
            return WORKING_DTYPES[requested]
        except KeyError:
            raise InvalidParameter(
                f"dtype '{requested}' is not supported; choose one of {list(WORKING_DTYPES)}",
                location=["dtype"],
            ) from None
    native = (operands.a.dtype.newbyteorder("="), operands.b.dtype.newbyteorder("="))
    if precision == Precision.INT8.value or (operands.typed and native == (INT8, INT8)):
        return WORKING_DTYPES[INT8_PRODUCT]
    if operands.typed and np.dtype(np.float64) in native:
        return WORKING_DTYPES["float64"]
    return WORKING_DTYPES[DEFAULT_DTYPE]


@dataclass
class Stopwatch:
    """The checkpoints of one request, in perf_counter seconds, from the moment it reached its route."""

    received: float = field(default_factory=perf_counter)
    read: float = 0.0
    decoded: float = 0.0
    computed: float = 0.0

    def mark_read(self) -> None:
        self.read = perf_counter()

    def mark_decoded(self) -> None:
        self.decoded = perf_counter()

    def elapsed_ms(self) -> float:
        return (perf_counter() - self.received) * 1e3


@dataclass(frozen=True)
class Product:
    """A computed product and how it was made, until its answer is encoded."""

    outcome: Outcome
    dtype: np.dtype
    shape: ProductShape
    backend: BackendName
    clock: Stopwatch
    roofline: RooflineModel

    @property
    def c(self) -> np.ndarray:
        """The product; not for one written into a client's shared-memory region (`into`), which this process
        never maps."""
        if self.outcome.c is None:
            raise RuntimeError("the product was written into the client's shared memory; it is not here")
        return self.outcome.c

    def release(self) -> None:
        """Let go of the memory `c` lives in: call once the answer no longer reads it (sent, or encoded into a
        copy), or when it will not be sent."""
        self.outcome.release()

    def protocol_parameters(self) -> dict[str, str | int | float]:
        """What the inference protocol's answer says of the product in its `parameters` (over HTTP and gRPC): the
        kernel, backend, batch size, precision and its input error, and the roofline's fields that are not null as
        `roofline_<field>` (the protocol's parameters are numbers or strings)."""
        precision = self.outcome.plan.precision
        return {
            "kernel": self.outcome.plan.kernel,
            "backend": self.backend,
            "batch_size": self.outcome.batch_size,
            "precision": precision.value,
            "error_bound_input": float(input_error(precision)),
            **{f"roofline_{name}": value for name, value in self.roofline.model_dump(exclude_none=True).items()},
        }

    def describe(self) -> MatmulMetadata:
        """The product's metadata, its answer encoded now."""
        clock, device = self.clock, self.outcome.device
        finished = perf_counter()
        flops = 2 * self.shape.m * self.shape.n * self.shape.k
        read_ms = (clock.read - clock.received) * 1e3
        precision = self.outcome.plan.precision
        return MatmulMetadata(
            shape=self.shape.result,
            dtype=cast(DtypeName, self.dtype.name),
            precision=precision.value,
            error_bound=ErrorBound(
                constant=BOUND_CONSTANT,
                input_error=input_error(precision),
                sums=float32_sums(precision),
                unit_roundoff=unit_roundoff(self.dtype),
            ),
            kernel=self.outcome.plan.kernel,
            tile=self.outcome.plan.tile,
            backend=self.backend,
            device=self.outcome.device_name,
            timing=Timing(
                read_ms=read_ms,
                decode_ms=(clock.decoded - clock.received) * 1e3 - read_ms,
                stage_ms=self.outcome.stage_ms,
                handoff_ms=self.outcome.handoff_ms,
                queue_ms=self.outcome.queue_ms,
                h2d_ms=device.h2d_ms,
                kernel_ms=device.kernel_ms,
                d2h_ms=device.d2h_ms,
                encode_ms=(finished - clock.computed) * 1e3,
                total_ms=(finished - clock.received) * 1e3,
            ),
            gflops=flops * self.outcome.batch_size / (device.kernel_ms * 1e6)
            if flops and self.outcome.batch_size and device.kernel_ms > 0
            else None,
            batch_size=self.outcome.batch_size,
            roofline=self.roofline,
        )


class MatmulService:
    """Runs products on the engine within the settings' limits and deadline."""

    def __init__(self, engine: EngineFront, settings: Settings) -> None:
        self.engine = engine
        self.limits = Limits(
            max_dim=settings.max_dim,
            max_elements=settings.max_elements,
            max_result_elements=settings.max_result_elements,
        )
        self.max_queue_s = settings.request_timeout_s

    def admit(self) -> None:
        """NotReady or Overloaded now, before a body is read; the room is checked again when the product is
        queued."""
        self.engine.check_ready()
        self.engine.check_room()

    async def run(
        self,
        operands: Operands,
        options: RequestOptions,
        deadline_s: float | None,
        clock: Stopwatch,
        into: SharedOutput | None = None,
    ) -> Product:
        """Check that the operands multiply, resolve the dtype, and run the product on the engine (into the
        client's shared memory when `into` says where); it may wait in the queue for `deadline_s` (at most the
        settings' request timeout, which is also the default)."""
        a, b = operands.a, operands.b
        shape = check_product(a, b, self.limits)
        working = working_dtype(options.dtype, options.precision, operands)
        check_sums_fit(shape.k, working)
        precision = requested_precision(options.precision, working, operands)
        m, k, n = shape.m, shape.k, shape.n
        queue_s = self.max_queue_s if deadline_s is None else min(deadline_s, self.max_queue_s)
        request = ProductRequest.of(a, b, working, options.kernel or AUTO, options.tile, precision)
        outcome = await self.engine.matmul(a, b, request, queue_s, into=into)
        clock.computed = perf_counter()
        line = roofline(
            outcome.global_elements,
            (m, n, k),
            working,
            outcome.batch_size,
            kernel_ms=outcome.device.kernel_ms,
            peaks=outcome.peaks,
            precision=precision,
        )
        return Product(
            outcome=outcome,
            dtype=working,
            shape=shape,
            backend=self.engine.backend_name,
            clock=clock,
            roofline=RooflineModel.model_validate(line, from_attributes=True),
        )
