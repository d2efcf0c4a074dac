"""kernels/registry.py's launch checks, which every launch passes before a kernel runs: an instance with 16-byte
vectors accepts only rows of A (k) and of B and C (n) that hold whole vectors, each checked on its own, and the
instance a shape gets is chosen by the dimensions its vectors run along."""

from __future__ import annotations

import pytest

from kernels.registry import KERNELS, VECTOR_MULTIPLE, LaunchConfig

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
