"""Optional API keys: with MATMUL_API_KEYS set, every route but the health probes needs one of them."""

from __future__ import annotations

import hmac

from starlette.types import Receive, Scope, Send

from app.api.errors import error_response_for
from app.api.middleware import HttpMiddleware
from app.errors import Unauthorized

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


def _presented_key(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            return bytes(value)
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return bytes(value[7:]).strip()
    return None


def matches_a_key(presented: bytes, keys: list[bytes]) -> bool:
    """Compared with every key in constant time, so timing tells nothing about any of them."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


class ApiKeyMiddleware(HttpMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = scope["app"].state.settings
        if not settings.api_keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        keys = [key.get_secret_value().encode() for key in settings.api_keys]
        presented = _presented_key(scope)
        if presented is not None and matches_a_key(presented, keys):
            await self.app(scope, receive, send)
            return
        error = Unauthorized(
            "this server needs an API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
            if presented is None
            else "the API key is not valid"
        )
        await error_response_for(scope["path"], error, settings.retry_after_s)(scope, receive, send)
