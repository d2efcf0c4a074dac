"""Compiling the catalogue's kernels and launching them: `Launcher`, the one launcher the engine, the benchmark and the
GPU tests share, launches every rung of kernels/catalogue.py by name.

`compile_ptx` needs only NVRTC (no driver, no GPU), so CI can check every source. `Launcher` needs a device and CuPy:
when it is built it loads the FMA ladder (`KernelLibrary`) and, where the device runs them, the tensor-core kernels
(`TensorCoreLibrary`, sm_90a cubins), from binaries compiled ahead or compiled then (kernels/binaries.py;
`programs_on` says which a device loads); cuBLAS is kernels/cublas.py. `device_attributes`
reads what the roofline's peaks are computed from (numerics/roofline.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from kernels import tensorcore, tma
from kernels.binaries import COMPILE_OPTIONS, Binary, KernelBinaries, Program, nvrtc_compile
from kernels.catalogue import RUNGS, Rung, rungs_on
from kernels.cublas import cublas_product
from kernels.registry import (
    KERNELS,
    STATIC_SMEM_LIMIT,
    KernelSpec,
    LaunchConfig,
    batch_stride,
    cdiv,
    read_kernel_source,
)
from numerics.precision import INT8_MAX_K, Precision, int8_fits, operand_dtype

DEVICE_ATTRIBUTES = MappingProxyType(
    {"multiprocessors": 16, "clock_khz": 13, "memory_clock_khz": 36, "memory_bus_width_bits": 37}
)
"""What the roofline needs of a device, as cudaDeviceAttr numbers (cudaDevAttrMultiProcessorCount, ClockRate,
MemoryClockRate, GlobalMemoryBusWidth) for cudaDeviceGetAttribute: CUDA 13's cudaDeviceProp has no clock rates."""


def compile_ptx(spec: KernelSpec, arch: str = "compute_90") -> tuple[str, dict[str, str]]:
    """Compile one kernel's source with NVRTC for `arch`: the PTX, and each name expression's lowered name.

    Raises RuntimeError with NVRTC's log when the source does not compile.
    """
    options = [f"--gpu-architecture={arch}", *COMPILE_OPTIONS]
    ptx, lowered, _ = nvrtc_compile(
        spec.source, spec.read_source(), spec.name_expressions(), options, lambda nvrtc, p: nvrtc.getPTX(p)
    )
    return ptx.decode(), lowered


def compile_tensor_core_source(
    source: str, expressions: list[str], arch: str = tensorcore.ARCH
) -> tuple[bytes, dict[str, str], str]:
    """A tensor-core source (kernels/tensorcore.py) compiled by NVRTC: for sm_90a down to machine code (wgmma
    cannot go through PTX that the driver compiles for plain sm_90), with ptxas's resource report (registers, spills)
    as the log; for a virtual architecture (`tensorcore.PORTABLE_ARCH`) to PTX. The cubin or PTX, the lowered names
    and the log."""
    if arch.startswith("compute_"):
        options = [f"--gpu-architecture={arch}", *COMPILE_OPTIONS]
        return nvrtc_compile(source, read_kernel_source(source), expressions, options, lambda nvrtc, p: nvrtc.getPTX(p))
    options = [f"--gpu-architecture={arch}", *COMPILE_OPTIONS, "--ptxas-options=-v"]
    return nvrtc_compile(source, read_kernel_source(source), expressions, options, lambda nvrtc, p: nvrtc.getCUBIN(p))


def device_attributes(cupy: Any, device: int) -> dict[str, int | None]:
    """DEVICE_ATTRIBUTES of `device`, each None where the runtime refuses it or reports 0 (not known)."""

    def read(attribute: int) -> int | None:
        try:
            return int(cupy.cuda.runtime.deviceGetAttribute(attribute, device)) or None
        except cupy.cuda.runtime.CUDARuntimeError:
            return None

    return {name: read(attribute) for name, attribute in DEVICE_ATTRIBUTES.items()}


class Launcher:
    """Every rung of the catalogue that the current CuPy device runs, loaded when this is built (from `binaries`,
    which compiles what it has not kept), launched by its name on the current stream."""

    def __init__(self, binaries: KernelBinaries | None = None) -> None:
        import cupy

        major, minor = divmod(int(cupy.cuda.Device().compute_capability), 10)
        self.rungs: list[Rung] = rungs_on((major, minor))
        """What this device runs, in the catalogue's order."""
        self._names = frozenset(rung.name for rung in self.rungs)
        self.binaries = binaries or KernelBinaries()
        """Where the kernels were loaded from, and how many of them had to be compiled."""
        self._fma = KernelLibrary(self.binaries, (major, minor))
        runs_tensor_cores = any(rung.launcher == "tensor_core" for rung in self.rungs)
        self.tensor_cores = TensorCoreLibrary((major, minor), self.binaries) if runs_tensor_cores else None
        """The tensor-core kernels' library, where the device runs them (its operand conversions are tested alone)."""

    def runs(self, kernel: str) -> bool:
        return kernel in self._names

    def compiled_instances(self) -> int:
        """How many kernel instances were compiled (cuBLAS's own are not counted)."""
        tensor_core = 0 if self.tensor_cores is None else self.tensor_cores.instances
        return self._fma.instances + tensor_core

    def launch(
        self,
        kernel: str,
        a: Any,
        b: Any,
        c: Any,
        *,
        precision: Precision = Precision.FP32,
        config: LaunchConfig | None = None,
    ) -> None:
        """c = a @ b by the rung `kernel` in `precision` on the current stream: CuPy arrays, C-contiguous, matrices
        or, for the rungs that take `stacks`, stacks of them as numpy.matmul takes them (3-D, a matrix or a stack of
        one on either side broadcast), a and b in the operand dtype of c's (int8 for int32, else c's own). `config` is
        the FMA kernel's instance (by default the one its spec picks for the shape); the other rungs choose their
        own."""
        if not self.runs(kernel):
            raise ValueError(f"kernel '{kernel}' does not run on this device; it runs {[r.name for r in self.rungs]}")
        rung = RUNGS[kernel]
        if not rung.computes(c.dtype.name, precision):
            raise ValueError(f"kernel '{kernel}' does not compute {c.dtype} in precision {precision}")
        if not a.dtype == b.dtype == operand_dtype(c.dtype):
            raise ValueError(f"{c.dtype} products take {operand_dtype(c.dtype)} operands, not {a.dtype}, {b.dtype}")
        if c.ndim > 2 and not rung.stacks:
            raise ValueError(f"kernel '{kernel}' computes one product a launch, not a stack")
        if rung.launcher == "cublas":
            cublas_product(a, b, c, precision)
        elif rung.launcher == "fma":
            spec = KERNELS[kernel]
            (m, k), n = a.shape[-2:], b.shape[-1]
            self._fma.launch(spec, config or spec.config_for(m, n, k, None), a, b, c)
        else:
            assert self.tensor_cores is not None  # runs() said so
            self.tensor_cores.launch(kernel, a, b, c, precision)


class _Instance(Protocol):
    """What loading a kernel instance needs of its config."""

    def expression(self) -> str: ...

    def smem_bytes(self) -> int: ...


def machine_arch(compute_capability: tuple[int, int]) -> str:
    """What the FMA kernels are compiled for on a device of `compute_capability`: its machine code where this NVRTC
    knows the architecture, else PTX of the newest one it knows below it, which the driver compiles at load."""
    from cupy.cuda import nvrtc

    major, minor = compute_capability
    known = [int(arch) for arch in nvrtc.getSupportedArchs()]
    arch = 10 * major + minor
    return f"sm_{arch}" if arch in known else f"compute_{max(a for a in known if a <= arch)}"


def fma_programs(compute_capability: tuple[int, int], specs: Iterable[KernelSpec] = KERNELS.values()) -> list[Program]:
    """The FMA ladder's instances, one program each (so that a cold start compiles them side by side)."""
    arch = machine_arch(compute_capability)
    return [Program(spec.source, (expression,), arch) for spec in specs for expression in spec.name_expressions()]


def tensor_core_instances(compute_capability: tuple[int, int]) -> dict[str, Mapping[Any, _Instance]]:
    """The instances of each tensor-core source that a device of `compute_capability` runs: on 9.0 every one (int8's
    and FP8's wide tiles among wgmma's), elsewhere mma.sync's portable ones."""
    if compute_capability != tensorcore.COMPUTE_CAPABILITY:
        return {tensorcore.MMA_SYNC_SOURCE: tensorcore.MMA_SYNC_PORTABLE_CONFIGS}
    return {
        tensorcore.WGMMA_SOURCE: {
            **tensorcore.WGMMA_CONFIGS,
            Precision.INT8: tensorcore.WGMMA_INT8,
            **{
                config.expression(): config
                for config in (*tensorcore.WGMMA_FP8_WIDE.values(), *tensorcore.WGMMA_FP8_WIDE_PERSISTENT.values())
            },
        },
        tensorcore.WGMMA_PINGPONG_SOURCE: {Precision.INT8: tensorcore.WGMMA_INT8_PINGPONG},
        tensorcore.WGMMA_ROWS_SOURCE: {Precision.TF32: tensorcore.WGMMA_TF32_ROWS},
        tensorcore.DMMA_SOURCE: tensorcore.DMMA_CONFIGS,
        tensorcore.MMA_SYNC_SOURCE: tensorcore.MMA_SYNC_CONFIGS,
    }


def tensor_core_programs(compute_capability: tuple[int, int]) -> list[Program]:
    """The tensor-core kernels of a device of `compute_capability` (see TensorCoreLibrary): each instance a program,
    the operand conversions one."""
    hopper = compute_capability == tensorcore.COMPUTE_CAPABILITY
    arch = tensorcore.ARCH if hopper else tensorcore.PORTABLE_ARCH
    instances = [
        Program(source, (config.expression(),), arch)
        for source, configs in tensor_core_instances(compute_capability).items()
        for config in configs.values()
    ]
    return [*instances, Program(tensorcore.OPERANDS_SOURCE, tuple(tensorcore.operand_expressions(hopper)), arch)]


def programs_on(compute_capability: tuple[int, int]) -> list[Program]:
    """Every program a Launcher on a device of `compute_capability` loads: what an image compiles ahead."""
    runs_tensor_cores = any(rung.launcher == "tensor_core" for rung in rungs_on(compute_capability))
    tensor_core = tensor_core_programs(compute_capability) if runs_tensor_cores else []
    return [*fma_programs(compute_capability), *tensor_core]


def _loaded(binaries: Sequence[Binary]) -> dict[str, Any]:
    """Each instance of `binaries` (name expression -> CuPy kernel), loaded on the current device."""
    import cupy

    functions = {}
    for binary in binaries:
        module = cupy.RawModule(path=str(binary.path))
        functions.update({expression: module.get_function(name) for expression, name in binary.lowered.items()})
    return functions


class KernelLibrary:
    """The FMA ladder's kernels (kernels/registry.py), every instance in both dtypes, loaded on the current CuPy
    device, of `compute_capability`."""

    def __init__(
        self,
        binaries: KernelBinaries,
        compute_capability: tuple[int, int],
        specs: Iterable[KernelSpec] = KERNELS.values(),
    ) -> None:
        import cupy

        specs = list(specs)
        smem_limit = int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
        loaded = _loaded(binaries.of(fma_programs(compute_capability, specs)))
        self._functions: dict[tuple[str, str, str], Any] = {}
        for spec in specs:
            for dtype in ("float32", "float64"):
                for config in spec.configs:
                    function = loaded[spec.name_expression(dtype, config)]
                    smem = config.smem_bytes(np.dtype(dtype).itemsize)
                    if smem > smem_limit:
                        raise ValueError(
                            f"{spec.name}/{config.label}/{dtype} needs {smem} B of shared memory; "
                            f"this device allows {smem_limit}"
                        )
                    if smem > STATIC_SMEM_LIMIT:
                        function.max_dynamic_shared_size_bytes = smem
                    self._functions[(spec.name, dtype, config.label)] = function
        self.instances = len(self._functions)

    def launch(self, spec: KernelSpec, config: LaunchConfig, a: Any, b: Any, c: Any) -> None:
        """c = a @ b on the current stream: 2-D C-contiguous CuPy arrays of one dtype, or, for kernels that are
        `batched`, a stack c of a batch of products of one shape (one launch, gridDim.z = batch), from stacks of as
        many matrices or a matrix (or stack of one) that every product reads where it lies (a batch stride of 0).
        `Launcher.launch` gives stacks only to kernels that are `batched`."""
        (m, k), n = a.shape[-2:], b.shape[-1]
        if not config.accepts(n, k):
            raise ValueError(
                f"{spec.name}/{config.label} needs k a multiple of {config.k_multiple} and n of "
                f"{config.n_multiple}; got k={k}, n={n}"
            )
        function = self._functions[(spec.name, a.dtype.name, config.label)]
        shape_args = (np.int32(m), np.int32(n), np.int32(k))
        strides = (np.uint64(batch_stride(a)), np.uint64(batch_stride(b))) if spec.batched else ()
        function(
            config.grid(m, n, c.shape[0] if c.ndim == 3 else 1),
            config.block(),
            (a, b, c, *shape_args, *strides),
            shared_mem=config.smem_bytes(a.dtype.itemsize),
        )


STORED_DTYPES = MappingProxyType(
    {
        tensorcore.OperandKind.BF16: np.dtype(np.uint16),
        tensorcore.OperandKind.FP16: np.dtype(np.uint16),
        tensorcore.OperandKind.TF32: np.dtype(np.float32),
        tensorcore.OperandKind.S8: np.dtype(np.int8),
        tensorcore.OperandKind.E4M3: np.dtype(np.uint8),
    }
)
"""The dtype of the arrays holding each kind of converted operand: 16-bit formats and e4m3 as their bits."""
LARGEST_MAGNITUDE_THREADS = 256
LARGEST_MAGNITUDE_BLOCKS = 1024
"""At most this many blocks measure an operand's largest magnitude, each thread then taking 16 bytes at a time."""


class TensorCoreLibrary:
    """The tensor-core kernels (kernels/tensorcore.py) loaded on the current CuPy device, of `compute_capability`:
    on 9.0 (H100, H200) every one, compiled for sm_90a (float32 products in the tensor-core precisions and int8 ones
    through wgmma and mma.sync, float64 products on the FP64 tensor cores); from 8.0 on elsewhere, mma.sync's
    portable instances and the operand conversions but FP8's, as PTX for compute_80."""

    def __init__(
        self,
        compute_capability: tuple[int, int] = tensorcore.COMPUTE_CAPABILITY,
        binaries: KernelBinaries | None = None,
    ) -> None:
        import cupy

        self._cp = cupy
        hopper = compute_capability == tensorcore.COMPUTE_CAPABILITY
        self.mma_sync_configs = tensorcore.MMA_SYNC_CONFIGS if hopper else tensorcore.MMA_SYNC_PORTABLE_CONFIGS
        """The mma.sync instance of each precision on this device."""
        binaries = binaries or KernelBinaries()
        loaded = _loaded(binaries.of(tensor_core_programs(compute_capability)))

        def allowed(config: _Instance) -> Any:
            """The loaded instance of `config`, allowed the dynamic shared memory it asks for."""
            function = loaded[config.expression()]
            function.max_dynamic_shared_size_bytes = config.smem_bytes()
            return function

        sources = tensor_core_instances(compute_capability)
        self._multiprocessors = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        wgmma_configs = [
            config
            for source in (tensorcore.WGMMA_SOURCE, tensorcore.WGMMA_PINGPONG_SOURCE, tensorcore.WGMMA_ROWS_SOURCE)
            for config in sources.get(source, {}).values()
        ]
        self._wgmma: dict[_Instance, Any] = {config: allowed(config) for config in wgmma_configs}
        """Each wgmma instance by its config: the precisions', TF32's from the rows, int8's two and FP8's wide tiles,
        each in both grids."""
        self._dmma: dict[bool, Any] = {key: allowed(c) for key, c in sources.get(tensorcore.DMMA_SOURCE, {}).items()}
        self._mma_sync: dict[Precision, Any] = {
            key: allowed(config) for key, config in sources.get(tensorcore.MMA_SYNC_SOURCE, {}).items()
        }
        self._largest_magnitude = loaded[tensorcore.LARGEST_MAGNITUDE]
        self._conversions: dict[tuple[str, int], Any] = {}
        for expression in tensorcore.conversion_expressions(hopper):
            kernel, conversion = expression.removesuffix(">").split("<")
            self._conversions[(kernel, int(conversion))] = loaded[expression]
        self.instances = len(self._wgmma) + len(self._mma_sync) + len(self._dmma)

    def launch(self, kernel: str, a: Any, b: Any, c: Any, precision: Precision) -> None:
        """c = a @ b by the tensor-core rung `kernel` (wgmma, mma_sync, dmma) in `precision`."""
        if kernel == tensorcore.WGMMA and precision is Precision.INT8:
            self.wgmma_int8(a, b, c)
        elif kernel == tensorcore.WGMMA:
            self.wgmma(a, b, c, precision)
        elif kernel == tensorcore.MMA_SYNC:
            self.mma_sync(a, b, c, precision)
        elif kernel == tensorcore.DMMA:
            self.dmma(a, b, c)
        else:
            raise ValueError(f"'{kernel}' is not a tensor-core kernel")

    def largest_magnitudes(self, *operands: Any) -> Any:
        """A device array of uint32, the float32 bits of each operand's largest magnitude (CuPy float32 arrays,
        C-contiguous), in their order: what FP8's scales come from (kernels/e4m3_scale.cuh)."""
        largest = self._cp.zeros(len(operands), np.uint32)
        for i, x in enumerate(operands):
            if x.size:
                blocks = min(cdiv(x.size, 4 * LARGEST_MAGNITUDE_THREADS), LARGEST_MAGNITUDE_BLOCKS)
                self._largest_magnitude((blocks,), (LARGEST_MAGNITUDE_THREADS,), (x, np.uint64(x.size), largest[i:]))
        return largest

    def converted(self, config: tensorcore.WgmmaConfig, x: Any, *, transposed: bool, amax: Any = None) -> list[Any]:
        """x (2-D, C-contiguous: float32, or int8 for int8 products) as the tensor-core kernels of `config` read it:
        K-major rows (x's rows, or its columns when `transposed`) in the kernel's input type (uint16 bits for bf16
        and fp16, uint8 for e4m3), padded to the stride alignment; the big and the small part for 3xtf32. For e4m3,
        `amax` is a device array whose first word holds x's `largest_magnitudes`."""
        height, width = x.shape
        rows, k = (width, height) if transposed else (height, width)
        dtype = STORED_DTYPES[config.kind]
        parts = [self._cp.empty((rows, config.padded_k(k)), dtype) for _ in range(config.parts)]
        if transposed:
            kernel, grid, block = "convert_transposed", (cdiv(width, 32), min(cdiv(height, 32), 65535)), (32, 8)
        elif width % 4 == 0 and x.data.ptr % (4 * x.itemsize) == 0:  # rows of whole, aligned fours
            kernel, grid, block = "convert_rows_by_four", (cdiv(width, 4 * 256), min(height, 65535)), (256, 1)
        else:
            kernel, grid, block = "convert_rows", (cdiv(width, 256), min(height, 65535)), (256, 1)
        arguments = (x, parts[0], parts[-1], np.int32(height), np.int32(width), np.int32(parts[0].shape[1]), amax)
        self._conversions[(kernel, int(config.conversion))](grid, block, arguments)
        return parts

    def wgmma(self, a: Any, b: Any, c: Any, precision: Precision) -> None:
        """c = a @ b in `precision` on the current stream through kernels/wgmma.cu: 2-D C-contiguous CuPy float32
        arrays."""
        config = tensorcore.WGMMA_CONFIGS[precision]
        if _nothing_to_multiply(c, a.shape[1]):
            return
        if precision is Precision.FP8:
            self.wgmma_e4m3(*self.e4m3_operands(a, b), a.shape[1], c)
            return
        if precision is Precision.TF32:
            self.wgmma_tf32(a, b, c)
            return
        a_parts = self.converted(config, a, transposed=False)
        b_parts = self.converted(config, b, transposed=True)
        self._launch_wgmma(config, a_parts, b_parts, c, a.shape[1])

    def wgmma_int8(
        self,
        a: Any,
        b: Any,
        c: Any,
        *,
        b_transposed: bool = False,
        config: tensorcore.WgmmaConfig | tensorcore.PingPongConfig | None = None,
    ) -> None:
        """c = a @ b, exactly, on the current stream through the wgmma int8 instance for k
        (`tensorcore.wgmma_int8_config`), or `config`, one of `tensorcore.WGMMA_INT8_INSTANCES`: a and b 2-D
        C-contiguous CuPy int8 arrays (b given as B^T, N x K, when `b_transposed`), c int32. ValueError where k is so
        long that a sum could pass int32's range, or for a config that is not an int8 instance."""
        if config is not None and config not in tensorcore.WGMMA_INT8_INSTANCES.values():
            raise ValueError(f"{config.expression()} is not a wgmma int8 instance")
        k = a.shape[1]
        _check_int8_sums_fit(k)
        if _nothing_to_multiply(c, k):
            return
        config = config or tensorcore.wgmma_int8_config(k)
        operands = config.operands

        def k_major(x: Any) -> list[Any]:
            """x's rows as the kernel reads them: in place where they start on 16 bytes, else copied, padded."""
            if _rows_lie_aligned(x):
                return [x]
            return self.converted(operands, x, transposed=False)

        b_parts = k_major(b) if b_transposed else self.converted(operands, b, transposed=True)
        self._launch_wgmma(config, k_major(a), b_parts, c, k)

    def wgmma_tf32(
        self, a: Any, b: Any, c: Any, config: tensorcore.WgmmaConfig | tensorcore.RowsConfig | None = None
    ) -> None:
        """c = a @ b in TF32 on the current stream (2-D C-contiguous CuPy float32 arrays) through
        `tensorcore.WGMMA_TF32_ROWS`, or `config`, one of `tensorcore.WGMMA_TF32_INSTANCES`. The rows' instance
        (kernels/wgmma_rows.cu) reads A and B where they lie, their rows copied into padded ones only where they are
        not whole 16-byte units from a 16-byte boundary, and its copies round both to TF32; the passes' one
        (kernels/wgmma.cu) reads them converted (A rounded, B transposed and rounded). Neither lets the tensor cores
        truncate an operand, an error of one sign that grows with k, past the bound (numerics/precision.py) for
        operands of one sign. ValueError for another config."""
        if config is not None and config not in tensorcore.WGMMA_TF32_INSTANCES.values():
            raise ValueError(f"{config.expression()} is not a wgmma TF32 instance")
        config = config or tensorcore.WGMMA_TF32_ROWS
        (m, k), n = a.shape, b.shape[1]
        if _nothing_to_multiply(c, k):
            return
        if isinstance(config, tensorcore.WgmmaConfig):
            a_parts = self.converted(config, a, transposed=False)
            self._launch_wgmma(config, a_parts, self.converted(config, b, transposed=True), c, k)
            return
        passes = tensorcore.WGMMA_CONFIGS[Precision.TF32]

        def rows_of(x: Any) -> Any:
            """x where its rows lie aligned, else its rows copied into padded ones (rounded to TF32 already)."""
            return x if _rows_lie_aligned(x) else self.converted(passes, x, transposed=False)[0]

        def matrix(x: Any, rows: int, columns: int, box_rows: int, box_columns: int) -> tma.Matrix2d:
            row_bytes = x.shape[1] * x.itemsize  # not strides[0]: a one-row view's may be anything
            return tma.Matrix2d(x.data.ptr, x.itemsize, rows, columns, row_bytes, box_rows, box_columns, tf32=True)

        # held until the launch: a copy let go of before it could give its memory to the next one
        b_rows, a_rows = rows_of(b), rows_of(a)
        maps = self._device_maps(
            matrix(b_rows, k, n, config.tile_k, config.box_columns), matrix(a_rows, m, k, config.block_n, config.tile_k)
        )
        self._wgmma[config](
            (config.blocks(m, n), 1, 1),
            (tensorcore.THREADS, 1, 1),
            (maps, c, np.int32(m), np.int32(n), np.int32(k)),
            shared_mem=config.smem_bytes(),
        )

    def _device_maps(self, *matrices: tma.Matrix2d) -> Any:
        """The tensor maps of `matrices`, in their order, in device memory, as the wgmma kernels take them."""
        maps = b"".join(tma.encode(matrix) for matrix in matrices)
        return self._cp.asarray(np.frombuffer(maps, np.uint8))

    def e4m3_operands(self, a: Any, b: Any) -> tuple[Any, Any, Any]:
        """A and B^T as kernels/wgmma.cu's FP8 instance reads them (uint8 e4m3 bits, K-major, rows padded to the
        stride alignment), each scaled by the power of two its largest magnitude gives, and those magnitudes
        (`largest_magnitudes`), which the instance scales the product back by: from CuPy float32 a and b."""
        config = tensorcore.WGMMA_CONFIGS[Precision.FP8]
        amax = self.largest_magnitudes(a, b)
        (a_e4m3,) = self.converted(config, a, transposed=False, amax=amax)
        (b_t_e4m3,) = self.converted(config, b, transposed=True, amax=amax[1:])
        return a_e4m3, b_t_e4m3, amax

    def wgmma_e4m3(
        self, a_e4m3: Any, b_t_e4m3: Any, amax: Any, k: int, c: Any, config: tensorcore.WgmmaConfig | None = None
    ) -> None:
        """c (M x N, float32) = A @ B on the current stream through kernels/wgmma.cu's FP8 instance for its shape
        (`tensorcore.wgmma_fp8_config`), or `config` (one of `tensorcore.WGMMA_FP8_INSTANCES`), from `e4m3_operands`
        (A, M x k, and B^T, N x k) and the largest magnitudes their scales came from. ValueError for another
        config."""
        if config is not None and config not in tensorcore.WGMMA_FP8_INSTANCES.values():
            raise ValueError(f"{config.expression()} is not a wgmma FP8 instance")
        m, n = c.shape
        config = config or tensorcore.wgmma_fp8_config(m, n, k, self._multiprocessors)
        self._launch_wgmma(config, [a_e4m3], [b_t_e4m3], c, k, amax)

    def _launch_wgmma(
        self,
        config: tensorcore.WgmmaConfig | tensorcore.PingPongConfig,
        a_parts: list[Any],
        b_parts: list[Any],
        c: Any,
        k: int,
        amax: Any = None,
    ) -> None:
        """Launch a wgmma instance on operands as it reads them: A's parts M x K and B^T's N x K, K-major (their
        rows padded past k), into c, M x N; `amax` the largest magnitudes of A and B for FP8's scales (the ping-pong
        kernel takes none)."""
        m, n = c.shape
        operands = config.operands

        def matrix(part: Any, rows: int, box_rows: int) -> tma.Matrix2d:
            return tma.Matrix2d(
                address=part.data.ptr,
                element_bytes=operands.element_bytes,
                rows=rows,
                columns=k,
                row_bytes=part.shape[1] * operands.element_bytes,
                box_rows=box_rows,
                box_columns=operands.tile_k,
            )

        a_box, b_box = config.boxes
        device_maps = self._device_maps(
            *(matrix(part, m, a_box) for part in a_parts), *(matrix(part, n, b_box) for part in b_parts)
        )
        scales = () if isinstance(config, tensorcore.PingPongConfig) else (amax,)
        self._wgmma[config](
            (config.blocks(m, n, self._multiprocessors), 1, 1),
            (tensorcore.THREADS, 1, 1),
            (device_maps, c, np.int32(m), np.int32(n), np.int32(k), *scales),
            shared_mem=config.smem_bytes(),
        )

    def mma_sync(self, a: Any, b: Any, c: Any, precision: Precision) -> None:
        """c = a @ b in `precision` (tf32, bf16 or fp16: 2-D C-contiguous CuPy float32 arrays; int8: int8 a and b,
        int32 c, exactly) on the current stream through kernels/mma_sync.cu. Both operands are converted (TF32
        rounded, not read as they are; int8 copied into rows of 16 bytes). ValueError where k is so long that an
        int32 sum could pass its range."""
        config = self.mma_sync_configs[precision]
        (m, k), n = a.shape, b.shape[1]
        if precision is Precision.INT8:
            _check_int8_sums_fit(k)
        if _nothing_to_multiply(c, k):
            return
        config_of_operands = tensorcore.operand_config(precision)
        (a_part,) = self.converted(config_of_operands, a, transposed=False)
        (b_part,) = self.converted(config_of_operands, b, transposed=True)
        self._mma_sync[precision](
            (config.blocks(m, n), 1, 1),
            (tensorcore.MMA_THREADS, 1, 1),
            (a_part, b_part, c, np.int32(m), np.int32(n), np.int32(k), np.int32(a_part.shape[1])),
            shared_mem=config.smem_bytes(),
        )

    def dmma(self, a: Any, b: Any, c: Any) -> None:
        """c = a @ b on the current stream through kernels/dmma.cu: 2-D C-contiguous CuPy float64 arrays."""
        (m, k), n = a.shape, b.shape[1]
        if _nothing_to_multiply(c, k):
            return
        config = tensorcore.dmma_config(n, k)
        self._dmma[config.vec](
            (config.blocks(m, n), 1, 1),
            (config.threads, 1, 1),
            (a, b, c, np.int32(m), np.int32(n), np.int32(k)),
            shared_mem=config.smem_bytes(),
        )


def _rows_lie_aligned(x: Any) -> bool:
    """Whether the copy engine can read x's rows where they lie: whole 16-byte units from a 16-byte boundary."""
    alignment = tensorcore.STRIDE_ALIGNMENT
    return bool(x.shape[1] * x.itemsize % alignment == 0 and x.data.ptr % alignment == 0)


def _check_int8_sums_fit(k: int) -> None:
    if not int8_fits(k):
        raise ValueError(f"k = {k}: sums of int8 products pass int32 beyond k = {INT8_MAX_K}")


def _nothing_to_multiply(c: Any, k: int) -> bool:
    """Whether c = a @ b needs no kernel: C is empty, or k = 0 (C is then zeros, written here)."""
    if c.size == 0:
        return True
    if k == 0:
        c.fill(0)
        return True
    return False
