"""create_app(): settings and engine built in the lifespan, routers, middleware, error handlers."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app import __version__
from app.allocator import cap_malloc_arenas
from app.api.auth import ApiKeyMiddleware
from app.api.connection import HEADER_LIMITS, HeaderLimits
from app.api.errors import UnexpectedErrors, install_error_handlers
from app.api.framing import RequestHeadMiddleware
from app.api.limits import BodyLimitMiddleware
from app.api.observe import RequestObserver, configure_access_log
from app.api.routes import api_router, docs
from app.api.routes.v2 import new_statistics
from app.config import Settings
from app.engine import build_engine
from app.metrics import ServiceMetrics

DEVICE_LOST_EXIT_CODE = 75
"""EX_TEMPFAIL: the process exits after its CUDA context was poisoned, to be restarted with a fresh one."""


def _shut_down_for_restart() -> None:
    """Graceful shutdown (uvicorn's SIGTERM path: stop accepting, finish in-flight answers, run the lifespan's
    end), after which the lifespan exits with DEVICE_LOST_EXIT_CODE for the supervisor to restart us."""
    signal.raise_signal(signal.SIGTERM)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app. Settings come from MATMUL_* env vars unless given (tests pass their own)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        cap_malloc_arenas()  # before the engine and the codec thread pool start their threads
        resolved = settings if settings is not None else Settings()
        engine = build_engine(resolved, on_device_lost=_shut_down_for_restart)
        app.state.settings = resolved
        app.state.engine = engine
        app.state.metrics = ServiceMetrics()
        app.state.inference_stats = new_statistics(engine)
        configure_access_log(resolved.access_log)
        engine.start()
        try:
            yield {HEADER_LIMITS: HeaderLimits.of(resolved)}  # for the server's connections (app.api.connection)
        finally:
            await engine.stop()
        if engine.device_lost:
            logging.shutdown()
            os._exit(DEVICE_LOST_EXIT_CODE)

    app = FastAPI(
        title="matmul-service",
        version=__version__,
        summary="Matrix multiplication on NVIDIA GPUs with hand-written CUDA kernels, over HTTP.",
        lifespan=lifespan,
        docs_url=None,  # served by app.api.routes.docs, with local assets
        redoc_url=None,
    )
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(RequestHeadMiddleware)
    app.add_middleware(ApiKeyMiddleware)
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(RequestObserver)
    install_error_handlers(app)
    app.include_router(api_router)
    app.mount(docs.ASSETS_PATH, docs.docs_assets(), name="docs-assets")
    return app
