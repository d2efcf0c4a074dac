"""The hand-written CUDA kernels: name -> KernelSpec (source file, template symbol, launch configurations).

Every kernel in this package has the same signature, row-major throughout::

    template <typename T, ...> __global__ void symbol(const T* A, const T* B, T* C, int M, int N, int K)

computing C (M x N) = A (M x K) @ B (K x N). A `LaunchConfig` is one template instance: its arguments after
the dtype, the block of threads it runs with and the tile of C one block computes, from which the grid
follows. Nothing here needs a GPU or CuPy: the engine compiles `name_expressions()` with NVRTC and launches
the configuration `config_for()` picks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

KERNEL_DIR = Path(__file__).resolve().parent
CTYPES = MappingProxyType({"float32": "float", "float64": "double"})
MAX_THREADS_PER_BLOCK = 1024
MAX_GRID_Y = 65535
STATIC_SMEM_LIMIT = 48 * 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    def __post_init__(self) -> None:
        if self.threads[0] * self.threads[1] > MAX_THREADS_PER_BLOCK:
            raise ValueError(f"config {self.label}: {self.threads} is more than {MAX_THREADS_PER_BLOCK} threads")
        if self.tile_m <= 0 or self.tile_n <= 0:
            raise ValueError(f"config {self.label}: tiles must be positive, not {self.tile_m}x{self.tile_n}")

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        """Blocks covering an m x n result; ValueError past CUDA's limit of 65535 blocks along y."""
        rows = cdiv(m, self.tile_m)
        if rows > MAX_GRID_Y:
            raise ValueError(f"config {self.label}: {m} rows need {rows} blocks along y, over CUDA's {MAX_GRID_Y}")
        return (cdiv(n, self.tile_n), rows, 1)

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
        return self.path.read_text(encoding="utf-8")

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


KERNELS: MappingProxyType[str, KernelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            KernelSpec(
                name="naive",
                source="naive.cu",
                symbol="matmul_naive",
                summary="One thread per output element, 16x16 blocks; every operand read from global memory.",
                configs=(LaunchConfig(label="16x16", template_args=(), threads=(16, 16), tile_m=16, tile_n=16),),
            ),
            KernelSpec(
                name="tiled",
                source="tiled.cu",
                symbol="matmul_tiled",
                summary="Classic shared-memory tiling: TILE x TILE tiles of A and B, two barriers per step.",
                configs=_square_tiles(8, 16, 32),
                tiles=(8, 16, 32),
                default_tile=16,
            ),
        )
    }
)
