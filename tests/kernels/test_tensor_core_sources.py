"""The tensor-core kernels compile through NVRTC for sm_90a down to machine code, with no GPU and no driver (CI
checks this), without spilling; and the geometry kernels/tensorcore.py derives for them."""

from __future__ import annotations

import re

import pytest

from kernels import tensorcore
from kernels.catalogue import TENSOR_CORE_PRECISIONS
from kernels.cuda import compile_tensor_core_source
from kernels.registry import MAX_DYNAMIC_SMEM, cdiv
from numerics.precision import Precision
from tests.kernels.test_kernel_sources import _nvrtc_missing

SPILLS = re.compile(r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")
SOURCES = {
    tensorcore.WGMMA_SOURCE: [
        *(config.expression() for config in tensorcore.WGMMA_CONFIGS.values()),
        tensorcore.WGMMA_INT8.expression(),
        *(config.expression() for config in tensorcore.WGMMA_FP8_WIDE.values()),
        *(config.expression() for config in tensorcore.WGMMA_FP8_WIDE_PERSISTENT.values()),
    ],
    tensorcore.WGMMA_PINGPONG_SOURCE: [tensorcore.WGMMA_INT8_PINGPONG.expression()],
    tensorcore.WGMMA_ROWS_SOURCE: [tensorcore.WGMMA_TF32_ROWS.expression()],
    tensorcore.MMA_SYNC_SOURCE: [config.expression() for config in tensorcore.MMA_SYNC_CONFIGS.values()],
    tensorcore.DMMA_SOURCE: [config.expression() for config in tensorcore.DMMA_CONFIGS.values()],
    tensorcore.OPERANDS_SOURCE: tensorcore.operand_expressions(),
}


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("source", list(SOURCES))
def test_compiles_for_sm90a_without_spilling(source: str) -> None:
    expressions = SOURCES[source]
    cubin, lowered, log = compile_tensor_core_source(source, expressions)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(expressions)
    reports = SPILLS.findall(log)
    assert len(reports) == len(expressions), log
    assert all(stores == loads == "0" for stores, loads in reports), log


def test_every_tensor_core_precision_has_an_instance_that_fits_in_shared_memory() -> None:
    assert set(tensorcore.WGMMA_CONFIGS) == set(TENSOR_CORE_PRECISIONS)
    for config in (*tensorcore.WGMMA_CONFIGS.values(), tensorcore.WGMMA_INT8, *tensorcore.WGMMA_FP8_WIDE.values()):
        assert config.smem_bytes() <= MAX_DYNAMIC_SMEM
        # a tile row is one 128-byte swizzle span, and a TMA box has at most 256 rows
        assert config.tile_k * config.element_bytes == tensorcore.ROW_BYTES
        assert config.block_n <= 256 and tensorcore.BLOCK_M <= 256


def test_tf32_from_the_rows_tiles_c_transposed_in_boxes_the_copy_engine_takes() -> None:
    rows = tensorcore.WGMMA_TF32_ROWS
    assert rows.expression() == "matmul_wgmma_rows<256, 4>"
    assert rows.smem_bytes() <= MAX_DYNAMIC_SMEM
    # B's boxes: 32 columns of float32, one 128-byte swizzle span, by a stage's rows of K; A's: block_n rows of that K
    assert rows.box_columns * 4 == rows.tile_k * 4 == tensorcore.ROW_BYTES
    assert rows.block_n <= 256  # a TMA box has at most 256 rows
    # a block per 128 x 256 tile of C^T: 128 of N by 256 of M
    assert rows.blocks(4096, 4096) == 16 * 32
    assert rows.blocks(257, 4) == 2 and rows.blocks(256, 132) == 2 and rows.blocks(1, 4) == 1
    assert set(tensorcore.WGMMA_TF32_INSTANCES.values()) == {rows, tensorcore.WGMMA_CONFIGS[Precision.TF32]}


@pytest.mark.parametrize(
    ("precision", "k", "padded"),
    [(Precision.BF16, 1, 8), (Precision.FP16, 8, 8), (Precision.BF16, 4099, 4104), (Precision.TF32, 5, 8),
     (Precision.TF32X3, 4096, 4096)],
)  # fmt: skip
def test_rows_are_padded_to_the_copy_engines_16_bytes(precision: Precision, k: int, padded: int) -> None:
    config = tensorcore.WGMMA_CONFIGS[precision]
    assert config.padded_k(k) == padded
    assert (config.padded_k(k) * config.element_bytes) % tensorcore.STRIDE_ALIGNMENT == 0


@pytest.mark.parametrize(("k", "padded"), [(1, 16), (16, 16), (17, 32), (4099, 4112)])
def test_int8_rows_are_padded_to_16_elements(k: int, padded: int) -> None:
    assert tensorcore.WGMMA_INT8.padded_k(k) == padded
    assert tensorcore.WGMMA_INT8.tile_k == 128
    assert tensorcore.WGMMA_INT8.expression() == "matmul_wgmma<3, 256, 4, false>"


def test_int8_runs_in_turns_up_to_its_k_and_in_tiles_past_it() -> None:
    pingpong = tensorcore.WGMMA_INT8_PINGPONG
    assert pingpong.expression() == "matmul_wgmma_pingpong<3, 128, 128, 6>"
    assert pingpong.smem_bytes() <= MAX_DYNAMIC_SMEM
    assert max(pingpong.boxes) <= 256  # a TMA box has at most 256 rows
    assert pingpong.tiles(4096, 4096) == 32 * 32 and pingpong.tiles(129, 1) == 2
    assert pingpong.blocks(4096, 4096, 132) == 132 and pingpong.blocks(129, 1, 132) == 2
    assert tensorcore.wgmma_int8_config(1) is tensorcore.wgmma_int8_config(tensorcore.PINGPONG_INT8_MAX_K) is pingpong
    assert tensorcore.wgmma_int8_config(tensorcore.PINGPONG_INT8_MAX_K + 1) is tensorcore.WGMMA_INT8
    assert set(tensorcore.WGMMA_INT8_INSTANCES.values()) == {pingpong, tensorcore.WGMMA_INT8}


def test_fp8_wide_tiles_read_what_the_narrow_ones_read_and_fit() -> None:
    narrow = tensorcore.WGMMA_CONFIGS[Precision.FP8]
    assert tensorcore.FP8_WIDTHS == (176, 192, 208)
    for width in tensorcore.FP8_WIDTHS:
        wide, persistent = tensorcore.WGMMA_FP8_WIDE[width], tensorcore.WGMMA_FP8_WIDE_PERSISTENT[width]
        assert wide.expression() == f"matmul_wgmma<4, {width}, 4, false>"
        assert persistent.expression() == f"matmul_wgmma<4, {width}, 4, false, true>"
        assert wide.smem_bytes() <= MAX_DYNAMIC_SMEM
        assert wide.boxes == (128, width) and wide.conversion is narrow.conversion
        assert wide.padded_k(33) == narrow.padded_k(33)
    assert list(tensorcore.WGMMA_FP8_INSTANCES) == [
        "128 wide",
        "176 wide",
        "192 wide",
        "208 wide",
        "176 persistent",
        "192 persistent",
        "208 persistent",
    ]
    persistent = tensorcore.WGMMA_FP8_WIDE_PERSISTENT[208]
    assert tensorcore.WGMMA_FP8_WIDE[208].blocks(4096, 4096, 132) == 32 * 20  # 4.8 rounds on 132 SMs
    assert persistent.blocks(4096, 4096, 132) == 132 and persistent.blocks(129, 209, 132) == 2 * 2
    with pytest.raises(ValueError, match="SM count"):
        persistent.blocks(4096, 4096)


@pytest.mark.parametrize(
    ("m", "n", "k", "width"),
    [
        # rounds of 132 blocks, each round of 128 x BN tiles counted as BN + 46 columns
        (2048, 2048, 2048, 128),  # 128 wide: 256 tiles, 2 rounds of 174; 176 wide: 192 tiles, 2 rounds of 222
        (2304, 2304, 2304, 176),  # 176: 252 tiles, 2 rounds (444); 192: 216, 2 (476); 128: 324, 3 (522)
        (3072, 3072, 3072, 192),  # 192: 384 tiles, 3 rounds (714); 208: 360, 3 (762); 176: 432, 4 (888)
        (4096, 4096, 4096, 208),  # 208: 640 tiles, 5 rounds (1,270); 176: 768, 6 (1,332); 128: 1,024, 8 (1,392)
        (6144, 6144, 6144, 208),  # 208: 1,440 tiles, 11 rounds (2,794); 176: 1,680, 13 (2,886)
        (8192, 8192, 8192, 192),  # 192: 2,752 tiles, 21 rounds (4,998); 208: 2,560, 20 (5,080); 176: 3,008, 23
        (128, 128 * 132, 8192, 128),  # one row of 132 tiles: one round at every width, the narrowest's the shortest
        (128, 208 * 132, 8192, 208),  # 208: one round (254); 192: 143 tiles, 2 (476); 128: 215, 2 (348)
    ],
)
def test_fp8_runs_on_the_width_whose_rounds_cost_least(m: int, n: int, k: int, width: int) -> None:
    chosen = tensorcore.wgmma_fp8_config(m, n, k, 132)
    assert chosen.block_n == width
    assert chosen is (
        tensorcore.WGMMA_CONFIGS[Precision.FP8]
        if width == 128
        else tensorcore.WGMMA_FP8_WIDE_PERSISTENT[width]
        if k <= tensorcore.FP8_PERSISTENT_MAX_K
        else tensorcore.WGMMA_FP8_WIDE[width]
    )


def test_fp8_wide_tiles_run_as_a_persistent_grid_up_to_its_k() -> None:
    max_k = tensorcore.FP8_PERSISTENT_MAX_K
    assert tensorcore.wgmma_fp8_config(4096, 4096, max_k, 132) is tensorcore.WGMMA_FP8_WIDE_PERSISTENT[208]
    assert tensorcore.wgmma_fp8_config(4096, 4096, max_k + 1, 132) is tensorcore.WGMMA_FP8_WIDE[208]


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
def test_only_the_kinds_that_sum_each_tile_of_k_apart_compile_as_a_persistent_grid() -> None:
    """The others leave each tile's last stage held, which a persistent block's next tile would wait for."""
    with pytest.raises(RuntimeError, match="a persistent grid for the kinds that sum each tile of K apart"):
        compile_tensor_core_source(tensorcore.WGMMA_SOURCE, ["matmul_wgmma<0, 256, 4, false, true>"])


def test_one_block_per_tile_of_c() -> None:
    bf16, split = tensorcore.WGMMA_CONFIGS[Precision.BF16], tensorcore.WGMMA_CONFIGS[Precision.TF32X3]
    assert bf16.blocks(4096, 4096) == 32 * 16
    assert bf16.blocks(129, 257) == 2 * 2
    assert split.blocks(4093, 4099) == 32 * 33
    assert bf16.expression() == "matmul_wgmma<0, 256, 4, false>"
    assert split.expression() == "matmul_wgmma<2, 128, 3, true>"


PORTABLE_SMEM = 99 * 1024
"""The least dynamic shared memory a block may ask for from compute capability 8.0 on (8.6 and 8.9: 99 KiB)."""


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("source", [tensorcore.MMA_SYNC_SOURCE, tensorcore.OPERANDS_SOURCE])
def test_mma_sync_and_the_conversions_compile_to_ptx_for_compute_80_without_fp8(source: str) -> None:
    """What GPUs other than an H100 or H200 load: PTX of compute capability 8.0, which the driver compiles for the
    device; FP8's conversion (cvt to e4m3 needs 8.9) left out."""
    expressions = (
        [config.expression() for config in tensorcore.MMA_SYNC_PORTABLE_CONFIGS.values()]
        if source == tensorcore.MMA_SYNC_SOURCE
        else tensorcore.operand_expressions(fp8=False)
    )
    ptx, lowered, _ = compile_tensor_core_source(source, expressions, tensorcore.PORTABLE_ARCH)
    text = ptx.decode()
    assert ".target sm_80" in text and set(lowered) == set(expressions)
    assert "e4m3" not in text and all(name in text for name in lowered.values())
    if source == tensorcore.MMA_SYNC_SOURCE:
        assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in text


def test_every_mma_sync_and_dmma_instance_fits_in_shared_memory() -> None:
    assert set(tensorcore.MMA_SYNC_CONFIGS) == {Precision.TF32, Precision.BF16, Precision.FP16, Precision.INT8}
    assert set(tensorcore.MMA_SYNC_PORTABLE_CONFIGS) == set(tensorcore.MMA_SYNC_CONFIGS)
    for portable in tensorcore.MMA_SYNC_PORTABLE_CONFIGS.values():
        assert portable.smem_bytes() <= PORTABLE_SMEM and portable.block_n % (4 * 16) == 0
    for mma in tensorcore.MMA_SYNC_CONFIGS.values():
        assert mma.smem_bytes() <= MAX_DYNAMIC_SMEM
        # eight warps of 64 x block_n / 4, each ldmatrix.x4 of B covering two blocks of 8 columns
        assert mma.block_n % (4 * 16) == 0
    for dmma in tensorcore.DMMA_CONFIGS.values():
        assert dmma.smem_bytes() * (2 if dmma.threads <= 128 else 1) <= MAX_DYNAMIC_SMEM
        assert dmma.block_m % dmma.warp_m == 0 and dmma.block_n % tensorcore.DMMA_WARP_N == 0
        assert dmma.mma_k in (8, 16) and dmma.block_k % 16 == 0


@pytest.mark.parametrize(
    ("n", "k", "vec"), [(4096, 4096, True), (4099, 4096, False), (4096, 4097, False), (1, 1, False), (2, 2, True)]
)
def test_dmma_copies_16_bytes_only_where_every_row_starts_on_16_bytes(n: int, k: int, vec: bool) -> None:
    config = tensorcore.dmma_config(n, k)
    assert config.vec is vec
    assert config.expression().startswith(f"matmul_dmma<{config.block_m}, {config.block_n}, ")


def test_one_mma_sync_or_dmma_block_per_tile_of_c() -> None:
    mma = tensorcore.MMA_SYNC_CONFIGS[Precision.BF16]
    assert mma.blocks(4096, 4096) == 32 * cdiv(4096, mma.block_n)
    assert mma.expression() == f"matmul_mma<0, {mma.block_n}, {mma.stages}>"
    dmma = tensorcore.dmma_config(4096, 4096)
    assert dmma.blocks(4097, 4096) == cdiv(4097, dmma.block_m) * cdiv(4096, dmma.block_n)
    assert dmma.threads == (dmma.block_m // dmma.warp_m) * (dmma.block_n // tensorcore.DMMA_WARP_N) * 32
