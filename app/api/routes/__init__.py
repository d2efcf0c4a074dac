"""One router per surface, collected here; the routes behind API keys document their 401."""

from typing import Any

from fastapi import FastAPI

from app.api.routes import docs, echo, health, info, matmul, metrics
from app.api.schemas import ErrorBody
from app.api.v2 import routes as v2
from app.api.v2 import shared_memory

UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {
        "model": ErrorBody,
        "description": "MATMUL_API_KEYS is set and the request sent no valid key (WWW-Authenticate: Bearer).",
    }
}


def include_routers(app: FastAPI) -> None:
    """Every surface's router, included in the app itself: each level of routers in between is matched again on
    every request (a v2 infer spent 8% of an HTTP worker finding its route through one such level)."""
    app.include_router(matmul.router, responses=UNAUTHORIZED)
    app.include_router(health.router)
    app.include_router(info.router, responses=UNAUTHORIZED)
    app.include_router(v2.router)
    app.include_router(shared_memory.system_router, responses=UNAUTHORIZED)
    app.include_router(shared_memory.cuda_router, responses=UNAUTHORIZED)
    app.include_router(metrics.router, responses=UNAUTHORIZED)
    app.include_router(echo.router, responses=UNAUTHORIZED)
    app.include_router(docs.router)
