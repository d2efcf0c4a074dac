"""What every backend offers the worker, and the values that travel between routes and the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from app.engine.autotune import AutoChoice
from app.errors import InvalidParameter, ShapeMismatch
from app.shapes import ProductShape, product_shape
from kernels.catalogue import DTYPES, Rung
from kernels.registry import KERNELS, LaunchConfig
from numerics.precision import INT8_PRODUCT, Precision
from numerics.roofline import DevicePeaks, minimum_global_elements

AUTO = "auto"
NUMPY = "numpy"

Pairs = Sequence[tuple[np.ndarray, np.ndarray]]
"""The operands of one launch: (a, b) pairs, all of one shape. On the GPU backend an operand may also be a device
array (a view of a client's CUDA shared memory, `open_device_memory`)."""
Outputs = Sequence[np.ndarray] | None
"""Where a launch writes its products, one C-contiguous array of the working dtype per pair (the data plane's
shared memory, or on the GPU backend a client's device memory); None: the backend allocates them."""


def _nothing_to_release() -> None:
    return None


@dataclass(frozen=True)
class KernelInfo:
    """One kernel a request may name, as `GET /v1/kernels` lists it."""

    name: str
    kind: Literal["cuda", "emulation", "library", "auto"]
    summary: str
    dtypes: tuple[str, ...] = DTYPES
    tiles: tuple[int, ...] = ()
    default_tile: int | None = None
    precisions: tuple[str, ...] = (Precision.FP32,)
    """The precisions it computes in (numerics/precision.py)."""
    stacks: bool = True
    """Whether it computes stacks of products (app/shapes.py), in one launch on the GPU."""


ALL_PRECISIONS = tuple(Precision)
ALL_DTYPES = (*DTYPES, INT8_PRODUCT)
"""The product dtypes: the float ones and int32, the exact product of int8 operands."""


def kernel_info(rung: Rung, kind: Literal["cuda", "emulation"] = "cuda", summary_prefix: str = "") -> KernelInfo:
    """How `GET /v1/kernels` lists a rung of the catalogue (cuBLAS as a library; an emulation of it, as such: one
    that computes stacks, matrix by matrix where its kernel would not take them)."""
    return KernelInfo(
        name=rung.name,
        kind="library" if rung.launcher == "cublas" else kind,
        summary=summary_prefix + rung.summary,
        dtypes=rung.dtypes,
        tiles=rung.tiles,
        default_tile=rung.default_tile,
        precisions=rung.precisions,
        stacks=rung.stacks or kind == "emulation",
    )


@dataclass(frozen=True)
class ProductRequest:
    """One product as the service asks the engine for it, from the route to the backend's planning: its shape, the
    working dtype, the kernel (`auto`, or one a client named) with its tile, and the precision; a stack of `batch`
    products of that shape (app/shapes.py) where it is not None. The deadline travels beside it."""

    m: int
    n: int
    k: int
    dtype: str = "float32"
    kernel: str = AUTO
    tile: int | None = None
    precision: Precision = Precision.FP32
    batch: int | None = None

    @classmethod
    def of(
        cls,
        a: Any,
        b: Any,
        dtype: np.dtype | str,
        kernel: str = AUTO,
        tile: int | None = None,
        precision: Precision = Precision.FP32,
    ) -> ProductRequest:
        """The request for a @ b (arrays, or anything with the `shape` of a matrix or a stack of them)."""
        shape = product_shape(tuple(a.shape), tuple(b.shape))
        return cls(shape.m, shape.n, shape.k, np.dtype(dtype).name, kernel, tile, precision, shape.batch)

    @property
    def shape(self) -> ProductShape:
        return ProductShape(self.m, self.k, self.n, self.batch)


@dataclass(frozen=True)
class Plan:
    """A request's kernel, resolved and checked before it is queued: what the worker will launch."""

    kernel: str
    tile: int | None = None
    config: LaunchConfig | None = field(default=None, compare=False)
    precision: Precision = Precision.FP32
    """How the multiplier rounds the float32 operands (numerics/precision.py); fp32 for float64 products."""

    def global_elements(self, m: int, n: int, k: int) -> int:
        """The elements an (m, n, k) product moves to and from global memory, for the roofline: as the launch's
        access pattern asks, or the minimum (A and B read once, C written once) for a library or tensor-core kernel."""
        return minimum_global_elements(m, n, k) if self.config is None else self.config.global_elements(m, n, k)


def ladder_plan(kernel: str, request: ProductRequest, library: str, products_per_launch: int = 1) -> Plan:
    """The plan of `kernel`, a rung of the FMA ladder (kernels/registry.py), for `request`: its tile as named or as
    the registry picks for the shape (InvalidParameter for a tile it lacks), its grid within CUDA's limits
    (ShapeMismatch; an emulation refuses what its kernel would) with `products_per_launch` along z (a stack's
    products, where the backend launches them at once: the GPU's; the emulations go matrix by matrix), and fp32
    only: the ladder computes with the FMA units, and `library` runs the other precisions (InvalidParameter
    otherwise)."""
    if request.precision is not Precision.FP32:
        raise InvalidParameter(
            f"kernel '{kernel}' computes in fp32 only; precision {request.precision} runs on '{library}' (or auto)",
            location=["precision"],
        )
    spec = KERNELS[kernel]
    try:
        config = spec.config_for(request.m, request.n, request.k, request.tile)
    except ValueError as exc:
        raise InvalidParameter(str(exc), location=["tile"]) from exc
    try:
        config.grid(request.m, request.n, products_per_launch)
    except ValueError as exc:
        raise ShapeMismatch(
            f"kernel '{kernel}' cannot cover this shape: {exc}; '{library}' can", location=["a"]
        ) from exc
    return Plan(kernel=kernel, tile=int(config.label) if spec.tiles else None, config=config)


@dataclass(frozen=True)
class DeviceTiming:
    """Milliseconds spent by the backend: staging and copies in, the kernel alone, the copy out."""

    h2d_ms: float
    kernel_ms: float
    d2h_ms: float


@dataclass(frozen=True)
class Outcome:
    """The product and how it was made."""

    c: np.ndarray | None
    """The product; None when it was written into a client's shared-memory region that this process does not map."""
    plan: Plan
    queue_ms: float
    device: DeviceTiming
    device_name: str
    peaks: DevicePeaks
    """The roofs of the device that computed it, for the answer's roofline."""
    global_elements: int
    """The elements the kernel moved to and from global memory (`Plan.global_elements`), for the roofline."""
    batch_size: int = 1
    """Products in the launch that computed this one (dynamic batching, and a stack's products); its timings are
    the launch's."""
    stage_ms: float = 0.0
    """Copying the operands into the shared memory the engine process reads (0 inside the engine process)."""
    handoff_ms: float = 0.0
    """The engine call's time spent neither queued nor on the device: the control channel both ways."""
    release: Callable[[], None] = _nothing_to_release
    """Lets go of the memory `c` lives in (a shared-memory slab), once nothing reads the product any more."""


class Launch(Protocol):
    """Products submitted to a backend, perhaps still being computed."""

    def done(self) -> bool:
        """Whether `result` would return without waiting."""
        ...

    def result(self) -> tuple[list[np.ndarray], DeviceTiming]:
        """Wait for the products (in the order of the pairs) and their timing; raises what computing them
        raised."""
        ...


@dataclass(frozen=True)
class Finished:
    """A launch computed before `submit` returned."""

    products: list[np.ndarray]
    timing: DeviceTiming

    def done(self) -> bool:
        return True

    def result(self) -> tuple[list[np.ndarray], DeviceTiming]:
        return self.products, self.timing


class Backend(Protocol):
    """A compute backend. `prepare`, `submit` and `Launch.result` run on the worker thread that owns the device."""

    @property
    def name(self) -> Literal["cpu", "gpu"]: ...

    @property
    def device_name(self) -> str: ...

    @property
    def peaks(self) -> DevicePeaks:
        """The device's peak FLOP/s per arithmetic (numerics/roofline.py's `roof_name`) and DRAM bandwidth, where
        known."""
        ...

    def kernels(self) -> list[KernelInfo]: ...

    def plan(self, request: ProductRequest) -> Plan:
        """Resolve `auto` and check the kernel and tile (and that the kernel computes in the request's precision and
        dtype); raises UnknownKernel or InvalidParameter."""
        ...

    def prepare(self) -> None:
        """Compile and warm every kernel; raise if any instance gives a wrong answer."""
        ...

    def batchable(self, plan: Plan) -> bool:
        """Whether products with this plan can run several to a launch."""
        ...

    @property
    def max_in_flight(self) -> int:
        """Launches that may be submitted before the oldest one's result is taken: 1 where `submit` computes
        before it returns; more where the device computes one launch while the next one's copies run."""
        ...

    def submit(
        self, pairs: Pairs, dtype: np.dtype, plan: Plan, on_done: Callable[[], None], outputs: Outputs = None
    ) -> Launch:
        """Start a @ b in `dtype` for every pair, all of one shape, as one launch (pairs of one, unless
        batchable), into `outputs` when given. The operands are as decoded (any integer/float dtype, byte order,
        layout); they are staged before this returns, so a value that does not fit `dtype` raises here. Operands
        already in `dtype`, C-contiguous, in pinned memory are copied from where they are. `on_done` is called,
        from any thread, when the launch finishes after `submit` has returned (a launch done on return may not
        call it)."""
        ...

    def check_operand(self, operand: Any, name: str, precision: Precision) -> None:
        """InvalidMatrix when a finite element of an operand in a client's shared-memory region (a host array, or a
        device array for CUDA shared memory) would be infinite in the format `precision` rounds operands into.
        Operands sent in a request's body are checked as the HTTP worker stages them."""
        ...

    def pin(self, memory: np.ndarray) -> None:
        """Page-lock host memory that operands and products will live in (the data plane's shared memory), so
        that copies run straight from and into it; a no-op where there are no copies to a device."""
        ...

    def unpin(self, memory: np.ndarray) -> None:
        """Undo `pin`, once no launch uses the memory."""
        ...

    def open_device_memory(self, raw_handle: bytes, device: int, byte_size: int) -> Any:
        """Another process's device memory, from its CUDA IPC handle (Triton's CUDA shared memory), as a device
        array of `byte_size` bytes that operands and outputs may view; SharedMemoryError where there is no device,
        or it is not `device`, or the handle does not open."""
        ...

    def close_device_memory(self, memory: Any) -> None:
        """Undo `open_device_memory`, once no launch uses the memory."""
        ...

    def describe(self) -> dict[str, Any]:
        """Device facts for `GET /v1/info`."""
        ...

    def auto_choices(self) -> list[AutoChoice]:
        """What `auto` runs for each shape class, with the timings that decided it (empty: one choice only)."""
        ...

    def memory_held(self) -> int:
        """Bytes of device memory the backend holds, in arrays or cached for reuse (0 on the CPU)."""
        ...

    def compiled_instances(self) -> int:
        """Kernel instances compiled and self-tested so far."""
        ...

    def close(self) -> None: ...
