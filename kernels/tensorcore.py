"""The tensor-core kernels: kernels/wgmma.cu (the product) and kernels/operands.cu (the operands as it reads them),
per precision. Nothing here needs a GPU or CuPy: kernels/cuda.py's `TensorCoreLibrary` compiles and launches them.

They use Hopper's `wgmma` and `setmaxnreg`, so they are compiled for sm_90a, which only a compute capability 9.0
device (H100, H200) runs; elsewhere the tensor-core precisions run on cuBLAS alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType

from kernels.precision import Precision
from kernels.registry import cdiv

WGMMA = "wgmma"
WGMMA_SUMMARY = (
    "Tensor cores (Hopper wgmma, sm_90a), fed by TMA bulk copies through a 4-stage mbarrier pipeline; operands "
    "converted on the device first. Precisions tf32, 3xtf32, bf16, fp16."
)
WGMMA_SOURCE = "wgmma.cu"
OPERANDS_SOURCE = "operands.cu"
ARCH = "sm_90a"
COMPUTE_CAPABILITY = (9, 0)

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


class Conversion(IntEnum):
    """kernels/operands.cu's Conversion: what the pass from float32 writes."""

    TO_BF16 = 0
    TO_FP16 = 1
    TO_TF32 = 2
    SPLIT_TF32 = 3


@dataclass(frozen=True)
class WgmmaConfig:
    """One instance of kernels/wgmma.cu's template, and the conversion of its operands."""

    kind: OperandKind
    block_n: int
    stages: int
    split: bool
    conversion: Conversion

    @property
    def element_bytes(self) -> int:
        return 4 if self.kind is OperandKind.TF32 else 2

    @property
    def parts(self) -> int:
        """Tiles per operand per stage: the big and small parts when split."""
        return 2 if self.split else 1

    @property
    def tile_k(self) -> int:
        return ROW_BYTES // self.element_bytes

    def expression(self) -> str:
        split = "true" if self.split else "false"
        return f"matmul_wgmma<{int(self.kind)}, {self.block_n}, {self.stages}, {split}>"

    def smem_bytes(self) -> int:
        """The tiles of every stage, a full and an empty mbarrier per stage, and the alignment slack."""
        stage = self.parts * (BLOCK_M + self.block_n) * ROW_BYTES
        return self.stages * stage + 2 * self.stages * 8 + ALIGNMENT_SLACK

    def padded_k(self, k: int) -> int:
        """Elements per row of a converted operand: k, padded to a whole multiple of the stride alignment."""
        per_unit = STRIDE_ALIGNMENT // self.element_bytes
        return cdiv(k, per_unit) * per_unit

    def blocks(self, m: int, n: int) -> int:
        return cdiv(m, BLOCK_M) * cdiv(n, self.block_n)


WGMMA_CONFIGS: MappingProxyType[Precision, WgmmaConfig] = MappingProxyType(
    {
        Precision.BF16: WgmmaConfig(OperandKind.BF16, 256, 4, False, Conversion.TO_BF16),
        Precision.FP16: WgmmaConfig(OperandKind.FP16, 256, 4, False, Conversion.TO_FP16),
        Precision.TF32: WgmmaConfig(OperandKind.TF32, 256, 4, False, Conversion.TO_TF32),
        # two accumulators of 64 x 128 a warpgroup, and four tiles a stage
        Precision.TF32X3: WgmmaConfig(OperandKind.TF32, 128, 3, True, Conversion.SPLIT_TF32),
    }
)


def conversion_expressions() -> list[str]:
    return [f"{kernel}<{int(c)}>" for kernel in ("convert_rows", "convert_transposed") for c in Conversion]
