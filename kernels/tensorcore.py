"""The tensor-core kernels and their instances: kernels/mma_sync.cu (warp-level mma.sync) and kernels/wgmma.cu
(Hopper's warpgroup MMA) per precision, with kernels/operands.cu writing the operands as they read them; and
kernels/dmma.cu, float64 products on the FP64 tensor cores. Nothing here needs a GPU or CuPy: kernels/cuda.py's
`TensorCoreLibrary` compiles and launches them.

wgmma and setmaxnreg exist only on sm_90a, and dmma.cu's m16n8k8 f64 instruction only from sm_90, so these are
compiled for sm_90a, which only a compute capability 9.0 device (H100, H200) runs. mma_sync.cu and operands.cu use
only instructions of compute capability 8.0 (cp.async, ldmatrix, mma.sync in bf16, fp16, tf32 and s8), so elsewhere,
from 8.0 on, they are compiled to PTX for compute_80 that the driver compiles for the device, with instances small
enough for its shared memory (`MMA_SYNC_PORTABLE_CONFIGS`), and without FP8's conversion (e4m3 needs 8.9). There the
other tensor-core precisions run on cuBLAS alone, and float64 on the FMA kernels and cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from types import MappingProxyType
from typing import ClassVar

from kernels.registry import cdiv
from numerics.precision import Precision

WGMMA = "wgmma"
WGMMA_SUMMARY = (
    "Tensor cores (Hopper wgmma, sm_90a), fed by TMA bulk copies through a 4-stage mbarrier pipeline; operands "
    "converted on the device first, but TF32's, read where they lie and rounded by the copies. Precisions tf32, "
    "3xtf32, bf16, fp16, fp8 (e4m3, a power-of-two scale per operand); int8 operands into exact int32."
)
WGMMA_SOURCE = "wgmma.cu"
WGMMA_PINGPONG_SOURCE = "wgmma_pingpong.cu"
"""wgmma.cu's kernel as a persistent grid whose consumers take tiles in turns: int8's instance up to a k."""
OPERANDS_SOURCE = "operands.cu"
ARCH = "sm_90a"
COMPUTE_CAPABILITY = (9, 0)
PORTABLE_ARCH = "compute_80"
"""mma_sync.cu and operands.cu elsewhere: PTX that the driver compiles for the device it runs on."""
PORTABLE_COMPUTE_CAPABILITY = (8, 0)

BLOCK_M = 128
"""Rows of C per block (kernels/wgmma.cu's BM): two consumer warpgroups of 64."""
THREADS = 384
"""A producer warpgroup and two consumer warpgroups."""
ROW_BYTES = 128
"""Bytes of K in one row of a shared-memory tile: the span of the 128-byte swizzle."""
TENSOR_MAP_BYTES = 128
STRIDE_ALIGNMENT = 16
"""The bulk tensor copy's rule for the byte stride between rows in global memory."""
ALIGNMENT_SLACK = 1024
"""Dynamic shared memory is asked for this much more, so that the kernel can start its tiles on 1024 bytes."""


class OperandKind(IntEnum):
    """kernels/wgmma.cu's OperandKind: what the tensor cores read."""

    BF16 = 0
    FP16 = 1
    TF32 = 2
    S8 = 3
    E4M3 = 4


ELEMENT_BYTES = MappingProxyType(
    {OperandKind.BF16: 2, OperandKind.FP16: 2, OperandKind.TF32: 4, OperandKind.S8: 1, OperandKind.E4M3: 1}
)


class Conversion(IntEnum):
    """kernels/operands.cu's Conversion: what the pass from the operand as sent (float32, or int8 for the copy)
    writes. TO_E4M3 scales the operand by the power of two its largest magnitude gives (`LARGEST_MAGNITUDE`)."""

    TO_BF16 = 0
    TO_FP16 = 1
    TO_TF32 = 2
    SPLIT_TF32 = 3
    COPY_S8 = 4
    TO_E4M3 = 5


LARGEST_MAGNITUDE = "largest_magnitude"
"""kernels/operands.cu's kernel measuring an operand's largest magnitude, which its FP8 scale comes from."""


@dataclass(frozen=True)
class WgmmaConfig:
    """One instance of kernels/wgmma.cu's template, and the conversion of its operands."""

    kind: OperandKind
    block_n: int
    stages: int
    split: bool
    conversion: Conversion
    persistent: bool = False
    """A block per SM taking tiles in turn, where False is a block per tile."""

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.kind]

    @property
    def parts(self) -> int:
        """Tiles per operand per stage: the big and small parts when split."""
        return 2 if self.split else 1

    @property
    def tile_k(self) -> int:
        return ROW_BYTES // self.element_bytes

    @property
    def operands(self) -> WgmmaConfig:
        """The instance whose operand conversion this one reads: its own."""
        return self

    @property
    def boxes(self) -> tuple[int, int]:
        """Rows of the tensor maps' boxes: A's and B^T's."""
        return BLOCK_M, self.block_n

    def expression(self) -> str:
        split = "true" if self.split else "false"
        persistent = ", true" if self.persistent else ""  # the template's default: false
        return f"matmul_wgmma<{int(self.kind)}, {self.block_n}, {self.stages}, {split}{persistent}>"

    def smem_bytes(self) -> int:
        """The tiles of every stage, a full and an empty mbarrier per stage, and the alignment slack."""
        stage = self.parts * (BLOCK_M + self.block_n) * ROW_BYTES
        return self.stages * stage + 2 * self.stages * 8 + ALIGNMENT_SLACK

    def padded_k(self, k: int) -> int:
        """Elements per row of a converted operand: k, padded to a whole multiple of the stride alignment."""
        per_unit = STRIDE_ALIGNMENT // self.element_bytes
        return cdiv(k, per_unit) * per_unit

    def tiles(self, m: int, n: int) -> int:
        return cdiv(m, BLOCK_M) * cdiv(n, self.block_n)

    def blocks(self, m: int, n: int, multiprocessors: int = 0) -> int:
        """One block per tile of C, or for a persistent instance one per SM (`multiprocessors`, which it needs)
        where there are more tiles."""
        tiles = self.tiles(m, n)
        if not self.persistent:
            return tiles
        if multiprocessors < 1:
            raise ValueError(f"{self.expression()} is a persistent grid: it needs the device's SM count")
        return min(tiles, multiprocessors)


WGMMA_CONFIGS: MappingProxyType[Precision, WgmmaConfig] = MappingProxyType(
    {
        Precision.BF16: WgmmaConfig(OperandKind.BF16, 256, 4, False, Conversion.TO_BF16),
        Precision.FP16: WgmmaConfig(OperandKind.FP16, 256, 4, False, Conversion.TO_FP16),
        Precision.TF32: WgmmaConfig(OperandKind.TF32, 256, 4, False, Conversion.TO_TF32),
        # two accumulators of 64 x 128 a warpgroup, and four tiles a stage
        Precision.TF32X3: WgmmaConfig(OperandKind.TF32, 128, 3, True, Conversion.SPLIT_TF32),
        # two accumulators too (each tile's sums apart), so 128 wide; 32 KiB a stage
        Precision.FP8: WgmmaConfig(OperandKind.E4M3, 128, 4, False, Conversion.TO_E4M3),
    }
)

FP8_WIDTHS = (176, 192, 208)
"""The widths of FP8's wide tiles, 128 x BN: BN / 2 totals and as many tile sums a consumer thread (208 of the 232 it
is given at the widest; a 128 x 256 tile's 256 would pass the 255 a thread can name), 38 to 42 KiB a stage. They read
the operands as the 128-wide instance converts them."""
WGMMA_FP8_WIDE: MappingProxyType[int, WgmmaConfig] = MappingProxyType(
    {width: WgmmaConfig(OperandKind.E4M3, width, 4, False, Conversion.TO_E4M3) for width in FP8_WIDTHS}
)
"""FP8's wide tiles by width, a block a tile."""
WGMMA_FP8_WIDE_PERSISTENT: MappingProxyType[int, WgmmaConfig] = MappingProxyType(
    {width: replace(config, persistent=True) for width, config in WGMMA_FP8_WIDE.items()}
)
"""The same tiles as persistent grids."""
FP8_PERSISTENT_MAX_K = 6144
"""Wide FP8 products up to this k run as a persistent grid, longer ones a block per tile: a block's next tile then
loads while it stores the last, a cost the same per tile whatever k is, so it gains where a tile's products are short
(H200, docs/tensor-cores.md: 0.92-0.93 of cuBLASLt against 0.88 at 4096^3, 1.05 against 1.01-1.02 at 6144^3, and at
8192^3 0.88-0.91 against 0.90-0.91)."""
FP8_TILE_COST_COLUMNS = 46
"""What a block spends on a tile beside its products (its first loads, its stores, its adds' tail), in columns of
products: a round of 128 x BN tiles takes as long as BN + 46 columns would. Fitted to the widths' times at 6144^3 on an
H200 (docs/tensor-cores.md), it orders the widths' measured times at every size from 2304^3 to 7168^3; at 8192^3 they
were within 0.03-0.06 of each other and changed order between runs."""


WGMMA_FP8_INSTANCES: MappingProxyType[str, WgmmaConfig] = MappingProxyType(
    {
        "128 wide": WGMMA_CONFIGS[Precision.FP8],
        **{f"{width} wide": WGMMA_FP8_WIDE[width] for width in FP8_WIDTHS},
        **{f"{width} persistent": WGMMA_FP8_WIDE_PERSISTENT[width] for width in FP8_WIDTHS},
    }
)
"""FP8's wgmma instances, by the name the benchmark gives them: 128-wide tiles, and each wide tile a block a tile
and as a persistent grid."""


def wgmma_fp8_config(m: int, n: int, k: int, multiprocessors: int) -> WgmmaConfig:
    """The FP8 instance of an m x n x k product on a device of `multiprocessors` SMs: the width of tile (128, or one of
    `FP8_WIDTHS`) whose rounds of blocks take least time, a round of 128 x BN tiles (as many tiles as SMs, the last one
    rounded up) counted as BN + `FP8_TILE_COST_COLUMNS` columns of products; a wide one as a persistent grid up to
    `FP8_PERSISTENT_MAX_K`.

    Measured on an H200 with `scripts/bench_kernels.py --precisions fp8 --configs all` (docs/tensor-cores.md), ratio
    to cuBLASLt. At 2048^3 the 128-wide tiles (two rounds) ran 0.77 against 0.67-0.68 for 176 wide (two rounds);
    at 3072^3, 192 wide (three rounds) 0.89 against 0.85 for 208 (three) and 0.75 for 176 (four); at 4096^3, 208 wide
    (five rounds) 0.93 against 0.89 for 176 (six); at 6144^3 0.95 against 0.92."""
    narrow = WGMMA_CONFIGS[Precision.FP8]

    def cost(config: WgmmaConfig) -> int:
        return cdiv(config.tiles(m, n), multiprocessors) * (config.block_n + FP8_TILE_COST_COLUMNS)

    best = min((narrow, *WGMMA_FP8_WIDE.values()), key=cost)
    if best is narrow:
        return narrow
    return WGMMA_FP8_WIDE_PERSISTENT[best.block_n] if k <= FP8_PERSISTENT_MAX_K else best


WGMMA_ROWS_SOURCE = "wgmma_rows.cu"
"""TF32 from A and B as they lie: each block a tile of C^T = B^T A^T, B^T's fragments loaded into registers from B's
rows, the copies rounding both operands to TF32. It runs every TF32 product of `wgmma`."""


@dataclass(frozen=True)
class RowsConfig:
    """One instance of kernels/wgmma_rows.cu's kernel: a block per 128 x block_n tile of C^T (128 of N by block_n of
    M), B's tile copied in boxes of 32 columns by tile_k rows of K, A's in one box of block_n rows."""

    block_n: int
    stages: int

    tile_k: ClassVar[int] = ROW_BYTES // ELEMENT_BYTES[OperandKind.TF32]
    box_columns: ClassVar[int] = 32
    """Columns of B in one of its boxes: a 128-byte row of the swizzle."""

    def expression(self) -> str:
        return f"matmul_wgmma_rows<{self.block_n}, {self.stages}>"

    def smem_bytes(self) -> int:
        """The tiles of every stage, a full and an empty mbarrier per stage, and the alignment slack."""
        return self.stages * (BLOCK_M + self.block_n) * ROW_BYTES + 2 * self.stages * 8 + ALIGNMENT_SLACK

    def blocks(self, m: int, n: int) -> int:
        return cdiv(n, BLOCK_M) * cdiv(m, self.block_n)


WGMMA_TF32_ROWS = RowsConfig(256, 4)
"""TF32's instance: no pass over an operand whose rows are whole 16-byte units from a 16-byte boundary (a multiple
of 4 long), and a copy into padded rows, not a transpose, over one that is not. The two passes took 0.076 ms of the
0.42 the pass-fed instance took at 4096^3 on an H200, where the product alone ran 1.01 of cuBLAS TF32."""
WGMMA_TF32_INSTANCES: MappingProxyType[str, WgmmaConfig | RowsConfig] = MappingProxyType(
    {"rows": WGMMA_TF32_ROWS, "passes": WGMMA_CONFIGS[Precision.TF32]}
)
"""TF32's two wgmma instances, by the name the benchmark gives them: from the operands as they lie, or after the
passes converting them."""


WGMMA_INT8 = WgmmaConfig(OperandKind.S8, 256, 4, False, Conversion.COPY_S8)
"""int8 operands, int32 sums and C: 128-element rows of K, four stages of 128 x 256 tiles (the BF16 instance's
bytes)."""


@dataclass(frozen=True)
class PingPongConfig:
    """One instance of kernels/wgmma_pingpong.cu's kernel: a block per SM, whose two consumer warpgroups take whole
    tile_m x tile_n tiles of C in turns, one writing its sums while the other multiplies. It reads its operands as
    `operands` converts them."""

    operands: WgmmaConfig
    tile_m: int
    tile_n: int
    stages: int

    @property
    def kind(self) -> OperandKind:
        return self.operands.kind

    def expression(self) -> str:
        return f"matmul_wgmma_pingpong<{int(self.kind)}, {self.tile_m}, {self.tile_n}, {self.stages}>"

    def smem_bytes(self) -> int:
        """The tiles of every stage, a full and an empty mbarrier per stage, and the alignment slack."""
        return self.stages * (self.tile_m + self.tile_n) * ROW_BYTES + 2 * self.stages * 8 + ALIGNMENT_SLACK

    @property
    def boxes(self) -> tuple[int, int]:
        """Rows of the tensor maps' boxes: A's and B^T's."""
        return self.tile_m, self.tile_n

    def tiles(self, m: int, n: int) -> int:
        return cdiv(m, self.tile_m) * cdiv(n, self.tile_n)

    def blocks(self, m: int, n: int, multiprocessors: int) -> int:
        """One block per SM, fewer where there are fewer tiles."""
        return min(self.tiles(m, n), multiprocessors)


WGMMA_INT8_PINGPONG = PingPongConfig(WGMMA_INT8, 128, 128, 6)
"""int8 in turns: 128 x 128 tiles (a consumer's 128 int32 sums a thread), six stages of 32 KiB."""
WGMMA_INT8_INSTANCES: MappingProxyType[str, WgmmaConfig | PingPongConfig] = MappingProxyType(
    {"tiles": WGMMA_INT8, "turns": WGMMA_INT8_PINGPONG}
)
"""int8's two wgmma instances, by the name the benchmark gives them: one block a 128 x 256 tile, or tiles in turns."""
PINGPONG_INT8_MAX_K = 6144
"""int8 products up to this k run in turns (`WGMMA_INT8_PINGPONG`), longer ones one block per 128 x 256 tile
(`WGMMA_INT8`). The epilogue that turns hide costs the same per tile whatever k is, while their narrower tiles copy
a third more operand bytes per product at every k: so k alone sets the crossover, measured on an H200 across k and
m x n (docs/tensor-cores.md, "Ping-pong")."""


def wgmma_int8_config(k: int) -> WgmmaConfig | PingPongConfig:
    """The wgmma instance of an int8 product whose inner dimension is k."""
    return WGMMA_INT8_PINGPONG if k <= PINGPONG_INT8_MAX_K else WGMMA_INT8


def operand_config(precision: Precision) -> WgmmaConfig:
    """The wgmma instance whose operands' conversion (and layout) a product in `precision` reads: int8's copy, or
    the precision's rounding."""
    return WGMMA_INT8 if precision is Precision.INT8 else WGMMA_CONFIGS[precision]


MMA_SYNC = "mma_sync"
MMA_SYNC_SUMMARY = (
    "Tensor cores, warp-level mma.sync (m16n8k16 bf16/fp16, m16n8k8 tf32, m16n8k32 s8): ldmatrix from swizzled "
    "shared memory, a cp.async pipeline; operands converted on the device first. Precisions tf32, bf16, fp16; int8 "
    "operands into exact int32. Compute capability 8.0 and later."
)
MMA_SYNC_SOURCE = "mma_sync.cu"
MMA_THREADS = 256
"""Eight warps, 2 x 4 (kernels/mma_sync.cu's MMA_THREADS)."""


@dataclass(frozen=True)
class MmaSyncConfig:
    """One instance of kernels/mma_sync.cu's template. It reads the operands as `operand_config(precision)` converts
    them (K-major, rows padded to 16 bytes), which is also the layout mma.sync's row.col form takes."""

    kind: OperandKind
    block_n: int
    stages: int

    def expression(self) -> str:
        return f"matmul_mma<{int(self.kind)}, {self.block_n}, {self.stages}>"

    def smem_bytes(self) -> int:
        return self.stages * (BLOCK_M + self.block_n) * ROW_BYTES

    def blocks(self, m: int, n: int) -> int:
        return cdiv(m, BLOCK_M) * cdiv(n, self.block_n)


MMA_SYNC_CONFIGS: MappingProxyType[Precision, MmaSyncConfig] = MappingProxyType(
    {
        # 128 x 256 tiles, 4 stages: the fastest of 128/256 wide and 3/4 deep on the H100 (docs/tensor-cores.md)
        Precision.TF32: MmaSyncConfig(OperandKind.TF32, 256, 4),
        Precision.BF16: MmaSyncConfig(OperandKind.BF16, 256, 4),
        Precision.FP16: MmaSyncConfig(OperandKind.FP16, 256, 4),
        Precision.INT8: MmaSyncConfig(OperandKind.S8, 256, 4),
    }
)
MMA_SYNC_PORTABLE_CONFIGS: MappingProxyType[Precision, MmaSyncConfig] = MappingProxyType(
    {precision: MmaSyncConfig(config.kind, 128, 3) for precision, config in MMA_SYNC_CONFIGS.items()}
)
"""Where the device is not a compute capability 9.0 one: 128 x 128 tiles, 3 stages, 96 KiB of shared memory, which
every GPU from 8.0 on gives a block (99 KiB on 8.6 and 8.9, 163 KiB on 8.0). Not timed on those GPUs: what they
compute is tested on an H100 or H200, which runs the same PTX."""

DMMA = "dmma"
DMMA_SUMMARY = (
    "float64 on the FP64 tensor cores (mma.sync m16n8k8 f64, DMMA): 16-byte fragment loads from swizzled shared "
    "memory, a 4-stage cp.async pipeline."
)
DMMA_SOURCE = "dmma.cu"
DMMA_WARP_N = 32
"""Columns of a warp's tile (kernels/dmma.cu's DMMA_WN)."""


@dataclass(frozen=True)
class DmmaConfig:
    """One instance of kernels/dmma.cu's template: block tile, warp rows, pipeline depth, copy width, instruction."""

    block_m: int
    block_n: int
    block_k: int
    warp_m: int
    stages: int
    vec: bool
    """16-byte copies and stores, which need K and N even."""
    mma_k: int
    """The instruction: m16n8k8 (8) or m16n8k16 (16)."""

    @property
    def threads(self) -> int:
        return (self.block_m // self.warp_m) * (self.block_n // DMMA_WARP_N) * 32

    def expression(self) -> str:
        vec = "true" if self.vec else "false"
        return (
            f"matmul_dmma<{self.block_m}, {self.block_n}, {self.block_k}, {self.warp_m}, {self.stages}, {vec}, "
            f"{self.mma_k}>"
        )

    def smem_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * self.block_k * 8

    def blocks(self, m: int, n: int) -> int:
        return cdiv(m, self.block_m) * cdiv(n, self.block_n)


DMMA_CONFIGS: MappingProxyType[bool, DmmaConfig] = MappingProxyType(
    {
        # Keyed by `vec`. Measured on the H100 among 64-256 wide tiles, 2-5 stages and the instructions
        # (docs/tensor-cores.md): 128 x 64 with two blocks an SM, for 16-byte copies and 8-byte ones alike.
        True: DmmaConfig(128, 64, 16, 64, 4, vec=True, mma_k=8),
        False: DmmaConfig(128, 64, 16, 64, 4, vec=False, mma_k=8),
    }
)


def dmma_config(n: int, k: int) -> DmmaConfig:
    """The instance for rows of A of k and of B and C of n doubles: 16-byte copies when both are even."""
    return DMMA_CONFIGS[n % 2 == 0 and k % 2 == 0]


KERNEL_NAMES = (MMA_SYNC, WGMMA, DMMA)
"""The kernels a request may name that run only where these compile (compute capability 9.0)."""


def conversion_expressions(fp8: bool = True) -> list[str]:
    """Each conversion kernel of kernels/operands.cu in each conversion (without FP8's where `fp8` is False: e4m3
    needs compute capability 8.9)."""
    kernels = ("convert_rows", "convert_rows_by_four", "convert_transposed")
    conversions = [c for c in Conversion if fp8 or c is not Conversion.TO_E4M3]
    return [f"{kernel}<{int(c)}>" for kernel in kernels for c in conversions]


def operand_expressions(fp8: bool = True) -> list[str]:
    """Every kernel of kernels/operands.cu: the conversions and the largest magnitude."""
    return [*conversion_expressions(fp8), LARGEST_MAGNITUDE]
