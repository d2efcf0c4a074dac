"""The compute engine: worker threads that each own a device, and the backends they drive."""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.config import BackendChoice, Settings
from app.engine.base import Backend, DeviceTiming, KernelInfo, Outcome, Plan
from app.engine.cpu import CpuBackend
from app.engine.engine import Engine
from app.engine.worker import BatchPolicy, EngineState, Worker

__all__ = [
    "BatchPolicy",
    "DeviceTiming",
    "Engine",
    "EngineState",
    "KernelInfo",
    "Outcome",
    "Plan",
    "Worker",
    "build_engine",
]

log = logging.getLogger(__name__)


def _choose_backends(settings: Settings) -> list[Backend]:
    """One backend per device: the GPUs listed in MATMUL_DEVICES (or every visible one), else the CPU."""
    if settings.backend is BackendChoice.CPU:
        return [CpuBackend(reason="MATMUL_BACKEND=cpu")]
    from app.engine import gpu

    devices = settings.devices or list(range(gpu.device_count())) or [0]
    missing = next((m for m in map(gpu.gpu_unavailable, devices) if m is not None), None)
    if missing is None:
        return [
            gpu.GpuBackend(d, settings.device_memory_limit_bytes, settings.fault_injection, settings.pipeline_depth)
            for d in devices
        ]
    said = f" ({missing.detail})" if missing.detail else ""
    if settings.backend is BackendChoice.GPU:
        raise RuntimeError(f"MATMUL_BACKEND=gpu, but the GPU backend cannot start: {missing.reason}{said}")
    log.warning("%s: running on the CPU backend%s", missing.reason, said)
    return [CpuBackend(reason=missing.reason)]


def build_engine(settings: Settings, on_device_lost: Callable[[], None] | None = None) -> Engine:
    """The engine for these settings, not yet started."""
    batching = (
        BatchPolicy(max_size=settings.max_batch_size, max_delay_s=settings.max_queue_delay_us / 1e6)
        if settings.batching
        else None
    )
    return Engine(
        [
            Worker(backend, queue_size=settings.queue_size, on_device_lost=on_device_lost, batching=batching)
            for backend in _choose_backends(settings)
        ]
    )
