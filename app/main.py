"""create_app(): settings and engine built in the lifespan, routers, middleware, error handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__
from app.api.errors import install_error_handlers
from app.api.limits import BodyLimitMiddleware
from app.api.observe import RequestObserver, configure_access_log
from app.api.routes import api_router
from app.api.routes.v2 import new_statistics
from app.config import Settings
from app.engine import build_engine
from app.metrics import ServiceMetrics


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app. Settings come from MATMUL_* env vars unless given (tests pass their own)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        resolved = settings if settings is not None else Settings()
        engine = build_engine(resolved)
        app.state.settings = resolved
        app.state.engine = engine
        app.state.metrics = ServiceMetrics()
        app.state.inference_stats = new_statistics(engine)
        configure_access_log(resolved.access_log)
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(
        title="matmul-service",
        version=__version__,
        summary="Matrix multiplication on NVIDIA GPUs with hand-written CUDA kernels, over HTTP.",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(RequestObserver)
    install_error_handlers(app)
    app.include_router(api_router)
    return app
