"""The .npy reader's refusals by their whole message (what a client reads: which matrix, what was wrong, where in
the header, which limit) and location, and the header grammar at its edges."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.codecs.npy import NPY_MAX_HEADER, _fields_as_numpy_writes, _NpyHeaderText, decode_npy, encode_npy
from app.codecs.operands import Limits
from app.errors import MatmulError
from matmul_client.wire import npy_parts
from matmul_tools.bodies import npy_bytes

LIMITS = Limits(max_dim=8, max_elements=40, max_result_elements=64)
EXAMPLE = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"


def npy_with_header(text: str, data: bytes = bytes(24), version: bytes = b"\x01\x00") -> bytes:
    width = 2 if version == b"\x01\x00" else 4
    return b"\x93NUMPY" + version + len(text.encode()).to_bytes(width, "little") + text.encode() + data


def refusal(body: bytes, name: str = "b") -> tuple[str, str, list[str | int] | None]:
    with pytest.raises(MatmulError) as caught:
        decode_npy(body, name, LIMITS)
    return caught.value.code, caught.value.message, caught.value.location


def header_refusal(what: str, at: int, near: str) -> tuple[str, str, list[str]]:
    return (
        "malformed_payload",
        f"'b' is not a valid .npy file: its header has {what} at character {at} ({near!r}); NumPy writes {EXAMPLE}",
        ["b"],
    )


@pytest.mark.parametrize(
    ("text", "data"),
    [
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", bytes(24)),
        ("{'shape': (2, 3), 'fortran_order': True, 'descr': '>f8'}", bytes(48)),
        ('{"descr": "<i2", "fortran_order": False, "shape": (2, 3,)}  \t\r\n', bytes(12)),
        ("{'descr':'|u1','fortran_order':False,'shape':(2,3)}", bytes(6)),
    ],
)
def test_headers_numpy_writes_or_could(text: str, data: bytes) -> None:
    assert decode_npy(npy_with_header(text, data), "b", LIMITS).shape == (2, 3)


def test_fortran_order_is_read() -> None:
    array = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    decoded = decode_npy(npy_bytes(array), "a", LIMITS)
    np.testing.assert_array_equal(decoded, array)
    assert decoded.flags.f_contiguous and not decoded.flags.c_contiguous
    c_ordered = decode_npy(npy_bytes(np.ascontiguousarray(array)), "a", LIMITS)
    assert c_ordered.flags.c_contiguous and not c_ordered.flags.f_contiguous


@pytest.mark.parametrize(
    ("text", "what", "at"),
    [
        ("[", "no '{'", 0),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", "a one-dimensional shape without its comma", 52),
        ("{'descr': '<f4' 'shape': (2, 3)}", "no ',' or '}' after a value", 17),
        (
            "{'descr': '<f4', 'fortran_order': False}",
            "the keys ['descr', 'fortran_order'], not ['descr', 'fortran_order', 'shape']",
            39,
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}",
            "the key 'x', not one of ['descr', 'fortran_order', 'shape'] once each",
            59,
        ),
        ("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3)}", "'0' as its 'fortran_order'", 34),
        ("{'descr': 1, 'fortran_order': False, 'shape': (2, 3)}", "'1' as its 'descr'", 10),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}", "no ',' or ')' after a dimension", 53),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} x", "text after the closing '}'", 57),
        ("{'descr' '<f4'}", "no ':'", 10),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}\x0c", "text after the closing '}'", 57),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} X", "text after the closing '}'", 57),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3)}", "something NumPy does not write", 51),
    ],
)
def test_header_refusals_name_what_and_where(text: str, what: str, at: int) -> None:
    """The message quotes the header from the character named, 24 characters at most."""
    assert refusal(npy_with_header(text)) == header_refusal(what, at, text[at : at + 24])


def test_a_structured_dtype_is_refused_by_name() -> None:
    text = "{'descr': [('x', '<f4')], 'fortran_order': False, 'shape': (2, 3)}"
    assert refusal(npy_with_header(text)) == (
        "invalid_matrix",
        "matrix 'b' has a structured dtype (a list of fields); supported are float16, float32, float64 and integers",
        ["b"],
    )


@pytest.mark.parametrize("descr", ["<f4x", "<q9", "O!", "<f3"])
def test_a_descr_that_is_not_a_dtype(descr: str) -> None:
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': (2, 3)}}"
    assert refusal(npy_with_header(text)) == (
        "malformed_payload",
        f"'b' is not a valid .npy file: its descr {descr!r} is not a dtype",
        ["b"],
    )


@pytest.mark.parametrize(
    ("shape", "dims"),
    [("(2,)", "1-D with shape [2]"), ("(1, 2, 3, 4)", "4-D with shape [1, 2, 3, 4]"), ("()", "0-D with shape []")],
)
def test_a_shape_that_is_neither_a_matrix_nor_a_stack(shape: str, dims: str) -> None:
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}}}"
    assert refusal(npy_with_header(text)) == (
        "invalid_matrix",
        f"matrix 'b' must be 2-D (a matrix) or 3-D (a stack of matrices, one leading batch dimension), got {dims}",
        ["b"],
    )


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"", "it does not begin with the .npy magic \\x93NUMPY"),
        (b"\x93NUMPY\x01", "it does not begin with the .npy magic \\x93NUMPY"),
        (b"\x93NUMPY\x01\x00", "it ends inside its 0-byte header (truncated)"),
        (b"\x93NUMPX\x01\x00\x00\x00", "it does not begin with the .npy magic \\x93NUMPY"),
        (b"\x93NUMPY\x02\x01\x00\x00", "format version 2.1; NumPy writes 1.0, 2.0 and 3.0"),
        (b"\x93NUMPY\x01\x00\x0a\x00{'descr'", "it ends inside its 10-byte header (truncated)"),
        (
            b"\x93NUMPY\x02\x00" + (NPY_MAX_HEADER + 1).to_bytes(4, "little"),
            f"its header is {NPY_MAX_HEADER + 1} bytes, over the {NPY_MAX_HEADER} NumPy reads",
        ),
    ],
)
def test_framing_refusals(body: bytes, problem: str) -> None:
    assert refusal(body) == ("malformed_payload", f"'b' is not a valid .npy file: {problem}", ["b"])


def test_a_header_of_exactly_the_largest_size_numpy_reads_is_read() -> None:
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}"
    text += " " * (NPY_MAX_HEADER - len(text))
    assert decode_npy(npy_with_header(text, version=b"\x02\x00"), "b", LIMITS).shape == (2, 3)


def test_a_version_3_header_must_be_utf8() -> None:
    body = npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", version=b"\x03\x00")
    body = body.replace(b"'<f4'", b"'\xff<f4'")
    code, message, location = refusal(body)
    assert (code, location) == ("malformed_payload", ["b"])
    assert message == "'b' is not a valid .npy file: its version 3.0 header is not UTF-8: invalid start byte"


@pytest.mark.parametrize(
    ("extra", "present", "tail"), [(-1, 23, " (truncated)"), (1, 25, ""), (-24, 0, " (truncated)")]
)
def test_data_of_the_wrong_size_names_both_sizes(extra: int, present: int, tail: str) -> None:
    body = npy_bytes(np.ones((2, 3), np.float32))
    body = body[:extra] if extra < 0 else body + bytes(extra)
    assert refusal(body) == (
        "malformed_payload",
        f"'b' is a 2x3 float32 .npy whose data should be 24 bytes, but {present} bytes follow the header{tail}",
        ["b"],
    )


@pytest.mark.parametrize("starts_at", [0, 1, 63, 98, 131])
def test_the_data_of_an_npy_file_in_a_body_begins_on_a_multiple_of_64_of_the_body(starts_at: int) -> None:
    """Padded as NumPy pads, with spaces before the newline: NumPy and the service read it."""
    array = np.arange(6, dtype=">f4").reshape(3, 2)
    head, data = npy_parts(array, starts_at=starts_at)
    assert (starts_at + len(head)) % 64 == 0 and head.endswith(b"\n")
    saved = io.BytesIO()
    np.save(saved, np.ascontiguousarray(array))
    assert head[10:].rstrip() == saved.getvalue()[10 : len(saved.getvalue()) - len(bytes(data))].rstrip()  # np.save's
    np.testing.assert_array_equal(np.load(io.BytesIO(head + bytes(data)), allow_pickle=False), array)
    np.testing.assert_array_equal(decode_npy(head + bytes(data), "a", LIMITS), array)


def test_encoding_writes_a_c_ordered_npy_numpy_reads() -> None:
    array = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    head, data = npy_parts(array)
    assert b"'fortran_order': False" in head and bytes(data) == np.ascontiguousarray(array).tobytes()
    np.testing.assert_array_equal(decode_npy(encode_npy(array), "c", LIMITS), array)
    empty_head, empty = npy_parts(np.zeros((0, 3), np.float32))
    assert bytes(empty) == b"" and b"(0, 3)" in empty_head


def _numpy_header_text(descr: str, fortran_order: bool, shape: tuple[int, ...], padding: int) -> str:
    """A header as numpy.lib.format writes it: the keys sorted, each value's repr, a trailing ', ', spaces and a
    newline."""
    fields = {"descr": descr, "fortran_order": fortran_order, "shape": shape}
    return "{" + "".join(f"'{key}': {value!r}, " for key, value in fields.items()) + "}" + " " * padding + "\n"


def _read_by_grammar(text: str) -> dict[str, object] | None:
    try:
        return _NpyHeaderText(text, "a").parse()
    except MatmulError:
        return None


header_fields = st.tuples(
    st.sampled_from(["<f4", ">f8", "|u1", "<i8", "<f2", "|b1", "<M8[us]", "x", ""]),
    st.booleans(),
    st.lists(st.integers(0, 10**20 - 1), max_size=4).map(tuple),
    st.integers(0, 70),
)


@given(header_fields)
def test_a_header_as_numpy_writes_it_is_read_as_the_grammar_reads_it(
    fields: tuple[str, bool, tuple[int, ...], int],
) -> None:
    text = _numpy_header_text(*fields)
    assert _fields_as_numpy_writes(text) == _NpyHeaderText(text, "a").parse()


@given(header_fields, st.data())
def test_any_other_header_is_left_to_the_grammar(
    fields: tuple[str, bool, tuple[int, ...], int], data: st.DataObject
) -> None:
    """A header changed in one place: where the quick reading takes it, the grammar reads the same fields from it."""
    text = _numpy_header_text(*fields)
    at = data.draw(st.integers(0, len(text)))
    changed = (
        text[:at] + data.draw(st.sampled_from(["", " ", ",", "(", ")", "'", '"', "-", "1", "\t", "}"])) + text[at + 1 :]
    )
    quick = _fields_as_numpy_writes(changed)
    assert quick is None or quick == _read_by_grammar(changed)


@pytest.mark.parametrize(
    "text",
    [
        "{'shape': (2, 3), 'fortran_order': True, 'descr': '>f8'}",
        '{"descr": "<i2", "fortran_order": False, "shape": (2, 3,)}  \t\r\n',
        "{'descr':'|u1','fortran_order':False,'shape':(2,3)}",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3,), }",
    ],
)
def test_headers_numpy_does_not_write_are_read_by_the_grammar_alone(text: str) -> None:
    assert _fields_as_numpy_writes(text) is None
