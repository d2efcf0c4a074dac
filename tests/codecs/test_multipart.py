"""The in-memory multipart parser: parts are views of the body, not copies, and stay exact where the parser
had to hold bytes back (data that begins like the boundary)."""

from __future__ import annotations

import numpy as np
import pytest

from app.codecs.multipart import parse_file_parts
from app.errors import InvalidMatrix, InvalidParameter, MalformedPayload
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


def test_a_preamble_and_an_epilogue_are_ignored() -> None:
    """RFC 2046: text before the first delimiter and after the closing one is not part of the body's parts."""
    body = (
        b"This is a preamble; --xx is not a delimiter here.\r\n"
        + multipart_body([("a", b"A"), ("b", b"B")])
        + b"an epilogue\r\n"
    )
    parts = parse_file_parts(body, MULTIPART_CONTENT_TYPE)
    assert {name: bytes(data) for name, data in parts.items()} == {"a": b"A", "b": b"B"}


def test_a_body_without_a_delimiter_says_so() -> None:
    with pytest.raises(MalformedPayload, match="has no delimiter '--xx'"):
        parse_file_parts(b"just some text\r\n", MULTIPART_CONTENT_TYPE)


@pytest.mark.parametrize(("length", "refused"), [(70, False), (71, True), (257, True)])
def test_a_boundary_is_at_most_70_characters(length: int, refused: bool) -> None:
    boundary = "b" * length
    body = multipart_body([("a", b"A")], boundary=boundary)
    if refused:
        with pytest.raises(MalformedPayload, match=f"boundary is {length} characters; RFC 2046 allows 1 to 70"):
            parse_file_parts(body, f"multipart/form-data; boundary={boundary}")
    else:
        assert bytes(parse_file_parts(body, f"multipart/form-data; boundary={boundary}")["a"]) == b"A"


def test_a_parameter_sent_as_a_text_field_is_pointed_to_the_query_string() -> None:
    with pytest.raises(InvalidParameter, match=r"parameters belong in the query string \(POST /matmul\?kernel=numpy\)"):
        parse_file_parts(multipart_body([("kernel", b"numpy", False)]), MULTIPART_CONTENT_TYPE)


def test_a_matrix_sent_as_a_text_field_is_pointed_to_a_file_part() -> None:
    with pytest.raises(InvalidMatrix, match=r"send each matrix as a \.npy file \(curl -F a=@a\.npy\)"):
        parse_file_parts(multipart_body([("a", b"1,2", False)]), MULTIPART_CONTENT_TYPE)
