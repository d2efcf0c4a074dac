"""The service's figures: each stage of the stopwatch in milliseconds, GFLOP/s as the launch's 2*m*n*k / kernel time."""

from __future__ import annotations

import numpy as np
import pytest

from app import service
from app.engine import DeviceTiming, Outcome, Plan
from app.product import RooflineModel
from kernels.roofline import DevicePeaks

ROOFLINE = RooflineModel(
    flops=0, global_bytes=0, intensity=None, peak_gflops=None, peak_fraction=None, global_gbps=None, dram_gbps=None
)


def _product(m: int, k: int, n: int, kernel_ms: float, batch_size: int = 1) -> service.Product:
    outcome = Outcome(
        c=np.zeros((m, n)),
        plan=Plan(kernel="numpy"),
        queue_ms=3.0,
        device=DeviceTiming(h2d_ms=0.5, kernel_ms=kernel_ms, d2h_ms=0.25),
        device_name="test",
        peaks=DevicePeaks(),
        batch_size=batch_size,
    )
    clock = service.Stopwatch(received=100.0, read=100.5, decoded=101.25, computed=102.0)
    return service.Product(outcome, np.dtype(np.float32), m, k, n, "cpu", clock, ROOFLINE)


def test_each_stage_is_reported_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Received at 100 s, read at 100.5 s, decoded at 101.25 s, computed at 102 s, described at 104 s."""
    monkeypatch.setattr(service, "perf_counter", lambda: 104.0)
    timing = _product(2, 3, 4, kernel_ms=1.5).describe().timing
    assert timing.model_dump() == {
        "read_ms": 500.0, "decode_ms": 750.0, "queue_ms": 3.0, "h2d_ms": 0.5, "kernel_ms": 1.5, "d2h_ms": 0.25,
        "encode_ms": 2000.0, "total_ms": 4000.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "kernel_ms", "batch_size", "gflops"),
    [((1000, 2000, 3000), 4.0, 1, 3000.0), ((10, 20, 30), 0.5, 4, 0.096), ((0, 5, 5), 1.0, 1, None),
     ((5, 5, 5), 0.0, 1, None)],
)  # fmt: skip
def test_gflops_is_the_launchs_work_over_its_kernel_time(
    shape: tuple[int, int, int], kernel_ms: float, batch_size: int, gflops: float | None
) -> None:
    """2 * 1000 * 3000 * 2000 FLOPs in 4 ms are 3000 GFLOP/s; a batch of 4 does 4 times the work in its launch;
    no work, or no time measured, has no rate."""
    m, k, n = shape
    described = _product(m, k, n, kernel_ms, batch_size).describe()
    assert described.gflops == (None if gflops is None else pytest.approx(gflops, rel=1e-12))
    assert described.batch_size == batch_size and described.shape == (m, n)
