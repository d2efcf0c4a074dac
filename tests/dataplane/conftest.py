"""The engine processes of each test module's `settings`, started by a supervisor as `matmul-service` does, and an
HTTP worker's side of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from app.config import Settings
from app.dataplane.engine_client import EngineClient
from app.dataplane.supervisor import EngineSupervisor
from app.engine import EngineState
from tests.fakes import until


@pytest.fixture
def supervisor(settings: Settings) -> Iterator[EngineSupervisor]:
    supervisor = EngineSupervisor(settings)
    supervisor.start()
    yield supervisor
    supervisor.stop()


@pytest.fixture
async def engine(supervisor: EngineSupervisor, settings: Settings) -> AsyncIterator[EngineClient]:
    """An HTTP worker's side of those engine processes, with an arena of its own, once they are ready."""
    engine = EngineClient(supervisor.sockets, settings)
    await engine.start()
    await until(lambda: engine.state is EngineState.READY, guard_s=60)
    yield engine
    await engine.stop()
    engine.arena.close()
