"""/docs and /redoc load every asset from the service itself, so they work on a network without internet access."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from tests.conftest import _client_for

pytestmark = pytest.mark.anyio
PAGES = ["/docs", "/redoc"]
KEY = {"x-api-key": "docs-key"}


class AssetLinks(HTMLParser):
    """The URLs a page makes the browser fetch: scripts, stylesheets, icons, images, and ReDoc's spec-url."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        wanted = {"script": "src", "link": "href", "img": "src", "redoc": "spec-url"}.get(tag)
        if wanted is not None and named.get(wanted):
            self.urls.append(str(named[wanted]))


def asset_urls(page: str) -> list[str]:
    parser = AssetLinks()
    parser.feed(page)
    # Swagger UI names its OpenAPI document in the inline script
    return parser.urls + re.findall(r"\burl: '([^']+)'", page)


CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


async def _assets_are_served_here(client: httpx.AsyncClient, path: str, headers: dict[str, str]) -> list[str]:
    page = await client.get(path, headers=headers)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = asset_urls(page.text)
    assert not re.search(r"https?://|//[a-z]", page.text), "the page names another origin"
    origin = urlsplit(str(client.base_url))
    for url in urls:
        absolute = urlsplit(urljoin(f"{client.base_url}{path}", url))
        assert (absolute.scheme, absolute.netloc) == (origin.scheme, origin.netloc), url
        asset = await client.get(absolute.path, headers=headers)
        assert asset.status_code == 200, url
        suffix = absolute.path[absolute.path.rfind(".") :]
        assert asset.headers["content-type"].startswith(CONTENT_TYPES[suffix]), (url, asset.headers["content-type"])
        assert len(asset.content) > 1000, url
    return urls


@pytest.mark.parametrize("path", PAGES)
async def test_every_asset_of_the_page_comes_from_the_service(client: httpx.AsyncClient, path: str) -> None:
    urls = await _assets_are_served_here(client, path, headers={})
    assert {url.rsplit("/", 1)[-1] for url in urls} >= {"favicon.png", "openapi.json"}
    assert any(url.endswith(".js") for url in urls)


@pytest.fixture
async def keyed() -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(backend="cpu", access_log=False, api_keys=KEY["x-api-key"])  # type: ignore[arg-type]
    async for client in _client_for(create_app(settings)):
        yield client


@pytest.mark.parametrize("path", PAGES)
async def test_behind_api_keys_the_page_and_its_assets_need_the_same_key(keyed: httpx.AsyncClient, path: str) -> None:
    urls = await _assets_are_served_here(keyed, path, headers=KEY)
    for url in [path, *urls]:
        assert (await keyed.get(url)).status_code == 401, url
