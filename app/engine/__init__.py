"""The compute engine: a worker thread that owns a device, the backends it drives, and `EngineFront`, what the
routes ask of an engine. It runs in the engine processes of `app.dataplane`."""

from __future__ import annotations

from app.engine.base import DeviceTiming, KernelInfo, Outcome, Plan, ProductRequest
from app.engine.device_worker import BatchPolicy, DeviceWorker, EngineState
from app.engine.engine import EngineFront, LentMemory, LocalEngine, SlabUse

__all__ = [
    "BatchPolicy",
    "DeviceTiming",
    "DeviceWorker",
    "EngineFront",
    "EngineState",
    "KernelInfo",
    "LentMemory",
    "LocalEngine",
    "Outcome",
    "Plan",
    "ProductRequest",
    "SlabUse",
]
