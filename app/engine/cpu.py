"""The CPU backend, so that the service runs on machines without a GPU: NumPy's matmul (its BLAS), and the
teaching kernels `naive` and `tiled` as NumPy emulations of their GPU decomposition (kernels/emulation.py)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from time import perf_counter
from typing import Any, Final

import numpy as np

from app.engine.autotune import AutoChoice
from app.engine.base import (
    ALL_DTYPES,
    ALL_PRECISIONS,
    AUTO,
    NUMPY,
    DeviceTiming,
    Finished,
    KernelInfo,
    Outputs,
    Pairs,
    Plan,
    ProductRequest,
    kernel_info,
    ladder_plan,
)
from app.engine.staging import cast_into, check_in_format
from app.errors import InvalidParameter, SharedMemoryError, UnknownKernel
from app.shapes import matrix_of, result_shape
from kernels.catalogue import RUNGS
from kernels.emulation import EMULATIONS
from numerics.precision import Precision, exact_int8_product, float32_emulation, operand_dtype
from numerics.roofline import DevicePeaks

EMULATED = "An emulation of the GPU kernel in NumPy, thread for thread (float32: the GPU's bits). The kernel: "


class CpuBackend:
    name: Final = "cpu"

    def __init__(self, reason: str) -> None:
        self.device_name = platform.processor() or platform.machine() or "cpu"
        self.peaks = DevicePeaks()
        """None known: see numerics.roofline."""
        self._reason = reason

    def kernels(self) -> list[KernelInfo]:
        return [
            KernelInfo(
                name=AUTO,
                kind="auto",
                summary="The fastest kernel this backend has: numpy.",
                dtypes=ALL_DTYPES,
                precisions=ALL_PRECISIONS,
            ),
            *(kernel_info(RUNGS[name], "emulation", EMULATED) for name in EMULATIONS),
            KernelInfo(
                name=NUMPY,
                kind="library",
                summary="numpy.matmul, through NumPy's BLAS; the tensor-core precisions emulated; int8 operands "
                "multiplied exactly in float64 into int32.",
                dtypes=ALL_DTYPES,
                precisions=ALL_PRECISIONS,
            ),
        ]

    def plan(self, request: ProductRequest) -> Plan:
        kernel, tile, precision = request.kernel, request.tile, request.precision
        if kernel in EMULATIONS:
            return ladder_plan(kernel, request, NUMPY)
        if kernel not in (AUTO, NUMPY):
            offered = [info.name for info in self.kernels()]
            needs_gpu = kernel in RUNGS
            raise UnknownKernel(
                f"kernel '{kernel}' "
                + ("needs the GPU backend, but this server runs on the CPU" if needs_gpu else "does not exist")
                + f"; this server has {offered}",
                location=["kernel"],
            )
        if tile is not None:
            raise InvalidParameter(f"tile applies to the tiled kernel only, not to '{kernel}'", location=["tile"])
        return Plan(kernel=NUMPY, precision=precision)

    def prepare(self) -> None:
        np.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))

    def batchable(self, plan: Plan) -> bool:
        return True

    @property
    def max_in_flight(self) -> int:
        return 1

    def submit(
        self, pairs: Pairs, dtype: np.dtype, plan: Plan, on_done: Callable[[], None], outputs: Outputs = None
    ) -> Finished:
        start = perf_counter()
        operands_in = operand_dtype(dtype)
        staged_pairs = [(_in_dtype(a, operands_in, "a"), _in_dtype(b, operands_in, "b")) for a, b in pairs]
        staged = perf_counter()
        products = list(outputs) if outputs is not None else [np.empty(result_shape(a, b), dtype) for a, b in pairs]
        # NaN and infinities propagate as docs/api.md says; NumPy's RuntimeWarnings about them are log noise.
        with np.errstate(invalid="ignore", over="ignore"):
            for (a, b), c in zip(staged_pairs, products, strict=True):
                _compute(a, b, c, plan)
        done = perf_counter()
        return Finished(
            products, DeviceTiming(h2d_ms=(staged - start) * 1e3, kernel_ms=(done - staged) * 1e3, d2h_ms=0.0)
        )

    def check_operand(self, operand: Any, name: str, precision: Precision) -> None:
        check_in_format(operand, name, precision)

    def pin(self, memory: np.ndarray) -> None:
        return None

    def unpin(self, memory: np.ndarray) -> None:
        return None

    def open_device_memory(self, raw_handle: bytes, device: int, byte_size: int) -> Any:
        raise SharedMemoryError(
            f"CUDA shared memory needs the GPU backend; this engine runs on the CPU ({self._reason})",
            location=["raw_handle"],
        )

    def close_device_memory(self, memory: Any) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.device_name,
            "cpu_count": os.cpu_count(),
            "numpy_version": np.__version__,
            "why_cpu": self._reason,
        }

    def auto_choices(self) -> list[AutoChoice]:
        return []

    def memory_held(self) -> int:
        return 0

    def compiled_instances(self) -> int:
        return 0

    def close(self) -> None:
        return None


def _in_dtype(operand: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """The operand as a C-contiguous array of `dtype`: itself when it is one, else a converted copy."""
    if operand.dtype == dtype and operand.flags.c_contiguous:
        return operand
    converted = np.empty(operand.shape, dtype)
    cast_into(converted, operand, name)
    return converted


def _compute(a: np.ndarray, b: np.ndarray, c: np.ndarray, plan: Plan) -> None:
    """c = a @ b as `plan` computes it: a stack in one NumPy call where NumPy computes it as planned, else matrix by
    matrix (the teaching rungs' emulations take matrices, and fp8 scales each matrix by its own largest magnitude,
    as the product of that matrix alone would be)."""
    if c.ndim == 3 and (plan.config is not None or plan.precision is Precision.FP8):
        for index in range(c.shape[0]):
            _compute(matrix_of(a, index), matrix_of(b, index), c[index], plan)
        return
    if plan.precision is Precision.INT8:
        exact_int8_product(a, b, c)
    elif plan.precision is not Precision.FP32:
        np.copyto(c, float32_emulation(a, b, plan.precision))
    elif plan.config is None:
        np.matmul(a, b, out=c)
    else:
        np.copyto(c, EMULATIONS[plan.kernel](a, b, plan.config))
