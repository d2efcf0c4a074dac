"""The teaching pair on the CPU: naive.cu and tiled.cu emulated in NumPy, thread for thread and step for step.

A thread of either kernel owns one output of C and walks k in order, one multiply-add per step, which NVRTC
contracts into a fused multiply-add (FMA: a * b + acc rounded once). The emulations run every thread of the
grid at once: one NumPy call per k step across the outputs of a band of rows (the band keeps the temporaries
in cache), so a product costs O(k * m / band) NumPy calls rather than m * n * k Python steps.

Rounding. In float32 the product of two elements is exact in float64 (24 + 24 significant bits < 53), so each
step forms a * b exactly, adds the float32 accumulator to it in float64 and rounds the sum once to float32:
the accumulator stays float32 and each step is the FFMA of the GPU, except where the float64 sum itself had to
round onto a float32 halfway point (double rounding), which takes a rare bit pattern of the operands. In
float64 no wider NumPy type holds a product exactly, so a step rounds the product and then the sum, one
rounding more than the GPU's DFMA: results may differ from the GPU's in the last bits, within the same error
bound (about sqrt(k) * 2^-53 relative).

Why not `acc += A[:, tile] @ B[tile, :]` per k tile: that sums each tile in BLAS's order, at BLAS's precision,
and adds the partial sum to the accumulator once, a rounding neither kernel does. tiled.cu changes where the
operands come from (shared memory, staged a tile at a time), not the order of the FMAs: each thread still
accumulates k = 0, 1, ... in sequence, and the zero padding of edge tiles adds fma(0, 0, acc) = acc. So the
two kernels give the same bits, and so do their emulations; what differs is the global-memory traffic
(`LaunchConfig.global_elements`), which the roofline of every answer reports.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import numpy as np

from kernels.registry import LaunchConfig, cdiv

ROW_BAND = 64
"""Rows of C emulated together: a band's float64 step (64 x n) stays in L2 for n up to a few thousand."""


def _fma_step(acc: np.ndarray, a_column: np.ndarray, b_row: np.ndarray, product: np.ndarray) -> None:
    """acc += a_column * b_row for every output at once, the product formed in float64 (`product` is the
    scratch for it) and the sum rounded once into acc's dtype."""
    np.multiply(a_column, b_row, out=product)
    np.add(acc, product, out=acc, casting="same_kind")


def emulate_naive(a: np.ndarray, b: np.ndarray, config: LaunchConfig) -> np.ndarray:
    """naive.cu: thread (row, col) computes C[row, col] alone, acc += A[row, p] * B[p, col] for p = 0..k-1,
    reading both operands from global memory. C is returned in a's dtype."""
    (m, k), n = a.shape, b.shape[1]
    a_wide, b_wide = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    c = np.zeros((m, n), a.dtype)
    product = np.empty((min(ROW_BAND, m), n))
    for top in range(0, m, ROW_BAND):
        rows = slice(top, min(top + ROW_BAND, m))
        band, scratch = c[rows], product[: rows.stop - top]
        for p in range(k):
            _fma_step(band, a_wide[rows, p : p + 1], b_wide[p : p + 1, :], scratch)
    return c


def _zero_padded(x: np.ndarray, rows: int, columns: int) -> np.ndarray:
    padded = np.zeros((rows, columns))
    padded[: x.shape[0], : x.shape[1]] = x
    return padded


def emulate_tiled(a: np.ndarray, b: np.ndarray, config: LaunchConfig) -> np.ndarray:
    """tiled.cu with TILE = config.tile_m: the grid covers C with TILE x TILE blocks, each k step stages one
    zero-padded TILE x TILE tile of A and of B (a band's blocks share the step), every thread runs TILE FMAs
    over them in k order, and only threads inside C store. C is returned in a's dtype."""
    tile = config.tile_m
    (m, k), n = a.shape, b.shape[1]
    grid_m, grid_k, grid_n = (cdiv(side, tile) * tile for side in (m, k, n))
    a_global, b_global = _zero_padded(a, grid_m, grid_k), _zero_padded(b, grid_k, grid_n)
    acc = np.zeros((grid_m, grid_n), a.dtype)
    band_rows = max(tile, ROW_BAND // tile * tile)
    product = np.empty((min(band_rows, grid_m), grid_n))
    for top in range(0, grid_m, band_rows):
        rows = slice(top, min(top + band_rows, grid_m))
        band, scratch = acc[rows], product[: rows.stop - top]
        for k0 in range(0, grid_k, tile):
            a_tiles, b_tiles = a_global[rows, k0 : k0 + tile], b_global[k0 : k0 + tile, :]
            for i in range(tile):
                _fma_step(band, a_tiles[:, i : i + 1], b_tiles[i : i + 1, :], scratch)
    return np.ascontiguousarray(acc[:m, :n])


Emulation = Callable[[np.ndarray, np.ndarray, LaunchConfig], np.ndarray]
EMULATIONS: MappingProxyType[str, Emulation] = MappingProxyType({"naive": emulate_naive, "tiled": emulate_tiled})
"""Kernel name -> its CPU emulation: c = emulation(a, b, config), a and b 2-D in the working dtype."""
