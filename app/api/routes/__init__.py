"""One router per surface, collected here."""

from fastapi import APIRouter

from app.api.routes import echo, health, info, matmul, metrics, v2

api_router = APIRouter()
api_router.include_router(matmul.router)
api_router.include_router(health.router)
api_router.include_router(info.router)
api_router.include_router(v2.router)
api_router.include_router(metrics.router)
api_router.include_router(echo.router)
