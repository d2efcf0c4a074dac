"""What the routes use of `app.state`, where the lifespan puts it (tests may put their own there once it has run).

The two routes that carry products (`POST /matmul`, v2 infer) read it through the plain functions here (`service_of`,
`settings_of`): FastAPI solves a route's dependencies anew for every request, inspecting each parameter's type
again. Read this way, a 64² product through `/matmul` took 0.84-0.99 ms of an HTTP worker's CPU, against 0.89-1.08
ms as dependencies (medians 0.88 and 0.98; one worker, CPU backend, 2 CPUs, six runs each in turn). The other
routes declare them as dependencies (`EngineDep`, ...).

Every dependency is `async def`, though none awaits: FastAPI runs a plain `def` dependency in its thread pool, a
thread hop per dependency per request, where an `async def` one is called on the loop."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.config import Settings
from app.engine.engine import EngineFront
from app.service import MatmulService


def engine_of(request: Request) -> EngineFront:
    engine: EngineFront = request.app.state.engine
    return engine


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def service_of(request: Request) -> MatmulService:
    """The service over the app's engine and settings."""
    return MatmulService(engine_of(request), settings_of(request))


async def get_engine(request: Request) -> EngineFront:
    return engine_of(request)


async def get_settings(request: Request) -> Settings:
    return settings_of(request)


EngineDep = Annotated[EngineFront, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
