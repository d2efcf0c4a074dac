"""Per-model inference statistics, in the shape of the protocol's statistics extension (`/v2/models/{m}/stats`).

Counted by this process only: with several HTTP workers each keeps its own (Prometheus metrics aggregate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from app.product import Timing


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ms: float) -> None:
        self.count += 1
        self.ns += round(ms * 1e6)

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStatistics:
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)

    def record_success(self, timing: Timing) -> None:
        self.inference_count += 1
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        self.success.add(timing.total_ms)
        self.queue.add(timing.queue_ms)
        self.compute_input.add(timing.read_ms + timing.decode_ms + timing.h2d_ms)
        self.compute_infer.add(timing.kernel_ms)
        self.compute_output.add(timing.d2h_ms + timing.encode_ms)

    def record_failure(self, ms: float) -> None:
        self.last_inference_ms = int(time.time() * 1000)
        self.fail.add(ms)

    def as_json(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "version": "1",
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                part: getattr(self, part).as_json()
                for part in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
            },
            "batch_stats": [],
        }


class InferenceStatistics:
    """Every model's statistics, kept from the first request that names it."""

    def __init__(self) -> None:
        self.by_model: dict[str, ModelStatistics] = {}

    def of(self, model: str) -> ModelStatistics:
        return self.by_model.setdefault(model, ModelStatistics())


async def get_statistics(request: Request) -> InferenceStatistics:
    statistics: InferenceStatistics = request.app.state.inference_stats
    return statistics


StatisticsDep = Annotated[InferenceStatistics, Depends(get_statistics)]
