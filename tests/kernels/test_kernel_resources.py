"""Static checks of every registered kernel (no GPU): it compiles for sm_90, and no instance spills registers.

Runs scripts/check_kernels.py's checks: NVRTC always (the test extra brings it), ptxas resources when `nvcc`
is on PATH.
"""

from __future__ import annotations

import pytest

from kernels.registry import KERNELS
from tests.scripts import import_script

check_kernels = import_script("check_kernels")


@pytest.mark.parametrize("name", list(KERNELS))
def test_compiles_for_sm90_with_nvrtc(name: str) -> None:
    check_kernels.check_nvrtc(KERNELS[name], "compute_90")


@pytest.mark.skipif(check_kernels.nvcc_path() is None, reason="nvcc is not on PATH: no ptxas resource report")
def test_no_instance_spills_registers() -> None:
    nvcc = check_kernels.nvcc_path()
    rows = check_kernels.check_resources(KERNELS.values(), nvcc)
    print(check_kernels.format_table(rows))
    expected = sum(len(spec.configs) * 2 for spec in KERNELS.values())
    assert len(rows) == expected
    spilling = [f"{r.kernel}/{r.config}/{r.dtype}" for r in rows if r.spills]
    assert not spilling, f"these instances spill registers to local memory: {spilling}"
