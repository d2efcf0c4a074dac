"""GET /metrics: Prometheus exposition of the service's metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import EngineDep
from app.metrics import ServiceMetrics

router = APIRouter(tags=["observability"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format."}},
)
async def metrics(request: Request, engine: EngineDep) -> Response:
    """Requests by route/status/kernel, latency and stage histograms, queue depth (in all and by engine), in-flight,
    device memory, bytes."""
    service_metrics: ServiceMetrics = request.app.state.metrics
    service_metrics.queue_depth.set(engine.queue_depth)
    for device in engine.describe():
        label = "cpu" if device.get("index") is None else str(device["index"])
        service_metrics.engine_queue_depth.labels(device=label).set(device["queue_depth"])
    service_metrics.device_memory.set(engine.memory_held())
    service_metrics.kernels_compiled.set(engine.compiled_instances())
    body, content_type = service_metrics.render()
    return Response(content=body, media_type=content_type)
