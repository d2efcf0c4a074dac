"""Optional API keys: every route but the health probes needs one when MATMUL_API_KEYS is set."""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from app.config import Settings
from app.main import create_app
from tests.conftest import _client_for

pytestmark = pytest.mark.anyio
BODY = {"a": [[1.0]], "b": [[2.0]]}


@pytest.fixture
async def keyed() -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(backend="cpu", access_log=False, api_keys="first-key, second-key")  # type: ignore[arg-type]
    async for client in _client_for(create_app(settings)):
        yield client


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"x-api-key": "first-key-but-longer"}])
async def test_no_or_a_wrong_key_gets_401(keyed: httpx.AsyncClient, headers: dict[str, str]) -> None:
    r = await keyed.post("/matmul", json=BODY, headers=headers)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "first-key" not in r.text and "second-key" not in r.text


@pytest.mark.parametrize(
    "headers",
    [{"authorization": "Bearer first-key"}, {"authorization": "bearer second-key"}, {"x-api-key": "second-key"}],
)
async def test_any_configured_key_opens_every_route(keyed: httpx.AsyncClient, headers: dict[str, str]) -> None:
    assert (await keyed.post("/matmul", json=BODY, headers=headers)).status_code == 200
    assert (await keyed.get("/v1/info", headers=headers)).status_code == 200
    assert (await keyed.get("/metrics", headers=headers)).status_code == 200


async def test_probes_stay_open_and_the_inference_protocol_answers_in_its_own_format(keyed: httpx.AsyncClient) -> None:
    for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
        assert (await keyed.get(path)).status_code == 200, path
    r = await keyed.get("/v2/models/matmul")
    assert r.status_code == 401 and set(r.json()) == {"error"}


async def test_keys_are_never_shown(keyed: httpx.AsyncClient) -> None:
    settings = Settings(backend="cpu", api_keys="s3cret")  # type: ignore[arg-type]
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings.model_dump())


async def test_no_key_reaches_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The right key and a wrong one, each sent as a bearer token and as X-API-Key, through the app with its access
    log on: neither key is in any record (root at DEBUG, and `app.access`, which does not propagate) nor in what the
    access log's own handler writes to stderr, though both hold the line of each of the four requests."""
    right, wrong = "right-key-7f3a9c", "wrong-key-d41e02"
    sent = [
        {"authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key}
        for key in (right, wrong)
        for header in ("bearer", "x-api-key")
    ]
    access = logging.getLogger("app.access")
    written = io.StringIO()
    settings = Settings(backend="cpu", access_log=True, api_keys=right)  # type: ignore[arg-type]
    caplog.set_level(logging.DEBUG)
    async for client in _client_for(create_app(settings)):
        # the lifespan's handler, writing to stderr (pytest's own capture handlers are StreamHandler subclasses)
        (stderr_handler,) = [handler for handler in access.handlers if type(handler) is logging.StreamHandler]
        stderr = stderr_handler.setStream(written)
        caplog.set_level(logging.DEBUG, logger=access.name)
        access.addHandler(caplog.handler)  # pytest attaches it only to loggers that were non-propagating already
        try:
            statuses = [(await client.post("/matmul", json=BODY, headers=headers)).status_code for headers in sent]
        finally:
            access.removeHandler(caplog.handler)
            stderr_handler.setStream(stderr)
    assert statuses == [200, 200, 401, 401]
    access_lines = [orjson.loads(line) for line in written.getvalue().splitlines()]
    assert [(line["path"], line["status"]) for line in access_lines] == [("/matmul", status) for status in statuses]
    assert set(written.getvalue().splitlines()) <= {r.getMessage() for r in caplog.records if r.name == access.name}
    for key in (right, wrong):
        assert key not in written.getvalue() and key not in caplog.text
