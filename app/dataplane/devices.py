"""Which engines to start: the CUDA devices the GPU backend can run on here, or why the CPU backend runs instead.

The supervisor asks this in a process of its own, `python -m app.dataplane.devices --backend auto --devices 0,1`, which
prints `{"devices": [0, 1]}` or `{"cpu": "why"}`: the supervisor, whose HTTP workers are forked from it, never
imports CuPy. This module imports nothing of the service, and of CuPy only its binding of the CUDA runtime
(`cupy_backends.cuda.api.runtime`, which is `cupy.cuda.runtime`, the same calls and errors), not CuPy itself: the
question is a start's first step, before any engine process starts, and on an H200 host CuPy's import made it
0.72-0.93 s where the driver's start alone takes about 0.3 (docs/performance.md, "A cold start"). What it does not
see: a CuPy whose binding loads but whose own import fails (built for another NumPy, say). Its engine process then
fails at start with that import's error in the log, and is restarted, rather than the CPU serving in its place.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("app.engine_process")

CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_DEVICE = 100
BACKENDS = ("auto", "cpu", "gpu")
"""MATMUL_BACKEND's values (app/config.py's BackendChoice)."""


def device_count() -> int:
    """CUDA devices CuPy sees here (0 without CuPy or a driver)."""
    try:
        from cupy_backends.cuda.api import runtime

        return int(runtime.getDeviceCount())
    except Exception:
        return 0


@dataclass(frozen=True)
class GpuUnavailable:
    """Why the GPU backend cannot run here: `reason` in plain words, `detail` as CuPy or CUDA put it."""

    reason: str
    detail: str = ""


NO_GPU = "No NVIDIA GPU or driver found"


def _driver_installed() -> bool:
    """Whether the NVIDIA driver's CUDA library can be loaded (CuPy's runtime reports its absence as a version
    problem: cudaErrorInsufficientDriver)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def gpu_unavailable(device: int) -> GpuUnavailable | None:
    """Why the GPU backend cannot run on `device` (None when it can): no CuPy, no GPU or driver, no such device."""
    try:
        from cupy_backends.cuda.api import runtime
    except ImportError:
        return GpuUnavailable("CuPy is not installed (pip install 'matmul-service[gpu]')")
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        if exc.status == CUDA_ERROR_NO_DEVICE or (
            exc.status == CUDA_ERROR_INSUFFICIENT_DRIVER and not _driver_installed()
        ):
            return GpuUnavailable(NO_GPU, detail=str(exc))
        if exc.status == CUDA_ERROR_INSUFFICIENT_DRIVER:
            return GpuUnavailable("The NVIDIA driver is older than CuPy's CUDA runtime needs", detail=str(exc))
        return GpuUnavailable("CUDA is not usable", detail=str(exc))
    if count == 0:
        return GpuUnavailable(NO_GPU, detail="CUDA sees no device")
    if device >= count:
        return GpuUnavailable(f"device {device} was asked for, but {count} CUDA device(s) are visible")
    return None


def engines(backend: str, devices: Sequence[int]) -> dict[str, Any]:
    """The engines MATMUL_BACKEND = `backend` and MATMUL_DEVICES = `devices` ask for: those devices, else every
    visible one; the CPU when the backend is cpu or, with auto, when no GPU can be used. RuntimeError when the backend
    is gpu and cannot be."""
    if backend == "cpu":
        return {"cpu": "MATMUL_BACKEND=cpu"}
    wanted = list(devices) or list(range(device_count())) or [0]
    missing = next((m for m in map(gpu_unavailable, wanted) if m is not None), None)
    if missing is None:
        return {"devices": wanted}
    said = f" ({missing.detail})" if missing.detail else ""
    if backend == "gpu":
        raise RuntimeError(f"MATMUL_BACKEND=gpu, but the GPU backend cannot start: {missing.reason}{said}")
    log.warning("%s: running on the CPU backend%s", missing.reason, said)
    return {"cpu": missing.reason}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.dataplane.devices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="MATMUL_BACKEND (default: auto)")
    parser.add_argument(
        "--devices",
        type=lambda text: [int(device) for device in text.split(",") if device],
        default=[],
        help="MATMUL_DEVICES: comma-separated CUDA ordinals (default: every visible device)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s devices %(levelname)s %(name)s: %(message)s")
    print(json.dumps(engines(args.backend, args.devices)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
