"""The roofline of one product: its arithmetic, the global-memory traffic of the kernel that ran, and how close
the launch came to the device's two roofs, the peak FLOP/s of the product's arithmetic and the DRAM bandwidth.

A kernel whose arithmetic intensity (FLOPs per byte it requests) is below the ridge point, peak FLOP/s over
DRAM bandwidth (20 FLOP/B for float32 on an H100), can at best run at intensity x bandwidth; above it, at the
peak. The traffic is the kernel's own requests to global memory by its access pattern
(`LaunchConfig.global_elements`), or the minimum (A and B read once, C written once) for the libraries and the
tensor-core kernels. L1 and L2 serve part of those requests, so their achieved rate can pass the DRAM bandwidth:
naive's does.

The peak is the arithmetic's, not the kernel's: whichever units of the device can do it fastest (`ROOFS`). A
float32 product's is the FMA lanes'; a tensor-core precision's is the tensor cores' for its input type (3xtf32's
a third of TF32's, since it does three TF32 products for each it returns); a float64 product's is the higher of
the FP64 lanes and DMMA, so a kernel built from FMA instructions shows how far the chip's FP64 tensor cores leave
it behind. The peaks come from the device's attributes: SMs x multiply-adds per clock per SM (by compute
capability, below) x 2 FLOPs x clock, and memory clock x bus width x 2 (double data rate);
`kernels.cuda.device_attributes` reads them. A CPU gets no peaks (`DevicePeaks()`): its sustained clock and
vector units cannot be read portably, and an estimate would be a guess dressed as a figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from numerics.precision import Precision, operand_dtype

FMA_LANES: MappingProxyType[tuple[int, int], tuple[int, int]] = MappingProxyType(
    {
        (7, 0): (64, 32),
        (7, 5): (64, 2),
        (8, 0): (64, 32),
        (8, 6): (128, 2),
        (8, 7): (128, 2),
        (8, 9): (128, 2),
        (9, 0): (128, 64),
    }
)
"""Compute capability -> (float32, float64) fused multiply-adds per clock per SM of the FMA lanes, from the
arithmetic-instruction throughput table of the CUDA C++ Programming Guide. A capability not listed gets no peak."""

TENSOR_CORE_MMAS: MappingProxyType[tuple[int, int], Mapping[str, int]] = MappingProxyType(
    {
        (7, 0): {"fp16": 512},
        (8, 0): {"tf32": 512, "bf16": 1024, "fp16": 1024, "int8": 2048, "float64": 64},
        (9, 0): {"tf32": 1024, "bf16": 2048, "fp16": 2048, "fp8": 4096, "int8": 4096, "float64": 128},
    }
)
"""Compute capability -> dense tensor-core multiply-adds per clock per SM by input type (16-bit and TF32 inputs
with float32 accumulation; FP8 (e4m3) with float32 sums; int8 with int32 sums; float64 on DMMA), from NVIDIA's V100,
A100 and H100 architecture whitepapers. Only the data-centre chips are listed: the others' rates with float32
accumulation differ by product line."""

TF32_PRODUCTS_PER_3XTF32 = 3
"""3xtf32 returns one product for three TF32 products (big·big, big·small, small·big)."""


def roof_name(dtype: np.dtype, precision: Precision) -> str:
    """The key of a product's roof in `DevicePeaks.flops_per_s`: the dtype's for fp32, else the precision's."""
    return dtype.name if precision is Precision.FP32 else precision.value


@dataclass(frozen=True)
class DevicePeaks:
    """A device's roofs: peak FLOP/s per arithmetic (`roof_name`: float32, float64 and each tensor-core
    precision), DRAM bytes/s; None where not known."""

    flops_per_s: Mapping[str, float | None] = field(default_factory=dict)
    dram_bytes_per_s: float | None = None


def gpu_peaks(
    compute_capability: tuple[int, int],
    multiprocessors: int | None,
    clock_khz: int | None,
    memory_clock_khz: int | None,
    memory_bus_width_bits: int | None,
) -> DevicePeaks:
    """The roofs of a GPU from its attributes; a figure whose inputs are missing or 0 is None."""
    fma32, fma64 = FMA_LANES.get(compute_capability, (0, 0))
    tensor = TENSOR_CORE_MMAS.get(compute_capability, {})
    per_clock = {
        "float32": fma32,
        "float64": max(fma64, tensor.get("float64", 0)),
        Precision.TF32.value: tensor.get("tf32", 0),
        Precision.TF32X3.value: tensor.get("tf32", 0) / TF32_PRODUCTS_PER_3XTF32,
        Precision.BF16.value: tensor.get("bf16", 0),
        Precision.FP16.value: tensor.get("fp16", 0),
        Precision.FP8.value: tensor.get("fp8", 0),
        Precision.INT8.value: tensor.get("int8", 0),
    }
    flops_per_s: dict[str, float | None] = {
        name: 2.0 * multiprocessors * mmas * clock_khz * 1e3 if multiprocessors and mmas and clock_khz else None
        for name, mmas in per_clock.items()
    }
    dram = (
        2.0 * memory_clock_khz * 1e3 * memory_bus_width_bits / 8 if memory_clock_khz and memory_bus_width_bits else None
    )
    return DevicePeaks(flops_per_s=flops_per_s, dram_bytes_per_s=dram)


@dataclass(frozen=True)
class Roofline:
    """One product against the roofs. Work and traffic are the product's; rates are the launch's (a batch's
    work over its kernel time, as `gflops`). None: not known here, or no arithmetic or no time to rate."""

    flops: int
    global_bytes: int
    intensity: float | None
    peak_gflops: float | None
    peak_fraction: float | None
    global_gbps: float | None
    dram_gbps: float | None


def minimum_global_elements(m: int, n: int, k: int) -> int:
    """The fewest elements any m x n x k product moves: A and B read once, C written once. The roofline's
    traffic for the libraries (cuBLAS, NumPy's BLAS), whose access patterns are not ours to count."""
    return m * k + k * n + m * n


def roofline(
    global_elements: int,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    batch_size: int,
    kernel_ms: float,
    peaks: DevicePeaks,
    precision: Precision = Precision.FP32,
) -> Roofline:
    """The roofline of an (m, n, k) product in `precision` whose kernel moves `global_elements` to and from global
    memory (`LaunchConfig.global_elements`, or `minimum_global_elements` for a library or tensor-core kernel)."""
    m, n, k = shape
    flops = 2 * m * n * k
    operand_bytes = operand_dtype(dtype).itemsize
    if operand_bytes == dtype.itemsize:
        global_bytes = global_elements * dtype.itemsize
    else:  # int8 operands, int32 C: only kernels that read each operand once run these (`minimum_global_elements`)
        global_bytes = (m * k + k * n) * operand_bytes + m * n * dtype.itemsize
    seconds = kernel_ms / 1e3 if batch_size else 0.0  # an empty stack ran no arithmetic to rate
    achieved_flops = flops * batch_size / seconds if flops and seconds > 0 else None
    peak = peaks.flops_per_s.get(roof_name(dtype, precision))
    return Roofline(
        flops=flops,
        global_bytes=global_bytes,
        intensity=flops / global_bytes if global_bytes else None,
        peak_gflops=peak / 1e9 if peak else None,
        peak_fraction=achieved_flops / peak if achieved_flops and peak else None,
        global_gbps=global_bytes * batch_size / seconds / 1e9 if global_bytes and seconds > 0 else None,
        dram_gbps=peaks.dram_bytes_per_s / 1e9 if peaks.dram_bytes_per_s else None,
    )
