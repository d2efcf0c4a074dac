"""Properties of the codecs, by hypothesis: what encodes decodes to itself, and no bytes crash a decoder.

Every decoder is given arbitrary bytes and valid payloads broken on purpose (cut short, bytes flipped, bytes
inserted, headers rewritten): each must return operands or raise a `MatmulError` (a 4xx for the client),
never any other exception (a 500). `.npy` headers are also written as hostile text (mutations of what NumPy
writes, towers of unary signs, booleans, nested tuples, huge digit strings, wrong keys, non-ASCII), alone, as
`.npz` members and as multipart parts; a header the service accepts is one NumPy reads the same way. The
example counts come from the Hypothesis profile in conftest.py.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Callable
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from app import codecs
from app.api.errors import status_of
from app.codecs.multipart import decode_multipart
from app.errors import MalformedPayload, MatmulError
from app.shapes import OPERAND_DIMENSIONS
from matmul_tools.bodies import multipart_body, npy_bytes, npz_bytes, zip_members

LIMITS = codecs.Limits(max_dim=64, max_elements=1024, max_result_elements=4096)
MAX_MEMBER_BYTES = 1 << 16

# ------------------------------------------------------------------------------------------- strategies

BYTE_ORDERS = "<>"
SUPPORTED_DTYPES = (
    hnp.floating_dtypes(sizes=(32, 64), endianness="?")
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
)
SHAPES = hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=6)


@st.composite
def matrices(
    draw: st.DrawFn, dtypes: st.SearchStrategy[np.dtype] = SUPPORTED_DTYPES, finite: bool = False, min_rows: int = 0
) -> np.ndarray:
    """A matrix of a supported dtype, either byte order, C or Fortran order; floats include NaN/Inf unless `finite`."""
    dtype = draw(dtypes)
    matrix = draw(arrays(dtype, draw(SHAPES.filter(lambda s: s[0] >= min_rows)), finite))
    return np.asfortranarray(matrix) if draw(st.booleans()) else matrix


def arrays(dtype: np.dtype, shape: tuple[int, ...], finite: bool) -> st.SearchStrategy[np.ndarray]:
    """Arrays of `dtype`; floats of any value its width holds, NaN and infinities included unless `finite`."""
    if dtype.kind != "f":
        return hnp.arrays(dtype, shape)
    elements = st.floats(width=8 * dtype.itemsize, allow_nan=not finite, allow_infinity=not finite)
    return hnp.arrays(dtype, shape, elements=elements)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid payload with one to three edits: cut short, a byte changed, bytes inserted or removed."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
        if edit == "truncate":
            del data[at:]
        elif edit == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


def npy_header(descr: object, fortran_order: object, shape: object, version: int = 1) -> bytes:
    """A .npy header written by hand, so that any value can stand in any field."""
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran_order!r}, 'shape': {shape!r}, }}"
    text += " " * (-(len(text) + 11) % 64) + "\n"
    size = len(text).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + text.encode("latin-1")


ODD_INTS = st.integers(-3, 70) | st.sampled_from([2**31, 2**63, 2**64 - 1])
npy_headers = st.builds(
    npy_header,
    descr=st.sampled_from(["<f4", ">f8", "|u1", "<i8", "<c16", "|b1", "<f2", "|O", "<U3", "|V4", "<M8[s]", "x"])
    | st.text(st.characters(max_codepoint=255), max_size=6)
    | st.lists(st.tuples(st.sampled_from(["f0", "f1"]), st.sampled_from(["<f4", "<i2"])), max_size=2),
    fortran_order=st.sampled_from([True, False, 0, 1, None, "yes"]),
    shape=st.tuples(ODD_INTS, ODD_INTS) | st.lists(ODD_INTS, max_size=3).map(tuple) | st.just([2, 2]),
    version=st.sampled_from([1, 2]),
)
"""Headers with every field plausible or not: negative, huge and ill-typed shapes; unsupported dtypes."""
npy_files = st.builds(lambda header, data: header + data, npy_headers, st.binary(max_size=96))
valid_npy = matrices().map(codecs.npy.encode_npy) | matrices().map(npy_bytes)


valid_npz = st.builds(zip_members, compressed=st.booleans(), a=valid_npy, b=valid_npy)

JSON_INTEGERS = st.integers(-(2**63), 2**64 - 1)  # what orjson writes
JSON_SCALARS = st.none() | st.booleans() | JSON_INTEGERS | st.floats(allow_nan=False) | st.text(max_size=4)
json_values = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)
ROWS = st.lists(st.lists(JSON_SCALARS | st.lists(JSON_INTEGERS, max_size=2), max_size=3), max_size=3)
json_bodies = st.fixed_dictionaries(
    {"a": ROWS | json_values, "b": ROWS | json_values},
    optional={"kernel": json_values, "tile": json_values, "dtype": json_values, "extra": json_values},
).map(orjson.dumps)

TENSOR_NAMES = st.sampled_from(["A", "B", "C", ""]) | json_values
infer_tensors = st.fixed_dictionaries(
    {"name": TENSOR_NAMES},
    optional={
        "datatype": st.sampled_from(["FP32", "FP64", "INT8", "BYTES"]) | json_values,
        "shape": st.lists(ODD_INTS, max_size=3) | json_values,
        "data": ROWS | st.lists(JSON_SCALARS, max_size=6) | json_values,
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": ODD_INTS | json_values}) | json_values,
    },
)
infer_docs = st.fixed_dictionaries(
    {"inputs": st.lists(infer_tensors, max_size=3) | json_values},
    optional={
        "id": json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"kernel": json_values, "tile": json_values, "binary_data_output": json_values}
        )
        | json_values,
        "outputs": st.lists(st.fixed_dictionaries({"name": TENSOR_NAMES}, optional={"parameters": json_values}))
        | json_values,
    },
)
"""Inference requests whose every field is plausible or not."""
HEADER_LENGTHS = st.none() | st.text(max_size=6) | st.integers(-2, 300).map(str) | st.just("9" * 5000)

# ------------------------------------------------------------------------------------------------ helpers


def decodes_or_refuses(decode: Callable[..., Any], *args: Any) -> Any:
    """What `decode` returns, or None when it refuses with a MatmulError; any other exception fails the test."""
    try:
        return decode(*args)
    except MatmulError as exc:
        refusal = exc
    assert refusal.message and 400 <= status_of(refusal) < 500, refusal
    return None


def assert_within_limits(matrix: np.ndarray) -> None:
    """A matrix or a stack of them (app.shapes), every dimension, the batch's too, and the elements within LIMITS."""
    assert matrix.ndim in OPERAND_DIMENSIONS and min(matrix.shape) >= 0
    assert max(matrix.shape) <= LIMITS.max_dim and matrix.size <= LIMITS.max_elements
    codecs.operands.check_dtype(matrix.dtype, "decoded")


def assert_operands_sane(operands: codecs.Operands | None) -> None:
    if operands is not None:
        assert_within_limits(operands.a)
        assert_within_limits(operands.b)


def assert_same(decoded: np.ndarray, original: np.ndarray) -> None:
    """Same shape and the same values, NaN for NaN."""
    assert decoded.shape == original.shape
    np.testing.assert_array_equal(decoded, original, strict=False)


def assert_json_numbers(written: list[Any], original: np.ndarray) -> None:
    """JSON numbers (row-major) that read back as `original` in its own dtype, null where it holds NaN or Inf."""
    cast = original.dtype.type
    for number, value in zip(written, original.ravel().tolist(), strict=True):
        if number is None:
            assert not math.isfinite(value)
        else:
            assert cast(number) == cast(value)


def json_body(a: bytes, b: bytes) -> bytes:
    return b"".join((b'{"a":', a, b',"b":', b, b"}"))


# ------------------------------------------------------------------------------------------- round trips


@given(matrices())
def test_npy_round_trip(matrix: np.ndarray) -> None:
    decoded = codecs.npy.decode_npy(codecs.npy.encode_npy(matrix), "a", LIMITS)
    assert decoded.dtype == matrix.dtype
    assert_same(decoded, matrix)


@given(matrices(), st.sampled_from([(1, 0), (2, 0), (3, 0)]))
def test_npy_files_numpy_writes_decode_as_written(matrix: np.ndarray, version: tuple[int, int]) -> None:
    """Fortran-ordered and big-endian files, every header version: the data is what NumPy saved."""
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, matrix, version=version)
    decoded = codecs.npy.decode_npy(buffer.getvalue(), "a", LIMITS)
    assert decoded.dtype == matrix.dtype and decoded.flags.f_contiguous == matrix.flags.f_contiguous
    assert_same(decoded, matrix)


@given(matrices(), matrices(), st.booleans())
def test_npz_and_multipart_round_trip(a: np.ndarray, b: np.ndarray, compressed: bool) -> None:
    archive = zip_members(compressed, a=npy_bytes(a), b=codecs.npy.encode_npy(b))
    for operands in (
        codecs.npz.decode_npz(archive, LIMITS, MAX_MEMBER_BYTES),
        codecs.npy.decode_parts({"a": npy_bytes(a), "b": codecs.npy.encode_npy(b)}, LIMITS, container="multipart body"),
    ):
        assert (operands.a.dtype, operands.b.dtype) == (a.dtype, b.dtype) and operands.typed
        assert_same(operands.a, a)
        assert_same(operands.b, b)


@given(matrices(finite=True, min_rows=1), matrices(finite=True, min_rows=1))
def test_json_round_trip(a: np.ndarray, b: np.ndarray) -> None:
    """Finite matrices with at least one row (JSON cannot say how many columns no rows have)."""
    operands = codecs.json.decode_json(
        json_body(codecs.json.encode_json_matrix(a), codecs.json.encode_json_matrix(b)), LIMITS
    )
    assert not operands.typed
    for decoded, original in ((operands.a, a), (operands.b, b)):
        assert decoded.dtype.kind in "iuf"
        # NumPy reads JSON integers beside ones past int64 as float64, rounded as the engine rounds them anyway.
        common = original.dtype if original.dtype.kind == "f" else np.dtype(np.float64)
        assert_same(decoded.astype(common), original.astype(common))


@given(matrices())
@example(np.arange(6, dtype=">f8").reshape(2, 3))  # orjson reads native byte order only
@example(np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)))  # and C order only
def test_json_writes_non_finite_elements_as_null(matrix: np.ndarray) -> None:
    rows = orjson.loads(codecs.json.encode_json_matrix(matrix))
    assert len(rows) == matrix.shape[0] and all(len(row) == matrix.shape[1] for row in rows)
    assert_json_numbers([number for row in rows for number in row], matrix)


FLOATS = st.sampled_from([np.dtype("<f4"), np.dtype("<f8")])


@st.composite
def operand_pairs(draw: st.DrawFn, finite: bool) -> tuple[np.ndarray, np.ndarray]:
    """A (m x k) and B (k x n), little-endian float32/float64 each, as the inference protocol carries them."""
    m, k, n = draw(st.integers(0, 5)), draw(st.integers(0, 5)), draw(st.integers(0, 5))
    return draw(arrays(draw(FLOATS), (m, k), finite)), draw(arrays(draw(FLOATS), (k, n), finite))


def infer_request(a: np.ndarray, b: np.ndarray, binary: bool) -> tuple[bytes, str | None]:
    """The body of an infer request carrying A and B as JSON data or as binary tensor data, and its header length."""
    tensors = []
    for name, array in (("A", a), ("B", b)):
        tensor: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": f"FP{array.itemsize * 8}"}
        if binary:
            tensor["parameters"] = {"binary_data_size": array.nbytes}
        else:
            tensor["data"] = array.tolist()
        tensors.append(tensor)
    header = orjson.dumps({"inputs": tensors, "parameters": {"binary_data_output": binary}})
    if not binary:
        return header, None
    return header + a.tobytes() + b.tobytes(), str(len(header))


@given(operand_pairs(finite=False), st.just(True) | st.just(False))
def test_infer_round_trip(pair: tuple[np.ndarray, np.ndarray], binary: bool) -> None:
    a, b = pair
    if not binary:
        a, b = (np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0) for x in (a, b))  # JSON has no NaN/Inf
    decoded = codecs.inference_v2.decode_infer(*infer_request(a, b, binary), LIMITS)
    assert decoded.binary_output is binary
    assert decoded.operands.options.dtype == ("float64" if np.dtype("<f8") in (a.dtype, b.dtype) else "float32")
    assert_same(decoded.operands.a.astype(a.dtype), a)
    assert_same(decoded.operands.b.astype(b.dtype), b)


@given(matrices(dtypes=FLOATS), st.booleans(), st.none() | st.text(max_size=8))
@example(np.zeros((0, 3), np.float32), True, None)  # an empty product: no bytes follow the header
def test_infer_answer_round_trip(c: np.ndarray, binary: bool, request_id: str | None) -> None:
    body, data = codecs.inference_v2.encode_infer(c, "matmul", request_id, binary, {"kernel": "numpy"})
    header = orjson.loads(body)
    (output,) = header["outputs"]
    assert output["shape"] == list(c.shape) and header.get("id") == request_id
    if binary:
        assert data is not None and output["parameters"]["binary_data_size"] == c.nbytes == data.nbytes
        sent = np.frombuffer(data, c.dtype.newbyteorder("<")).reshape(c.shape)
        assert_same(sent, c)
    else:
        assert data is None
        assert_json_numbers(output["data"], c)


# ------------------------------------------------------------------------------------ hostile header text

NPY_DESCRS = st.sampled_from(["<f4", ">f8", "<i8", "|u1", "<u2"])
SMALL_SHAPES = st.tuples(st.integers(0, 4), st.integers(0, 4))


def header_text(descr: str, fortran_order: bool, shape: tuple[int, ...]) -> str:
    """The header dict exactly as NumPy writes it."""
    return f"{{'descr': {descr!r}, 'fortran_order': {fortran_order!r}, 'shape': {shape!r}, }}"


valid_header_texts = st.builds(header_text, NPY_DESCRS, st.booleans(), SMALL_SHAPES)
HEADER_PIECES = st.sampled_from(
    [
        *"{}():,'\"-+~[]\\ \t\r\n0129LjeE._x",
        "True", "False", "None", "not ", "'descr'", "'shape'", "'fortran_order'", "(2, 2)", "(2,)", "()",
        "((2, 2),)", "[2, 2]", "{}", "2L", "1e3", "0x10", "1_0", "2j", "-0", "b'<f4'", "lambda: 0", "__import__('os')",
        "é", "\u2028", "\x00", "\ufeff", "9" * 25,
    ]
) | st.text(max_size=3)  # fmt: skip
"""Text that means something to Python's parser or to NumPy's, or nothing at all."""


@st.composite
def mutated_header_texts(draw: st.DrawFn) -> str:
    """A header NumPy writes with one to four pieces of text inserted, deleted or replaced."""
    text = draw(valid_header_texts)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["insert", "delete", "replace"]))
        cut = draw(st.integers(0, 4)) if edit != "insert" else 0
        piece = draw(HEADER_PIECES) if edit != "delete" else ""
        text = text[:at] + piece + text[at + cut :]
    return text


def shape_text(body: str) -> str:
    return "{'descr': '<f4', 'fortran_order': False, 'shape': (" + body + "), }"


sign_towers = st.builds(
    lambda sign, count, size: shape_text(sign * count + f"{size}, 2"),
    st.sampled_from(["-", "+", "~", "not ", "- +", "(", "[", "*"]),
    st.integers(1, 5000),
    st.integers(0, 4),
)
"""`(-----2, 2)`: Python's literal parser recurses once per sign (RecursionError, MemoryError)."""
odd_shapes = st.recursive(
    st.booleans() | st.none() | st.integers(-4, 6) | st.floats(allow_nan=False, width=16) | st.text(max_size=2),
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3) | st.tuples(inner),
    max_leaves=6,
).map(lambda shape: f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape!r}, }}")
huge_digits = st.builds(lambda digits: shape_text(f"{digits}, 2"), st.integers(15, 6000).map(lambda n: "9" * n))
wrong_keys = st.dictionaries(
    st.sampled_from(["descr", "fortran_order", "shape", "Descr", "shape ", "", "extra"]),
    st.sampled_from(["'<f4'", "False", "True", "(2, 2)", "(2,)", "0", "None", "{}", "'<f4' '<f4'"]),
    max_size=5,
).map(lambda fields: "{" + "".join(f"'{key}': {value}, " for key, value in fields.items()) + "}")
non_ascii = st.builds(
    lambda text, at, char: text[:at] + char + text[at:],
    valid_header_texts,
    st.integers(0, 60),
    st.characters(min_codepoint=128, exclude_categories=["Cs"]),
)
hostile_header_texts = mutated_header_texts() | sign_towers | odd_shapes | huge_digits | wrong_keys | non_ascii


def npy_with_header(text: str, version: int, data: bytes) -> bytes:
    """A .npy file whose header is `text` (UTF-8 whatever the version), padded as NumPy pads, then `data`."""
    raw = text.encode("utf-8")
    width = 2 if version == 1 else 4
    raw += b" " * (-(len(raw) + 9 + width) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(raw).to_bytes(width, "little") + raw + data


hostile_npy_files = st.builds(
    npy_with_header, hostile_header_texts, st.sampled_from([1, 2, 3]), st.binary(max_size=64) | st.just(bytes(64))
)


def reads_as_numpy_does(decoded: np.ndarray, data: bytes) -> None:
    """A header the service accepted is one NumPy reads into the same matrix."""
    assert_same(decoded, np.load(io.BytesIO(data), allow_pickle=False))


@given(hostile_npy_files)
@example(npy_with_header(shape_text("True, 4"), 1, bytes(64)))
@example(npy_with_header(shape_text("-" * 5000 + "2, 2"), 1, bytes(16)))
@example(npy_with_header(shape_text("+" * 5000 + "2, 2"), 3, bytes(16)))
@example(npy_with_header(shape_text("9" * 5000 + ", 2"), 2, bytes(16)))
@example(npy_with_header(header_text("<f4", False, (2, 2)).replace("'<f4'", "'<f4é'"), 1, bytes(16)))
def test_hostile_npy_header_text_is_refused_or_read_as_numpy_reads_it(data: bytes) -> None:
    decoded = decodes_or_refuses(codecs.npy.decode_npy, data, "a", LIMITS)
    if decoded is not None:
        assert_within_limits(decoded)
        reads_as_numpy_does(decoded, data)


@given(hostile_npy_files, valid_npy, st.booleans())
@example(npy_with_header(shape_text("-" * 5000 + "2, 2"), 1, bytes(16)), npy_bytes(np.eye(2)), True)
@example(npy_with_header(shape_text("True, 4"), 1, bytes(64)), npy_bytes(np.eye(2)), False)
def test_hostile_npy_header_text_in_an_npz_member_is_refused_or_read(hostile: bytes, valid: bytes, first: bool) -> None:
    members = {"a": hostile, "b": valid} if first else {"a": valid, "b": hostile}
    for compressed in (False, True):
        assert_operands_sane(
            decodes_or_refuses(codecs.npz.decode_npz, zip_members(compressed, **members), LIMITS, 1 << 16)
        )


BCHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "
boundaries = st.text(BCHARS, min_size=1, max_size=300).filter(lambda b: not b.endswith(" ")) | st.text(
    st.characters(max_codepoint=255), max_size=8
)
part_data = hostile_npy_files | valid_npy | st.binary(max_size=32)
multipart_parts = st.lists(
    st.tuples(st.sampled_from(["a", "b", "kernel", "tile", "c", ""]), part_data, st.booleans()), max_size=4
)
multipart_bodies = st.builds(
    lambda parts, boundary, preamble, epilogue: (multipart_body(parts, None, boundary, preamble, epilogue), boundary),
    multipart_parts,
    boundaries,
    st.sampled_from([b"", b"This is the preamble.\r\n", b"\r\n"]) | st.binary(max_size=16),
    st.sampled_from([b"", b"This is the epilogue.\r\n"]) | st.binary(max_size=16),
)


@given(multipart_bodies | mutated(multipart_bodies.map(lambda pair: pair[0])).map(lambda body: (body, "xx")))
@example((multipart_body([("a", npy_bytes(np.eye(2)))] * 2, boundary="b" * 300), "b" * 300))
@example((multipart_body([("a", npy_bytes(np.eye(2))), ("kernel", b"numpy", False)]), "xx"))
def test_hostile_multipart_bodies_are_refused_or_read(pair: tuple[bytes, str]) -> None:
    body, boundary = pair
    content_type = f'multipart/form-data; boundary="{boundary}"'
    assert_operands_sane(decodes_or_refuses(decode_multipart, body, content_type, LIMITS))


# --------------------------------------------------------------------------------- no bytes crash a decoder


# NumPy warns when a header parses only as Python 2 would write it (`2L`); a mutated one can, and is read.
PYTHON2_HEADER = "ignore:Reading `.npy` or `.npz` file required additional header parsing:UserWarning"


@pytest.mark.filterwarnings(PYTHON2_HEADER)
@given(st.binary(max_size=256) | mutated(valid_npy) | npy_files)
@example(npy_header("<f8", False, (-2, -3)) + bytes(48))  # two negative sides whose product looks right
@example(b"\x93NUMPY\x01\x00\x04\x00'''\n")  # neither Python nor NumPy's tokenizer reads the header
def test_any_npy_bytes_decode_or_are_refused(data: bytes) -> None:
    decoded = decodes_or_refuses(codecs.npy.decode_npy, data, "a", LIMITS)
    if decoded is not None:
        assert_within_limits(decoded)


@pytest.mark.filterwarnings(PYTHON2_HEADER)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", ""]), st.binary(max_size=64) | mutated(valid_npy) | npy_files))
def test_any_parts_decode_or_are_refused(parts: dict[str, bytes]) -> None:
    assert_operands_sane(decodes_or_refuses(codecs.npy.decode_parts, parts, LIMITS, "multipart body"))


def _zip_with_central_directory_offset_past_its_place() -> bytes:
    """A valid .npz whose end record puts the central directory 16 MiB later than it is: members seek before 0."""
    archive = bytearray(npz_bytes(a=np.ones((2, 2)), b=np.ones((2, 2))))
    at = archive.rfind(b"PK\x05\x06") + 16
    offset = int.from_bytes(archive[at : at + 4], "little") + (1 << 24)
    archive[at : at + 4] = offset.to_bytes(4, "little")
    return bytes(archive)


@pytest.mark.filterwarnings(PYTHON2_HEADER)
@given(st.binary(max_size=512) | mutated(valid_npz))
@example(_zip_with_central_directory_offset_past_its_place())
def test_any_npz_bytes_decode_or_are_refused(data: bytes) -> None:
    assert_operands_sane(decodes_or_refuses(codecs.npz.decode_npz, data, LIMITS, MAX_MEMBER_BYTES))


def _zip_with_member_header(member: bytes, method: int, flags: int) -> bytes:
    """An .npz whose members, stored as `member`, claim another compression method or the encryption flag."""
    archive = bytearray(zip_members(a=member, b=member))
    for signature, flags_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        at = archive.find(signature)
        archive[at + flags_at] |= flags
        archive[at + method_at : at + method_at + 2] = method.to_bytes(2, "little")
    return bytes(archive)


NOT_DEFLATE = b"\xff" * 64  # a block type deflate does not have
NOT_LZMA = b"\x09\x04\x05\x00" + b"\xff" * 60  # zipfile's LZMA header, then properties no LZMA filter takes


@pytest.mark.parametrize(
    ("member", "method", "flags"),
    [
        (NOT_DEFLATE, zipfile.ZIP_DEFLATED, 0),
        (NOT_LZMA, zipfile.ZIP_LZMA, 0),
        (NOT_DEFLATE, zipfile.ZIP_BZIP2, 0),
        (NOT_DEFLATE, 99, 0),
        (NOT_DEFLATE, zipfile.ZIP_STORED, 1),
    ],
    ids=["deflate", "lzma", "bzip2", "unknown-method", "encrypted"],
)
def test_npz_members_compressed_oddly_or_encrypted_are_refused(member: bytes, method: int, flags: int) -> None:
    """Bytes that zlib, lzma or bz2 cannot inflate, and encrypted members, are malformed payloads."""
    with pytest.raises(MalformedPayload, match=r"not a valid \.npz archive"):
        codecs.npz.decode_npz(_zip_with_member_header(member, method, flags), LIMITS, MAX_MEMBER_BYTES)


@given(st.binary(max_size=256) | json_bodies | mutated(json_bodies))
@example(b'{"a": ' + b"[" * 100 + b"1" + b"]" * 100 + b', "b": [[1]]}')  # deeper than NumPy's 64 dimensions
@example(b'{"a": [[[1]]], "b": [[[]]]}')  # stacks of one, b's matrix with no columns
def test_any_json_bytes_decode_or_are_refused(data: bytes) -> None:
    assert_operands_sane(decodes_or_refuses(codecs.json.decode_json, data, LIMITS))


@given(st.binary(max_size=256) | infer_docs.map(orjson.dumps) | mutated(infer_docs.map(orjson.dumps)), HEADER_LENGTHS)
@example(b'{"inputs": [{"name": "A", "datatype": []}, {"name": "B"}]}', None)  # an unhashable datatype
@example(b"{}", "\u00b2")  # str.isdigit() says yes to a superscript two; int() does not
@example(b"{}", "9" * 5000)  # more digits than int() converts
def test_any_infer_body_decodes_or_is_refused(body: bytes, header_length: str | None) -> None:
    decoded = decodes_or_refuses(codecs.inference_v2.decode_infer, body, header_length, LIMITS)
    if decoded is not None:
        assert_operands_sane(decoded.operands)


@given(infer_docs, operand_pairs(finite=False), st.data())
def test_infer_binary_data_with_any_header_decodes_or_is_refused(
    doc: dict[str, Any], pair: tuple[np.ndarray, np.ndarray], data: st.DataObject
) -> None:
    """A header of any shape before real binary tensors, with a header length right, short or long."""
    header = orjson.dumps(doc)
    body = header + pair[0].tobytes() + pair[1].tobytes()
    header_length = str(len(header) + data.draw(st.integers(-2, 2)))
    decoded = decodes_or_refuses(codecs.inference_v2.decode_infer, body, header_length, LIMITS)
    if decoded is not None:
        assert_operands_sane(decoded.operands)
