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


NEAR_MISSES = {
    "longer": "first-key-but-longer",
    "prefix": "first-ke",
    "short prefix": "sec",
    "one character": "f",
    "suffix": "irst-key",
    "last character": "y",
    "one byte changed": "first-kez",
    "case changed": "First-key",
    "a byte in the middle changed": "first_key",
    "both keys joined": "first-keysecond-key",
    "both keys listed": "first-key,second-key",
    "a NUL after the key": "first-key\x00",
    "wrong": "wrong",
}
"""Keys that are not a configured one ("first-key", "second-key") but share bytes with one: a check that compared
prefixes, suffixes or lengths would let some of them in."""


@pytest.mark.parametrize("presented", NEAR_MISSES.values(), ids=NEAR_MISSES.keys())
@pytest.mark.parametrize("header", ["bearer", "x-api-key"])
async def test_a_key_that_is_not_a_configured_one_gets_401(
    keyed: httpx.AsyncClient, presented: str, header: str
) -> None:
    headers = {"authorization": f"Bearer {presented}"} if header == "bearer" else {"x-api-key": presented}
    r = await keyed.post("/matmul", json=BODY, headers=headers)
    assert (
        r.status_code == 401
        and r.json()["code"] == "unauthorized"
        and r.json()["message"] == "the API key is not valid"
    )
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "first-key" not in r.text and "second-key" not in r.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer "},
        {"authorization": "Bearer    "},
        {"authorization": "Bearer"},
        {"x-api-key": ""},
        {"x-api-key": "   "},
        {"authorization": "first-key"},  # no scheme
        {"authorization": "Basic first-key"},
        {"authorization": "Token first-key"},
        {"authorization": "Bearerfirst-key"},
        {"proxy-authorization": "Bearer first-key"},
        {"api-key": "first-key"},
        {"x-api-key": "Bearer first-key"},
        {"cookie": "api_key=first-key"},
    ],
    ids=str,
)
async def test_no_key_an_empty_one_or_the_right_one_in_the_wrong_place_gets_401(
    keyed: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    r = await keyed.post("/matmul", json=BODY, headers=headers)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized", r.text
    query = await keyed.post("/matmul", params={"api_key": "first-key", "key": "first-key"}, json=BODY)
    assert query.status_code == 401


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
    sent += [{"authorization": f"Basic {right}"}, {"x-api-key": right[:12]}]  # in the wrong scheme; a prefix
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
    assert statuses == [200, 200, 401, 401, 401, 401]
    access_lines = [orjson.loads(line) for line in written.getvalue().splitlines()]
    assert [(line["path"], line["status"]) for line in access_lines] == [("/matmul", status) for status in statuses]
    assert set(written.getvalue().splitlines()) <= {r.getMessage() for r in caplog.records if r.name == access.name}
    for key in (right, wrong, right[:12]):
        assert key not in written.getvalue() and key not in caplog.text
