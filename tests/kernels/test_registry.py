"""kernels/registry.py's launch checks, which every launch passes before a kernel runs, at their bounds: threads per
block, positive tiles, the grid's y and z limits, the row lengths a vectorised instance accepts (k and n each on its
own), and which instance a request gets, for generic configurations and for the registered kernels' own."""

from __future__ import annotations

import pytest

from kernels.registry import KERNELS, MAX_GRID_Y, MAX_THREADS_PER_BLOCK, VECTOR_MULTIPLE, KernelSpec, LaunchConfig


def config(
    label: str = "c", threads: tuple[int, int] = (4, 4), tile_m: int = 2, tile_n: int = 3, **multiples: int
) -> LaunchConfig:
    return LaunchConfig(label=label, template_args=(), threads=threads, tile_m=tile_m, tile_n=tile_n, **multiples)


def test_a_block_of_exactly_the_thread_limit_is_declared_and_one_thread_more_is_not() -> None:
    assert config(threads=(32, 32)).block() == (32, 32, 1)
    assert MAX_THREADS_PER_BLOCK == 1024
    with pytest.raises(ValueError, match=r"config x: \(1025, 1\) is more than 1024 threads"):
        config("x", threads=(1025, 1))


@pytest.mark.parametrize(("tile_m", "tile_n"), [(0, 1), (1, 0), (-1, 1)])
def test_tiles_must_be_positive(tile_m: int, tile_n: int) -> None:
    assert config(tile_m=1, tile_n=1).tile_m == 1
    with pytest.raises(ValueError, match=rf"config c: tiles must be positive, not {tile_m}x{tile_n}"):
        config(tile_m=tile_m, tile_n=tile_n)


def test_the_grid_covers_n_along_x_m_along_y_and_the_batch_along_z() -> None:
    assert config(tile_m=2, tile_n=3).grid(9, 7, 5) == (3, 5, 5)
    assert config(tile_m=2, tile_n=3).grid(9, 7) == (3, 5, 1)


def test_the_grid_takes_exactly_cudas_limit_along_y_and_z_and_refuses_one_block_more() -> None:
    tall = config(tile_m=2)
    assert tall.grid(2 * MAX_GRID_Y, 1, MAX_GRID_Y) == (1, MAX_GRID_Y, MAX_GRID_Y)
    with pytest.raises(ValueError, match=r"config c: 131071 rows need 65536 blocks along y, over CUDA's 65535"):
        tall.grid(2 * MAX_GRID_Y + 1, 1)
    with pytest.raises(ValueError, match=r"config c: a batch of 65536 is over CUDA's 65535 blocks along z"):
        tall.grid(1, 1, MAX_GRID_Y + 1)


@pytest.mark.parametrize(
    ("n", "k", "accepted"),
    [(8, 4, True), (4, 8, True), (6, 4, False), (8, 6, False), (8, 2, False), (0, 0, True)],
)
def test_a_vectorised_instance_accepts_only_rows_of_whole_vectors(n: int, k: int, accepted: bool) -> None:
    """n_multiple 4 and k_multiple 4: both row lengths must be whole vectors; each is checked on its own."""
    assert config(n_multiple=4, k_multiple=4).accepts(n, k) is accepted
    assert config(n_multiple=4).accepts(n, 2) is (n % 4 == 0)
    assert config(k_multiple=4).accepts(2, k) is (k % 4 == 0)


def _spec(**choices: object) -> KernelSpec:
    configs = (config("8"), config("16"), config("other"))
    return KernelSpec(name="t", source="t.cu", symbol="s", summary="", configs=configs, **choices)


def test_the_instance_a_request_gets() -> None:
    tiled = _spec(tiles=(8, 16), default_tile=16)
    assert tiled.config_for(1, 2, 3, 8).label == "8"
    assert tiled.config_for(1, 2, 3, None).label == "16", "no tile asked for: the default"
    asked: list[tuple[int, int, int]] = []
    chosen = _spec(choose=lambda m, n, k: asked.append((m, n, k)) or "other")
    assert chosen.config_for(1, 2, 3, None).label == "other" and asked == [(1, 2, 3)]
    assert _spec().config_for(1, 2, 3, None).label == "8", "no choice: the first instance"


def test_a_tile_a_kernel_does_not_offer_is_refused_saying_what_it_offers() -> None:
    with pytest.raises(ValueError, match=r"^tile 4 is not valid for kernel 't': one of \[8, 16\]$"):
        _spec(tiles=(8, 16), default_tile=16).config_for(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"^tile 8 is not valid for kernel 't': not selectable for this kernel$"):
        _spec().config_for(1, 2, 3, 8)


VECTORISED = [
    (spec.name, config) for spec in KERNELS.values() for config in spec.configs if config.label.endswith("-vec")
]
IDS = [f"{name}-{config.label}" for name, config in VECTORISED]


def test_every_vectorised_kernel_has_vector_instances() -> None:
    assert {name for name, _ in VECTORISED} == {"blocktile1d", "blocktile2d", "fast"}


@pytest.mark.parametrize(("name", "config"), VECTORISED, ids=IDS)
def test_a_vector_instance_accepts_whole_vectors_only_along_n_and_k(name: str, config: LaunchConfig) -> None:
    whole, broken = 8 * VECTOR_MULTIPLE, 8 * VECTOR_MULTIPLE + 2
    assert config.accepts(n=whole, k=whole)
    assert not config.accepts(n=broken, k=whole)
    # only k breaks the multiple: refused wherever the instance reads A in vectors (fast copies only B so)
    assert config.accepts(n=whole, k=broken) is (config.k_multiple == 1)


def test_the_vector_instances_that_read_a_in_vectors_need_k_whole() -> None:
    readers = [(name, config.label) for name, config in VECTORISED if config.k_multiple == VECTOR_MULTIPLE]
    assert {name for name, _ in readers} == {"blocktile1d", "blocktile2d"}


@pytest.mark.parametrize("name", ["blocktile1d", "blocktile2d"])
def test_a_blocktile_shape_gets_vectors_only_when_n_and_k_both_hold_them(name: str) -> None:
    spec = KERNELS[name]
    for (m, n, k), vec in [((8, 8, 8), True), ((8, 8, 6), False), ((8, 6, 8), False), ((6, 8, 8), True)]:
        config = spec.config_for(m, n, k, None)
        assert config.label.endswith("-vec" if vec else "-scalar"), (m, n, k, config.label)
        assert config.accepts(n, k)


def test_fast_picks_its_vectors_by_n_and_its_tile_by_the_blocks_of_m_and_n() -> None:
    fast = KERNELS["fast"]
    assert fast.config_for(4096, 6, 8, None).label.endswith("-scalar")
    assert fast.config_for(6, 4096, 6, None).label.endswith("-vec")
    # 128 blocks or more, largest tile first: 4096 x 192 of C is 64 x 2 blocks of 64 x 128 (128), 192 x 4096 only
    # 3 x 32 (96), so it takes the 64 x 64 tile (3 x 64 blocks)
    assert fast.config_for(4096, 192, 64, None).label.startswith("64x128x16")
    assert fast.config_for(192, 4096, 64, None).label.startswith("64x64x16")
    assert fast.config_for(4096, 4096, 64, None).label.startswith("128x128x16")


def test_the_grid_runs_n_along_x_and_m_along_y() -> None:
    config = KERNELS["blocktile1d"].config_for(100, 40, 8, None)
    assert (config.tile_m, config.tile_n) == (64, 64)
    assert config.grid(m=200, n=40) == (1, 4, 1)
    assert config.grid(m=40, n=200, batch=3) == (4, 1, 3)
