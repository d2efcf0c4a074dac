"""The hand-written CUDA kernels: name -> KernelSpec (source file, template symbol, launch configurations).

Every kernel in this package has the same signature, row-major throughout::

    template <typename T, ...> __global__ void symbol(const T* A, const T* B, T* C, int M, int N, int K)

computing C (M x N) = A (M x K) @ B (K x N). A `LaunchConfig` is one template instance: its arguments after
the dtype, the block of threads it runs with and the tile of C one block computes, from which the grid
follows, and the global-memory traffic its access pattern asks for (`global_elements`, for the roofline).
Nothing here needs a GPU or CuPy: the engine compiles `name_expressions()` with NVRTC and launches the
configuration `config_for()` picks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypedDict, Unpack

KERNEL_DIR = Path(__file__).resolve().parent
LOCAL_INCLUDE = re.compile(r'^#include "(?P<header>[\w.]+\.cuh)"$', re.MULTILINE)
"""An include of a header of this folder (kernels/common.cuh), which `read_kernel_source` puts in place."""
CTYPES = MappingProxyType({"float32": "float", "float64": "double"})
MAX_THREADS_PER_BLOCK = 1024
MAX_GRID_Y = 65535
STATIC_SMEM_LIMIT = 48 * 1024


def read_kernel_source(source: str) -> str:
    """kernels/<source> with each `#include "<name>.cuh"` of this folder replaced by that header's text, between
    `#line` directives so that compiler messages still name the right file and line. NVRTC then needs no include
    path, and the text kept binaries are keyed on (kernels/binaries.py) changes when a header does, which an include
    path would hide."""
    text = (KERNEL_DIR / source).read_text(encoding="utf-8")

    def header_text(include: re.Match[str]) -> str:
        line = text.count("\n", 0, include.start()) + 1
        header = (KERNEL_DIR / include["header"]).read_text(encoding="utf-8")
        return f'#line 1 "{include["header"]}"\n{header}#line {line + 1} "{source}"'

    return LOCAL_INCLUDE.sub(header_text, text)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def batch_stride(x: Any) -> int:
    """Elements from one matrix of operand `x` to the next in a batched launch: 0 for a matrix, or a stack of one,
    which every product of the stack reads where it lies (numpy.matmul's broadcasting)."""
    return x.shape[-2] * x.shape[-1] if x.ndim == 3 and x.shape[0] > 1 else 0


@dataclass(frozen=True)
class LaunchConfig:
    """One template instance of a kernel and the geometry it is launched with."""

    label: str
    template_args: tuple[int, ...]
    threads: tuple[int, int]
    tile_m: int
    tile_n: int
    smem_elements: int = 0
    """Dynamic shared memory, in elements of the dtype (0: the kernel declares its shared memory statically)."""
    k_multiple: int = 1
    n_multiple: int = 1
    """Row lengths of A (k) and of B and C (n) must be multiples of these: 16-byte vector accesses need whole,
    aligned vectors. An instance launched on other shapes would fault, so `accepts` guards every launch."""
    reuse: tuple[int, int] | None = None
    """(rows, columns) of C that share one global read of an operand element: a block reads each element of A
    it needs once for `columns` outputs of a row and each element of B once for `rows` outputs of a column.
    None: the block tile (tile_m, tile_n), as in every kernel that stages its tiles in shared memory."""

    def __post_init__(self) -> None:
        if self.threads[0] * self.threads[1] > MAX_THREADS_PER_BLOCK:
            raise ValueError(f"config {self.label}: {self.threads} is more than {MAX_THREADS_PER_BLOCK} threads")
        if self.tile_m <= 0 or self.tile_n <= 0:
            raise ValueError(f"config {self.label}: tiles must be positive, not {self.tile_m}x{self.tile_n}")

    def accepts(self, n: int, k: int) -> bool:
        return n % self.n_multiple == 0 and k % self.k_multiple == 0

    def grid(self, m: int, n: int, batch: int = 1) -> tuple[int, int, int]:
        """Blocks covering `batch` m x n results (z picks the product); ValueError past CUDA's 65535 along y, z."""
        rows = cdiv(m, self.tile_m)
        if rows > MAX_GRID_Y:
            raise ValueError(f"config {self.label}: {m} rows need {rows} blocks along y, over CUDA's {MAX_GRID_Y}")
        if batch > MAX_GRID_Y:
            raise ValueError(f"config {self.label}: a batch of {batch} is over CUDA's {MAX_GRID_Y} blocks along z")
        return (cdiv(n, self.tile_n), rows, batch)

    def global_elements(self, m: int, n: int, k: int) -> int:
        """Elements one m x n x k product requests from global memory by this instance's access pattern: every
        element of A once per group of `reuse` columns of C, every element of B once per group of rows, every
        element of C written once. Only what the outputs inside C need is counted (not the zero padding of
        edge tiles); requests that L1 or L2 serve are (this is the traffic asked of global memory, not DRAM's)."""
        rows, columns = self.reuse or (self.tile_m, self.tile_n)
        return m * k * cdiv(n, columns) + k * n * cdiv(m, rows) + m * n

    def block(self) -> tuple[int, int, int]:
        return (self.threads[0], self.threads[1], 1)

    def smem_bytes(self, itemsize: int) -> int:
        return self.smem_elements * itemsize


@dataclass(frozen=True)
class KernelSpec:
    """A kernel a request can name: where its source is, and which instances of it exist."""

    name: str
    source: str
    symbol: str
    summary: str
    configs: tuple[LaunchConfig, ...]
    tiles: tuple[int, ...] = ()
    """Tile widths a request may choose with `tile=`; the config labelled str(tile) serves each."""
    default_tile: int | None = None
    batched: bool = True
    """Whether one launch may run several products of one shape (gridDim.z of them; each operand a stack, or a
    matrix they all read: batch strides, common.cuh)."""
    choose: Callable[[int, int, int], str] | None = field(default=None, compare=False)
    """Label of the config to run for an (m, n, k) when the request names no tile; None: the first config."""

    def __post_init__(self) -> None:
        labels = {c.label for c in self.configs}
        missing = [t for t in self.tiles if str(t) not in labels]
        if missing:
            raise ValueError(f"kernel {self.name}: tiles {missing} have no config")
        if self.tiles and self.default_tile not in self.tiles:
            raise ValueError(f"kernel {self.name}: default tile {self.default_tile} is not one of {self.tiles}")

    @property
    def path(self) -> Path:
        return KERNEL_DIR / self.source

    def read_source(self) -> str:
        return read_kernel_source(self.source)

    def name_expression(self, dtype: str, config: LaunchConfig) -> str:
        args = ", ".join([CTYPES[dtype], *(str(a) for a in config.template_args)])
        return f"{self.symbol}<{args}>"

    def name_expressions(self) -> list[str]:
        return [self.name_expression(dtype, config) for dtype in CTYPES for config in self.configs]

    def config_for(self, m: int, n: int, k: int, tile: int | None) -> LaunchConfig:
        """The instance to launch for this shape; ValueError if `tile` is not one this kernel offers."""
        if tile is not None:
            if tile not in self.tiles:
                offered = f"one of {list(self.tiles)}" if self.tiles else "not selectable for this kernel"
                raise ValueError(f"tile {tile} is not valid for kernel '{self.name}': {offered}")
            label = str(tile)
        elif self.default_tile is not None:
            label = str(self.default_tile)
        elif self.choose is not None:
            label = self.choose(m, n, k)
        else:
            return self.configs[0]
        return next(c for c in self.configs if c.label == label)


def _square_tiles(*widths: int) -> tuple[LaunchConfig, ...]:
    return tuple(LaunchConfig(label=str(w), template_args=(w,), threads=(w, w), tile_m=w, tile_n=w) for w in widths)


VECTOR_BYTES = 16
"""Width of the vectorised loads and stores: a float4 or a double2."""
VECTOR_MULTIPLE = VECTOR_BYTES // 4
"""Row lengths that allow 16-byte vectors for both dtypes (a float32 vector holds 4, a float64 one 2)."""
MAX_ITEMSIZE = 8
"""Shared-memory sizes are checked for float64, the larger of the two dtypes."""
MAX_DYNAMIC_SMEM = 227 * 1024
"""The most dynamic shared memory one block may opt into on sm_90."""


def _vector_label(base: str, vec: bool) -> str:
    return f"{base}-{'vec' if vec else 'scalar'}"


def _check(condition: bool, label: str, why: str) -> None:
    if not condition:
        raise ValueError(f"config {label}: {why}")


def _check_static_smem(label: str, elements: int) -> None:
    nbytes = elements * MAX_ITEMSIZE
    _check(
        nbytes <= STATIC_SMEM_LIMIT, label, f"{nbytes} B of static shared memory (float64) is over {STATIC_SMEM_LIMIT}"
    )


def _coalesced_config(rows: int) -> LaunchConfig:
    label = f"32x{rows}"
    _check(rows >= 1 and 32 * rows <= MAX_THREADS_PER_BLOCK, label, f"{rows} warps per block is not in 1..32")
    return LaunchConfig(label=label, template_args=(), threads=(32, rows), tile_m=rows, tile_n=32, reuse=(1, 32))


def _blocktile1d_config(bm: int, bn: int, bk: int, tm: int, vec: bool) -> LaunchConfig:
    label = _vector_label(f"{bm}x{bn}x{bk}", vec)
    _check(bm % tm == 0, label, f"the block height {bm} is not a multiple of the thread height {tm}")
    _check(bk % VECTOR_MULTIPLE == 0 and bn % VECTOR_MULTIPLE == 0, label, "tiles must hold whole vectors")
    threads = bm * bn // tm
    _check(threads <= MAX_THREADS_PER_BLOCK, label, f"{threads} threads per block")
    _check_static_smem(label, bk * (bm + bn))
    multiple = VECTOR_MULTIPLE if vec else 1
    return LaunchConfig(
        label=label,
        template_args=(bm, bn, bk, tm, int(vec)),
        threads=(threads, 1),
        tile_m=bm,
        tile_n=bn,
        k_multiple=multiple,
        n_multiple=multiple,
    )


def _blocktile2d_config(bm: int, bn: int, bk: int, tm: int, tn: int, vec: bool) -> LaunchConfig:
    label = _vector_label(f"{bm}x{bn}x{bk}", vec)
    _check(bm % tm == 0 and bn % tn == 0, label, f"the block {bm}x{bn} does not split into {tm}x{tn} threads")
    _check(tm % VECTOR_MULTIPLE == 0 and tn % VECTOR_MULTIPLE == 0, label, "thread tiles must hold whole vectors")
    _check(bk % VECTOR_MULTIPLE == 0 and bn % VECTOR_MULTIPLE == 0, label, "tiles must hold whole vectors")
    threads = (bm // tm) * (bn // tn)
    _check(threads <= MAX_THREADS_PER_BLOCK, label, f"{threads} threads per block")
    _check_static_smem(label, bk * (bm + bn))
    multiple = VECTOR_MULTIPLE if vec else 1
    return LaunchConfig(
        label=label,
        template_args=(bm, bn, bk, tm, tn, int(vec)),
        threads=(threads, 1),
        tile_m=bm,
        tile_n=bn,
        k_multiple=multiple,
        n_multiple=multiple,
    )


FAST_PAD = 4
"""Elements of padding at the end of each transposed row of A in kernels/fast.cu (its PAD)."""


def _fast_config(
    bm: int, bn: int, bk: int, warp: tuple[int, int], lane: tuple[int, int], stages: int, vec: bool
) -> LaunchConfig:
    """An instance of kernels/fast.cu: block bm x bn x bk, warp tile `warp`, lane tile `lane`, `stages` deep."""
    (wm, wn), (tm, tn) = warp, lane
    label = _vector_label(f"{bm}x{bn}x{bk}-s{stages}", vec)
    _check(bm % wm == 0 and bn % wn == 0, label, f"the block {bm}x{bn} does not split into {wm}x{wn} warps")
    _check(wm % tm == 0 and wn % tn == 0, label, f"the warp {wm}x{wn} does not split into {tm}x{tn} lanes")
    _check((wm // tm) * (wn // tn) == 32, label, f"a {wm}x{wn} warp of {tm}x{tn} lanes is not 32 lanes")
    _check(tm % VECTOR_MULTIPLE == 0 and tn % VECTOR_MULTIPLE == 0, label, "lane tiles must hold whole vectors")
    _check(stages >= 2, label, f"{stages} stages cannot overlap copies with arithmetic")
    threads = (bm // wm) * (bn // wn) * 32
    _check(threads <= MAX_THREADS_PER_BLOCK, label, f"{threads} threads per block")
    _check(threads % bk == 0 and (bm * bk) % threads == 0, label, f"{threads} threads cannot share the A tile")
    for itemsize in (4, 8):
        width = VECTOR_BYTES // itemsize if vec else 1
        _check(
            (bk * bn // width) % threads == 0 and threads % (bn // width) == 0,
            label,
            f"{threads} threads cannot share the B tile in copies of {width} elements",
        )
    smem_elements = stages * bk * (bm + FAST_PAD + bn)
    nbytes = smem_elements * MAX_ITEMSIZE
    _check(nbytes <= MAX_DYNAMIC_SMEM, label, f"{nbytes} B of shared memory (float64) is over {MAX_DYNAMIC_SMEM}")
    return LaunchConfig(
        label=label,
        template_args=(bm, bn, bk, wm, wn, tm, tn, stages, int(vec)),
        threads=(threads, 1),
        tile_m=bm,
        tile_n=bn,
        smem_elements=smem_elements,
        n_multiple=VECTOR_MULTIPLE if vec else 1,
    )


VECTOR_CHOICES = (True, False)
"""Every vectorised kernel comes in two instances: 16-byte loads and stores, and the scalar fallback."""


def _vector_ok(n: int, k: int) -> bool:
    """Whether rows of A (length k) and of B and C (length n) may be read and written in 16-byte vectors."""
    return n % VECTOR_MULTIPLE == 0 and k % VECTOR_MULTIPLE == 0


FAST_TILES = {
    "128x128x16": ((128, 128, 16), (32, 64), (8, 8)),
    "64x128x16": ((64, 128, 16), (32, 64), (8, 8)),
    "64x64x16": ((64, 64, 16), (32, 32), (8, 4)),
}
"""The flagship's block shapes, largest first: (block m, n, k), warp tile, lane tile. See docs/kernels.md."""
FAST_STAGES = 3
FAST_MIN_BLOCKS = 128
"""A shape gets the largest block tile that still yields this many blocks (an H100 or H200 has 132 SMs):
fewer blocks than SMs leaves SMs idle, which costs more than the larger tile's better reuse gains."""


def _fast_label(tile: str) -> str:
    return f"{tile}-s{FAST_STAGES}"


def _fast_configs() -> tuple[LaunchConfig, ...]:
    return tuple(
        _fast_config(bm, bn, bk, warp, lane, FAST_STAGES, vec)
        for (bm, bn, bk), warp, lane in FAST_TILES.values()
        for vec in VECTOR_CHOICES
    )


def _choose_fast(m: int, n: int, k: int) -> str:
    """The flagship's instance for a shape class. Only B is copied in vectors, so only n decides the width."""
    smallest = list(FAST_TILES)[-1]
    tile = next(
        (name for name, ((bm, bn, _), _, _) in FAST_TILES.items() if cdiv(m, bm) * cdiv(n, bn) >= FAST_MIN_BLOCKS),
        smallest,
    )
    return _vector_label(_fast_label(tile), n % VECTOR_MULTIPLE == 0)


def _choose_blocktile(base: str) -> Callable[[int, int, int], str]:
    return lambda m, n, k: _vector_label(base, _vector_ok(n, k))


class _Choices(TypedDict, total=False):
    tiles: tuple[int, ...]
    default_tile: int
    batched: bool
    choose: Callable[[int, int, int], str]


def _kernel(name: str, summary: str, configs: tuple[LaunchConfig, ...], **choices: Unpack[_Choices]) -> KernelSpec:
    """The kernel `name`: its source is kernels/<name>.cu, its template `matmul_<name>`."""
    return KernelSpec(name, f"{name}.cu", f"matmul_{name}", summary, configs, **choices)


KERNELS: MappingProxyType[str, KernelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            _kernel(
                "naive",
                summary="One thread per output element, 16x16 blocks; every operand read from global memory.",
                configs=(
                    LaunchConfig(label="16x16", template_args=(), threads=(16, 16), tile_m=16, tile_n=16, reuse=(1, 1)),
                ),
            ),
            _kernel(
                "tiled",
                summary="Classic shared-memory tiling: TILE x TILE tiles of A and B, two barriers per step.",
                configs=_square_tiles(8, 16, 32),
                tiles=(8, 16, 32),
                default_tile=16,
            ),
            _kernel(
                "coalesced",
                summary="One thread per output; a warp reads A 32 elements at a time and shares them by shuffle.",
                configs=(_coalesced_config(8),),
            ),
            _kernel(
                "blocktile1d",
                summary="64x64 shared-memory tiles, a column of 8 outputs per thread, 16-byte global loads.",
                configs=tuple(_blocktile1d_config(64, 64, 8, 8, vec) for vec in VECTOR_CHOICES),
                choose=_choose_blocktile("64x64x8"),
            ),
            _kernel(
                "blocktile2d",
                summary="128x128 tiles, an 8x8 block of outputs per thread (outer products), 16-byte loads.",
                configs=tuple(_blocktile2d_config(128, 128, 8, 8, 8, vec) for vec in VECTOR_CHOICES),
                choose=_choose_blocktile("128x128x8"),
            ),
            _kernel(
                "fast",
                summary="Warp tiles, 8x8 outputs per lane, a multi-stage cp.async pipeline; tiles chosen per shape.",
                configs=_fast_configs(),
                choose=_choose_fast,
                # Its float32 instances sit at their 127-register cap: the batch offset moves the 64-bit bases
                # of A and B out of the constant bank into registers and they spill (scripts/check_kernels.py).
                batched=False,
            ),
        )
    }
)
