"""HTTP/1.1 answers read from a kept-alive connection: the status line, the header fields into a dict, and the body
framed as the answer says (Content-Length, chunks, or the connection's end).

What `MatmulClient` used of the standard library's `http.client.HTTPResponse`, without its email-message parser:
that parser was two thirds of the client's own CPU for a 64x64 product (about 0.4 of 0.6 ms, with the product's two
dozen X-Matmul-* fields). Its exceptions are the standard library's (`http.client.HTTPException` and kin), which the
client already maps to httpx's.
"""

from __future__ import annotations

import http.client
import io
import re
from typing import Protocol

MAX_LINE_BYTES = 65536
"""The longest status line or header field read (http.client's own bound)."""
MAX_FIELDS = 100
"""The most header fields an answer may have (http.client's own bound)."""
MAX_INTERIM = 16
"""The most 1xx interim answers read past before the answer itself."""
MAX_CHUNKED_BYTES = 1 << 32
"""The longest chunked body read (4 GiB: twice a product answer at the server's default limit of 2^28 elements)."""
PIECE_BYTES = 1 << 20
"""The most bytes read in one call where a server's own count says how many are to come: memory is taken as bytes
arrive, never for what a server merely claims."""
_CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")
"""A Content-Length this client reads: ASCII digits (str.isdigit would take '²'), at most 18 of them."""
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
"""A chunk's size: hexadecimal digits (int(..., 16) would take '-1' and '0x10'), under 2^60."""


class Reader(Protocol):
    """What an answer is read from: a connection's buffered reader (`socket.makefile("rb")`)."""

    def readline(self, size: int = -1, /) -> bytes: ...

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int: ...

    def peek(self, size: int = 0, /) -> bytes: ...


def _line(reader: Reader) -> bytes:
    line = reader.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES:
        raise http.client.LineTooLong("header line")
    return line


def _head_lines(reader: Reader) -> list[str]:
    """The next head's lines, without their ends: the status line, then each field's, up to the blank line. A head
    that the reader holds whole already (a server's answer comes in one piece) is taken in one read and split;
    any other (in pieces, or with lines ended by a bare LF) is read line by line."""
    held = reader.peek()
    end = held.find(b"\r\n\r\n")
    if 0 <= end < MAX_LINE_BYTES and held.count(b"\n", 0, end) == held.count(b"\r\n", 0, end):
        return reader.read(end + 4)[:end].decode("latin-1").split("\r\n")
    line = _line(reader)
    if not line:
        raise http.client.RemoteDisconnected("Remote end closed connection without response")
    lines = [line.decode("latin-1").rstrip("\r\n")]
    while len(lines) <= MAX_FIELDS + 1:
        field = _line(reader)
        if field in (b"\r\n", b"\n"):
            return lines
        if not field:
            raise http.client.IncompleteRead(b"", None)
        lines.append(field.decode("latin-1").rstrip("\r\n"))
    return lines  # one field too many, which _head refuses


def _head(reader: Reader) -> tuple[str, int, dict[str, str]]:
    """The status line's version and code and the header fields (names lower-cased, repeated ones joined with
    ', '), past any 1xx interim answers (at most MAX_INTERIM of them)."""
    for _ in range(MAX_INTERIM + 1):
        status, *lines = _head_lines(reader)
        version, _, rest = status.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()) or rest[3:4] not in ("", " "):
            raise http.client.BadStatusLine(status)
        if len(lines) > MAX_FIELDS:
            raise http.client.HTTPException(f"got more than {MAX_FIELDS} headers")
        fields: dict[str, str] = {}
        for field in lines:
            name, colon, value = field.partition(":")
            if not colon or not name or name != name.strip():
                raise http.client.HTTPException(f"a malformed header line: {field[:100]!r}")
            name, value = name.lower(), value.strip()
            fields[name] = f"{fields[name]}, {value}" if name in fields else value
        if code == "101" or not code.startswith("1"):
            return version, int(code), fields
    raise http.client.HTTPException(f"more than {MAX_INTERIM} interim answers")


def _read_claimed(reader: Reader, size: int) -> bytes:
    """`size` bytes, or fewer at the connection's end, read a piece at a time (`PIECE_BYTES`)."""
    if size <= PIECE_BYTES:
        return reader.read(size)
    data = bytearray()
    while len(data) < size and (piece := reader.read(min(PIECE_BYTES, size - len(data)))):
        data += piece
    return bytes(data)


def _chunks(reader: Reader) -> bytes:
    """A chunked body, whole (at most MAX_CHUNKED_BYTES), and its trailer fields read past."""
    body = bytearray()
    while True:
        size_line = _line(reader).split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_line):
            raise http.client.HTTPException(f"a malformed chunk size: {size_line[:20]!r}")
        size = int(size_line, 16)
        if size == 0:
            while _line(reader) not in (b"\r\n", b"\n", b""):
                pass
            return bytes(body)
        if len(body) + size > MAX_CHUNKED_BYTES:
            raise http.client.HTTPException(f"a chunked body of more than {MAX_CHUNKED_BYTES} bytes")
        chunk = _read_claimed(reader, size)
        if len(chunk) < size:
            raise http.client.IncompleteRead(bytes(body) + chunk, size - len(chunk))
        body += chunk
        if _line(reader) not in (b"\r\n", b"\n"):
            raise http.client.HTTPException("a chunk longer than its size")


class Answer:
    """One answer's head, read when this is made, and its body, read through `read` and `readinto`."""

    def __init__(self, reader: Reader, method: str) -> None:
        version, self.status, self.headers = _head(reader)
        connection = self.headers.get("connection", "").lower()
        self.will_close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
        """Whether the server closes the connection after this answer."""
        self._reader = reader
        if method == "HEAD" or self.status in (204, 304):
            self.length: int | None = 0
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            body = _chunks(reader)
            self._reader, self.length = io.BufferedReader(io.BytesIO(body)), len(body)
        elif "content-length" in self.headers:
            declared = self.headers["content-length"]
            if not _CONTENT_LENGTH.fullmatch(declared):
                raise http.client.HTTPException(f"a Content-Length this client does not read: {declared[:40]!r}")
            self.length = int(declared)
        else:  # the body ends where the connection does
            self.length, self.will_close = None, True
        """Bytes of the body not read yet; None where it ends with the connection."""

    def finished(self) -> bool:
        """Whether the body was read to its end."""
        return self.length == 0

    def read(self, amount: int) -> bytes:
        """The next `amount` bytes of the body, fewer at its end: a caller that reads a body whole says how much of
        it it takes, and an answer that says it has more is left unfinished."""
        if self.length is None:
            data = _read_claimed(self._reader, amount)
            if len(data) < amount:
                self.length = 0
            return data
        wanted = min(amount, self.length)
        data = _read_claimed(self._reader, wanted)
        self.length -= len(data)
        if len(data) < wanted:
            raise http.client.IncompleteRead(data, self.length)
        return data

    def readinto(self, into: memoryview) -> int:
        """Fill as much of `into` as one read gives from the body (0 at its end)."""
        if self.length is not None:
            into = into[: self.length]
        got = self._reader.readinto(into) if into.nbytes else 0
        if self.length is not None:
            self.length -= got
        elif not got:
            self.length = 0
        return got
