"""Prometheus metrics of the service, in a registry of its own (built per app, so tests can build many).

With several worker processes, set PROMETHEUS_MULTIPROC_DIR (an empty directory, the same for all of them)
before the server starts: prometheus-client then keeps every value in files there, and `render` merges
them, so any worker's /metrics answers for all of them. The live gauges' files of a worker that is gone are removed
by whatever supervises the workers (`matmul-service`'s, app.api.workers): left there, the merge would add what the
worker held when it died to every scrape.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    Summary,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from app.product import Timing

# Seconds; from 50 us (a tiny product's kernel) to 60 s (a huge JSON body).
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
STAGES = ("queue", "h2d", "kernel", "d2h")
INFERENCE_PARTS = "matmul_inference_part_seconds"
INFERENCE_LAST = "matmul_inference_last_timestamp_seconds"


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "matmul_requests", "HTTP requests answered, by route, method, status and kernel.",
            ["route", "method", "status", "kernel"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "matmul_request_duration_seconds", "Time from request start to the last byte of the answer.",
            ["route"], buckets=BUCKETS, registry=r,
        )  # fmt: skip
        self.stage = Histogram(
            "matmul_stage_duration_seconds", "Time of each stage of a product: queue, h2d, kernel, d2h.",
            ["stage", "kernel"], buckets=BUCKETS, registry=r,
        )  # fmt: skip
        self.bytes_in = Counter("matmul_request_bytes", "Bytes of request bodies received.", ["route"], registry=r)
        self.bytes_out = Counter("matmul_response_bytes", "Bytes of response bodies sent.", ["route"], registry=r)
        self.in_flight = Gauge(
            "matmul_requests_in_flight", "Requests being handled now.", registry=r, multiprocess_mode="livesum"
        )
        # What the engine processes report: every HTTP worker sees the same figures, so the merge keeps the latest.
        self.queue_depth = Gauge(
            "matmul_queue_depth", "Products waiting in the engine processes' queues.",
            registry=r, multiprocess_mode="livemostrecent",
        )  # fmt: skip
        self.engine_queue_depth = Gauge(
            "matmul_engine_queue_depth", "Products waiting in each engine process's queue, by its device index ('cpu' "
            "for the CPU backend's).", ["device"], registry=r, multiprocess_mode="livemostrecent",
        )  # fmt: skip
        self.device_memory = Gauge(
            "matmul_device_memory_bytes", "Device memory the engines' CuPy pools hold (in arrays or cached for reuse).",
            registry=r, multiprocess_mode="livemostrecent",
        )  # fmt: skip
        self.slab_used = Gauge(
            "matmul_slab_used_bytes", "Shared memory held by requests in flight, summed over the HTTP workers.",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        # process_resident_memory_bytes, CPU seconds, open fds, ... from /proc (Linux); not merged in multiprocess mode
        ProcessCollector(registry=r)
        self.kernels_compiled = Gauge(
            "matmul_kernels_compiled", "Kernel instances compiled and self-tested by the engine processes.",
            registry=r, multiprocess_mode="livemostrecent",
        )  # fmt: skip

        # the inference protocol's statistics extension (app.api.v2.statistics), kept here so that workers share them
        self.inference_parts = Summary(
            INFERENCE_PARTS, "Inference-protocol products by model: count and seconds of each part the statistics "
            "extension reports (success, fail, queue, compute_input, compute_infer, compute_output).",
            ["model", "part"], registry=r,
        )  # fmt: skip
        self.inference_last = Gauge(
            INFERENCE_LAST, "When each model last answered an inference-protocol request (Unix time).",
            ["model"], registry=r, multiprocess_mode="max",
        )  # fmt: skip

    def observe_product(self, kernel: str, timing: Timing) -> None:
        for stage in STAGES:
            self.stage.labels(stage=stage, kernel=kernel).observe(getattr(timing, f"{stage}_ms") / 1e3)

    def _merged(self) -> CollectorRegistry:
        """This registry, or in multiprocess mode one that reads every process's values."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return self.registry
        merged = CollectorRegistry()
        MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return merged

    def families(self) -> Iterable[Metric]:
        """Every metric's samples, merged across processes in multiprocess mode."""
        return self._merged().collect()

    def render(self) -> tuple[bytes, str]:
        """The exposition text of every metric, merged across processes in multiprocess mode."""
        return generate_latest(self._merged()), CONTENT_TYPE_LATEST
