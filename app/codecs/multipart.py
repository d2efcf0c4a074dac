"""multipart/form-data bodies, parsed in memory with python-multipart's push parser.

Starlette's form parser spools every file part over 1 MB to a temporary file, one thread hop per 64 KB
chunk: 300-450 ms for two 64 MB .npy parts on the GPU machine. The body is already in memory (read under
the size limits), so this feeds it to the parser whole and keeps each part as a view of the body: the parser
reports a part's data as offsets into the very buffer it was given, and nothing is copied.

RFC 2046 framing: a boundary of 1 to 70 characters, a preamble before the first delimiter and an epilogue after
the last are allowed (and ignored).

A body of .npy file parts is first read by the lengths their headers declare: after a part's headers comes a .npy
header that says how many bytes follow it, and the delimiter must stand right after them. That reads a 134 MB body
without searching its data for the boundary (the search took 17% of an HTTP worker's time in the 4096^2 cell on
the H100). Any body that does not fit that pattern exactly (a preamble, a text field, a header the parser would
read differently, a delimiter elsewhere) is parsed by python-multipart, which also says what is wrong with it. The
one difference: a sender that let its boundary occur inside a .npy part's data (RFC 2046 forbids it) has that
part read whole, as its header declares, where a search would have cut it short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlencode

import numpy as np
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from app.codecs.npy import NPY_MAX_HEADER, array_of, decode_parts, read_npy_header
from app.codecs.operands import OPERANDS, Body, Limits, Operands, require_operands
from app.errors import InvalidMatrix, InvalidParameter, MalformedPayload, MatmulError

MEDIA_TYPE = "multipart/form-data"
MAX_PARTS = 8
MAX_BOUNDARY = 70
"""RFC 2046 section 5.1.1: a boundary is 1 to 70 characters."""
MAX_PART_HEAD = 4096
"""The most bytes of headers a part may have to be read by its .npy length (else python-multipart reads it)."""


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    header_name: bytes = b""
    header_value: bytes = b""
    chunks: list[bytes | memoryview] = field(default_factory=list)


def parse_file_parts(body: bytes, content_type: str) -> dict[str, bytes | memoryview]:
    """The file parts of a multipart body, by field name, as views of `body` where the parser reports them in
    it; MalformedPayload when it does not parse."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise MalformedPayload("the multipart body cannot be parsed: its Content-Type has no boundary")
    if len(boundary) > MAX_BOUNDARY:
        raise MalformedPayload(
            f"the multipart boundary is {len(boundary)} characters; RFC 2046 allows 1 to {MAX_BOUNDARY}"
        )
    body = _without_preamble(body, boundary)
    finished: list[_Part] = []
    current = _Part()
    view = memoryview(body)

    def on_part_begin() -> None:
        nonlocal current
        if len(finished) >= MAX_PARTS:
            raise MalformedPayload(f"the multipart body has more than {MAX_PARTS} parts")
        current = _Part()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        current.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        current.header_value += data[start:end]

    def on_header_end() -> None:
        current.headers[current.header_name.lower()] = current.header_value
        current.header_name = current.header_value = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        # data is the body except for bytes the parser held back at a possible boundary: copy only those
        current.chunks.append(view[start:end] if data is body else data[start:end])

    def on_part_end() -> None:
        finished.append(current)

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise MalformedPayload(f"the multipart body cannot be parsed: {exc}") from exc
    if parser.state != MultipartState.END:
        closing = f"--{boundary.decode('latin-1')}--"
        raise MalformedPayload(f"the multipart body ends before its closing boundary {closing!r} (truncated)")
    return _file_parts(finished)


def decode_multipart(body: Body, content_type: str, limits: Limits) -> Operands:
    """A multipart/form-data body with the .npy file parts 'a' and 'b' -> Operands: views of `body` where it is
    made of .npy parts alone, else of a copy of it python-multipart parses (bytes, when `body` is not)."""
    operands = decode_by_length(body, content_type, limits)
    if operands is not None:
        return operands
    parts = parse_file_parts(body if isinstance(body, bytes) else bytes(body), content_type)
    return decode_parts(parts, limits, container="multipart body")


def decode_by_length(body: Body, content_type: str, limits: Limits) -> Operands | None:
    """The Operands of a body made only of .npy file parts, read by the lengths their headers declare: views of
    `body`, found by reading headers alone (each once), in well under a millisecond whatever the body's size; None
    for any other body (which `decode_multipart` gives to python-multipart)."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary", b"")
    arrays = _npy_arrays_by_length(memoryview(body), boundary, limits) if 0 < len(boundary) <= MAX_BOUNDARY else None
    if arrays is None:
        return None
    require_operands(arrays, "multipart body")
    return Operands(a=arrays["a"], b=arrays["b"])


def _npy_arrays_by_length(body: memoryview, boundary: bytes, limits: Limits) -> dict[str, np.ndarray] | None:
    """The arrays of a body made only of .npy file parts, each ended where its .npy header says with the delimiter
    right there, as views of `body`; None for any other body."""
    delimiter = b"--" + boundary
    if not _holds(body, 0, delimiter + b"\r\n"):
        return None
    arrays: dict[str, np.ndarray] = {}
    at = len(delimiter) + 2
    while len(arrays) < MAX_PARTS:
        head_end = bytes(body[at : at + MAX_PART_HEAD]).find(b"\r\n\r\n")
        name = _npy_file_part_name(bytes(body[at : at + head_end])) if head_end >= 0 else None
        if name is None or name in arrays:
            return None
        start = at + head_end + 4
        try:
            header = read_npy_header(body[start : start + NPY_MAX_HEADER + 16], name, limits)
        except MatmulError:
            return None
        end = start + header.file_bytes
        if not _holds(body, end, b"\r\n" + delimiter):
            return None
        arrays[name] = array_of(header, body[start:end])
        at = end + 2 + len(delimiter)
        if _holds(body, at, b"--"):
            return arrays  # the closing delimiter; an epilogue after it is ignored
        if not _holds(body, at, b"\r\n"):
            return None
        at += 2
    return None


def _holds(body: memoryview, at: int, expected: bytes) -> bool:
    """Whether `expected` stands in `body` at `at`."""
    return body[at : at + len(expected)] == expected


def _npy_file_part_name(head: bytes) -> str | None:
    """The field name of a part whose headers are plain `Name: value` lines with a Content-Disposition of
    form-data, a name and a filename; None for anything else."""
    headers: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    disposition, options = parse_options_header(headers.get(b"content-disposition", b""))
    field = options.get(b"name", b"")
    if disposition != b"form-data" or not field or b"filename" not in options:
        return None
    return field.decode("latin-1")


def _without_preamble(body: bytes, boundary: bytes) -> bytes:
    """The body from its first delimiter on: what comes before it is a preamble (copied once only when there is one)."""
    delimiter = b"--" + boundary
    if body.startswith(delimiter):
        return body
    if not body:
        raise MalformedPayload("the multipart body is empty; send the .npy file parts 'a' and 'b'")
    first = body.find(b"\r\n" + delimiter)
    if first < 0:
        shown = delimiter.decode("latin-1")
        raise MalformedPayload(f"the multipart body has no delimiter {shown!r} (its Content-Type's boundary)")
    return body[first + 2 :]


def _text_field_error(name: str, part: _Part) -> InvalidMatrix | InvalidParameter:
    """What to say about a text field: matrices are files, parameters belong in the query string."""
    if name in OPERANDS:
        return InvalidMatrix(
            f"part '{name}' is a text field; send each matrix as a .npy file (curl -F {name}=@{name}.npy)",
            location=[name],
        )
    query = urlencode({name: bytes(b"".join(part.chunks)[:64]).decode("latin-1")})
    return InvalidParameter(
        f"part '{name}' is a text field; parameters belong in the query string (POST /matmul?{query}) and the "
        "body holds only the .npy file parts 'a' and 'b'",
        location=[name],
    )


def _file_parts(parts: list[_Part]) -> dict[str, bytes | memoryview]:
    files: dict[str, bytes | memoryview] = {}
    for part in parts:
        disposition, options = parse_options_header(part.headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("latin-1")
        if disposition != b"form-data" or not name:
            raise MalformedPayload("a multipart part has no Content-Disposition: form-data; name=...")
        if b"filename" not in options:
            raise _text_field_error(name, part)
        if name in files:
            raise InvalidMatrix(f"part '{name}' is sent twice", location=[name])
        files[name] = part.chunks[0] if len(part.chunks) == 1 else b"".join(part.chunks)
    return files
