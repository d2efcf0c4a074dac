"""Optional API keys: every route but the health probes needs one when MATMUL_API_KEYS is set."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
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
