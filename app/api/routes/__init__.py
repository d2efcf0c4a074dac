"""One router per surface, collected here; the routes behind API keys document their 401."""

from typing import Any

from fastapi import APIRouter

from app.api.routes import docs, echo, health, info, matmul, metrics
from app.api.schemas import ErrorBody
from app.api.v2 import routes as v2

UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {
        "model": ErrorBody,
        "description": "MATMUL_API_KEYS is set and the request sent no valid key (WWW-Authenticate: Bearer).",
    }
}

api_router = APIRouter()
api_router.include_router(matmul.router, responses=UNAUTHORIZED)
api_router.include_router(health.router)
api_router.include_router(info.router, responses=UNAUTHORIZED)
api_router.include_router(v2.router)
api_router.include_router(metrics.router, responses=UNAUTHORIZED)
api_router.include_router(echo.router, responses=UNAUTHORIZED)
api_router.include_router(docs.router)
