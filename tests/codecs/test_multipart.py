"""The in-memory multipart parser: parts are views of the body, not copies, and stay exact where the parser
had to hold bytes back (data that begins like the boundary); its refusals by their whole message and location."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from app.codecs import multipart
from app.codecs.multipart import decode_by_length, decode_multipart, parse_file_parts
from app.codecs.npy import decode_parts
from app.codecs.operands import Limits, Operands, RequestOptions, check_dtype
from app.errors import InvalidMatrix, InvalidParameter, MalformedPayload, MatmulError
from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, multipart_body, npy_bytes

LIMITS = Limits(max_dim=8, max_elements=40, max_result_elements=64)


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


def _refusal(body: bytes, content_type: str = MULTIPART_CONTENT_TYPE) -> tuple[str, str, list[str | int] | None]:
    """What parse_file_parts refuses `body` with: the error's code, its whole message, and its location."""
    with pytest.raises((MalformedPayload, InvalidMatrix, InvalidParameter)) as caught:
        parse_file_parts(body, content_type)
    return caught.value.code, caught.value.message, caught.value.location


def test_eight_parts_are_read_and_a_ninth_is_refused() -> None:
    """MAX_PARTS is 8: a body of exactly 8 parts parses; one of 9 is refused before its ninth part is kept."""
    eight = [(f"p{i}", bytes([i])) for i in range(8)]
    parts = parse_file_parts(multipart_body(eight), MULTIPART_CONTENT_TYPE)
    assert {name: bytes(data) for name, data in parts.items()} == dict(eight)
    assert _refusal(multipart_body([*eight, ("p8", b"9")])) == (
        "malformed_payload",
        "the multipart body has more than 8 parts",
        None,
    )


@pytest.mark.parametrize("content_type", ["multipart/form-data", "multipart/form-data; boundary="])
def test_a_content_type_without_a_boundary_says_so(content_type: str) -> None:
    assert _refusal(multipart_body([("a", b"A")]), content_type) == (
        "malformed_payload",
        "the multipart body cannot be parsed: its Content-Type has no boundary",
        None,
    )


def test_an_empty_body_asks_for_the_two_file_parts() -> None:
    assert _refusal(b"") == (
        "malformed_payload",
        "the multipart body is empty; send the .npy file parts 'a' and 'b'",
        None,
    )


def test_a_body_without_a_delimiter_names_the_delimiter_it_looked_for() -> None:
    assert _refusal(b"-xx\r\n-xx--") == (
        "malformed_payload",
        "the multipart body has no delimiter '--xx' (its Content-Type's boundary)",
        None,
    )


def test_a_body_that_does_not_parse_says_why() -> None:
    code, message, location = _refusal(b"--xx\r\nno colon in this header line\r\n\r\nA\r\n--xx--\r\n")
    assert (code, location) == ("malformed_payload", None)
    assert message.startswith("the multipart body cannot be parsed: ")


def test_a_part_must_be_form_data_with_a_name() -> None:
    for head in (b'Content-Disposition: attachment; name="a"', b"Content-Disposition: form-data", b"X: y"):
        body = b"--xx\r\n" + head + b"\r\n\r\nA\r\n--xx--\r\n"
        assert _refusal(body) == (
            "malformed_payload",
            "a multipart part has no Content-Disposition: form-data; name=...",
            None,
        )


def test_a_part_sent_twice_is_named() -> None:
    assert _refusal(multipart_body([("a", b"A"), ("b", b"B"), ("a", b"C")])) == (
        "invalid_matrix",
        "part 'a' is sent twice",
        ["a"],
    )


def test_a_text_field_is_named_with_its_value_in_the_query_string_it_belongs_in() -> None:
    assert _refusal(multipart_body([("tile", b"1" * 70, False)])) == (
        "invalid_parameter",
        f"part 'tile' is a text field; parameters belong in the query string (POST /matmul?tile={'1' * 64}) "
        "and the body holds only the .npy file parts 'a' and 'b'",
        ["tile"],
    )
    assert _refusal(multipart_body([("b", b"1,2", False)])) == (
        "invalid_matrix",
        "part 'b' is a text field; send each matrix as a .npy file (curl -F b=@b.npy)",
        ["b"],
    )


def test_a_part_may_have_other_headers_before_its_content_disposition() -> None:
    body = (
        b"--xx\r\nContent-Type: application/octet-stream\r\n"
        b'Content-Disposition: form-data; name="a"; filename="a.npy"\r\n\r\nA\r\n--xx--\r\n'
    )
    assert bytes(parse_file_parts(body, MULTIPART_CONTENT_TYPE)["a"]) == b"A"


def test_a_line_break_before_the_first_delimiter_is_an_empty_preamble() -> None:
    parts = parse_file_parts(b"\r\n" + multipart_body([("a", b"A")]), MULTIPART_CONTENT_TYPE)
    assert bytes(parts["a"]) == b"A"


def test_missing_matrices_are_named_as_parts_of_the_multipart_body() -> None:
    with pytest.raises(InvalidMatrix) as caught:
        decode_multipart(multipart_body([("a", npy_bytes(np.eye(2)))]), MULTIPART_CONTENT_TYPE, LIMITS)
    assert caught.value.message == "the multipart body must hold exactly 'a' and 'b': missing ['b']"
    assert caught.value.location == ["b"]


def test_the_pickled_objects_dtype_is_named_as_such() -> None:
    with pytest.raises(InvalidMatrix) as caught:
        check_dtype(np.dtype(object), "a")
    assert caught.value.message == (
        "matrix 'a' has dtype pickled Python objects; supported are float16, float32, float64 and integers "
        "(converted to the requested float dtype)"
    )
    assert caught.value.location == ["a"]


def test_options_given_twice_name_the_option() -> None:
    with pytest.raises(InvalidParameter) as caught:
        RequestOptions(dtype="float32").merged_with(RequestOptions(dtype="float64"))
    assert caught.value.message == "'dtype' is given twice with different values: 'float32' and 'float64'"
    assert caught.value.location == ["dtype"]


# ------------------------------------------------------------------- .npy parts read by their headers' lengths


@pytest.fixture
def searched(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bodies that went to python-multipart (the search), recorded: the rest were read by length."""
    bodies: list[bytes] = []

    def recording(body: bytes, content_type: str) -> dict[str, bytes | memoryview]:
        bodies.append(body)
        return parse_file_parts(body, content_type)

    monkeypatch.setattr(multipart, "parse_file_parts", recording)
    return bodies


def npy_pair(boundary: str = "0123456789abcdef0123456789abcdef") -> tuple[bytes, str, np.ndarray, np.ndarray]:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.asfortranarray(np.arange(8.0).reshape(4, 2))
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))], boundary=boundary)
    return body, f"multipart/form-data; boundary={boundary}", a, b


def _in_memory(body: bytes) -> memoryview:
    """A body as read into memory lent by the engine: a memoryview of an array's bytes."""
    memory = np.frombuffer(bytearray(body), np.uint8)
    return memory.data


# a large body comes in a bytearray, or in the engine's shared memory (a memoryview of it)
@pytest.mark.parametrize("kind", [bytes, bytearray, _in_memory], ids=["bytes", "bytearray", "lent memory"])
def test_npy_parts_are_read_by_length_as_views_of_the_body(
    searched: list[bytes], kind: Callable[[bytes], bytes | bytearray | memoryview]
) -> None:
    body, content_type, a, b = npy_pair()
    read = kind(body + b"an epilogue")
    operands = decode_multipart(read, content_type, LIMITS)
    by_length = decode_by_length(read, content_type, LIMITS)
    assert searched == [] and by_length is not None and np.shares_memory(by_length.a, operands.a)
    np.testing.assert_array_equal(operands.a, a)
    np.testing.assert_array_equal(operands.b, b)
    assert operands.a.base is not None and not operands.a.flags.owndata
    assert np.shares_memory(operands.b, np.frombuffer(read, np.uint8))


def test_a_body_in_lent_memory_that_must_be_searched_is_parsed_from_a_copy(searched: list[bytes]) -> None:
    """A preamble: python-multipart parses the body, as bytes; the operands are correct all the same."""
    body, content_type, a, b = npy_pair()
    operands = decode_multipart(_in_memory(b"a preamble\r\n" + body), content_type, LIMITS)
    assert len(searched) == 1 and isinstance(searched[0], bytes)
    np.testing.assert_array_equal(operands.a, a)
    np.testing.assert_array_equal(operands.b, b)


def test_a_boundary_inside_npy_data_does_not_cut_the_part(searched: list[bytes]) -> None:
    """RFC 2046 forbids it; a search would end the part there, the length its header declares does not."""
    boundary = "xx"
    a = np.frombuffer(b"\r\n--xx" + bytes(6), np.float32).reshape(3, 1)
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(np.ones((1, 2), np.float32)))], boundary=boundary)
    operands = decode_multipart(body, f"multipart/form-data; boundary={boundary}", LIMITS)
    assert searched == [] and operands.a.tobytes() == a.tobytes()


def _spliced(body: bytes, old: bytes, new: bytes) -> bytes:
    assert body.count(old) == 1
    return body.replace(old, new)


def _longer_a(body: bytes) -> bytes:
    end_of_a = body.index(b"\r\n--0123", 10)
    return body[:end_of_a] + b"\x00" + body[end_of_a:]


def _outcome(decode: Callable[[], Operands]) -> tuple[object, ...]:
    try:
        operands = decode()
    except MatmulError as error:
        return type(error), error.message
    return operands.a.tobytes(), operands.b.tobytes()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda body: b"a preamble\r\n" + body, id="preamble"),
        pytest.param(lambda body: _spliced(body, b'name="a"; filename="a.npy"', b'name="a"'), id="text-field"),
        pytest.param(
            lambda body: _spliced(body, b'filename="b.npy"\r\n', b'filename="b.npy"\r\n x: y\r\n'), id="folded"
        ),
        pytest.param(lambda body: _spliced(body, b'form-data; name="b"', b"form-data"), id="no-name"),
        pytest.param(
            lambda body: _spliced(body, b'filename="b.npy"\r\n', b'filename="b.npy"\r\nno colon\r\n'), id="colonless"
        ),
        pytest.param(lambda body: _spliced(body, b'form-data; name="b"', b'attachment; name="b"'), id="attachment"),
        pytest.param(
            lambda body: _spliced(body, b'filename="b.npy"\r\n', b'filename="b.npy"\r\nX: ' + b"x" * 5000 + b"\r\n"),
            id="long-head",
        ),
        pytest.param(_longer_a, id="data-longer-than-declared"),
        pytest.param(lambda body: _spliced(body, b'name="b"', b'name="a"'), id="a-twice"),
        pytest.param(lambda body: body[: body.rindex(b"--0123")] + b"--0123", id="no-closing"),
    ],
)
def test_any_other_body_goes_to_the_search_and_gets_its_answer(
    searched: list[bytes], change: Callable[[bytes], bytes]
) -> None:
    body, content_type, _, _ = npy_pair()
    changed = change(body)
    expected = _outcome(lambda: decode_parts(parse_file_parts(changed, content_type), LIMITS, "multipart body"))
    assert decode_by_length(changed, content_type, LIMITS) is None
    assert _outcome(lambda: decode_multipart(changed, content_type, LIMITS)) == expected
    assert searched == [changed]


def test_a_part_over_the_limits_goes_to_the_search_which_names_it(searched: list[bytes]) -> None:
    big = npy_bytes(np.ones((9, 1), np.float32))  # max_dim is 8
    body = multipart_body([("a", big), ("b", npy_bytes(np.ones((1, 1), np.float32)))], boundary="b0b")
    with pytest.raises(MatmulError, match="dimension 0 of 'a' is 9"):
        decode_multipart(body, "multipart/form-data; boundary=b0b", LIMITS)
    assert searched == [body]


@pytest.mark.parametrize("length", [1, 70])
def test_boundaries_of_1_to_70_characters_are_read_by_length(searched: list[bytes], length: int) -> None:
    body, content_type, a, _ = npy_pair(boundary="q" * length)
    np.testing.assert_array_equal(decode_multipart(body, content_type, LIMITS).a, a)
    assert searched == []


@pytest.mark.parametrize("boundary", ["", "q" * 71])
def test_an_empty_or_too_long_boundary_is_refused_even_where_the_parts_would_read(boundary: str) -> None:
    body, _, _, _ = npy_pair(boundary=boundary)
    with pytest.raises(MalformedPayload, match="boundary"):
        decode_multipart(body, f"multipart/form-data; boundary={boundary}", LIMITS)


def test_a_content_type_without_a_boundary_is_refused_whatever_the_body(searched: list[bytes]) -> None:
    body, _, _, _ = npy_pair(boundary="XXXX")
    with pytest.raises(MalformedPayload, match="has no boundary"):
        decode_multipart(body, "multipart/form-data", LIMITS)


def test_part_headers_in_any_order_with_colons_in_values_are_read_by_length(searched: list[bytes]) -> None:
    body, content_type, _, b = npy_pair()
    body = _spliced(
        body,
        b'Content-Disposition: form-data; name="b"; filename="b.npy"',
        b'Content-Type: application/x-npy\r\nContent-Disposition: form-data; name="b"; filename="c:b.npy"',
    )
    np.testing.assert_array_equal(decode_multipart(body, content_type, LIMITS).b, b)
    assert searched == []


def test_nine_npy_parts_are_refused_as_more_than_eight() -> None:
    one = npy_bytes(np.ones((1, 1), np.float32))
    body = multipart_body([(f"p{i}", one) for i in range(9)], boundary="b0b")
    with pytest.raises(MalformedPayload, match="more than 8 parts"):
        decode_multipart(body, "multipart/form-data; boundary=b0b", LIMITS)
