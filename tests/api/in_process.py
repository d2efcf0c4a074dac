"""The app under a real uvicorn server on a thread of this process, so that a test can spy on the objects that serve
its connections (app.api.connection), over real sockets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn

from app.api.connection import GuardedHttpProtocol
from matmul_tools.service import wait_ready

READY_TIMEOUT_S = 120


@contextmanager
def serving(port: int, loop: str, settings: dict[str, str]) -> Iterator[None]:
    """The service on 127.0.0.1:`port` on the event loop `loop` ("uvloop" or "asyncio"), the CPU backend and no
    access log, with `settings` (environment variables) besides; ready once entered, stopped when left."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false", **settings}.items():
            patch.setenv(name, value)
        config = uvicorn.Config(
            "app.main:create_app",
            factory=True,
            port=port,
            http=GuardedHttpProtocol,  # type: ignore[arg-type]  # a BufferedProtocol: uvicorn calls what it is given
            loop=loop,
            log_level="warning",
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            wait_ready(f"http://127.0.0.1:{port}", READY_TIMEOUT_S)
            yield
        finally:
            server.should_exit = True
            thread.join(60)
