"""The compute engine: a worker thread that owns a device, the backends it drives, and `EngineFront`, what the
routes ask of an engine. It runs in the engine processes of `app.dataplane`."""

from __future__ import annotations

from app.engine.base import DeviceTiming, KernelInfo, Outcome, Plan, ProductRequest
from app.engine.engine import Engine, EngineFront, LentMemory, SlabUse
from app.engine.worker import BatchPolicy, EngineState, Worker

__all__ = [
    "BatchPolicy",
    "DeviceTiming",
    "Engine",
    "EngineFront",
    "EngineState",
    "KernelInfo",
    "LentMemory",
    "Outcome",
    "Plan",
    "ProductRequest",
    "SlabUse",
    "Worker",
]
