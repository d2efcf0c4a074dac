"""Optional API keys: with MATMUL_API_KEYS set, every route but the health probes needs one of them."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import Receive, Scope, Send

from app.api.errors import error_response_for
from app.api.middleware import HttpMiddleware
from app.errors import Unauthorized

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


def presented_key(fields: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request presents among its header fields (HTTP headers, gRPC metadata; names in lower case): the
    first X-API-Key, or Authorization's bearer token, whichever comes first."""
    for name, value in fields:
        if name == b"x-api-key":
            return bytes(value)
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return bytes(value[7:]).strip()
    return None


def _matches_a_key(presented: bytes, keys: list[bytes]) -> bool:
    """Compared with every key in constant time, so timing tells nothing about any of them."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


def check_key(presented: bytes | None, keys: list[bytes], how_to_send: str) -> None:
    """Unauthorized unless `presented` is one of `keys`; `how_to_send` tells a client without a key how to send one."""
    if presented is None:
        raise Unauthorized(f"this server needs an API key: send {how_to_send}")
    if not _matches_a_key(presented, keys):
        raise Unauthorized("the API key is not valid")


class ApiKeyMiddleware(HttpMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = scope["app"].state.settings
        if not settings.api_keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        keys = [key.get_secret_value().encode() for key in settings.api_keys]
        try:
            check_key(presented_key(scope["headers"]), keys, "'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
        except Unauthorized as error:
            await error_response_for(scope["path"], error, settings.retry_after_s)(scope, receive, send)
            return
        await self.app(scope, receive, send)
