"""Every registered kernel compiles through NVRTC for sm_90, with no GPU and no driver (CI checks this)."""

from __future__ import annotations

import itertools
import re

import pytest

from kernels.cuda import compile_ptx
from kernels.registry import KERNEL_DIR, KERNELS, LOCAL_INCLUDE, KernelSpec, LaunchConfig


def _nvrtc_missing() -> str | None:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:
        return f"no NVRTC can be loaded: {exc}"
    return None


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("spec", list(KERNELS.values()), ids=list(KERNELS))
def test_compiles_for_sm90_with_every_instance(spec: KernelSpec) -> None:
    ptx, lowered = compile_ptx(spec, arch="compute_90")
    assert ".target sm_90" in ptx
    assert set(lowered) == set(spec.name_expressions())
    for mangled in lowered.values():
        assert f".entry {mangled}(" in ptx


def test_launch_geometry_covers_the_matrix() -> None:
    config = KERNELS["tiled"].config_for(100, 33, 7, tile=32)
    assert config.grid(100, 33) == (2, 4, 1)
    assert config.block() == (32, 32, 1)


@pytest.mark.parametrize("tile", [8, 16, 32])
def test_tiled_offers_each_tile(tile: int) -> None:
    assert KERNELS["tiled"].config_for(5, 5, 5, tile).threads == (tile, tile)


def test_a_tile_the_kernel_does_not_offer_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"tile 64 is not valid for kernel 'tiled': one of \[8, 16, 32\]"):
        KERNELS["tiled"].config_for(5, 5, 5, 64)
    with pytest.raises(ValueError, match="not selectable"):
        KERNELS["naive"].config_for(5, 5, 5, 16)


def test_a_grid_past_cudas_y_limit_is_a_value_error() -> None:
    config = KERNELS["naive"].configs[0]
    assert config.grid(65535 * 16, 1)[1] == 65535
    with pytest.raises(ValueError, match="over CUDA's 65535"):
        config.grid(65535 * 16 + 1, 1)


def test_configs_are_checked_when_declared() -> None:
    with pytest.raises(ValueError, match="more than 1024 threads"):
        LaunchConfig(label="x", template_args=(), threads=(64, 32), tile_m=64, tile_n=32)


@pytest.mark.parametrize("spec", list(KERNELS.values()), ids=list(KERNELS))
def test_each_source_opens_with_its_comment_and_gets_its_headers_in_place(spec: KernelSpec) -> None:
    """The source NVRTC compiles holds no include of a local header; after each #line directive the text goes on
    with the line of the file it names, so compiler messages point at the right place."""
    assert spec.path.read_text().startswith(f"// {spec.name}: ")
    source = spec.read_source()
    assert not LOCAL_INCLUDE.search(source)
    lines = source.splitlines()
    directives = [(i, match) for i, line in enumerate(lines) if (match := re.fullmatch(r'#line (\d+) "(.+)"', line))]
    included = LOCAL_INCLUDE.findall(spec.path.read_text())
    assert [match[2] for _, match in directives] == [name for header in included for name in (header, spec.source)]
    assert "common.cuh" in included
    for i, match in directives:
        original = (KERNEL_DIR / match[2]).read_text().splitlines()
        following = list(itertools.takewhile(lambda line: not line.startswith("#line "), lines[i + 1 : i + 4]))
        assert following == original[int(match[1]) - 1 : int(match[1]) - 1 + len(following)]
