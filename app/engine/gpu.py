"""The GPU backend: CuPy on one device, our kernels compiled once with NVRTC, cuBLAS as the reference.

All of this runs on the worker thread that owns the device (see `app.engine.device_worker`). Per launch: operands
are converted into pinned host buffers (one pass that also fixes dtype, byte order and layout), copied to the
device on the copy-in stream, multiplied on the compute stream, and copied back on the copy-out stream into a
pinned buffer that is handed to the encoder as it is. Events order the three streams, so with two launches in
flight the second one's copy in runs under the first one's kernel, and the first one's copy out under the
second one's kernel. The same events give the h2d, kernel and d2h times. Pinned buffers come from CuPy's
pinned pool in a few sizes per power of two, so after warm-up a launch reuses blocks instead of allocating.

A reused block still holds what an earlier launch left in it, and C is not cleared before a launch: every kernel
writes every element, and clearing would cost a pass over C per launch. The tests construct the backend with
`poison_outputs`, which fills C with NaN first, on the device and in its pinned buffer, so that an element a kernel
skips reads NaN instead of an earlier product's value; the service never sets it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, Final

import numpy as np

import kernels
from app.engine.autotune import AUTO_BEATEN, AUTO_REPEATS, SHAPE_CLASSES, AutoChoice, pick_auto
from app.engine.base import (
    ALL_DTYPES,
    ALL_PRECISIONS,
    AUTO,
    DeviceTiming,
    Finished,
    KernelInfo,
    Launch,
    Outputs,
    Pairs,
    Plan,
    ProductRequest,
    kernel_info,
    ladder_plan,
)
from app.engine.staging import cast_into_parallel, check_in_format
from app.errors import (
    DeviceLost,
    DeviceOutOfMemory,
    InvalidParameter,
    SharedMemoryError,
    UnknownKernel,
)
from app.shapes import products_in, result_shape
from kernels.binaries import KernelBinaries
from kernels.catalogue import CUBLAS, DTYPES, RUNGS, TENSOR_CORE_PRECISIONS, Rung, rungs_on
from kernels.cublas import INT8_K_MULTIPLE
from kernels.cuda import Launcher, device_attributes
from kernels.registry import KERNELS, MAX_GRID_Y, LaunchConfig, cdiv
from numerics.precision import INT8_OPERAND, INT8_PRODUCT, Precision, operand_dtype
from numerics.reference import Reference
from numerics.roofline import DevicePeaks, gpu_peaks

log = logging.getLogger(__name__)

# Self-test shape at start-up: no side a multiple of any tile, so every edge guard is exercised.
SELF_TEST_SHAPE = (67, 45, 39)
# A kernel that executes `trap`, for tests of device loss; exists only with MATMUL_FAULT_INJECTION=1.
FAULT_TRAP = "fault_trap"
CUDA_ERROR_MEMORY_ALLOCATION = 2
STAGING_THREADS = 4
"""Threads that copy large operands into pinned memory, each a band of rows."""


def _fitted(shape: tuple[int, int, int], config: LaunchConfig | None) -> tuple[int, int, int]:
    """`shape` with k and n rounded up to what a vector instance accepts."""
    m, k, n = shape
    if config is None:
        return shape
    return m, cdiv(k, config.k_multiple) * config.k_multiple, cdiv(n, config.n_multiple) * config.n_multiple


def _call_when_done(event: Any, finished: threading.Event, on_done: Callable[[], None]) -> None:
    """On the watcher thread: wait for `event` (without the GIL), mark the launch finished and call back, also
    when the wait fails (the launch's result raises the error, translated).

    A thread of ours and a flag, rather than a host function on the stream and queries of the event: after a
    sticky error (a trapped kernel) a host function never ran and the event never read as done, so the worker
    waited forever, while synchronizing on the event returns the error at once."""
    with contextlib.suppress(Exception):
        event.synchronize()
    finished.set()
    on_done()


def _bytes_to_end_of_allocation(address: int) -> int:
    """Bytes from `address` to the end of the device allocation it lies in (the driver's cuMemGetAddressRange, which
    CuPy does not wrap), so that a region never reaches past the memory a client registered."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)
    )
    if status != 0:
        raise SharedMemoryError(f"the driver knows no allocation at the handle's address (CUresult {status})")
    return base.value + size.value - address


def _is_device_array(array: Any) -> bool:
    """Whether an operand or output lies on the device (a CuPy array) rather than in host memory."""
    return not isinstance(array, np.ndarray)


def _launchable(array: Any, dtype: np.dtype) -> bool:
    """Whether our kernels and cuBLAS may read or write a device array where it lies: the working dtype,
    C-contiguous, and aligned as a fresh allocation (the kernels' vector loads need 16 bytes)."""
    return bool(array.dtype == dtype and array.flags.c_contiguous and array.data.ptr % ALLOCATION_ALIGNMENT == 0)


ALLOCATION_ALIGNMENT = 256
"""Bytes; cudaMalloc's alignment, which every kernel here may assume of its operands."""
CUDA_MEMCPY_HOST_TO_DEVICE = 1
CUDA_MEMCPY_DEVICE_TO_HOST = 2


def _copy_between(runtime: Any, device: Any, hosts: list[np.ndarray], kind: int, stream: Any) -> None:
    """Queue one copy per host buffer between it and its consecutive part of `device` (C-contiguous, like every
    host buffer here), in order, as plain cudaMemcpyAsync calls. CuPy's `ndarray[i].set` and `.get` build a view
    and check the memory on every call, and a batch of 32 small products makes 96 of them per launch on the thread
    that submits every launch."""
    device_address = device.data.ptr
    for host in hosts:
        host_address = host.ctypes.data
        if kind == CUDA_MEMCPY_HOST_TO_DEVICE:
            runtime.memcpyAsync(device_address, host_address, host.nbytes, kind, stream.ptr)
        else:
            runtime.memcpyAsync(host_address, device_address, host.nbytes, kind, stream.ptr)
        device_address += host.nbytes


def _poison(dtype: np.dtype) -> float | int:
    """What `poison_outputs` fills C with: NaN, or int32's least value, which no sum of int8 products reaches (the
    least product is -128 * 127)."""
    return int(np.iinfo(dtype).min) if dtype.kind == "i" else math.nan


def _nothing() -> None:
    """The `on_done` of launches whose result is waited for at once."""


def _pinned_bucket(nbytes: int) -> int:
    """Round a pinned allocation up to one of 8 sizes per power of two, so the pool reuses blocks."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class _LaunchEvents:
    """The events around one launch's steps, each recorded on the stream that runs the step."""

    copy_in: Any
    copied_in: Any
    launch: Any
    launched: Any
    copy_out: Any
    copied_out: Any

    @classmethod
    def create(cls, cupy: Any) -> _LaunchEvents:
        """The events, `copied_out` made blocking: the watcher thread waits on it for as long as the launch runs, and
        a wait on an event without cudaEventBlockingSync spins, keeping a core busy that the HTTP workers need."""
        copy_in, copied_in, launch, launched, copy_out = (cupy.cuda.Event() for _ in range(5))
        return cls(copy_in, copied_in, launch, launched, copy_out, copied_out=cupy.cuda.Event(block=True))

    def timing(self, cupy: Any, staging_ms: float) -> DeviceTiming:
        elapsed = cupy.cuda.get_elapsed_time
        return DeviceTiming(
            h2d_ms=staging_ms + elapsed(self.copy_in, self.copied_in),
            kernel_ms=elapsed(self.launch, self.launched),
            d2h_ms=elapsed(self.copy_out, self.copied_out),
        )


@dataclass
class _GpuLaunch:
    """A launch queued on the streams. It keeps every buffer the streams still read or write alive until its
    result is taken: memory freed earlier could be handed to the next launch while this one still uses it."""

    backend: GpuBackend
    events: _LaunchEvents
    finished: threading.Event
    """Set by the watcher thread once the copy out is over, or failed."""
    products: list[np.ndarray]
    staging_ms: float
    buffers: tuple[Any, ...]

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self) -> tuple[list[np.ndarray], DeviceTiming]:
        return self.backend._collect(self)


AUTO_PROBE_ELEMENTS = 1 << 24
"""Most elements in one operand stack of auto's batched probe (64 MiB of float32): 32 products of the 256^2
probe, 16 of 1024^2, 4 of 2048^2, one of 4096^2."""


RANDOM_BLOCK = 1 << 20
"""Random values drawn on the host for each dtype of auto's probe, repeated on the device to fill its operands."""


class _DeviceRandom:
    """Operands for auto's probe: a block of random values per dtype (normal for floats, all of int8's range), drawn
    once by NumPy and repeated on the device by copies. No CuPy kernel (its random generators are CuPy kernels that a
    first start compiles, and cuRAND's, which the image does not ship), and the timings need no fresh values."""

    def __init__(self, cupy: Any) -> None:
        self._cp = cupy
        self._rng = np.random.default_rng(0)
        self._blocks: dict[np.dtype, Any] = {}

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A new device array of `shape` and `dtype` (float32, float64 or int8) filled with the dtype's block, by
        copies on the current stream."""
        block = self._blocks.get(dtype)
        if block is None:
            if dtype == INT8_OPERAND:
                values = self._rng.integers(-128, 128, RANDOM_BLOCK, dtype=np.int8)
            else:
                values = self._rng.standard_normal(RANDOM_BLOCK, dtype=dtype)
            block = self._blocks[dtype] = self._cp.asarray(values)
        filled = self._cp.empty(math.prod(shape), dtype)
        for start in range(0, filled.size, block.size):
            part = filled[start : start + block.size]
            part.data.copy_from_device_async(block.data, part.nbytes)
        return filled.reshape(shape)


class GpuBackend:
    name: Final = "gpu"
    _launcher: Launcher
    """Every kernel this device runs, compiled by `prepare` on the worker thread."""

    def __init__(
        self,
        device: int,
        memory_limit_bytes: int = 0,
        fault_injection: bool = False,
        pipeline_depth: int = 2,
        *,
        auto_batch: int = 1,
        poison_outputs: bool = False,
        kernel_cache: Path | None = None,
    ) -> None:
        import cupy

        self._cp = cupy
        self._device_id = device
        self._memory_limit_bytes = memory_limit_bytes
        self._fault_injection = fault_injection
        self._poison_outputs = poison_outputs
        self._auto_batch = auto_batch
        """Products per launch in auto's probe of the kernels that batch (MATMUL_MAX_BATCH_SIZE with batching on)."""
        """Fill C with NaN before each launch (see the module's docstring): for tests, never in the service."""
        self._kernel_cache = kernel_cache
        """The folder compiled kernels are kept in (None: kernels/binaries.py's default)."""
        self._trap: Any = None
        properties = cupy.cuda.runtime.getDeviceProperties(device)
        self.device_name: str = properties["name"].decode()
        self._properties = properties
        self._attributes = device_attributes(cupy, device)
        self.peaks: DevicePeaks = gpu_peaks((properties["major"], properties["minor"]), **self._attributes)
        self._pipeline_depth = pipeline_depth
        self._copy_in: Any = None
        self._compute: Any = None
        self._copy_out: Any = None
        self._compiled_instances = 0
        self._spare_events: list[_LaunchEvents] = []
        self._stagers = ThreadPoolExecutor(STAGING_THREADS, thread_name_prefix=f"staging-{device}")
        # The watcher waits on events with CUDA runtime calls, which start a context on the thread's device.
        self._watcher = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"launch-watcher-{device}",
            initializer=self._use_device,
        )
        self._auto: list[AutoChoice] = []
        self._compute_capability: tuple[int, int] = (properties["major"], properties["minor"])
        self._pinned_ranges: dict[int, int] = {}
        """Host memory given to `pin`: start address -> end address."""
        self._pinning = threading.Lock()

    # ------------------------------------------------------------------------------------------- catalogue

    def kernels(self) -> list[KernelInfo]:
        return [
            KernelInfo(
                name=AUTO,
                kind="auto",
                summary="The kernel measured fastest at start-up for the shape's class and the precision.",
                dtypes=ALL_DTYPES,
                precisions=ALL_PRECISIONS,
            ),
            *(kernel_info(rung) for rung in rungs_on(self._compute_capability)),
        ]

    def _tensor_core_rungs(self) -> list[Rung]:
        return rungs_on(self._compute_capability, "tensor_core")

    def plan(self, request: ProductRequest) -> Plan:
        kernel, tile, precision, dtype = request.kernel, request.tile, request.precision, request.dtype
        m, n, k = request.m, request.n, request.k
        stack = request.batch is not None
        if kernel == FAULT_TRAP and self._fault_injection:
            return Plan(kernel=FAULT_TRAP)
        stackers = self._stack_rungs(dtype, precision, request.shape.products) if stack else None
        # the int8 kernels here that take any k (cuBLAS's takes multiples of 4; none of them takes stacks)
        any_k = [] if stack else [r.name for r in self._tensor_core_rungs() if r.computes(INT8_PRODUCT, Precision.INT8)]
        if kernel == AUTO:
            kernel = pick_auto(self._auto, m, n, k, fallback=CUBLAS, precision=precision, dtype=dtype, among=stackers)
            if kernel == CUBLAS and dtype == INT8_PRODUCT and any_k and k % INT8_K_MULTIPLE:
                kernel = any_k[-1]  # the last in the ladder's order: wgmma where it runs
        rung = RUNGS.get(kernel)
        if rung is None or not rung.runs_on(self._compute_capability):
            offered = [info.name for info in self.kernels()]
            raise UnknownKernel(f"kernel '{kernel}' does not exist; this server has {offered}", location=["kernel"])
        if stackers is not None and not rung.stacks:
            raise InvalidParameter(
                f"kernel '{kernel}' computes one product a launch, not a stack: kernel {' or '.join(stackers)} does "
                "(GET /v1/kernels says which take stacks)",
                location=["kernel"],
            )
        if rung.launcher == "tensor_core":
            return self._tensor_core_plan(rung, tile, precision, dtype)
        if rung.launcher == "cublas":
            if tile is not None:
                raise InvalidParameter(f"tile does not apply to kernel '{kernel}'", location=["tile"])
            if not rung.computes(dtype, precision):
                raise InvalidParameter(self._not_computed_by(rung, dtype, precision), location=["precision"])
            # (no elements: no call, nothing to refuse)
            if dtype == INT8_PRODUCT and k % INT8_K_MULTIPLE and m and n and request.shape.products:
                if stack:
                    instead = "no kernel here computes int8 stacks of other k (zero columns of a and rows of b added "
                    "to reach a multiple leave the product as it is)"
                elif any_k:
                    instead = f"ask for kernel {' or '.join([*any_k, 'auto'])}"
                else:
                    instead = "no other kernel here does"
                raise InvalidParameter(
                    f"cuBLAS's int8 GEMM takes k a multiple of {INT8_K_MULTIPLE}, and k is {k}: {instead}",
                    location=["kernel"],
                )
            return Plan(kernel=kernel, precision=precision)
        return ladder_plan(kernel, request, CUBLAS, request.shape.products)  # a stack: one launch, z its products

    def _stack_rungs(self, dtype: str, precision: Precision, products: int) -> list[str]:
        """The kernels here that compute a stack of `products` `dtype` products in `precision` (the FMA kernels take
        at most CUDA's grid of MAX_GRID_Y along z); InvalidParameter if none does."""
        names = [
            r.name
            for r in rungs_on(self._compute_capability)
            if r.stacks and r.computes(dtype, precision) and (r.launcher != "fma" or products <= MAX_GRID_Y)
        ]
        if not names:
            raise InvalidParameter(
                f"no kernel on this device computes a stack of {dtype} products in precision {precision}; send its "
                "products one a request",
                location=["precision"],
            )
        return names

    def _not_computed_by(self, rung: Rung, dtype: str, precision: Precision) -> str:
        """Why `rung` cannot run a product of `dtype` in `precision`, naming the kernels here that can."""
        others = [other.name for other in rungs_on(self._compute_capability) if other.computes(dtype, precision)]
        instead = f"kernel {' or '.join(others)} does" if others else "no kernel on this device does"
        return f"kernel '{rung.name}' does not compute {dtype} in precision {precision}: {instead}"

    @staticmethod
    def _tensor_core_plan(rung: Rung, tile: int | None, precision: Precision, dtype: str) -> Plan:
        """A plan for one of the kernels only compute capability 9.0 runs, checked against what it computes in."""
        if tile is not None:
            raise InvalidParameter(f"tile does not apply to kernel '{rung.name}'", location=["tile"])
        if dtype not in rung.dtypes:
            raise InvalidParameter(
                f"kernel '{rung.name}' computes in {', '.join(rung.dtypes)}; this product's dtype is {dtype}",
                location=["dtype"],
            )
        if not rung.computes(dtype, precision):
            offered = [str(offered) for offered in rung.precisions if rung.computes(dtype, offered)]
            raise InvalidParameter(
                f"kernel '{rung.name}' computes {dtype} in precision {', '.join(offered)}, not {precision}",
                location=["precision"],
            )
        return Plan(kernel=rung.name, precision=precision)

    # ------------------------------------------------------------------------------------ on the worker

    def prepare(self) -> None:
        cp = self._cp
        cp.cuda.Device(self._device_id).use()
        if self._memory_limit_bytes:
            cp.get_default_memory_pool().set_limit(size=self._memory_limit_bytes)
        if self._fault_injection:
            source = (Path(kernels.__file__).parent / "fault_trap.cu").read_text(encoding="utf-8")
            self._trap = cp.RawKernel(source, "fault_trap")
            self._trap.compile()
        self._copy_in, self._compute, self._copy_out = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
        self._launcher = Launcher(KernelBinaries(self._kernel_cache))
        self._compiled_instances = self._launcher.compiled_instances()
        binaries = self._launcher.binaries
        log.info(
            "kernels loaded on device %d: %d compiled now, the rest from %s or %s",
            self._device_id,
            binaries.compiled,
            binaries.shipped,
            binaries.cache,
        )
        self._self_test()
        self._tune_auto()

    def _instances(self) -> list[tuple[Plan, str]]:
        """A plan for every compiled instance, and cuBLAS, in every precision each computes in, with each dtype it
        computes in."""
        fma = [Plan(kernel=CUBLAS)] + [
            Plan(kernel=spec.name, tile=int(config.label) if spec.tiles else None, config=config)
            for spec in KERNELS.values()
            for config in spec.configs
        ]
        other_modes = [
            (Plan(kernel=rung.name, precision=precision), dtype)
            for rung in (RUNGS[CUBLAS], *self._tensor_core_rungs())
            for dtype, precision in rung.modes()
            if rung.launcher == "tensor_core" or precision is not Precision.FP32
        ]
        return [(plan, dtype) for plan in fma for dtype in DTYPES] + other_modes

    def _self_test(self) -> None:
        """Run every kernel instance once (the warm-up), alone and, where it batches, as a batch of three, and
        check every element of each product against a float64 one (numerics/reference.py's bound, in the plan's
        precision; int8's exactly)."""
        rng = np.random.default_rng(0)
        for plan, dtype in self._instances():
            m, k, n = _fitted(SELF_TEST_SHAPE, plan.config)
            pairs: list[tuple[np.ndarray, np.ndarray]]
            if dtype == INT8_PRODUCT:  # int8 values, k as cuBLAS's int8 GEMM takes it
                k = cdiv(k, INT8_K_MULTIPLE) * INT8_K_MULTIPLE
                pairs = [(rng.integers(-128, 128, (m, k)), rng.integers(-128, 128, (k, n))) for _ in range(3)]
            else:
                pairs = [(rng.standard_normal((m, k)), rng.standard_normal((k, n))) for _ in range(3)]
            launches = [pairs[:1], pairs] if self.batchable(plan) else [pairs[:1]]
            for launch in launches:
                products, _ = self.submit(launch, np.dtype(dtype), plan, on_done=_nothing).result()
                for (a, b), c in zip(launch, products, strict=True):
                    problem = Reference.of(a, b, dtype, plan.precision).mismatch(c)
                    if problem is not None:
                        label = plan.config.label if plan.config else ""
                        raise RuntimeError(
                            f"self-test failed: {plan.kernel}/{label}/{dtype}/{plan.precision}, batch of "
                            f"{len(launch)}: {problem}"
                        )

    def _tune_auto(self) -> None:
        """Time every kernel on one shape per class, in float32, and let `auto` pick the fastest of each: the
        fastest per product, a kernel that batches being timed on a batch of up to `auto_batch` products in one
        launch (at most AUTO_PROBE_ELEMENTS per operand stack). With batching on, small products share launches,
        and a kernel that cannot batch them pays a launch each: timed one at a time, `fast` won the 256^3 probe
        on some starts, and 64^2 products at 128 connections then ran 1,112/s in batches of 1, against 4,168/s in
        batches of 25 when a batching kernel had won.

        The tensor-core precisions have their own choices, between cuBLAS and the tensor-core kernels: their
        conversion passes and launches cost more than cuBLAS's at small sizes, and less at large ones. So has float64
        where kernels/dmma.cu runs (elsewhere it takes float32's choices, as the FMA kernels rank alike in both), and
        int32, between cuBLAS's int8 GEMM and wgmma's int8 instance (elsewhere cuBLAS runs it)."""
        candidates: dict[tuple[Precision, str], list[str]] = {(Precision.FP32, "float32"): [CUBLAS, *KERNELS]}
        # the tensor-core kernels (sm_90a machine code) where they run; elsewhere cuBLAS runs the tensor-core
        # precisions, and float64 takes float32's choices
        tensor_core = self._tensor_core_rungs()
        if tensor_core:
            candidates.update(
                {
                    (precision, "float32"): [
                        rung.name for rung in (RUNGS[CUBLAS], *tensor_core) if rung.computes("float32", precision)
                    ]
                    for precision in TENSOR_CORE_PRECISIONS
                }
            )
            # float64 has a kernel of its own here (kernels/dmma.cu), so its choices are measured apart
            candidates[(Precision.FP32, "float64")] = [
                CUBLAS,
                *KERNELS,
                *(rung.name for rung in tensor_core if "float64" in rung.dtypes),
            ]
            candidates[(Precision.INT8, INT8_PRODUCT)] = [
                CUBLAS,
                *(rung.name for rung in tensor_core if rung.computes(INT8_PRODUCT, Precision.INT8)),
            ]
        choices = []
        random = _DeviceRandom(self._cp)
        for (precision, dtype), names in candidates.items():
            for shape_class in SHAPE_CLASSES:
                size = shape_class.probe
                timings: dict[str, float] = {}
                for name in names:
                    plan = self.plan(ProductRequest(size, size, size, dtype, name, None, precision))
                    try:
                        fastest_ms = min(timings.values(), default=math.inf)
                        timings[name] = self._probe_ms(plan, size, dtype, fastest_ms, random)
                    except self._cp.cuda.memory.OutOfMemoryError:
                        # the probe and its conversions do not fit in the memory the engine may use (a device
                        # memory limit): the kernel is no candidate for this class
                        self._cp.get_default_memory_pool().free_all_blocks()
                if not timings:
                    continue
                fastest = min(timings, key=timings.__getitem__)
                choices.append(
                    AutoChoice(
                        shape_class=shape_class, kernel=fastest, probe_ms=timings, precision=precision, dtype=dtype
                    )
                )
        self._auto = choices
        self._cp.get_default_memory_pool().free_all_blocks()

    def _probe_ms(self, plan: Plan, size: int, dtype: str, fastest_ms: float, random: _DeviceRandom) -> float:
        """Milliseconds per size^3 product of `plan` in `dtype` on operands from `random`, after a warm-up launch:
        of one launch where that takes AUTO_BEATEN times `fastest_ms` (the fastest of the class so far), else of
        AUTO_REPEATS more."""
        cp = self._cp
        batch = min(self._auto_batch, max(1, AUTO_PROBE_ELEMENTS // size**2)) if self.batchable(plan) else 1
        shape = (batch, size, size) if batch > 1 else (size, size)
        with self._compute:  # the operands are written in the order of the launches that read them
            a, b = (random.array(shape, operand_dtype(np.dtype(dtype))) for _ in range(2))
        c = cp.empty(shape, dtype=dtype)

        def per_product_ms(launches: int) -> float:
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            with self._compute as stream:
                start.record(stream)
                for _ in range(launches):
                    self._launch(plan, a, b, c)
                stop.record(stream)
            stop.synchronize()
            return float(cp.cuda.get_elapsed_time(start, stop)) / (launches * batch)

        with self._compute:
            self._launch(plan, a, b, c)
        first = per_product_ms(1)
        if first > AUTO_BEATEN * fastest_ms:
            return first
        return per_product_ms(AUTO_REPEATS)

    def auto_choices(self) -> list[AutoChoice]:
        return list(self._auto)

    def _pinned(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        count = math.prod(shape)
        memory = self._cp.cuda.alloc_pinned_memory(_pinned_bucket(count * dtype.itemsize))
        return np.frombuffer(memory, dtype, count).reshape(shape)

    def batchable(self, plan: Plan) -> bool:
        """cuBLAS in fp32 and the kernels that take a stack; the other precisions run one product per launch."""
        if plan.precision is not Precision.FP32:
            return False
        return plan.kernel == CUBLAS or (plan.kernel in KERNELS and KERNELS[plan.kernel].batched)

    @property
    def max_in_flight(self) -> int:
        return self._pipeline_depth

    @contextmanager
    def _cuda_errors(self) -> Iterator[None]:
        """CUDA's failures translated: out of memory -> 503 after freeing the pools' cached blocks; a sticky
        error (the context no longer works) -> DeviceLost; anything else propagates."""
        cp = self._cp
        try:
            yield
        except cp.cuda.memory.OutOfMemoryError as exc:
            self._free_cached_memory()
            raise DeviceOutOfMemory(f"the product does not fit in device memory now: {exc}") from exc
        except cp.cuda.runtime.CUDARuntimeError as exc:
            if exc.status == CUDA_ERROR_MEMORY_ALLOCATION:
                self._free_cached_memory()
                raise DeviceOutOfMemory(f"pinned host or device memory could not be allocated: {exc}") from exc
            if not self._context_works():
                raise DeviceLost(f"{exc}; the CUDA context is unusable") from exc
            raise

    def _free_cached_memory(self) -> None:
        self._cp.get_default_memory_pool().free_all_blocks()
        self._cp.get_default_pinned_memory_pool().free_all_blocks()

    def _context_works(self) -> bool:
        """Whether the device still runs work: after a sticky error every call fails, even this one."""
        try:
            probe = self._cp.zeros(1, dtype=self._cp.float32)
            self._cp.cuda.runtime.deviceSynchronize()
            return bool(probe.get()[0] == 0)
        except Exception:
            return False

    def submit(
        self, pairs: Pairs, dtype: np.dtype, plan: Plan, on_done: Callable[[], None], outputs: Outputs = None
    ) -> Launch:
        """All pairs (one shape) copied to the device, one launch (gridDim.z = len(pairs) when more than one),
        the products copied back into `outputs` (or pinned buffers of the backend's); queued on the streams, not
        waited for. A pair may be a stack (app/shapes.py), alone in its launch. Operands in pinned memory already
        (`pin`), in `dtype` and C-contiguous, are copied from where they are; others are staged first into one
        pinned buffer each for A and B. `on_done` runs on the watcher thread once the copy out is done."""
        a, b = pairs[0]
        (m, k), n = a.shape[-2:], b.shape[-1]
        with self._cuda_errors():
            if m == 0 or n == 0 or k == 0 or products_in(a, b) == 0:
                return self._empty_sums(pairs, dtype, outputs)
            try:
                return self._enqueue(pairs, dtype, plan, on_done, outputs)
            except BaseException:
                self._drain_streams()
                raise

    def _drain_streams(self) -> None:
        """After a launch failed part way: wait for the copies and kernels it queued before the error, which still
        read its staging buffers and write its outputs, before those go back to their pools or their owners."""
        for stream in (self._copy_in, self._compute, self._copy_out):
            with contextlib.suppress(Exception):  # a lost context fails this too; the launch's own error says so
                stream.synchronize()

    def _empty_sums(self, pairs: Pairs, dtype: np.dtype, outputs: Outputs) -> Finished:
        """Products with nothing to sum (k = 0) are zero matrices; those with no elements (m or n = 0, or an empty
        stack) have nothing to write. No copy, no launch, no library call (cuBLAS refuses k = 0 in its tensor-core
        modes)."""
        if outputs is None:
            products = [np.zeros(result_shape(a, b), dtype) for a, b in pairs]
        else:
            products = list(outputs)
            for output in products:
                output.fill(0)
            if any(_is_device_array(output) for output in products):  # a client's CUDA shared memory
                self._cp.cuda.get_current_stream().synchronize()
        return Finished(products, DeviceTiming(h2d_ms=0.0, kernel_ms=0.0, d2h_ms=0.0))

    def _use_device(self) -> None:
        """Make this backend's device the calling thread's, for good: since CUDA 12 setting a device starts its
        context, so switching back to another one (as `with cupy.cuda.Device(...)` does on exit) would start a
        context on that other GPU too. An engine process owns one device; its threads all use it."""
        self._cp.cuda.runtime.setDevice(self._device_id)

    def check_operand(self, operand: Any, name: str, precision: Precision) -> None:
        if _is_device_array(operand):  # checked where it lies, on this device
            self._use_device()
        with self._cuda_errors():
            check_in_format(operand, name, precision)

    def pin(self, memory: np.ndarray) -> None:
        cp = self._cp
        address = memory.ctypes.data
        self._use_device()
        with self._cuda_errors():
            cp.cuda.runtime.hostRegister(address, memory.nbytes, 0)
        # replaced, not changed in place: the worker thread reads it while another thread pins (and the lock keeps
        # two arenas pinned or unpinned at once by two threads from losing one's change)
        with self._pinning:
            self._pinned_ranges = {**self._pinned_ranges, address: address + memory.nbytes}

    def unpin(self, memory: np.ndarray) -> None:
        cp = self._cp
        address = memory.ctypes.data
        with self._pinning:
            if address not in self._pinned_ranges:
                return
            self._pinned_ranges = {low: high for low, high in self._pinned_ranges.items() if low != address}
        self._use_device()
        with self._cuda_errors():
            cp.cuda.runtime.hostUnregister(address)

    def open_device_memory(self, raw_handle: bytes, device: int, byte_size: int) -> Any:
        cp = self._cp
        if device != self._device_id:
            raise SharedMemoryError(
                f"the region is on device {device}; this engine process serves device {self._device_id}",
                location=["device_id"],
            )
        self._use_device()
        try:
            address = cp.cuda.runtime.ipcOpenMemHandle(raw_handle)
        except cp.cuda.runtime.CUDARuntimeError as exc:
            raise SharedMemoryError(f"the CUDA IPC handle does not open here: {exc}", location=["raw_handle"]) from None
        allocated = _bytes_to_end_of_allocation(address)
        if allocated < byte_size:
            cp.cuda.runtime.ipcCloseMemHandle(address)
            raise SharedMemoryError(
                f"byte_size is {byte_size}, but the device allocation the handle names has {allocated} bytes",
                location=["byte_size"],
            )
        memory = cp.cuda.UnownedMemory(address, byte_size, None, self._device_id)
        return cp.ndarray((byte_size,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))

    def close_device_memory(self, memory: Any) -> None:
        self._use_device()
        self._cp.cuda.runtime.ipcCloseMemHandle(memory.data.ptr)

    def _on_device(self, operands: list[Any], dtype: np.dtype) -> Any:
        """Operands that are device arrays (a client's CUDA shared memory), as the launch reads them: the one
        operand itself when it is in `dtype`, C-contiguous and aligned as a fresh allocation is, else converted
        and stacked into a new device buffer (on the copy-in stream, which the launch waits for)."""
        first = operands[0]
        if len(operands) == 1 and _launchable(first, dtype):
            return first
        stacked = self._cp.empty(((len(operands),) if len(operands) > 1 else ()) + first.shape, dtype)
        for i, operand in enumerate(operands):
            (stacked[i] if len(operands) > 1 else stacked)[...] = operand
        return stacked

    def _is_pinned(self, array: np.ndarray, dtype: np.dtype) -> bool:
        """Whether `array` can be copied as it is: `dtype`, C-contiguous, inside memory given to `pin`."""
        if array.dtype != dtype or not array.flags.c_contiguous:
            return False
        start = array.ctypes.data
        return any(low <= start and start + array.nbytes <= high for low, high in self._pinned_ranges.items())

    def _host_operands(self, operands: list[np.ndarray], dtype: np.dtype, name: str) -> list[np.ndarray]:
        """The operands where the copy in reads them: as they are when all are pinned already, else staged into
        one pinned buffer (stacked when there are several), converting dtype, byte order and layout."""
        if all(self._is_pinned(operand, dtype) for operand in operands):
            return operands
        stacked = len(operands) > 1
        host = self._pinned(((len(operands),) if stacked else ()) + operands[0].shape, dtype)
        for i, operand in enumerate(operands):
            cast_into_parallel(host[i] if stacked else host, operand, name, self._stagers, STAGING_THREADS)
        return [host]

    def _enqueue(
        self, pairs: Pairs, dtype: np.dtype, plan: Plan, on_done: Callable[[], None], outputs: Outputs
    ) -> _GpuLaunch:
        cp = self._cp
        a, b = pairs[0]
        answer = result_shape(a, b)
        # several pairs: single products merged into one launch (a stack is never merged: it is one already)
        stack: tuple[int, ...] = (len(pairs),) if len(pairs) > 1 else ()
        if outputs is not None and not all(
            out.shape == answer and out.dtype == dtype and out.flags.c_contiguous for out in outputs
        ):
            raise ValueError(f"each output must be a C-contiguous {dtype} array of shape {answer}")
        a_operands, b_operands = [a for a, _ in pairs], [b for _, b in pairs]
        on_device = [_is_device_array(operands[0]) for operands in (a_operands, b_operands)]
        into_device = outputs is not None and _is_device_array(outputs[0])
        operands_in = operand_dtype(dtype)
        started = perf_counter()
        a_hosts = [] if on_device[0] else self._host_operands(a_operands, operands_in, "a")
        b_hosts = [] if on_device[1] else self._host_operands(b_operands, operands_in, "b")
        staging_ms = (perf_counter() - started) * 1e3
        events = self._spare_events.pop() if self._spare_events else _LaunchEvents.create(cp)
        with self._copy_in as stream:
            events.copy_in.record(stream)
            a_dev = (
                self._on_device(a_operands, operands_in) if on_device[0] else cp.empty((*stack, *a.shape), operands_in)
            )
            b_dev = (
                self._on_device(b_operands, operands_in) if on_device[1] else cp.empty((*stack, *b.shape), operands_in)
            )
            _copy_between(cp.cuda.runtime, a_dev, a_hosts, CUDA_MEMCPY_HOST_TO_DEVICE, stream)
            _copy_between(cp.cuda.runtime, b_dev, b_hosts, CUDA_MEMCPY_HOST_TO_DEVICE, stream)
            events.copied_in.record(stream)
        with self._compute as stream:
            direct = into_device and not stack and outputs is not None and _launchable(outputs[0], dtype)
            c_dev = outputs[0] if direct and outputs is not None else cp.empty((*stack, *answer), dtype)
            if self._poison_outputs:
                c_dev.fill(_poison(dtype))
            stream.wait_event(events.copied_in)
            events.launch.record(stream)
            self._launch(plan, a_dev, b_dev, c_dev)
            if into_device and not direct and outputs is not None:
                for i, output in enumerate(outputs):
                    output[...] = c_dev[i] if stack else c_dev
            events.launched.record(stream)
        if outputs is None:
            c_host = self._pinned(c_dev.shape, dtype)
            products, c_hosts = (list(c_host) if stack else [c_host]), [c_host]
        else:
            products, c_hosts = list(outputs), [] if into_device else list(outputs)
        if self._poison_outputs:
            for host in c_hosts:
                host.fill(_poison(dtype))
        with self._copy_out as stream:
            stream.wait_event(events.launched)
            events.copy_out.record(stream)
            _copy_between(cp.cuda.runtime, c_dev, c_hosts, CUDA_MEMCPY_DEVICE_TO_HOST, stream)
            events.copied_out.record(stream)
        finished = threading.Event()
        self._watcher.submit(_call_when_done, events.copied_out, finished, on_done)
        return _GpuLaunch(
            backend=self,
            events=events,
            finished=finished,
            products=products,
            staging_ms=staging_ms,
            buffers=(*a_hosts, *b_hosts, a_dev, b_dev, c_dev),
        )

    def _collect(self, launch: _GpuLaunch) -> tuple[list[np.ndarray], DeviceTiming]:
        """Wait for the launch's copy out, then release its buffers and events for the next launches."""
        with self._cuda_errors():
            launch.events.copied_out.synchronize()
            timing = launch.events.timing(self._cp, launch.staging_ms)
        launch.buffers = ()
        self._spare_events.append(launch.events)
        return launch.products, timing

    def _launch(self, plan: Plan, a: Any, b: Any, c: Any) -> None:
        if plan.kernel == FAULT_TRAP:
            self._trap((1,), (1,), ())
        else:
            self._launcher.launch(plan.kernel, a, b, c, precision=plan.precision, config=plan.config)

    # ------------------------------------------------------------------------------------------- facts

    def describe(self) -> dict[str, Any]:
        cp = self._cp
        self._use_device()
        free, total = cp.cuda.runtime.memGetInfo()
        p = self._properties
        return {
            "name": self.device_name,
            "index": self._device_id,
            "compute_capability": f"{p['major']}.{p['minor']}",
            **self._attributes,
            "memory_total_bytes": total,
            "memory_free_bytes": free,
            "peak_gflops": {
                roof: None if flops is None else flops / 1e9 for roof, flops in self.peaks.flops_per_s.items()
            },
            "dram_gbps": None if self.peaks.dram_bytes_per_s is None else self.peaks.dram_bytes_per_s / 1e9,
            "cupy_version": cp.__version__,
            "cuda_runtime_version": cp.cuda.runtime.runtimeGetVersion(),
            "cuda_driver_version": cp.cuda.runtime.driverGetVersion(),
            "nvrtc_version": ".".join(map(str, cp.cuda.nvrtc.getVersion())),
        }

    def memory_held(self) -> int:
        self._use_device()
        return int(self._cp.get_default_memory_pool().total_bytes())

    def compiled_instances(self) -> int:
        return self._compiled_instances

    def close(self) -> None:
        self._stagers.shutdown()
        self._watcher.shutdown()
        self._cp.get_default_memory_pool().free_all_blocks()
        self._cp.get_default_pinned_memory_pool().free_all_blocks()
