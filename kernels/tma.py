"""TMA tensor maps: the 128-byte descriptors with which kernels/wgmma.cu's bulk copies find a tile in global
memory, encoded by the CUDA driver (cuTensorMapEncodeTiled, which neither CuPy nor the runtime API exposes).
Only engine processes and the benchmark use this module, on a machine with the driver."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

MAP_BYTES = 128
MAP_ALIGNMENT = 64
"""CUtensorMap is declared alignas(64)."""
DATA_TYPE_BY_BYTES = {1: 0, 2: 1, 4: 2}
"""CU_TENSOR_MAP_DATA_TYPE_UINT8, _UINT16 and _UINT32: the copies move bits, whatever the kernel reads them as."""
DATA_TYPE_TFLOAT32 = 11
"""CU_TENSOR_MAP_DATA_TYPE_TFLOAT32: float32 elements that the copy rounds to TF32 (to nearest, ties to even; the
low 13 bits of the mantissa zero) as it writes them into shared memory, subnormals kept."""
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0
"""CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements past the tensor's edges arrive as zeros."""


@functools.cache
def _encode_tiled() -> Callable[..., int]:
    driver = ctypes.CDLL("libcuda.so.1")
    encode = driver.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    encoder: Callable[..., int] = encode
    return encoder


@dataclass(frozen=True)
class Matrix2d:
    """A row-major matrix in device memory as the copies see it: `rows` rows of `columns` elements, the rows
    `row_bytes` apart (a multiple of 16), copied in boxes of `box_rows` x `box_columns` (box_columns * element
    bytes = 128, the swizzle's span); `tf32`: float32 elements, rounded to TF32 by the copy."""

    address: int
    element_bytes: int
    rows: int
    columns: int
    row_bytes: int
    box_rows: int
    box_columns: int
    tf32: bool = False


def encode(matrix: Matrix2d) -> bytes:
    """The tensor map of `matrix`, 128-byte swizzled boxes, zeros past its edges. RuntimeError with the driver's
    code when the driver refuses it."""
    raw = ctypes.create_string_buffer(MAP_BYTES + MAP_ALIGNMENT)
    aligned = -ctypes.addressof(raw) % MAP_ALIGNMENT
    destination = ctypes.addressof(raw) + aligned
    dims = (ctypes.c_uint64 * 2)(matrix.columns, matrix.rows)
    strides = (ctypes.c_uint64 * 1)(matrix.row_bytes)
    box = (ctypes.c_uint32 * 2)(matrix.box_columns, matrix.box_rows)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    result = _encode_tiled()(
        ctypes.c_void_p(destination),
        ctypes.c_int(DATA_TYPE_TFLOAT32 if matrix.tf32 else DATA_TYPE_BY_BYTES[matrix.element_bytes]),
        ctypes.c_uint32(2),
        ctypes.c_void_p(matrix.address),
        dims,
        strides,
        box,
        element_strides,
        ctypes.c_int(INTERLEAVE_NONE),
        ctypes.c_int(SWIZZLE_128B),
        ctypes.c_int(L2_PROMOTION_128B),
        ctypes.c_int(OOB_FILL_ZEROS),
    )
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused {matrix}: CUresult {result}")
    return raw.raw[aligned : aligned + MAP_BYTES]
