"""Dependencies the routes declare; the lifespan puts the objects on `app.state`, tests may swap them.

Every dependency is `async def`, though none awaits: FastAPI runs a plain `def` dependency in its thread pool, a
thread hop per dependency per request (five for a v2 infer), where an `async def` one is called on the loop."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.config import Settings
from app.engine.engine import EngineFront
from app.service import MatmulService


async def get_engine(request: Request) -> EngineFront:
    engine: EngineFront = request.app.state.engine
    return engine


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


EngineDep = Annotated[EngineFront, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_service(engine: EngineDep, settings: SettingsDep) -> MatmulService:
    """The service over the engine and settings these dependencies hand out (a test that swaps one swaps it)."""
    return MatmulService(engine, settings)


ServiceDep = Annotated[MatmulService, Depends(get_service)]
