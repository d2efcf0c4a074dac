"""The catalogue's modes: which (dtype, precision) each rung computes, so that nothing plans, self-tests or launches a
product in a mode its kernel does not have."""

from __future__ import annotations

from kernels.catalogue import CUBLAS, RUNGS, TENSOR_CORE_PRECISIONS
from kernels.tensorcore import DMMA, MMA_SYNC, WGMMA
from numerics.precision import PRECISIONS_OF, Precision


def test_each_rung_computes_its_dtypes_in_the_precisions_they_take() -> None:
    assert RUNGS[WGMMA].modes() == [*(("float32", p) for p in TENSOR_CORE_PRECISIONS), ("int32", Precision.INT8)]
    assert RUNGS[MMA_SYNC].modes() == [("float32", p) for p in (Precision.TF32, Precision.BF16, Precision.FP16)]
    assert RUNGS[DMMA].modes() == [("float64", Precision.FP32)]
    assert RUNGS[CUBLAS].modes() == [
        (dtype, p) for dtype, precisions in PRECISIONS_OF.items() for p in precisions if p is not Precision.FP8
    ]
    assert RUNGS["fast"].modes() == [("float32", Precision.FP32), ("float64", Precision.FP32)]


def test_a_precision_of_another_dtype_is_not_computed() -> None:
    wgmma = RUNGS[WGMMA]
    assert wgmma.computes("int32", Precision.INT8) and wgmma.computes("float32", Precision.BF16)
    assert not wgmma.computes("float32", Precision.INT8) and not wgmma.computes("int32", Precision.TF32)
    assert not wgmma.computes("float64", Precision.FP32) and not RUNGS["tiled"].computes("int32", Precision.INT8)
