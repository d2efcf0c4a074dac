"""The roofline: each kernel's global-memory traffic by its access pattern, the device's peaks, the answer's fields."""

from __future__ import annotations

import pytest

from kernels.registry import KERNELS, minimum_global_elements


@pytest.mark.parametrize(
    ("kernel", "tile", "mnk", "elements"),
    [
        # every thread reads its row of A and its column of B: 2mnk, + mn writes
        ("naive", None, (4, 3, 5), 4 * 5 * 3 + 5 * 3 * 4 + 4 * 3),
        # A once per block column (ceil(50/16) = 4), B once per block row (ceil(100/16) = 7)
        ("tiled", 16, (100, 50, 40), 100 * 40 * 4 + 40 * 50 * 7 + 100 * 50),
        ("tiled", 8, (1024, 1024, 1024), 2 * 1024**3 // 8 + 1024**2),
        ("tiled", 32, (1, 1, 1), 1 + 1 + 1),
        # a warp shares one read of A among its 32 columns; B is read by every output
        ("coalesced", None, (2, 40, 3), 2 * 3 * 2 + 3 * 40 * 2 + 2 * 40),
        ("blocktile1d", None, (4096, 4096, 4096), 2 * 4096**3 // 64 + 4096**2),
        ("blocktile2d", None, (300, 200, 7), 300 * 7 * 2 + 7 * 200 * 3 + 300 * 200),
        # fast runs 512^3 on its smallest block, 64x64: no tile yields 128 blocks there
        ("fast", None, (512, 512, 512), 2 * 512**3 // 64 + 512**2),
    ],
)
def test_each_kernel_requests_what_its_access_pattern_reads(
    kernel: str, tile: int | None, mnk: tuple[int, int, int], elements: int
) -> None:
    m, n, k = mnk
    config = KERNELS[kernel].config_for(m, n, k, tile)
    assert config.global_elements(m, n, k) == elements


def test_the_libraries_are_counted_at_the_minimum() -> None:
    assert minimum_global_elements(2, 3, 4) == 2 * 4 + 4 * 3 + 2 * 3
    assert minimum_global_elements(5, 0, 7) == 35


def test_tiling_divides_the_operand_reads_by_the_tile() -> None:
    m = n = k = 256
    naive = KERNELS["naive"].config_for(m, n, k, None).global_elements(m, n, k) - m * n
    for tile in (8, 16, 32):
        tiled = KERNELS["tiled"].config_for(m, n, k, tile).global_elements(m, n, k) - m * n
        assert naive == tile * tiled
