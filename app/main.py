"""create_app(): settings and the link to the engine processes built in the lifespan, routers, middleware, error
handlers.

An HTTP worker started by `matmul-service` finds the engine processes' sockets in MATMUL_ENGINE_SOCKETS. One
started any other way (`uvicorn app.main:create_app --factory`, a test) starts engine processes of its own in its
lifespan and stops them at its end: the same data plane either way.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app import __version__
from app.allocator import cap_malloc_arenas
from app.api import grpc
from app.api.auth import ApiKeyMiddleware
from app.api.connection import CONNECTION_LIMITS, ConnectionLimits
from app.api.errors import UnexpectedErrors, install_error_handlers
from app.api.exchange import BodyBuffers
from app.api.framing import RequestHeadMiddleware
from app.api.limits import BodyLimitMiddleware
from app.api.observe import RequestObserver, configure_access_log
from app.api.routes import docs, include_routers
from app.api.v2.statistics import InferenceStatistics
from app.config import Settings
from app.dataplane.engine_client import EngineClient
from app.dataplane.supervisor import ENGINE_SOCKETS_VARIABLE, EngineSupervisor, end_with_supervisor
from app.metrics import ServiceMetrics


async def _engine_sockets(settings: Settings, stack: AsyncExitStack) -> list[str]:
    """The sockets of the engine processes: those `matmul-service` started, else ones started here."""
    given = os.environ.get(ENGINE_SOCKETS_VARIABLE)
    if given:
        return given.split(",")
    supervisor = EngineSupervisor(settings)
    stack.callback(supervisor.stop)
    await asyncio.to_thread(supervisor.start)
    return supervisor.sockets


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app. Settings come from MATMUL_* env vars unless given (tests pass their own)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        cap_malloc_arenas()  # before the codec thread pool starts its threads
        end_with_supervisor()
        resolved = settings if settings is not None else Settings()
        async with AsyncExitStack() as stack:
            engine = EngineClient(await _engine_sockets(resolved, stack), resolved)
            stack.callback(engine.arena.close)
            await engine.start()
            stack.push_async_callback(engine.stop)
            app.state.settings = resolved
            app.state.engine = engine
            app.state.metrics = ServiceMetrics()
            # the gauge follows the arena as memory is lent and given back: any worker's scrape sums every worker's now
            engine.arena.on_use = app.state.metrics.slab_used.set
            app.state.body_buffers = BodyBuffers()
            app.state.inference_stats = InferenceStatistics(app.state.metrics)
            if resolved.grpc_port:
                server = await grpc.start_server(resolved, engine, app.state.inference_stats)
                stack.push_async_callback(server.stop, grpc.STOP_GRACE_S)
            configure_access_log(resolved.access_log)
            # What the worker holds now lives as long as it serves: no full collection walks it again meanwhile
            # (each such walk paused the event loop for 42-47 ms; docs/throughput.md, "Full collections").
            gc.freeze()
            stack.callback(gc.unfreeze)
            yield {CONNECTION_LIMITS: ConnectionLimits.of(resolved)}  # for the connections (app.api.connection)

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
    include_routers(app)
    app.mount(docs.ASSETS_PATH, docs.docs_assets(), name="docs-assets")
    return app
