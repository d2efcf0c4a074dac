"""Compiling the registered kernels and launching them: the one launcher the engine and the benchmarks share.

`compile_ptx` needs only NVRTC (no driver, no GPU), so CI can check every source; `KernelLibrary` needs a
device and CuPy's `RawModule`, and compiles everything once, when it is built. `device_attributes` reads what
the roofline's peaks are computed from (kernels/roofline.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

import numpy as np

from kernels.registry import KERNELS, STATIC_SMEM_LIMIT, KernelSpec, LaunchConfig

COMPILE_OPTIONS = ("-std=c++17",)
DEVICE_ATTRIBUTES = MappingProxyType(
    {"multiprocessors": 16, "clock_khz": 13, "memory_clock_khz": 36, "memory_bus_width_bits": 37}
)
"""What the roofline needs of a device, as cudaDeviceAttr numbers (cudaDevAttrMultiProcessorCount, ClockRate,
MemoryClockRate, GlobalMemoryBusWidth) for cudaDeviceGetAttribute: CUDA 13's cudaDeviceProp has no clock rates."""


def compile_ptx(spec: KernelSpec, arch: str = "compute_90") -> tuple[str, dict[str, str]]:
    """Compile one kernel's source with NVRTC for `arch`: the PTX, and each name expression's lowered name.

    Raises RuntimeError with NVRTC's log when the source does not compile.
    """
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(spec.read_source(), spec.source, [], [])
    try:
        expressions = spec.name_expressions()
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *COMPILE_OPTIONS])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{spec.source} does not compile for {arch}:\n{nvrtc.getProgramLog(program)}") from exc
        lowered = {expression: nvrtc.getLoweredName(program, expression) for expression in expressions}
        return nvrtc.getPTX(program).decode(), lowered
    finally:
        nvrtc.destroyProgram(program)


def device_attributes(cupy: Any, device: int) -> dict[str, int | None]:
    """DEVICE_ATTRIBUTES of `device`, each None where the runtime refuses it or reports 0 (not known)."""

    def read(attribute: int) -> int | None:
        try:
            return int(cupy.cuda.runtime.deviceGetAttribute(attribute, device)) or None
        except cupy.cuda.runtime.CUDARuntimeError:
            return None

    return {name: read(attribute) for name, attribute in DEVICE_ATTRIBUTES.items()}


class KernelLibrary:
    """Every registered kernel, compiled with NVRTC for the current CuPy device, ready to launch."""

    def __init__(self, specs: Iterable[KernelSpec] = KERNELS.values()) -> None:
        import cupy

        device = cupy.cuda.Device()
        smem_limit = int(device.attributes["MaxSharedMemoryPerBlockOptin"])
        self._functions: dict[tuple[str, str, str], Any] = {}
        for spec in specs:
            module = cupy.RawModule(
                code=spec.read_source(), options=COMPILE_OPTIONS, name_expressions=spec.name_expressions()
            )
            for dtype in ("float32", "float64"):
                for config in spec.configs:
                    function = module.get_function(spec.name_expression(dtype, config))
                    smem = config.smem_bytes(np.dtype(dtype).itemsize)
                    if smem > smem_limit:
                        raise ValueError(
                            f"{spec.name}/{config.label}/{dtype} needs {smem} B of shared memory; "
                            f"this device allows {smem_limit}"
                        )
                    if smem > STATIC_SMEM_LIMIT:
                        function.max_dynamic_shared_size_bytes = smem
                    self._functions[(spec.name, dtype, config.label)] = function

    def launch(self, spec: KernelSpec, config: LaunchConfig, a: Any, b: Any, c: Any) -> None:
        """c = a @ b on the current stream: 2-D C-contiguous CuPy arrays of one dtype, or 3-D stacks of a
        batch of products of one shape (one launch, gridDim.z = batch) for kernels that are `batched`."""
        batch = a.shape[0] if a.ndim == 3 else 1
        (m, k), n = a.shape[-2:], b.shape[-1]
        if batch > 1 and not spec.batched:
            raise ValueError(f"{spec.name} runs one product per launch, not a batch of {batch}")
        if not config.accepts(n, k):
            raise ValueError(
                f"{spec.name}/{config.label} needs k a multiple of {config.k_multiple} and n of "
                f"{config.n_multiple}; got k={k}, n={n}"
            )
        function = self._functions[(spec.name, a.dtype.name, config.label)]
        function(
            config.grid(m, n, batch),
            config.block(),
            (a, b, c, np.int32(m), np.int32(n), np.int32(k)),
            shared_mem=config.smem_bytes(a.dtype.itemsize),
        )
