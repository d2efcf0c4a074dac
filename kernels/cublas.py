"""cuBLAS in each precision of numerics/precision.py: the library every rung of the tensor-core ladder is measured
against in the same mode, and what `kernels=cublas` runs in a precision other than fp32. Only engine processes and
the benchmark call it; CuPy is imported on first use, so that the GPU backend's module imports where CuPy is not
installed (and says so) instead of failing to import."""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.registry import batch_stride
from numerics.precision import Precision

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8I, CUDA_R_32I = 0, 2, 14, 3, 10
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_32I = 68, 77, 72
CUBLAS_GEMM_DEFAULT = -1


_DEVICE_CONVERSIONS: dict[str, Any] = {}
"""numerics/precision.py's `bf16_bits` and `split_tf32` as one fused pass each on the device (CuPy
ElementwiseKernels, built on first use): the array versions take several passes with temporaries, which at 4096^2
cost more than the bf16 product itself. Same rounding, bit for bit, except that the device flushes a subnormal
small part of the split to zero (tests/kernels/test_gpu.py compares them)."""
_FINITE = "(u & 0x7f800000u) != 0x7f800000u"


def _device_conversion(name: str) -> Any:
    if name not in _DEVICE_CONVERSIONS:
        import cupy as cp

        kernels = {
            "bf16_bits": cp.ElementwiseKernel(
                "float32 x",
                "uint16 y",
                f"unsigned int u = __float_as_uint(x); if ({_FINITE}) u += 0x7fffu + ((u >> 16) & 1u); y = u >> 16;",
                "matmul_bf16_bits",
            ),
            "split_tf32": cp.ElementwiseKernel(
                "float32 x",
                "float32 big, float32 small",
                f"unsigned int u = __float_as_uint(x);"
                f" if ({_FINITE}) u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;"
                " big = __uint_as_float(u); small = x - big;",
                "matmul_split_tf32",
            ),
        }
        _DEVICE_CONVERSIONS[name] = kernels[name]
    return _DEVICE_CONVERSIONS[name]


def _gemm(b_op: int, x: Any, y: Any, kind: int, c: Any, c_kind: int, compute: int, beta: np.ndarray) -> None:
    """c = x @ y (row-major CuPy arrays: matrices, or stacks of them, c's leading dimension the batch) as one
    strided-batched GemmEx on the current stream: row-major C = X @ Y is column-major C^T = Y^T @ X^T. `y` is Y
    (b_op N) or Y^T as stored (b_op T, n x k, as IMMA takes it); alpha is 1 in beta's type."""
    import cupy as cp
    from cupy_backends.cuda.libs import cublas  # loads libcublas: on first use, not where there is no GPU

    m, k = x.shape[-2:]
    n = y.shape[-2] if b_op == CUBLAS_OP_T else y.shape[-1]
    one = np.ones(1, beta.dtype)
    cublas.gemmStridedBatchedEx(
        cp.cuda.device.get_cublas_handle(), b_op, CUBLAS_OP_N, n, m, k,
        one.ctypes.data, y.data.ptr, kind, y.shape[-1], batch_stride(y), x.data.ptr, kind, k, batch_stride(x),
        beta.ctypes.data, c.data.ptr, c_kind, n, m * n, c.shape[0] if c.ndim == 3 else 1, compute, CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


def cublas_product(a: Any, b: Any, c: Any, precision: Precision) -> None:
    """c = a @ b by cuBLAS in `precision` (CuPy float32 arrays, C-contiguous: matrices, or stacks of them as
    numpy.matmul takes them, a matrix or a stack of one on either side broadcast), on the current stream: one
    strided-batched GemmEx with the precision's operand types and compute type, float32 sums and C; 3xtf32 as three
    TF32 products of the split operands, the two small ones first; int8 `cublas_int8_product`. The reference each
    own kernel is measured against, in its mode."""
    import cupy as cp

    if precision is Precision.INT8:
        cublas_int8_product(a, b, c)
        return
    if precision is Precision.FP32:
        cp.matmul(a, b, out=c)
        return
    zero, one = np.zeros(1, np.float32), np.ones(1, np.float32)
    if precision is Precision.TF32:
        _gemm(CUBLAS_OP_N, a, b, CUDA_R_32F, c, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32, zero)
    elif precision is Precision.TF32X3:
        split = _device_conversion("split_tf32")
        (a_big, a_small), (b_big, b_small) = split(a), split(b)
        for x, y, beta in ((a_big, b_small, zero), (a_small, b_big, one), (a_big, b_big, one)):
            _gemm(CUBLAS_OP_N, x, y, CUDA_R_32F, c, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32, beta)
    elif precision is Precision.BF16:
        convert = _device_conversion("bf16_bits")
        _gemm(CUBLAS_OP_N, convert(a), convert(b), CUDA_R_16BF, c, CUDA_R_32F, CUBLAS_COMPUTE_32F, zero)
    else:
        _gemm(
            CUBLAS_OP_N, a.astype(cp.float16), b.astype(cp.float16), CUDA_R_16F, c, CUDA_R_32F, CUBLAS_COMPUTE_32F, zero
        )


INT8_K_MULTIPLE = 4
"""cuBLAS's int8 GEMM takes rows of A and B^T whose length k is a multiple of 4 (CUBLAS_STATUS_NOT_SUPPORTED else)."""


def cublas_int8_product(a: Any, b: Any, c: Any, *, b_transposed: bool = False) -> None:
    """c = a @ b by cuBLAS on the integer tensor cores (IMMA), exactly: CuPy int8 arrays a and b (C-contiguous,
    matrices or stacks as `cublas_product` takes them; b given as B^T, N x K, when `b_transposed`), int32 c, on the
    current stream. IMMA takes the operands "TN" (both K-major, as kernels/wgmma.cu's int8 instance does): B is
    transposed first where it is not, then GemmEx runs with int8 operands, int32 sums and C (CUBLAS_COMPUTE_32I)."""
    import cupy as cp

    b_t = b if b_transposed else cp.ascontiguousarray(b.swapaxes(-1, -2))
    _gemm(CUBLAS_OP_T, a, b_t, CUDA_R_8I, c, CUDA_R_32I, CUBLAS_COMPUTE_32I, np.zeros(1, np.int32))
