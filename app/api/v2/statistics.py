"""Per-model inference statistics, in the shape of the protocol's statistics extension (`/v2/models/{m}/stats`, gRPC's
ModelStatistics), kept in the service's Prometheus registry (app.metrics).

With several HTTP workers every worker counts the products it answers in the files prometheus-client shares between
them (PROMETHEUS_MULTIPROC_DIR), and each answer sums all of them: a client that reads the statistics before and after
a run (perf_analyzer does) sees the whole server's counts, whichever worker answers it. The same figures are on
/metrics as `matmul_inference_part_seconds` and `matmul_inference_last_timestamp_seconds`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import Depends, Request

from app.api.v2.models import VERSION
from app.metrics import INFERENCE_LAST, INFERENCE_PARTS, ServiceMetrics
from app.product import Timing

PARTS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
"""The extension's durations, each a count and cumulative nanoseconds."""


class InferenceStatistics:
    """Every model's statistics, recorded in and read back from the service's metrics."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def record_success(self, model: str, timing: Timing) -> None:
        parts = {
            "success": timing.total_ms,
            "queue": timing.queue_ms,
            "compute_input": timing.read_ms + timing.decode_ms + timing.h2d_ms,
            "compute_infer": timing.kernel_ms,
            "compute_output": timing.d2h_ms + timing.encode_ms,
        }
        for part, ms in parts.items():
            self.metrics.inference_parts.labels(model=model, part=part).observe(ms / 1e3)
        self.metrics.inference_last.labels(model=model).set(time.time())

    def record_failure(self, model: str, ms: float) -> None:
        self.metrics.inference_parts.labels(model=model, part="fail").observe(ms / 1e3)
        self.metrics.inference_last.labels(model=model).set(time.time())

    def model_stats(self, models: Iterable[str]) -> list[dict[str, Any]]:
        """The extension's `model_stats` of each of `models` (zeros for one that has answered nothing yet)."""
        counts: dict[tuple[str, str], int] = defaultdict(int)
        seconds: dict[tuple[str, str], float] = defaultdict(float)
        last: dict[str, float] = defaultdict(float)
        for family in self.metrics.families():
            for sample in family.samples:
                if sample.name == f"{INFERENCE_PARTS}_count":
                    counts[sample.labels["model"], sample.labels["part"]] += int(sample.value)
                elif sample.name == f"{INFERENCE_PARTS}_sum":
                    seconds[sample.labels["model"], sample.labels["part"]] += sample.value
                elif sample.name == INFERENCE_LAST:
                    last[sample.labels["model"]] = max(last[sample.labels["model"]], sample.value)
        return [
            {
                "name": model,
                "version": VERSION,
                "last_inference": round(last[model] * 1e3),
                "inference_count": counts[model, "success"],
                "execution_count": counts[model, "success"],
                "inference_stats": {
                    part: {"count": counts[model, part], "ns": round(seconds[model, part] * 1e9)} for part in PARTS
                },
                "batch_stats": [],
            }
            for model in models
        ]


def statistics_of(request: Request) -> InferenceStatistics:
    statistics: InferenceStatistics = request.app.state.inference_stats
    return statistics


async def get_statistics(request: Request) -> InferenceStatistics:
    return statistics_of(request)


StatisticsDep = Annotated[InferenceStatistics, Depends(get_statistics)]
