"""Every rung a request may name, in one catalogue: what it computes in, its tiles, the devices it runs on, and how it
launches. The instances behind each rung are where they are built: the FMA ladder's launch configurations in
registry.py, the tensor-core kernels' in tensorcore.py; cuBLAS is cuBLAS (cublas.py). kernels/cuda.py's `Launcher`
launches every rung by its name; the GPU backend lists and plans its kernels from here, and the CPU backend names the
GPU kernels its emulations stand for from here.

    rung          launcher       dtypes                    precisions                         devices
    naive ..      fma            float32, float64          fp32                               every CUDA GPU
    fast
    mma_sync      tensor_core    float32, int32            tf32, bf16, fp16, int8             compute capability 8.0 on
    wgmma         tensor_core    float32, int32            tf32, 3xtf32, bf16, fp16, fp8,     compute capability 9.0
                                                           int8
    dmma          tensor_core    float64                   fp32 (float64's own)               compute capability 9.0
    cublas        cublas         float32, float64, int32   every one but fp8                  every CUDA GPU

cuBLAS's GemmEx has no FP8 types (only cuBLASLt has, which CuPy does not bind), so fp8 runs on `wgmma` alone, and the
kernel benchmark measures it against cuBLASLt through PyTorch where PyTorch is installed.

A rung computes a product of one of its dtypes in those of its precisions that the dtype takes
(numerics/precision.py's `PRECISIONS_OF`): int32 from int8 operands, float64 in its own, float32 in the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from kernels import tensorcore
from kernels.registry import KERNELS
from numerics.precision import FLOAT_PRECISIONS, INT8_PRODUCT, PRECISIONS_OF, Precision

CUBLAS = "cublas"
CUBLAS_PRECISIONS = tuple(precision for precision in Precision if precision is not Precision.FP8)
"""Every precision but fp8: GemmEx has no FP8 types."""
DTYPES = ("float32", "float64")
"""The float dtypes, which every FMA kernel computes in."""
TENSOR_CORE_PRECISIONS = tuple(precision for precision in FLOAT_PRECISIONS if precision is not Precision.FP32)
"""The tensor cores' roundings of float32 operands."""

Launcher = Literal["fma", "tensor_core", "cublas"]


@dataclass(frozen=True)
class Rung:
    """One kernel a request may name by its `name`."""

    name: str
    summary: str
    launcher: Launcher
    """Which part of kernels/cuda.py's `Launcher` runs it: the FMA ladder's library (its instance chosen per shape
    or tile), the tensor-core library (its instance chosen per precision and shape), or cuBLAS (kernels/cublas.py)."""
    dtypes: tuple[str, ...] = DTYPES
    precisions: tuple[Precision, ...] = (Precision.FP32,)
    """How it rounds the operands (numerics/precision.py); fp32 alone for float64."""
    tiles: tuple[int, ...] = ()
    """What a request's `tile` may choose (the FMA ladder's `tiled`)."""
    default_tile: int | None = None
    compute_capability: tuple[int, int] | None = None
    """The one device generation its machine code runs on (sm_90a's); None: see `from_compute_capability`."""
    from_compute_capability: tuple[int, int] | None = None
    """The first device generation it runs on, and every later one (PTX the driver compiles); None with
    `compute_capability` None: every CUDA GPU the service runs on."""
    stacks: bool = False
    """Whether it computes a stack of products (numpy.matmul's (B, m, k) @ (B, k, n), either side a matrix
    broadcast) in one launch: cuBLAS strided-batched, the FMA kernels that take a batch over gridDim.z."""

    def runs_on(self, compute_capability: tuple[int, int]) -> bool:
        if self.compute_capability is not None:
            return compute_capability == self.compute_capability
        return self.from_compute_capability is None or compute_capability >= self.from_compute_capability

    def computes(self, dtype: str, precision: Precision) -> bool:
        """Whether it computes a product of `dtype` in `precision`."""
        return dtype in self.dtypes and precision in self.precisions and precision in PRECISIONS_OF[dtype]

    def modes(self) -> list[tuple[str, Precision]]:
        """Every (dtype, precision) it computes in."""
        return [
            (dtype, precision)
            for dtype in self.dtypes
            for precision in self.precisions
            if self.computes(dtype, precision)
        ]


def _hopper(name: str, summary: str, dtypes: tuple[str, ...], precisions: tuple[Precision, ...]) -> Rung:
    """A rung of kernels/tensorcore.py in sm_90a machine code, which only compute capability 9.0 runs."""
    return Rung(
        name,
        summary,
        "tensor_core",
        dtypes=dtypes,
        precisions=precisions,
        compute_capability=tensorcore.COMPUTE_CAPABILITY,
    )


RUNGS: MappingProxyType[str, Rung] = MappingProxyType(
    {
        rung.name: rung
        for rung in (
            *(
                Rung(
                    spec.name,
                    spec.summary,
                    "fma",
                    tiles=spec.tiles,
                    default_tile=spec.default_tile,
                    stacks=spec.batched,
                )
                for spec in KERNELS.values()
            ),
            Rung(
                tensorcore.MMA_SYNC,
                tensorcore.MMA_SYNC_SUMMARY,
                "tensor_core",
                dtypes=("float32", INT8_PRODUCT),
                precisions=tuple(tensorcore.MMA_SYNC_CONFIGS),
                from_compute_capability=tensorcore.PORTABLE_COMPUTE_CAPABILITY,
            ),
            _hopper(
                tensorcore.WGMMA,
                tensorcore.WGMMA_SUMMARY,
                ("float32", INT8_PRODUCT),
                (*TENSOR_CORE_PRECISIONS, Precision.INT8),
            ),
            _hopper(tensorcore.DMMA, tensorcore.DMMA_SUMMARY, ("float64",), (Precision.FP32,)),
            Rung(
                CUBLAS,
                "cuBLAS: cupy.matmul in fp32 (TF32 off), GemmEx in the precision's types (int8: IMMA, k a multiple "
                "of 4; no fp8): the reference.",
                "cublas",
                dtypes=(*DTYPES, INT8_PRODUCT),
                precisions=CUBLAS_PRECISIONS,
                stacks=True,
            ),
        )
    }
)
"""Every rung, by name, in the ladder's order: the FMA kernels, the tensor-core kernels, cuBLAS."""


def rungs_on(compute_capability: tuple[int, int], launcher: Launcher | None = None) -> list[Rung]:
    """The rungs a device of this compute capability runs (those of one launcher, when named)."""
    return [rung for rung in RUNGS.values() if rung.runs_on(compute_capability) and launcher in (None, rung.launcher)]
