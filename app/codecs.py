"""Bytes <-> matrices: JSON, `.npy`, `.npz` and multipart parts in; JSON and `.npy` out.

Decoders return the operands as they were sent (dtype, byte order and layout kept; `.npy` data is a
zero-copy view of the body): the engine converts them once, into its own buffers, to the working dtype.
Every problem is raised as an `InvalidInput` that says which matrix and where. Nothing here knows which
device runs the product; nothing here calls `np.load` (so nothing can unpickle).
"""

from __future__ import annotations

import io
import lzma
import math
import re
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import orjson

from app.errors import InvalidMatrix, InvalidParameter, MalformedPayload, NotAcceptable, ShapeMismatch

WORKING_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
DEFAULT_DTYPE = "float32"
OPERANDS = ("a", "b")
JSON_OPTION_KEYS = ("kernel", "tile", "dtype")
JSON_MEDIA_TYPE = "application/json"
NPY_MEDIA_TYPE = "application/x-npy"
NPZ_MEDIA_TYPE = "application/x-npz"
_NPY_MAX_HEADER = 10_000


@dataclass(frozen=True)
class Limits:
    """Size limits applied while decoding, before any array of that size is allocated."""

    max_dim: int
    max_elements: int
    max_result_elements: int


@dataclass(frozen=True)
class RequestOptions:
    """Options a request gives in its query string or, for JSON, in the body beside the matrices."""

    kernel: str | None = None
    tile: int | None = None
    dtype: str | None = None

    def merged_with(self, other: RequestOptions) -> RequestOptions:
        """Both sets of options in one; a value given twice must agree."""
        merged: dict[str, Any] = {}
        for key in ("kernel", "tile", "dtype"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine is not None and theirs is not None and mine != theirs:
                raise InvalidParameter(
                    f"'{key}' is given twice with different values: {mine!r} and {theirs!r}", location=[key]
                )
            merged[key] = mine if mine is not None else theirs
        return RequestOptions(**merged)


@dataclass(frozen=True)
class Operands:
    """The two matrices of a request, and the options a JSON body may carry beside them."""

    a: np.ndarray
    b: np.ndarray
    options: RequestOptions = RequestOptions()
    typed: bool = True
    """Whether the operands' dtypes were chosen by the client (.npy) rather than inferred from JSON numbers."""


def _kind_name(dtype: np.dtype) -> str:
    return "pickled Python objects" if dtype.hasobject else str(dtype)


def check_matrix(array: np.ndarray, name: str, limits: Limits) -> np.ndarray:
    """A 2-D matrix of integers or float32/float64 within the limits, or InvalidMatrix/ShapeMismatch."""
    if array.ndim != 2:
        raise InvalidMatrix(
            f"matrix '{name}' must be 2-D, got {array.ndim}-D with shape {list(array.shape)}", location=[name]
        )
    check_dtype(array.dtype, name)
    check_shape(tuple(array.shape), name, limits)
    return array


def check_dtype(dtype: np.dtype, name: str) -> None:
    if (
        dtype.names is not None
        or dtype.hasobject
        or not (dtype.kind in "iu" or (dtype.kind == "f" and dtype.itemsize in (4, 8)))
    ):
        raise InvalidMatrix(
            f"matrix '{name}' has dtype {_kind_name(dtype)}; supported are float32, float64 and integers "
            "(converted to the requested float dtype)",
            location=[name],
        )


def check_shape(shape: tuple[int, ...], name: str, limits: Limits, max_elements: int | None = None) -> None:
    """Every dimension within max_dim and the element count within max_elements (or the limit given)."""
    for axis, size in enumerate(shape):
        if size > limits.max_dim:
            raise ShapeMismatch(
                f"dimension {axis} of '{name}' is {size}, over the limit of {limits.max_dim}", location=[name]
            )
    bound = limits.max_elements if max_elements is None else max_elements
    if math.prod(shape) > bound:
        raise ShapeMismatch(
            f"matrix '{name}' has {math.prod(shape)} elements, over the limit of {bound}", location=[name]
        )


def check_product(a: np.ndarray, b: np.ndarray, limits: Limits) -> None:
    """Inner dimensions agree and the result fits the limits."""
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ShapeMismatch(
            f"inner dimensions differ: 'a' is {m}x{k} and 'b' is {k2}x{n}; a's columns ({k}) must equal "
            f"b's rows ({k2})",
            location=["b", 0],
        )
    check_shape((m, n), "result", limits, max_elements=limits.max_result_elements)


def working_dtype(requested: str | None, operands: Operands) -> np.dtype:
    """The dtype the product is computed in: the one requested, else float64 if a typed operand is, else float32."""
    if requested is not None:
        try:
            return WORKING_DTYPES[requested]
        except KeyError:
            raise InvalidParameter(
                f"dtype '{requested}' is not supported; choose one of {list(WORKING_DTYPES)}",
                location=["dtype"],
            ) from None
    native = (operands.a.dtype.newbyteorder("="), operands.b.dtype.newbyteorder("="))
    if operands.typed and np.dtype(np.float64) in native:
        return WORKING_DTYPES["float64"]
    return WORKING_DTYPES[DEFAULT_DTYPE]


# ---------------------------------------------------------------------------------------------- JSON in


def json_type(value: object) -> str:
    """How a decoded JSON value is named in messages: null, a boolean, a string, an object, a list, a number."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a number"


def _locate_json_problem(value: list[Any], name: str) -> InvalidMatrix | None:
    """The first element that keeps `value` from being a numeric matrix (error path only: a Python loop)."""
    width: int | None = None
    for i, row in enumerate(value):
        if not isinstance(row, list):
            return InvalidMatrix(
                f"{name}[{i}] is {json_type(row)}; '{name}' must be a list of rows, each a list of numbers",
                location=[name, i],
            )
        if width is None:
            width = len(row)
        elif len(row) != width:
            return InvalidMatrix(
                f"'{name}' is ragged: row {i} has {len(row)} elements but row 0 has {width}", location=[name, i]
            )
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, int | float):
                return InvalidMatrix(f"{name}[{i}][{j}] is {json_type(x)}, expected a number", location=[name, i, j])
    return None


def _json_matrix(doc: Mapping[str, Any], name: str, may_hold_booleans: bool, limits: Limits) -> np.ndarray:
    if name not in doc:
        raise InvalidMatrix(f"the JSON body has no matrix '{name}'", location=[name])
    value = doc[name]
    if not isinstance(value, list) or not value:
        raise InvalidMatrix(
            f"'{name}' must be a non-empty list of rows (a 2-D array of numbers), got {json_type(value)}"
            + (" with no rows" if isinstance(value, list) else ""),
            location=[name],
        )
    if isinstance(value[0], list):  # the size its rows claim, checked before NumPy builds anything
        check_shape((len(value), len(value[0])), name, limits)
    try:
        array = np.array(value)
        numeric = array.ndim == 2 and array.dtype.kind in "iuf"
    except ValueError:
        numeric = False
    # np.array turns [1, true] into int64 silently: a body with a boolean token gets the exact check too.
    if not numeric or may_hold_booleans:
        problem = _locate_json_problem(value, name)
        if problem is not None:
            raise problem
        if not numeric:
            raise InvalidMatrix(f"'{name}' is not a matrix of numbers", location=[name])
    return check_matrix(array, name, limits)


def decode_json(body: bytes, limits: Limits) -> Operands:
    """`{"a": [[...]], "b": [[...]], "dtype"?, "kernel"?, "tile"?}` -> Operands."""
    if not body:
        raise MalformedPayload("the request body is empty; send a JSON object with matrices 'a' and 'b'")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedPayload(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise MalformedPayload(f"the JSON body must be an object with keys 'a' and 'b', got {json_type(doc)}")
    unknown = sorted(set(doc) - {*OPERANDS, *JSON_OPTION_KEYS})
    if unknown:
        raise InvalidParameter(
            f"unknown keys in the JSON body: {unknown}; allowed are {[*OPERANDS, *JSON_OPTION_KEYS]}",
            location=[unknown[0]],
        )
    may_hold_booleans = b"true" in body or b"false" in body
    a, b = (_json_matrix(doc, name, may_hold_booleans, limits) for name in OPERANDS)
    return Operands(a=a, b=b, options=_json_options(doc), typed=False)


def _json_options(doc: Mapping[str, Any]) -> RequestOptions:
    for key in ("kernel", "dtype"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise InvalidParameter(f"'{key}' must be a string, got {json_type(doc[key])}", location=[key])
    tile = doc.get("tile")
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int)):
        raise InvalidParameter(f"'tile' must be an integer, got {json_type(tile)}", location=["tile"])
    return RequestOptions(kernel=doc.get("kernel"), tile=tile, dtype=doc.get("dtype"))


# ----------------------------------------------------------------------------------------- .npy / .npz in


@dataclass(frozen=True)
class _NpyHeader:
    shape: tuple[int, int]
    fortran_order: bool
    dtype: np.dtype
    offset: int
    """Where the data begins in the file."""

    @property
    def file_bytes(self) -> int:
        """The size of the whole file this header describes."""
        return self.offset + math.prod(self.shape) * self.dtype.itemsize


_NPY_MAGIC = b"\x93NUMPY"
_NPY_VERSIONS = {(1, 0): (2, "ascii"), (2, 0): (4, "ascii"), (3, 0): (4, "utf-8")}
"""Format version -> the width of the header's length field and the header's encoding (3.0: UTF-8 text)."""
_NPY_KEYS = ("descr", "fortran_order", "shape")
_NPY_EXAMPLE = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
_NPY_TOKEN = re.compile(
    r"[ \t]*(?:(?P<punct>[{}():,])|'(?P<quoted>[^'\\\n]{0,64})'|\"(?P<dquoted>[^\"\\\n]{0,64})\""
    r"|(?P<bool>True|False)\b|(?P<int>0|[1-9][0-9]{0,19})(?![0-9A-Za-z_.])|(?P<list>\[))"
)
"""One token of a header as NumPy writes it: punctuation, a short string, a boolean, a plain decimal integer of at
most 20 digits, or the `[` of a structured dtype's field list (refused by name). Nothing else is read."""
_NPY_DESCR = re.compile(r"[<>|=]?[biufcmMOSUV][0-9]{0,5}(?:\[[A-Za-z0-9]{1,4}\])?")
"""A dtype string as `dtype.str` writes it: byte order, kind, item size, and a datetime unit."""


class _NpyHeaderText:
    """A recursive-descent reader for the header dict `{'descr': <str>, 'fortran_order': <bool>, 'shape': (<ints>)}`
    exactly as NumPy writes it (keys in any order, spaces between tokens, a trailing comma). It never evaluates the
    text: a sign, an expression, a nested tuple or anything else NumPy does not write is refused where it stands."""

    def __init__(self, text: str, name: str) -> None:
        self.text = text
        self.name = name
        self.at = 0
        self.last = 0
        """Where the last token read begins, for the message."""

    def fail(self, what: str) -> MalformedPayload:
        near = self.text[self.last : self.last + 24]
        return MalformedPayload(
            f"'{self.name}' is not a valid .npy file: its header has {what} at character {self.last} ({near!r}); "
            f"NumPy writes {_NPY_EXAMPLE}",
            location=[self.name],
        )

    def token(self) -> tuple[str, str]:
        match = _NPY_TOKEN.match(self.text, self.at)
        if match is None or match.lastgroup is None:
            self.last = self.at
            raise self.fail("something NumPy does not write")
        self.last, self.at = match.start(match.lastgroup), match.end()
        kind = "quoted" if match.lastgroup == "dquoted" else match.lastgroup
        return kind, match.group(match.lastgroup)

    def expect(self, punct: str) -> None:
        if self.token() != ("punct", punct):
            raise self.fail(f"no {punct!r}")

    def parse(self) -> dict[str, Any]:
        self.expect("{")
        fields: dict[str, Any] = {}
        while True:
            kind, value = self.token()
            if (kind, value) == ("punct", "}"):
                break
            if kind != "quoted" or value not in _NPY_KEYS or value in fields:
                raise self.fail(f"the key {value!r}, not one of {list(_NPY_KEYS)} once each")
            self.expect(":")
            fields[value] = self.value(value)
            kind, value = self.token()
            if (kind, value) == ("punct", "}"):
                break
            if (kind, value) != ("punct", ","):
                raise self.fail("no ',' or '}' after a value")
        if self.text[self.at :].strip(" \t\r\n"):
            self.last = self.at
            raise self.fail("text after the closing '}'")
        if len(fields) != len(_NPY_KEYS):
            raise self.fail(f"the keys {sorted(fields)}, not {list(_NPY_KEYS)}")
        return fields

    def value(self, key: str) -> Any:
        kind, value = self.token()
        if key == "descr" and kind == "list":
            raise InvalidMatrix(
                f"matrix '{self.name}' has a structured dtype (a list of fields); supported are float32, float64 "
                "and integers",
                location=[self.name],
            )
        if key == "descr" and kind == "quoted":
            return value
        if key == "fortran_order" and kind == "bool":
            return value == "True"
        if key == "shape" and (kind, value) == ("punct", "("):
            return self.shape()
        raise self.fail(f"{value!r} as its {key!r}")

    def shape(self) -> tuple[int, ...]:
        sizes: list[int] = []
        comma = False
        while True:
            kind, value = self.token()
            if (kind, value) == ("punct", ")"):
                break
            if kind != "int":
                raise self.fail(f"{value!r} in the shape, where only non-negative integers go")
            sizes.append(int(value))
            kind, value = self.token()
            comma = (kind, value) == ("punct", ",")
            if (kind, value) == ("punct", ")"):
                break
            if not comma:
                raise self.fail("no ',' or ')' after a dimension")
        if len(sizes) == 1 and not comma:
            raise self.fail("a one-dimensional shape without its comma")
        return tuple(sizes)


def _npy_header_text(head: memoryview, name: str) -> tuple[str, int]:
    """The header text of a `.npy` file and where its data begins, from the magic, version and length fields."""

    def refuse(problem: str) -> MalformedPayload:
        return MalformedPayload(f"'{name}' is not a valid .npy file: {problem}", location=[name])

    if len(head) < 8 or head[:6] != _NPY_MAGIC:
        raise refuse("it does not begin with the .npy magic \\x93NUMPY")
    version = (head[6], head[7])
    if version not in _NPY_VERSIONS:
        raise refuse(f"format version {version[0]}.{version[1]}; NumPy writes 1.0, 2.0 and 3.0")
    width, encoding = _NPY_VERSIONS[version]
    size = int.from_bytes(head[8 : 8 + width], "little")
    offset = 8 + width + size
    if size > _NPY_MAX_HEADER:
        raise refuse(f"its header is {size} bytes, over the {_NPY_MAX_HEADER} NumPy reads")
    if len(head) < offset:
        raise refuse(f"it ends inside its {size}-byte header (truncated)")
    try:
        return bytes(head[8 + width : offset]).decode(encoding), offset
    except UnicodeDecodeError as exc:
        said = "UTF-8" if encoding == "utf-8" else "ASCII (format 3.0 is for UTF-8 headers)"
        raise refuse(f"its version {version[0]}.{version[1]} header is not {said}: {exc.reason}") from exc


def _npy_dtype(descr: str, name: str) -> np.dtype:
    if _NPY_DESCR.fullmatch(descr):
        try:
            return np.dtype(descr)
        except (TypeError, ValueError):
            pass
    raise MalformedPayload(f"'{name}' is not a valid .npy file: its descr {descr!r} is not a dtype", location=[name])


def _read_npy_header(head: bytes | memoryview | bytearray, name: str, limits: Limits) -> _NpyHeader:
    """The header at the start of a `.npy` file (`head` holds at least its first _NPY_MAX_HEADER + 16 bytes, or
    the whole file), read by the grammar NumPy writes and checked: a numeric dtype, a 2-D shape within the limits."""
    text, offset = _npy_header_text(memoryview(head), name)
    fields = _NpyHeaderText(text, name).parse()
    dtype, shape = _npy_dtype(fields["descr"], name), fields["shape"]
    if len(shape) != 2:
        raise InvalidMatrix(
            f"matrix '{name}' must be 2-D, got {len(shape)}-D with shape {list(shape)}", location=[name]
        )
    check_dtype(dtype, name)
    check_shape(shape, name, limits)
    return _NpyHeader(shape=shape, fortran_order=fields["fortran_order"], dtype=dtype, offset=offset)


def _data_size_error(header: _NpyHeader, name: str, present: int) -> MalformedPayload:
    expected = header.file_bytes - header.offset
    (m, n), dtype = header.shape, header.dtype
    return MalformedPayload(
        f"'{name}' is a {m}x{n} {dtype} .npy whose data should be {expected} bytes, "
        f"but {present} bytes follow the header" + (" (truncated)" if present < expected else ""),
        location=[name],
    )


def decode_npy(data: bytes | memoryview | bytearray, name: str, limits: Limits) -> np.ndarray:
    """One `.npy` file -> a view of its data, after checking the header against what follows."""
    buffer = memoryview(data)
    header = _read_npy_header(buffer, name, limits)
    if len(buffer) != header.file_bytes:
        raise _data_size_error(header, name, present=len(buffer) - header.offset)
    flat = np.frombuffer(buffer, dtype=header.dtype, count=math.prod(header.shape), offset=header.offset)
    return flat.reshape(header.shape, order="F" if header.fortran_order else "C")


def _read_npz_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, limits: Limits) -> bytearray:
    """One member of an `.npz`, inflated only once its header has passed the limits and its declared size
    matches that header: a small archive whose header claims a huge matrix is refused before anything large is
    allocated. zipfile reads no more than the declared size."""
    with cast(zipfile.ZipExtFile, archive.open(info)) as stream:
        head = stream.read(_NPY_MAX_HEADER + 16)
        header = _read_npy_header(head, name, limits)
        if info.file_size != header.file_bytes:
            raise _data_size_error(header, name, present=info.file_size - header.offset)
        member = bytearray(header.file_bytes)
        member[: len(head)] = head
        got = len(head) + stream.readinto(memoryview(member)[len(head) :])
    if got != header.file_bytes:
        raise _data_size_error(header, name, present=got - header.offset)
    return member


def _require_operands(names: Iterable[str], container: str) -> None:
    present = set(names)
    missing = [name for name in OPERANDS if name not in present]
    extra = sorted(present - set(OPERANDS))
    if missing or extra:
        said = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else ""]
        raise InvalidMatrix(
            f"the {container} must hold exactly 'a' and 'b': " + ", ".join(s for s in said if s),
            location=[(missing or extra)[0]],
        )


def decode_parts(parts: Mapping[str, bytes | memoryview | bytearray], limits: Limits, container: str) -> Operands:
    """Exactly the members 'a' and 'b', each a `.npy` file, from a multipart body or an `.npz` archive."""
    _require_operands(parts, container)
    return Operands(a=decode_npy(parts["a"], "a", limits), b=decode_npy(parts["b"], "b", limits))


def decode_npz(body: bytes, limits: Limits, max_member_bytes: int) -> Operands:
    """An `.npz` archive (as written by np.savez or np.savez_compressed) holding `a.npy` and `b.npy`."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
        _require_operands(members, ".npz archive")
        parts: dict[str, bytearray] = {}
        for member, info in members.items():
            if info.file_size > max_member_bytes:
                raise InvalidMatrix(
                    f"member '{info.filename}' of the .npz unpacks to {info.file_size} bytes, over the "
                    f"limit of {max_member_bytes}",
                    location=[member],
                )
            parts[member] = _read_npz_member(archive, info, member, limits)
    # zipfile lets the errors of what it reads through: a negative seek (ValueError), an encrypted member
    # (RuntimeError), data that zlib or lzma cannot inflate (bz2 raises OSError).
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        NotImplementedError,
        EOFError,
        OSError,
        ValueError,
        RuntimeError,
        zlib.error,
        lzma.LZMAError,
    ) as exc:
        raise MalformedPayload(f"the body is not a valid .npz archive: {exc}") from exc
    return decode_parts(parts, limits, container=".npz archive")


# ------------------------------------------------------------------------------------------------- out


def npy_parts(array: np.ndarray) -> tuple[bytes, memoryview]:
    """The `.npy` file of an array, always C-ordered, as its header and a view of the data: a C-ordered array's
    data is not copied (the view keeps the array alive until the bytes are sent)."""
    contiguous = np.ascontiguousarray(array)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(contiguous))
    data = contiguous.data.cast("B") if contiguous.size else memoryview(b"")
    return head.getvalue(), data


def encode_npy(array: np.ndarray) -> bytes:
    """The `.npy` file of an array as one bytes object (the data copied once)."""
    return b"".join(npy_parts(array))


def encode_json_matrix(array: np.ndarray) -> bytes:
    """A matrix as nested JSON lists, whatever its byte order and layout (orjson reads native C order only, so
    others are copied once). JSON has no NaN or Infinity: those elements are written as null."""
    native = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    return orjson.dumps(native, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_json_envelope(result_json: bytes, fields: Mapping[str, Any]) -> bytes:
    """`{"result": <result_json>, **fields}` without serialising the matrix a second time."""
    rest = orjson.dumps(fields)
    return b"".join((b'{"result":', result_json, b"," if len(rest) > 2 else b"", rest[1:]))


def choose_encoding(accept: str | None) -> str:
    """The media type to answer in, JSON or `.npy`, from an Accept header (q-values honoured)."""
    if not accept:
        return JSON_MEDIA_TYPE
    ranges: list[tuple[float, str]] = []
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        ranges.append((quality, media.lower()))
    for quality, media in sorted(ranges, key=lambda r: -r[0]):
        if quality <= 0:
            continue
        if media in (JSON_MEDIA_TYPE, "application/*", "*/*"):
            return JSON_MEDIA_TYPE
        if media == NPY_MEDIA_TYPE:
            return NPY_MEDIA_TYPE
    raise NotAcceptable(f"cannot answer in {accept!r}; this route answers {JSON_MEDIA_TYPE} or {NPY_MEDIA_TYPE}")
