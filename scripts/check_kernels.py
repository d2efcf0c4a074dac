"""Static checks of every registered kernel, no GPU needed: NVRTC compiles it, ptxas reports its resources.

For each kernel the source is compiled through NVRTC for compute_90 (what the service does at start-up).
When `nvcc` is on PATH, a translation unit that includes the .cu and explicitly instantiates every name
expression is built for sm_90 with `-Xptxas -v`, and a table of registers, shared memory, spills and stack
per instance is printed. Exit status 1 when any instance spills registers to local memory (or does not
compile); tests/kernels/test_kernel_resources.py runs the same check.

    python scripts/check_kernels.py [--kernels fast,blocktile2d] [--arch sm_90]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kernels.binaries import COMPILE_OPTIONS
from kernels.cuda import compile_ptx
from kernels.registry import CTYPES, KERNELS, KernelSpec

ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for")
FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
USED = re.compile(r"Used (?P<registers>\d+) registers(?:.*?(?P<smem>\d+) bytes smem)?")


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one instance, plus the dynamic shared memory its config asks for."""

    kernel: str
    dtype: str
    config: str
    registers: int
    static_smem: int
    dynamic_smem: int
    spill_stores: int
    spill_loads: int
    stack: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def check_nvrtc(spec: KernelSpec, arch: str = "compute_90") -> None:
    """Compile the kernel's every instance through NVRTC; RuntimeError with the log when it fails."""
    compile_ptx(spec, arch)


def instantiation_unit(spec: KernelSpec) -> str:
    """A translation unit that includes the kernel source and explicitly instantiates every name expression."""
    lines = [f'#include "{spec.path}"']
    batch_strides = ", size_t, size_t" if spec.batched else ""  # a batched kernel's operands' batch strides
    for dtype, ctype in CTYPES.items():
        for config in spec.configs:
            expression = spec.name_expression(dtype, config)
            lines.append(
                f"template __global__ void {expression}(const {ctype}*, const {ctype}*, {ctype}*, int, int, int"
                f"{batch_strides});"
            )
    return "\n".join(lines) + "\n"


def parse_ptxas(log: str) -> dict[str, tuple[int, int, int, int, int]]:
    """Mangled name -> (registers, static smem, spill stores, spill loads, stack) from `-Xptxas -v` output."""
    found: dict[str, tuple[int, int, int, int, int]] = {}
    name: str | None = None
    frame: tuple[int, int, int] | None = None
    for line in log.splitlines():
        if entry := ENTRY.search(line):
            name, frame = entry["name"], None
        elif (match := FRAME.search(line)) and name is not None:
            frame = (int(match["stack"]), int(match["stores"]), int(match["loads"]))
        elif (used := USED.search(line)) and name is not None:
            stack, stores, loads = frame or (0, 0, 0)
            found[name] = (int(used["registers"]), int(used["smem"] or 0), stores, loads, stack)
            name = None
    return found


def ptxas_resources(spec: KernelSpec, nvcc: str, arch: str = "sm_90") -> list[Resources]:
    """Build the kernel's instances for `arch` with nvcc and read back each one's resources."""
    _, lowered = compile_ptx(spec, arch.replace("sm_", "compute_"))
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / f"{spec.path.stem}_instances.cu"
        unit.write_text(instantiation_unit(spec), encoding="utf-8")
        command = [
            nvcc,
            *COMPILE_OPTIONS,
            f"-arch={arch}",
            "-cubin",
            "-Xptxas",
            "-v",
            "-o",
            str(Path(tmp) / "out.cubin"),
        ]
        result = subprocess.run([*command, str(unit)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc could not build {spec.source} for {arch}:\n{result.stderr}")
    reported = parse_ptxas(result.stderr + result.stdout)
    rows = []
    for dtype in CTYPES:
        itemsize = 4 if dtype == "float32" else 8
        for config in spec.configs:
            mangled = lowered[spec.name_expression(dtype, config)]
            if mangled not in reported:
                raise RuntimeError(f"ptxas reported nothing for {spec.name}/{config.label}/{dtype} ({mangled})")
            registers, smem, stores, loads, stack = reported[mangled]
            rows.append(
                Resources(
                    spec.name, dtype, config.label, registers, smem, config.smem_bytes(itemsize), stores, loads, stack
                )
            )
    return rows


def check_resources(specs: Iterable[KernelSpec], nvcc: str, arch: str = "sm_90") -> list[Resources]:
    specs = list(specs)
    with ThreadPoolExecutor() as pool:
        return [row for rows in pool.map(lambda s: ptxas_resources(s, nvcc, arch), specs) for row in rows]


def format_table(rows: Iterable[Resources]) -> str:
    header = (
        f"{'kernel':<12} {'dtype':<8} {'config':<30} {'regs':>5} {'smem B':>7} {'dyn B':>7} "
        f"{'spill st/ld':>12} {'stack':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        spill = f"{r.spill_stores}/{r.spill_loads}"
        flag = "  SPILLS" if r.spills else ""
        lines.append(
            f"{r.kernel:<12} {r.dtype:<8} {r.config:<30} {r.registers:>5} {r.static_smem:>7} {r.dynamic_smem:>7} "
            f"{spill:>12} {r.stack:>6}{flag}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", help="comma-separated kernel names (default: every registered kernel)")
    parser.add_argument("--arch", default="sm_90", help="the SM to build for (default: sm_90)")
    args = parser.parse_args(argv)
    names = args.kernels.split(",") if args.kernels else list(KERNELS)
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        parser.error(f"unknown kernels {unknown}; registered: {list(KERNELS)}")
    specs = [KERNELS[name] for name in names]
    try:
        for spec in specs:
            check_nvrtc(spec, args.arch.replace("sm_", "compute_"))
        print(f"NVRTC: {len(specs)} sources compile for {args.arch.replace('sm_', 'compute_')}")
        nvcc = nvcc_path()
        if nvcc is None:
            print("nvcc is not on PATH: no resource report")
            return 0
        rows = check_resources(specs, nvcc, args.arch)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(format_table(rows))
    spilling = [r for r in rows if r.spills]
    if spilling:
        print(f"{len(spilling)} instance(s) spill registers to local memory", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
