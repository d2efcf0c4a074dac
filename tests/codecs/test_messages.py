"""The JSON and .npz decoders' and the codecs' front door's refusals by their whole message (what a client reads:
which matrix, which key, which type, which limit) and location; and the JSON envelope."""

from __future__ import annotations

import io
import logging
import zipfile

import numpy as np
import orjson
import pytest

from app import codecs
from app.codecs.json import decode_json, encode_json_envelope, encode_json_matrix
from app.codecs.npy import NPY_MAX_HEADER
from app.codecs.npz import decode_npz
from app.codecs.operands import Limits
from app.errors import MatmulError
from matmul_tools.bodies import npy_bytes, npz_bytes, zip_members

LIMITS = Limits(max_dim=8, max_elements=40, max_result_elements=64)


def refusal(call: object, *args: object) -> tuple[str, str, list[str | int] | None]:
    with pytest.raises(MatmulError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value.code, caught.value.message, caught.value.location


def json_refusal(**doc: object) -> tuple[str, str, list[str | int] | None]:
    return refusal(decode_json, orjson.dumps(doc), LIMITS)


# ------------------------------------------------------------------------------------------------------ JSON


def test_json_body_refusals() -> None:
    assert refusal(decode_json, b"", LIMITS) == (
        "malformed_payload",
        "the request body is empty; send a JSON object with matrices 'a' and 'b'",
        None,
    )
    assert refusal(decode_json, b"[1]", LIMITS) == (
        "malformed_payload",
        "the JSON body must be an object with keys 'a' and 'b', got a list",
        None,
    )
    assert json_refusal(a=[[1]], b=[[1]], z=1, c=2) == (
        "invalid_parameter",
        "unknown keys in the JSON body: ['c', 'z']; allowed are ['a', 'b', 'kernel', 'tile', 'dtype', 'precision']",
        ["c"],
    )
    code, message, _ = refusal(decode_json, b"{", LIMITS)
    assert code == "malformed_payload" and message.startswith("the body is not valid JSON: ")


@pytest.mark.parametrize(
    ("value", "said"), [(None, "null"), (True, "a boolean"), ("x", "a string"), ({}, "an object"), (1.5, "a number")]
)
def test_json_types_are_named(value: object, said: str) -> None:
    assert json_refusal(a=value, b=[[1]]) == (
        "invalid_matrix",
        f"'a' must be a non-empty list of rows (a 2-D array of numbers, or a 3-D stack of them), got {said}",
        ["a"],
    )
    if value is not None and not isinstance(value, str):
        assert json_refusal(a=[[1]], b=[[1]], kernel=value) == (
            "invalid_parameter",
            f"'kernel' must be a string, got {said}",
            ["kernel"],
        )


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            {"a": [], "b": [[1]]},
            (
                "invalid_matrix",
                "'a' must be a non-empty list of rows (a 2-D array of numbers, or a 3-D stack of them), got a list "
                "with no rows",
                ["a"],
            ),
        ),
        ({"b": [[1]]}, ("invalid_matrix", "the JSON body has no matrix 'a'", ["a"])),
        ({"a": [[1]]}, ("invalid_matrix", "the JSON body has no matrix 'b'", ["b"])),
        (
            {"a": [[1], 2], "b": [[1]]},
            ("invalid_matrix", "a[1] is a number; 'a' must be a list of rows, each a list of numbers", ["a", 1]),
        ),
        (
            {"a": [[1, 2], [3, 4], [5]], "b": [[1]]},
            ("invalid_matrix", "'a' is ragged: row 2 has 1 elements but row 0 has 2", ["a", 2]),
        ),
        (
            {"a": [[1]], "b": [[1, 2], [3, "x"]]},
            ("invalid_matrix", "b[1][1] is a string, expected a number", ["b", 1, 1]),
        ),
        (
            {"a": [[1, 2], [3, False]], "b": [[1]]},
            ("invalid_matrix", "a[1][1] is a boolean, expected a number", ["a", 1, 1]),
        ),
        (
            {"a": [[1]], "b": [[1]], "dtype": 64},
            ("invalid_parameter", "'dtype' must be a string, got a number", ["dtype"]),
        ),
        (
            {"a": [[1]], "b": [[1]], "tile": 8.0},
            ("invalid_parameter", "'tile' must be an integer, got a number", ["tile"]),
        ),
        (
            {"a": [[1]], "b": [[1]], "tile": False},
            ("invalid_parameter", "'tile' must be an integer, got a boolean", ["tile"]),
        ),
        ({"a": [[0] * 9], "b": [[1]]}, ("shape_mismatch", "dimension 1 of 'a' is 9, over the limit of 8", ["a"])),
        (
            {"a": [[0] * 6] * 7, "b": [[1]]},
            ("shape_mismatch", "matrix 'a' has 42 elements, over the limit of 40", ["a"]),
        ),
        ({"a": [[1]], "b": [[1e308, 1]]}, None),
    ],
)
def test_json_matrix_refusals(doc: dict[str, object], expected: tuple[str, str, list[str | int]] | None) -> None:
    if expected is None:
        assert decode_json(orjson.dumps(doc), LIMITS).b.tolist() == [[1e308, 1]]
    else:
        assert json_refusal(**doc) == expected


def test_a_json_operand_of_four_dimensions_is_refused_for_its_dimensions_with_a_boolean_elsewhere_too() -> None:
    for kernel in ("auto", "true"):  # with 'true' in the body every element is looked at first
        assert json_refusal(a=[[[[1]]]], b=[[1]], kernel=kernel) == (
            "invalid_matrix",
            "matrix 'a' must be 2-D (a matrix) or 3-D (a stack of matrices, one leading batch dimension), got 4-D "
            "with shape [1, 1, 1, 1]",
            ["a"],
        )


def test_json_options_are_kept() -> None:
    options = decode_json(orjson.dumps({"a": [[1]], "b": [[2]], "kernel": "k", "tile": 4, "dtype": "float64"}), LIMITS)
    assert (options.options.kernel, options.options.tile, options.options.dtype, options.typed) == (
        "k",
        4,
        "float64",
        False,
    )


def test_json_envelope_with_and_without_fields() -> None:
    matrix = encode_json_matrix(np.arange(4, dtype=">f8").reshape(2, 2).T)
    assert orjson.loads(matrix) == [[0.0, 2.0], [1.0, 3.0]]
    assert orjson.loads(encode_json_envelope(matrix, {"kernel": "numpy", "n": 2})) == {
        "result": [[0.0, 2.0], [1.0, 3.0]],
        "kernel": "numpy",
        "n": 2,
    }
    assert orjson.loads(encode_json_envelope(matrix, {})) == {"result": [[0.0, 2.0], [1.0, 3.0]]}


def test_json_writes_nan_and_infinity_as_null() -> None:
    assert orjson.loads(encode_json_matrix(np.array([[np.nan, np.inf]], np.float32))) == [[None, None]]


# ------------------------------------------------------------------------------------------------------ .npz


def test_npz_refusals() -> None:
    assert refusal(decode_npz, npz_bytes(b=np.eye(2)), LIMITS, 1 << 20) == (
        "invalid_matrix",
        "the .npz archive must hold exactly 'a' and 'b': missing ['a']",
        ["a"],
    )
    assert refusal(decode_npz, npz_bytes(c=np.eye(2)), LIMITS, 1 << 20) == (
        "invalid_matrix",
        "the .npz archive must hold exactly 'a' and 'b': missing ['a', 'b'], unexpected ['c']",
        ["a"],
    )
    assert refusal(decode_npz, npz_bytes(a=np.eye(2), b=np.eye(2), d=np.eye(2), c=np.eye(2)), LIMITS, 1 << 20) == (
        "invalid_matrix",
        "the .npz archive must hold exactly 'a' and 'b': unexpected ['c', 'd']",
        ["c"],
    )
    code, message, location = refusal(decode_npz, b"not a zip", LIMITS, 1 << 20)
    assert (code, message, location) == (
        "malformed_payload",
        "the body is not a valid .npz archive: File is not a zip file",
        None,
    )


def test_npz_member_sizes() -> None:
    a = npy_bytes(np.ones((2, 3), np.float32))
    b = npy_bytes(np.ones((3, 2), np.float32))
    assert refusal(decode_npz, zip_members(a=a + b"x", b=b), LIMITS, 1 << 20) == (
        "malformed_payload",
        "'a' is a 2x3 float32 .npy whose data should be 24 bytes, but 25 bytes follow the header",
        ["a"],
    )
    assert refusal(decode_npz, zip_members(compressed=True, a=a, b=b[:-1]), LIMITS, 1 << 20) == (
        "malformed_payload",
        "'b' is a 3x2 float32 .npy whose data should be 24 bytes, but 23 bytes follow the header (truncated)",
        ["b"],
    )
    assert refusal(decode_npz, zip_members(a=a, b=b), LIMITS, len(b) - 1) == (
        "invalid_matrix",
        f"member 'a.npy' of the .npz unpacks to {len(a)} bytes, over the limit of {len(b) - 1}",
        ["a"],
    )
    ops = decode_npz(zip_members(a=a, b=b), LIMITS, len(a))
    assert ops.a.shape == (2, 3) and ops.b.shape == (3, 2)


# ------------------------------------------------------------------------------------------------ front door


@pytest.mark.parametrize(
    ("content_type", "said"),
    [("text/plain; charset=utf-8", "'text/plain'"), ("", "'(none)'"), ("application/x-npy", "'application/x-npy'")],
)
def test_an_undecodable_media_type_names_what_is_read(content_type: str, said: str) -> None:
    assert refusal(codecs.decodable_media_type, content_type) == (
        "unsupported_media_type",
        f"Content-Type {said} is not supported; send application/json, multipart/form-data with .npy parts 'a' "
        "and 'b', or application/x-npz",
        None,
    )


def test_media_types_are_read_case_blind_without_parameters() -> None:
    assert codecs.decodable_media_type(" Application/JSON ; charset=utf-8") == "application/json"
    assert codecs.decodable_media_type("multipart/form-data; boundary=x") == "multipart/form-data"


def test_decode_dispatches_on_the_media_type() -> None:
    body = orjson.dumps({"a": [[1]], "b": [[2]]})
    assert codecs.decode("application/json", body, LIMITS, 1 << 20).b.tolist() == [[2]]
    npz = npz_bytes(a=np.eye(2), b=np.eye(2))
    assert codecs.decode("application/x-npz", npz, LIMITS, 1 << 20).a.shape == (2, 2)


def boom(*args: object) -> None:
    raise KeyError("x" * 300)


def silent(*args: object) -> None:
    raise ValueError


@pytest.mark.parametrize(
    ("media_type", "target", "what"),
    [
        ("application/json", "app.codecs.json.decode_json", "JSON body"),
        ("application/x-npz", "app.codecs.npz.decode_npz", ".npz archive"),
        ("multipart/form-data; boundary=x", "app.codecs.multipart.decode_multipart", "multipart body"),
    ],
)
def test_a_decoders_unforeseen_failure_is_the_clients_malformed_body(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, media_type: str, target: str, what: str
) -> None:
    monkeypatch.setattr(target, boom)
    with caplog.at_level(logging.WARNING, logger="app.codecs"):
        assert refusal(codecs.decode, media_type, b"{}", LIMITS, 1) == (
            "malformed_payload",
            f"the {what} cannot be decoded: {repr('x' * 300)[:200]}",
            None,
        )
    [record] = [r for r in caplog.records if r.name == "app.codecs"]
    assert record.getMessage() == f"the {what} raised KeyError in boom"
    assert record.exc_info is not None and record.exc_info[0] is KeyError


def test_an_unforeseen_failure_without_a_message_is_named_by_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.codecs.inference_v2.decode_infer", silent)
    assert refusal(codecs.decode_infer, b"{}", None, LIMITS) == (
        "malformed_payload",
        "the inference request cannot be decoded: ValueError",
        None,
    )


def test_an_npz_member_with_a_header_of_the_largest_size_numpy_reads() -> None:
    """The member's first NPY_MAX_HEADER + 16 bytes are read for its header: a version 2.0 header of exactly
    NPY_MAX_HEADER bytes is whole in them."""
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}"
    text += " " * (NPY_MAX_HEADER - len(text))
    a = b"\x93NUMPY\x02\x00" + len(text).to_bytes(4, "little") + text.encode() + np.arange(6, dtype="<f4").tobytes()
    ops = decode_npz(zip_members(compressed=True, a=a, b=npy_bytes(np.ones((3, 2), np.float32))), LIMITS, 1 << 20)
    np.testing.assert_array_equal(ops.a, np.arange(6).reshape(2, 3))


def test_an_npz_member_shorter_than_its_declared_size_names_the_bytes_that_came() -> None:
    """The directory says 4 bytes more than the member holds (and than its header needs): the data read is short."""
    a = npy_bytes(np.ones((2, 3), np.float32))[:-4]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a.npy", a)
        archive.writestr("b.npy", npy_bytes(np.ones((3, 2), np.float32)))
        archive.filelist[0].file_size = len(a) + 4
    assert refusal(decode_npz, buffer.getvalue(), LIMITS, 1 << 20) == (
        "malformed_payload",
        "'a' is a 2x3 float32 .npy whose data should be 24 bytes, but 20 bytes follow the header (truncated)",
        ["a"],
    )
