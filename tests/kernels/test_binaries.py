"""Kernel binaries compiled ahead or at a first start, and found instead of compiled at the next (kernels/binaries.py,
kernels/prebuild.py): with NVRTC alone, no GPU and no driver."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kernels import tensorcore
from kernels.binaries import KernelBinaries, Program, nvrtc_compile
from kernels.cuda import fma_programs, machine_arch, programs_on, tensor_core_programs
from kernels.prebuild import main as prebuild
from kernels.registry import KERNELS, read_kernel_source
from tests.kernels.test_kernel_sources import _nvrtc_missing

needs_nvrtc = pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
NAIVE = Program("naive.cu", (KERNELS["naive"].name_expressions()[0],), "sm_90")


@needs_nvrtc
def test_a_program_is_compiled_once_then_found_in_the_cache(tmp_path: Path) -> None:
    first = KernelBinaries(cache=tmp_path / "cache", shipped=tmp_path / "none")
    (binary,) = first.of([NAIVE])
    assert first.compiled == 1
    code, lowered, _ = nvrtc_compile(
        NAIVE.source, read_kernel_source(NAIVE.source), NAIVE.expressions, NAIVE.options, lambda n, p: n.getCUBIN(p)
    )
    assert binary.path.parent == tmp_path / "cache" and binary.path.suffix == ".cubin"
    kept = [binary.path, binary.path.with_suffix(".json")]
    assert [path.stat().st_mode & 0o777 for path in kept] == [0o644, 0o644], "readable by the service's user"
    assert binary.path.read_bytes()[:4] == code[:4] == b"\x7fELF"
    assert dict(binary.lowered) == lowered

    again = KernelBinaries(cache=tmp_path / "cache", shipped=tmp_path / "none")
    assert again.of([NAIVE]) == [binary] and again.compiled == 0


@needs_nvrtc
def test_ptx_for_a_virtual_architecture() -> None:
    program = Program("naive.cu", NAIVE.expressions, "compute_80")
    assert not program.machine_code and program.suffix == ".ptx"
    code, lowered = program.compile(read_kernel_source("naive.cu"))
    assert b".target sm_80" in code and set(lowered) == set(NAIVE.expressions)


def test_the_key_changes_with_everything_that_decides_the_binary() -> None:
    text = read_kernel_source(NAIVE.source)
    keys = {
        NAIVE.key(text, (12, 8)),
        NAIVE.key(text + "\n// a header changed", (12, 8)),
        NAIVE.key(text, (12, 9)),
        Program(NAIVE.source, NAIVE.expressions, "sm_89").key(text, (12, 8)),
        Program(NAIVE.source, tuple(KERNELS["naive"].name_expressions()), "sm_90").key(text, (12, 8)),
    }
    assert len(keys) == 5
    assert NAIVE.key(text, (12, 8)) == Program(*NAIVE.__dict__.values()).key(text, (12, 8))


@needs_nvrtc
def test_the_image_prebuilt_folder_comes_first_and_nothing_is_compiled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shipped, cache = tmp_path / "prebuilt", tmp_path / "cache"
    assert prebuild(["9.0", "--into", str(shipped)]) == 0
    programs = programs_on((9, 0))
    assert f"{len(programs)} kernel programs for compute capability 9.0" in capsys.readouterr().out
    assert len(list(shipped.glob("*.cubin"))) == len(programs)

    binaries = KernelBinaries(cache=cache, shipped=shipped)
    found = binaries.of(programs)
    assert binaries.compiled == 0 and not cache.exists()
    assert {binary.path.parent for binary in found} == {shipped}

    assert prebuild(["9.0", "--into", str(shipped)]) == 0
    assert f"0 compiled, {len(programs)} already there" in capsys.readouterr().out


@needs_nvrtc
def test_a_cache_that_cannot_be_written_still_gives_binaries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    binaries = KernelBinaries(cache=blocked, shipped=tmp_path / "none")
    with caplog.at_level(logging.WARNING):
        (binary,) = binaries.of([NAIVE])
    assert binaries.compiled == 1 and binary.path.is_file() and not binary.path.is_relative_to(blocked)
    assert "cannot be written" in caplog.text


def test_prebuild_refuses_what_is_not_a_compute_capability(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        prebuild(["9"])
    assert exit.value.code == 2
    assert "a compute capability is major.minor, like 9.0; got '9'" in capsys.readouterr().err


@needs_nvrtc
def test_what_each_device_loads() -> None:
    hopper = programs_on((9, 0))
    assert {program.arch for program in fma_programs((9, 0))} == {"sm_90"}
    assert {program.arch for program in tensor_core_programs((9, 0))} == {tensorcore.ARCH}
    assert {program.source for program in hopper} >= {tensorcore.WGMMA_SOURCE, tensorcore.DMMA_SOURCE}
    ampere = programs_on((8, 0))
    assert {program.arch for program in ampere} == {"sm_80", tensorcore.PORTABLE_ARCH}
    assert tensorcore.WGMMA_SOURCE not in {program.source for program in ampere}
    turing = programs_on((7, 5))
    assert {program.source for program in turing} == {spec.source for spec in KERNELS.values()}
    every_instance = [expression for program in fma_programs((9, 0)) for expression in program.expressions]
    assert sorted(every_instance) == sorted(e for spec in KERNELS.values() for e in spec.name_expressions())


@needs_nvrtc
def test_a_device_newer_than_nvrtc_gets_ptx_it_can_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "getSupportedArchs", lambda: (75, 80, 86, 89, 90))
    assert machine_arch((9, 0)) == "sm_90"
    assert machine_arch((12, 0)) == "compute_90"
