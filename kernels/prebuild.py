"""Compile every kernel ahead of a start, for the devices named: `python -m kernels.prebuild 8.0 8.6 8.9 9.0`.

The image runs this when it is built, into the folder shipped inside the package (kernels/binaries.py's SHIPPED), so
that a container's first start on those devices loads machine code instead of compiling it; anywhere else `--into`
fills the cache folder the service reads (MATMUL_KERNEL_CACHE_DIR). NVRTC needs no GPU and no driver.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from kernels.binaries import SHIPPED, KernelBinaries
from kernels.cuda import programs_on


def compute_capability(text: str) -> tuple[int, int]:
    """'9.0' -> (9, 0)."""
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"a compute capability is major.minor, like 9.0; got {text!r}")
    return int(major), int(minor)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("devices", nargs="+", type=compute_capability, help="compute capabilities, like 9.0")
    parser.add_argument("--into", type=Path, default=SHIPPED, help=f"the folder (default: {SHIPPED})")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    programs = list(dict.fromkeys(program for device in args.devices for program in programs_on(device)))
    binaries = KernelBinaries(cache=args.into, shipped=args.into)
    binaries.of(programs)
    print(
        f"{len(programs)} kernel programs for compute capability "
        f"{', '.join(f'{major}.{minor}' for major, minor in args.devices)} in {args.into}: "
        f"{binaries.compiled} compiled, {len(programs) - binaries.compiled} already there, "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
