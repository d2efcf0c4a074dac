"""The catalogue's modes: which (dtype, precision) each rung computes, so that nothing plans, self-tests or launches a
product in a mode its kernel does not have."""

from __future__ import annotations

import pytest

from kernels.catalogue import CUBLAS, RUNGS, TENSOR_CORE_PRECISIONS, rungs_on
from kernels.tensorcore import DMMA, MMA_SYNC, WGMMA
from numerics.precision import PRECISIONS_OF, Precision


def test_each_rung_computes_its_dtypes_in_the_precisions_they_take() -> None:
    assert RUNGS[WGMMA].modes() == [*(("float32", p) for p in TENSOR_CORE_PRECISIONS), ("int32", Precision.INT8)]
    assert RUNGS[MMA_SYNC].modes() == [
        *(("float32", p) for p in (Precision.TF32, Precision.BF16, Precision.FP16)),
        ("int32", Precision.INT8),
    ]
    assert RUNGS[DMMA].modes() == [("float64", Precision.FP32)]
    assert RUNGS[CUBLAS].modes() == [
        (dtype, p) for dtype, precisions in PRECISIONS_OF.items() for p in precisions if p is not Precision.FP8
    ]
    assert RUNGS["fast"].modes() == [("float32", Precision.FP32), ("float64", Precision.FP32)]


@pytest.mark.parametrize(
    ("compute_capability", "rungs"),
    [
        ((7, 5), set()),
        ((8, 0), {MMA_SYNC}),
        ((8, 6), {MMA_SYNC}),
        ((8, 9), {MMA_SYNC}),
        ((9, 0), {MMA_SYNC, WGMMA, DMMA}),
        ((10, 0), {MMA_SYNC}),
        ((12, 0), {MMA_SYNC}),
    ],
)
def test_mma_sync_runs_from_compute_capability_8_0_on_and_the_sm90a_rungs_on_9_0_alone(
    compute_capability: tuple[int, int], rungs: set[str]
) -> None:
    """mma_sync's PTX for compute_80 runs on every later GPU; wgmma's and dmma's sm_90a machine code on 9.0 only;
    the FMA kernels and cuBLAS everywhere."""
    here = {rung.name for rung in rungs_on(compute_capability)}
    assert here & {MMA_SYNC, WGMMA, DMMA} == rungs
    assert {CUBLAS, "fast", "naive"} <= here


def test_a_precision_of_another_dtype_is_not_computed() -> None:
    wgmma = RUNGS[WGMMA]
    assert wgmma.computes("int32", Precision.INT8) and wgmma.computes("float32", Precision.BF16)
    assert not wgmma.computes("float32", Precision.INT8) and not wgmma.computes("int32", Precision.TF32)
    assert not wgmma.computes("float64", Precision.FP32) and not RUNGS["tiled"].computes("int32", Precision.INT8)
