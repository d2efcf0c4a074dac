"""The compute engine: a worker thread that owns the device, and the backends it can drive."""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.config import BackendChoice, Settings
from app.engine.base import Backend, DeviceTiming, KernelInfo, Outcome, Plan
from app.engine.cpu import CpuBackend
from app.engine.worker import Engine, EngineState

__all__ = ["DeviceTiming", "Engine", "EngineState", "KernelInfo", "Outcome", "Plan", "build_engine"]

log = logging.getLogger(__name__)


def _choose_backend(settings: Settings) -> Backend:
    if settings.backend is BackendChoice.CPU:
        return CpuBackend(reason="MATMUL_BACKEND=cpu")
    from app.engine import gpu

    reason = gpu.unavailable_reason(settings.device)
    if reason is None:
        return gpu.GpuBackend(settings.device, settings.device_memory_limit_bytes, settings.fault_injection)
    if settings.backend is BackendChoice.GPU:
        raise RuntimeError(f"MATMUL_BACKEND=gpu, but the GPU backend cannot start: {reason}")
    log.warning("no usable GPU (%s): running on the CPU backend", reason)
    return CpuBackend(reason=reason)


def build_engine(settings: Settings, on_device_lost: Callable[[], None] | None = None) -> Engine:
    """The engine for these settings, not yet started."""
    return Engine(_choose_backend(settings), queue_size=settings.queue_size, on_device_lost=on_device_lost)
