"""Probes for orchestrators: liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import EngineDep
from app.api.schemas import ErrorBody, HealthStatus

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness probe")
async def healthz() -> HealthStatus:
    """200 while the process serves HTTP; says nothing about the device."""
    return HealthStatus(status="ok")


@router.get(
    "/readyz",
    summary="Readiness probe",
    responses={503: {"model": ErrorBody, "description": "Kernels still compiling, or the backend failed."}},
)
async def readyz(engine: EngineDep) -> HealthStatus:
    """200 once every kernel is compiled, warmed and self-tested; 503 (with Retry-After) before that."""
    engine.check_ready()
    return HealthStatus(status="ready")
