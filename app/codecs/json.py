"""JSON bodies: `{"a": [[...]], "b": [[...]], "dtype"?, "kernel"?, "tile"?, "precision"?}` in (each operand a matrix,
or a stack of matrices: `[[[...]], ...]`), a matrix or a stack as nested lists out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from app.codecs.operands import OPERANDS, Limits, Operands, RequestOptions, check_matrix, check_shape
from app.errors import InvalidMatrix, InvalidParameter, MalformedPayload
from app.shapes import OPERAND_DIMENSIONS, check_dimensions
from matmul_client.wire import JSON_MEDIA_TYPE

MEDIA_TYPE = JSON_MEDIA_TYPE
JSON_OPTION_KEYS = ("kernel", "tile", "dtype", "precision")


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


def _locate_json_problem(value: list[Any], name: str, path: tuple[int, ...] = ()) -> InvalidMatrix | None:
    """The first element that keeps `value` from being a numeric matrix, or a stack of them when its first row's
    first element is a list (error path only: a Python loop). `path` is where `value` lies in the operand."""
    if path == () and value and isinstance(value[0], list) and value[0] and isinstance(value[0][0], list):
        return _locate_stack_problem(value, name)
    where = "".join(f"[{index}]" for index in path)
    width: int | None = None
    for i, row in enumerate(value):
        if not isinstance(row, list):
            return InvalidMatrix(
                f"{name}{where}[{i}] is {json_type(row)}; '{name}{where}' must be a list of rows, each a list of "
                "numbers",
                location=[name, *path, i],
            )
        if width is None:
            width = len(row)
        elif len(row) != width:
            return InvalidMatrix(
                f"'{name}{where}' is ragged: row {i} has {len(row)} elements but row 0 has {width}",
                location=[name, *path, i],
            )
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, int | float):
                return InvalidMatrix(
                    f"{name}{where}[{i}][{j}] is {json_type(x)}, expected a number", location=[name, *path, i, j]
                )
    return None


def _locate_stack_problem(value: list[Any], name: str) -> InvalidMatrix | None:
    """The first matrix of a stack that is not a numeric matrix, or that differs in shape from the first."""
    first: tuple[int, int] | None = None
    for index, matrix in enumerate(value):
        if not isinstance(matrix, list) or not matrix:
            return InvalidMatrix(
                f"{name}[{index}] is {json_type(matrix)}{' with no rows' if matrix == [] else ''}; a stack "
                f"'{name}' must be a list of matrices, each a non-empty list of rows",
                location=[name, index],
            )
        problem = _locate_json_problem(matrix, name, (index,))
        if problem is not None:
            return problem
        shape = (len(matrix), len(matrix[0]))
        if first is None:
            first = shape
        elif shape != first:
            return InvalidMatrix(
                f"the stack '{name}' is ragged: matrix {index} is {shape[0]}x{shape[1]} but matrix 0 is "
                f"{first[0]}x{first[1]}",
                location=[name, index],
            )
    return None


def _claimed_shape(value: list[Any]) -> tuple[int, ...]:
    """The shape the first element at each depth claims (a matrix's, or a stack's): what the limits see before
    NumPy builds anything."""
    shape = [len(value)]
    first = value[0]
    while isinstance(first, list) and len(shape) < 3:
        shape.append(len(first))
        first = first[0] if first else None
    return tuple(shape)


def _json_matrix(doc: Mapping[str, Any], name: str, may_hold_booleans: bool, limits: Limits) -> np.ndarray:
    if name not in doc:
        raise InvalidMatrix(f"the JSON body has no matrix '{name}'", location=[name])
    value = doc[name]
    if not isinstance(value, list) or not value:
        raise InvalidMatrix(
            f"'{name}' must be a non-empty list of rows (a 2-D array of numbers, or a 3-D stack of them), got "
            f"{json_type(value)}" + (" with no rows" if isinstance(value, list) else ""),
            location=[name],
        )
    check_shape(_claimed_shape(value), name, limits)
    try:
        array = np.array(value)
    except ValueError:
        array = None
    if array is not None and array.dtype.kind in "iuf" and array.ndim > max(OPERAND_DIMENSIONS):
        check_dimensions(tuple(array.shape), name)  # numbers, nested too deep
    numeric = array is not None and array.ndim in OPERAND_DIMENSIONS and array.dtype.kind in "iuf"
    # np.array turns [1, true] into int64 silently: a body with a boolean token gets the exact check too.
    if not numeric or may_hold_booleans:
        problem = _locate_json_problem(value, name)
        if problem is not None:
            raise problem
    if array is None or not numeric:
        raise InvalidMatrix(f"'{name}' is not a matrix of numbers, nor a stack of them", location=[name])
    return check_matrix(array, name, limits)


def decode_json(body: bytes | bytearray, limits: Limits) -> Operands:
    """`{"a": [[...]], "b": [[...]], "dtype"?, "kernel"?, "tile"?, "precision"?}` -> Operands."""
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
    for key in ("kernel", "dtype", "precision"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise InvalidParameter(f"'{key}' must be a string, got {json_type(doc[key])}", location=[key])
    tile = doc.get("tile")
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int)):
        raise InvalidParameter(f"'tile' must be an integer, got {json_type(tile)}", location=["tile"])
    return RequestOptions(kernel=doc.get("kernel"), tile=tile, dtype=doc.get("dtype"), precision=doc.get("precision"))


def encode_json_matrix(array: np.ndarray) -> bytes:
    """A matrix as nested JSON lists, whatever its byte order and layout (orjson reads native C order only, so
    others are copied once). JSON has no NaN or Infinity: those elements are written as null."""
    native = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    return orjson.dumps(native, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_json_envelope(result_json: bytes | memoryview, fields: Mapping[str, Any]) -> bytes:
    """`{"result": <result_json>, **fields}` without serialising the matrix a second time."""
    rest = orjson.dumps(fields)
    return b"".join((b'{"result":', result_json, b"," if len(rest) > 2 else b"", rest[1:]))
