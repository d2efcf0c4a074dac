"""A request's head that leaves something in doubt is answered, not guessed at: two Content-Types (400), a content
coding the service does not undo (415), a query parameter given twice (422); in the format of the surface asked."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.anyio

JSON_BODY = b'{"a": [[1.0]], "b": [[2.0]]}'


async def test_two_different_content_types_are_a_400(client: httpx.AsyncClient) -> None:
    """The first one was used silently."""
    headers = [("content-type", "application/json"), ("content-type", "application/x-npz")]
    r = await client.post("/matmul", content=JSON_BODY, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "bad_request" and "2 different Content-Type headers" in r.json()["message"]


async def test_the_same_content_type_twice_is_one(client: httpx.AsyncClient) -> None:
    headers = [("content-type", "application/json"), ("content-type", "Application/JSON")]
    r = await client.post("/matmul", content=JSON_BODY, headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("coding", "named"), [("gzip", "'gzip'"), ("br", "'br'"), ("identity, deflate", "'deflate'")])
async def test_a_content_coding_is_a_415_naming_it(client: httpx.AsyncClient, coding: str, named: str) -> None:
    """A gzip body was parsed as if it had no coding, and failed as malformed JSON."""
    headers = {"content-type": "application/json", "content-encoding": coding}
    r = await client.post("/matmul", content=b"\x1f\x8b\x08\x00", headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["code"] == "unsupported_media_type"
    assert f"Content-Encoding {named} is not supported" in r.json()["message"]


async def test_the_identity_coding_is_no_coding(client: httpx.AsyncClient) -> None:
    headers = {"content-type": "application/json", "content-encoding": "identity"}
    assert (await client.post("/matmul", content=JSON_BODY, headers=headers)).status_code == 200


async def test_a_repeated_query_parameter_is_a_422_naming_it(client: httpx.AsyncClient) -> None:
    """?kernel=bogus&kernel=numpy took the last one."""
    r = await client.post(
        "/matmul?kernel=bogus&kernel=numpy", content=JSON_BODY, headers={"content-type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_parameter" and r.json()["location"] == ["query", "kernel"]
    assert "'kernel' is given 2 times" in r.json()["message"]


async def test_under_v2_the_answers_are_in_the_protocols_format(client: httpx.AsyncClient) -> None:
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    r = await client.post("/v2/models/matmul/infer", content=b"{}", headers=headers)
    assert r.status_code == 415 and set(r.json()) == {"error"} and "'gzip'" in r.json()["error"]
