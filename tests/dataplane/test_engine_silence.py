"""An engine process that says nothing is taken for hung (app.dataplane.engine_client); one whose statuses this
HTTP worker has not read yet, because its own event loop was busy, is not."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from app.config import Settings
from app.dataplane.engine_client import EngineClient
from app.engine import EngineState
from app.errors import NotReady
from tests.fakes import until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
MIB = 1 << 20


@pytest.fixture(params=[("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """Both loops: uvloop runs due timers before it reads the sockets, asyncio after."""
    backend: tuple[str, dict[str, bool]] = request.param
    return backend


@pytest.fixture
def settings() -> Settings:
    return Settings(backend="cpu", engine_silence_s=1, slab_bytes=8 * MIB)


async def test_a_stall_of_the_workers_own_loop_takes_no_engine_for_hung(
    engine: EngineClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's loop is blocked for twice the silence while the engine goes on sending its statuses: once it
    runs again, the watch must not take the engine for hung before the statuses waiting in the socket are read."""
    with caplog.at_level(logging.ERROR, logger="app.dataplane.engine_client"):
        for _ in range(3):
            time.sleep(2.0)  # noqa: ASYNC251  # blocks the loop on purpose, as a long call in a route would
            await asyncio.sleep(0.6)
    assert not [record for record in caplog.records if "taken for hung" in record.getMessage()]
    assert not engine.links[0].is_silent


async def test_a_stopped_engine_is_taken_for_hung_and_serves_again_once_it_speaks(engine: EngineClient) -> None:
    link = engine.links[0]
    pid = link.welcome.engine_pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        await until(lambda: link.is_silent, guard_s=10)
        assert link.state is EngineState.FAILED
        with pytest.raises(NotReady, match=f"the engine process {pid} has said nothing for more than 1 s"):
            engine.check_ready()
    finally:
        os.kill(pid, signal.SIGCONT)
    await until(lambda: engine.state is EngineState.READY, guard_s=10)
    assert not link.is_silent
