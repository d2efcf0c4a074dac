"""kernels/reference.py: the tolerance table passes correct products at the largest k checked, fails wrong ones."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import kernels
from app.engine.base import DTYPE_NAMES
from kernels.reference import REL_TOLERANCE, relative_error, tolerance


def test_every_working_dtype_has_a_tolerance() -> None:
    assert {dtype.name for dtype in REL_TOLERANCE} == set(DTYPE_NAMES)
    assert tolerance("float32") == tolerance(np.float32) == REL_TOLERANCE[np.dtype(np.float32)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_correct_product_at_the_largest_k_passes_and_one_wrong_element_fails(dtype: str) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 8192)).astype(dtype), rng.standard_normal((8192, 16)).astype(dtype)
    reference = a.astype(np.float64) @ b.astype(np.float64)
    c = a @ b
    assert relative_error(c, reference) <= tolerance(dtype) / 2
    c[3, 5] += 1.0
    assert relative_error(c, reference) > tolerance(dtype)


def test_a_zero_reference_measures_the_absolute_error() -> None:
    assert relative_error(np.full((2, 2), 1e-3), np.zeros((2, 2))) == pytest.approx(2e-3)


def test_nothing_in_kernels_imports_the_app() -> None:
    for path in Path(kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [name for name in names if name.split(".")[0] == "app"], path.name
