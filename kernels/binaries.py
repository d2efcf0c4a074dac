"""Kernel binaries on disk: what NVRTC makes of each program, kept so that a start loads instead of compiling.

A `Program` is one source of this folder (its headers inlined), the template instances to compile of it (name
expressions) and the architecture: `sm_XY` (or `sm_90a`) for machine code, `compute_XY` for PTX that the driver
compiles when it loads it. Its key is a hash of all that decides NVRTC's output: the text, the instances, the options,
the architecture and NVRTC's version, so a stale binary is never found, only missed.

`KernelBinaries` looks for a program's binary in the folder shipped inside the package (`SHIPPED`, filled when the
image is built: kernels/prebuild.py), then in a writable cache folder, and compiles what neither holds, the programs
in parallel, into the cache. NVRTC needs no driver and no GPU. A cache that cannot be written costs only the
compilation at the next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.registry import read_kernel_source

log = logging.getLogger(__name__)

COMPILE_OPTIONS = ("-std=c++17",)
SHIPPED = Path(__file__).parent / "prebuilt"
"""Binaries that came with the package (the image's, compiled when it was built); absent in a checkout."""
FORMAT = 1
"""Part of every key: raise it when what a binary file holds, or how it is named, changes."""


def default_cache_folder() -> Path:
    """Where compiled binaries are kept unless a folder is given: $XDG_CACHE_HOME/matmul-service/kernels (by
    default ~/.cache/matmul-service/kernels)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "matmul-service" / "kernels"


def nvrtc_compile(
    name: str, text: str, expressions: Sequence[str], options: Sequence[str], output: Callable[[Any, Any], bytes]
) -> tuple[bytes, dict[str, str], str]:
    """Compile `text` with NVRTC: `output` of the program (its PTX or cubin), each name expression's lowered name,
    and the log. RuntimeError with the log when the source does not compile."""
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(text, name, [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(
                f"{name} does not compile ({' '.join(options)}):\n{nvrtc.getProgramLog(program)}"
            ) from exc
        lowered = {expression: nvrtc.getLoweredName(program, expression) for expression in expressions}
        return output(nvrtc, program), lowered, nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


@dataclass(frozen=True)
class Program:
    """What to compile: instances (`expressions`) of kernels/<source> for `arch`."""

    source: str
    expressions: tuple[str, ...]
    arch: str

    @property
    def machine_code(self) -> bool:
        """A cubin for a real architecture, not PTX for a virtual one."""
        return not self.arch.startswith("compute_")

    @property
    def options(self) -> list[str]:
        return [f"--gpu-architecture={self.arch}", *COMPILE_OPTIONS]

    @property
    def suffix(self) -> str:
        return ".cubin" if self.machine_code else ".ptx"

    def key(self, text: str, nvrtc_version: tuple[int, int]) -> str:
        """The hash a binary of this program, from `text` (the source as read), is stored under."""
        nvrtc = ".".join(map(str, nvrtc_version))
        decided_by = [str(FORMAT), self.source, text, *self.expressions, *self.options, nvrtc]
        return hashlib.sha256("\0".join(decided_by).encode()).hexdigest()[:32]

    def compile(self, text: str) -> tuple[bytes, dict[str, str]]:
        """NVRTC's binary of the program (cubin or PTX) and each expression's lowered name."""
        code, lowered, _ = nvrtc_compile(
            self.source,
            text,
            self.expressions,
            self.options,
            (lambda nvrtc, p: nvrtc.getCUBIN(p)) if self.machine_code else (lambda nvrtc, p: nvrtc.getPTX(p)),
        )
        return code, lowered


@dataclass(frozen=True)
class Binary:
    """A compiled program: the file CuPy loads it from, and the lowered name of each of its instances."""

    path: Path
    lowered: Mapping[str, str]


class KernelBinaries:
    """Binaries of programs: found in `shipped`, then in `cache`, else compiled (in parallel) and kept in `cache`."""

    def __init__(self, cache: Path | None = None, shipped: Path = SHIPPED) -> None:
        self.cache = cache if cache is not None else default_cache_folder()
        self.shipped = shipped
        self.compiled = 0
        """How many programs this one compiled (none where every binary was found)."""
        self._scratch: Path | None = None
        """Where binaries go when `cache` cannot be written: a folder of this process's, removed with this object."""

    def of(self, programs: Sequence[Program]) -> list[Binary]:
        """The binary of each program, in their order."""
        from cupy.cuda import nvrtc

        version = nvrtc.getVersion()
        texts = {source: read_kernel_source(source) for source in {program.source for program in programs}}
        keys = [program.key(texts[program.source], version) for program in programs]
        found = [self._find(program, key) for program, key in zip(programs, keys, strict=True)]
        missing = [i for i, binary in enumerate(found) if binary is None]
        if missing:
            with ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
                made = pool.map(lambda i: self._compile(programs[i], texts[programs[i].source], keys[i]), missing)
                for i, binary in zip(missing, made, strict=True):
                    found[i] = binary
            self.compiled += len(missing)
        return [binary for binary in found if binary is not None]

    def _find(self, program: Program, key: str) -> Binary | None:
        for folder in (self.shipped, self.cache):
            names = folder / f"{key}.json"
            if names.is_file():
                return Binary(folder / f"{key}{program.suffix}", json.loads(names.read_text(encoding="utf-8")))
        return None

    def _compile(self, program: Program, text: str, key: str) -> Binary:
        code, lowered = program.compile(text)
        try:
            return self._store(self.cache, program, key, code, lowered)
        except OSError as exc:
            log.warning("kernel cache %s cannot be written (%s): the next start compiles again", self.cache, exc)
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="matmul-kernels-"))
                weakref.finalize(self, shutil.rmtree, self._scratch, ignore_errors=True)
            return self._store(self._scratch, program, key, code, lowered)

    @staticmethod
    def _store(folder: Path, program: Program, key: str, code: bytes, lowered: Mapping[str, str]) -> Binary:
        """Write the binary, then its names (what `_find` looks for), each whole or not at all: processes that
        compile the same program at once each write a complete copy."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{key}{program.suffix}"
        _write_whole(path, code)
        _write_whole(folder / f"{key}.json", json.dumps(lowered).encode())
        return Binary(path, lowered)


BINARY_MODE = 0o644
"""Every user may read a kept binary (mkstemp makes files its owner's alone): the image's are written by root at build
and read by the service's own user."""


def _write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, by renaming a complete file there."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(descriptor, BINARY_MODE)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
