"""Staging operands into the working dtype: in one pass, or in bands of rows on several threads."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from app.engine.staging import PARALLEL_BYTES, cast_into_parallel
from app.errors import InvalidMatrix

ROWS = 1024
COLUMNS = PARALLEL_BYTES // (4 * ROWS)
"""A float32 operand exactly at the size that is split into bands."""


@pytest.fixture(scope="module")
def threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


@pytest.mark.parametrize("rows", [ROWS, ROWS - 1, 3])
def test_bands_of_rows_copy_every_element_converted(threads: ThreadPoolExecutor, rows: int) -> None:
    src = np.asfortranarray(np.random.default_rng(0).standard_normal((rows, COLUMNS)).astype(">f8"))
    dst = np.full((rows, COLUMNS), np.nan, np.float32)
    cast_into_parallel(dst, src, "a", threads, bands=4)
    np.testing.assert_array_equal(dst, src.astype(np.float32))


def test_a_value_out_of_range_in_a_later_band_names_its_row_in_the_whole_matrix(threads: ThreadPoolExecutor) -> None:
    src = np.zeros((ROWS, COLUMNS))
    src[900, 7] = 1e39
    src[1000, 1] = -1e39
    with pytest.raises(InvalidMatrix, match=r"b\[900\]\[7\] = 1e\+39 is out of range for float32") as caught:
        cast_into_parallel(np.empty((ROWS, COLUMNS), np.float32), src, "b", threads, bands=4)
    assert caught.value.location == ["b", 900, 7]
