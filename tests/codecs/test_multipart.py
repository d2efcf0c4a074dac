"""The in-memory multipart parser: parts are views of the body, not copies, and stay exact where the parser
had to hold bytes back (data that begins like the boundary)."""

from __future__ import annotations

import numpy as np
import pytest

from app.api.multipart import parse_file_parts
from app.errors import MalformedPayload
from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, multipart_body, npy_bytes


def test_parts_are_views_of_the_body() -> None:
    a, b = npy_bytes(np.arange(12.0).reshape(3, 4)), npy_bytes(np.ones((4, 2), np.float32))
    body = multipart_body([("a", a), ("b", b)])
    parts = parse_file_parts(body, MULTIPART_CONTENT_TYPE)
    assert {name: bytes(data) for name, data in parts.items()} == {"a": a, "b": b}
    for data in parts.values():
        assert isinstance(data, memoryview) and data.obj is body


def test_data_that_looks_like_a_boundary_is_kept_whole() -> None:
    """'\\r\\n--x' inside a part makes the parser hold those bytes back and hand them over from its own buffer."""
    tricky = b"head\r\n--x not a boundary\r\n-- nor this\r\n--xy" + bytes(range(256))
    parts = parse_file_parts(multipart_body([("a", tricky), ("b", b"tail")]), MULTIPART_CONTENT_TYPE)
    assert bytes(parts["a"]) == tricky and bytes(parts["b"]) == b"tail"


def test_a_body_without_its_closing_boundary_is_malformed() -> None:
    body = multipart_body([("a", b"data")])[: -len(b"--xx--\r\n") - 3]
    with pytest.raises(MalformedPayload, match="ends before its closing boundary '--xx--'"):
        parse_file_parts(body, MULTIPART_CONTENT_TYPE)
