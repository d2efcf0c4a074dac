"""The protocol's error answer, `{"error": "<message>"}`, as the OpenAPI document describes it."""

from __future__ import annotations

from typing import Any

_ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def protocol_error(description: str) -> dict[str, Any]:
    """An error answer of the protocol, documented."""
    example = {"error": "inner dimensions differ: ..."}
    return {"description": description, "content": {"application/json": {"schema": _ERROR_BODY, "example": example}}}
