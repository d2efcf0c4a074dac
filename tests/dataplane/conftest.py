"""The engine processes of each test module's `settings`, started by a supervisor as `matmul-service` does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.config import Settings
from app.dataplane.supervisor import EngineSupervisor


@pytest.fixture
def supervisor(settings: Settings) -> Iterator[EngineSupervisor]:
    supervisor = EngineSupervisor(settings)
    supervisor.start()
    yield supervisor
    supervisor.stop()
