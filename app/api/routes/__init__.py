"""One router per surface, collected here."""

from fastapi import APIRouter

from app.api.routes import health, info, matmul

api_router = APIRouter()
api_router.include_router(matmul.router)
api_router.include_router(health.router)
api_router.include_router(info.router)
