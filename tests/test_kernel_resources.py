"""Static checks of every registered kernel (no GPU): it compiles for sm_90, and no instance spills registers.

Runs scripts/check_kernels.py's checks: NVRTC always (the test extra brings it), ptxas resources when `nvcc`
is on PATH.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kernels.registry import KERNELS


def _load_check_kernels() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "scripts" / "check_kernels.py"
    spec = importlib.util.spec_from_file_location("check_kernels", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check_kernels = _load_check_kernels()


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
