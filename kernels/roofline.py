"""The roofline of one product: its arithmetic, the global-memory traffic of the kernel that ran, and how close
the launch came to the device's two roofs, the FMA lanes' peak FLOP/s and the DRAM bandwidth.

A kernel whose arithmetic intensity (FLOPs per byte it requests) is below the ridge point, peak FLOP/s over
DRAM bandwidth (20 FLOP/B for float32 on an H100), can at best run at intensity x bandwidth; above it, at the
peak. The traffic is the kernel's own requests to global memory by its access pattern
(`LaunchConfig.global_elements`), or the minimum (A and B read once, C written once) for the libraries. L1 and
L2 serve part of those requests, so their achieved rate can pass the DRAM bandwidth: naive's does.

The peaks come from the device's attributes: SMs x FMA lanes per SM (by compute capability, below) x 2 FLOPs
x clock, and memory clock x bus width x 2 (double data rate); `kernels.cuda.device_attributes` reads them. A CPU
gets no peaks (`DevicePeaks()`): its sustained clock and vector units cannot be read portably, and an estimate
would be a guess dressed as a figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from kernels.registry import LaunchConfig, minimum_global_elements

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
"""Compute capability -> (float32, float64) fused multiply-adds per clock per SM, from the arithmetic-instruction
throughput table of the CUDA C++ Programming Guide. A capability not listed gets no peak. Not counted: the
tensor cores, which none of our kernels use, though cuBLAS DGEMM does on 9.0 (DMMA), so its float64 fraction
can pass 1."""


@dataclass(frozen=True)
class DevicePeaks:
    """A device's roofs: FLOP/s of its FMA lanes per dtype name, DRAM bytes/s; None where not known."""

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
    lanes = FMA_LANES.get(compute_capability)
    flops_per_s: dict[str, float | None] = {}
    for dtype, lanes_per_sm in zip(("float32", "float64"), lanes or (None, None), strict=True):
        if multiprocessors and lanes_per_sm and clock_khz:
            flops_per_s[dtype] = 2.0 * multiprocessors * lanes_per_sm * clock_khz * 1e3
        else:
            flops_per_s[dtype] = None
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


def roofline(
    config: LaunchConfig | None,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    batch_size: int,
    kernel_ms: float,
    peaks: DevicePeaks,
) -> Roofline:
    """The roofline of an (m, n, k) product run by `config` (None: a library, counted at the minimum traffic)."""
    m, n, k = shape
    flops = 2 * m * n * k
    elements = minimum_global_elements(m, n, k) if config is None else config.global_elements(m, n, k)
    global_bytes = elements * dtype.itemsize
    seconds = kernel_ms / 1e3
    achieved_flops = flops * batch_size / seconds if flops and seconds > 0 else None
    peak = peaks.flops_per_s.get(dtype.name)
    return Roofline(
        flops=flops,
        global_bytes=global_bytes,
        intensity=flops / global_bytes if global_bytes else None,
        peak_gflops=peak / 1e9 if peak else None,
        peak_fraction=achieved_flops / peak if achieved_flops and peak else None,
        global_gbps=global_bytes * batch_size / seconds / 1e9 if global_bytes and seconds > 0 else None,
        dram_gbps=peaks.dram_bytes_per_s / 1e9 if peaks.dram_bytes_per_s else None,
    )
