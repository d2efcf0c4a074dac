"""The client's HTTP/1.1 answer reader (matmul_client/http11.py) on answers written byte for byte: heads, each way
of framing a body, and every malformed answer refused with the standard library's exception for it."""

from __future__ import annotations

import http.client
import io

import pytest

from matmul_client.http11 import MAX_FIELDS, MAX_INTERIM, MAX_LINE_BYTES, PIECE_BYTES, Answer


class Trickle(io.RawIOBase):
    """A connection that gives `piece` bytes a read: a head that arrives in pieces."""

    def __init__(self, raw: bytes, piece: int) -> None:
        self.raw, self.piece = raw, piece

    def readable(self) -> bool:
        return True

    def readinto(self, into: memoryview) -> int:  # type: ignore[override]
        size = min(self.piece, len(into), len(self.raw))
        into[:size], self.raw = self.raw[:size], self.raw[size:]
        return size


def answer(raw: bytes, method: str = "GET", piece: int | None = None) -> tuple[Answer, io.BufferedReader]:
    """The answer read from `raw`, given whole or `piece` bytes at a time."""
    reader = io.BufferedReader(io.BytesIO(raw) if piece is None else Trickle(raw, piece))
    return Answer(reader, method), reader


@pytest.mark.parametrize("piece", [None, 7, 1], ids=["whole", "in pieces of 7 bytes", "byte by byte"])
def test_the_head_is_read_into_a_dict_of_lower_cased_names(piece: int | None) -> None:
    got, reader = answer(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-npy\r\nX-Matmul-Kernel: tiled\r\n"
        b"Vary: accept\r\nvary:  accept-encoding \r\nContent-Length: 3\r\n\r\nabc",
        piece=piece,
    )
    assert got.status == 200 and not got.will_close and reader.read() == b"abc"
    assert got.headers == {
        "content-type": "application/x-npy",
        "x-matmul-kernel": "tiled",
        "vary": "accept, accept-encoding",
        "content-length": "3",
    }


def test_a_content_length_body_is_read_to_its_end_and_no_further() -> None:
    got, reader = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 next answer")
    into = bytearray(3)
    assert got.readinto(memoryview(into)) == 3 and into == b"hel" and got.length == 2 and not got.finished()
    assert got.read(100) == b"lo" and got.finished()
    assert got.read(100) == b"" and got.readinto(memoryview(bytearray(4))) == 0
    assert reader.read() == b"HTTP/1.1 next answer", "the next answer's bytes are left for it"


def test_lines_ended_by_a_bare_line_feed_are_lines() -> None:
    got, reader = answer(b"HTTP/1.1 200 OK\nX-One: 1\r\nX-Two: 2\r\n\r\nrest")
    assert got.status == 200 and got.headers == {"x-one": "1", "x-two": "2"} and reader.read() == b"rest"


def test_interim_answers_are_read_past() -> None:
    got, _ = answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
    assert got.status == 201 and got.read(2) == b"ok"


def test_interim_answers_without_end_are_refused() -> None:
    """A server that sends 100 Continue again and again is not read forever."""
    raw = b"HTTP/1.1 100 Continue\r\n\r\n" * (MAX_INTERIM + 1) + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    with pytest.raises(http.client.HTTPException, match=f"more than {MAX_INTERIM} interim"):
        answer(raw)
    got, _ = answer(raw.replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"", 1))
    assert got.status == 200


def test_a_chunked_body_is_joined_and_its_trailer_read_past() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw = head + b"4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nX-Trailer: 1\r\n\r\n"
    got, reader = answer(raw + b"rest")
    assert got.length == 9 and got.read(4) == b"wiki" and got.read(100) == b"pedia" and got.finished()
    assert reader.read() == b"rest"


def test_a_body_without_a_length_ends_with_the_connection() -> None:
    got, _ = answer(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
    assert got.will_close and got.length is None and not got.finished()
    assert got.read(3) == b"all" and got.read(100) == b" of it" and got.finished()


@pytest.mark.parametrize(
    ("head", "closes"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\n", False),
        (b"HTTP/1.0 200 OK\r\n", True),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n", False),
    ],
)
def test_whether_the_server_closes_the_connection(head: bytes, closes: bool) -> None:
    got, _ = answer(head + b"Content-Length: 0\r\n\r\n")
    assert got.will_close is closes and got.finished()


@pytest.mark.parametrize(("method", "status"), [("HEAD", 200), ("GET", 204), ("GET", 304)])
def test_answers_that_have_no_body(method: str, status: int) -> None:
    got, reader = answer(f"HTTP/1.1 {status} X\r\nContent-Length: 10\r\n\r\n".encode(), method)
    assert got.length == 0 and got.finished() and reader.read() == b""


@pytest.mark.parametrize(
    ("raw", "error", "said"),
    [
        (b"", http.client.RemoteDisconnected, "closed connection without response"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", http.client.BadStatusLine, "SSH-2.0-OpenSSH"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", http.client.BadStatusLine, "2x0"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", http.client.BadStatusLine, "2000"),
        (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * MAX_LINE_BYTES + b"\r\n\r\n", http.client.LineTooLong, "header"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * (MAX_FIELDS + 1) + b"\r\n", http.client.HTTPException, "more than"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", http.client.HTTPException, "malformed header"),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", http.client.HTTPException, "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", http.client.HTTPException, "Content-Length this"),
        # str.isdigit takes these, int() does not (a ValueError, not the protocol error it is)
        ("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"), http.client.HTTPException, "Length"),
        ("HTTP/1.1 \u00b200 OK\r\n\r\n".encode("latin-1"), http.client.BadStatusLine, "00 OK"),
        # 2^70 bytes: int() reads it, and a read of that many was an OverflowError
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % 2**70, http.client.HTTPException, "Content-Length this"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5", http.client.IncompleteRead, ""),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", http.client.HTTPException, "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nshort", http.client.IncompleteRead, ""),
        # int(..., 16) takes a sign and a prefix: -1 had read to the connection's end
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nx", http.client.HTTPException, "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x1\r\nx", http.client.HTTPException, "chunk size"),
        # 2^70 bytes claimed by one chunk: a read of that many was an OverflowError
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400000000000000000\r\n",
            http.client.HTTPException,
            "chunk",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
            http.client.HTTPException,
            "longer",
        ),
    ],
)
def test_a_malformed_answer_is_refused(raw: bytes, error: type[Exception], said: str) -> None:
    with pytest.raises(error) as refused:
        answer(raw)
    assert said in str(refused.value)


def test_a_body_cut_short_is_an_incomplete_read() -> None:
    got, _ = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly6b")
    with pytest.raises(http.client.IncompleteRead) as cut:
        got.read(100)
    assert cut.value.partial == b"only6b" and cut.value.expected == 4


def test_a_body_is_read_as_its_bytes_come_not_as_its_length_claims() -> None:
    """A Content-Length of 200 GB over a body of a few bytes: the read takes memory for what came (a piece at a time),
    where reading the claimed length at once had asked for all of it (a MemoryError)."""
    got, _ = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 200000000000\r\n\r\n" + b"x" * (PIECE_BYTES + 3))
    with pytest.raises(http.client.IncompleteRead) as cut:
        got.read(got.length or 0)
    assert cut.value.partial == b"x" * (PIECE_BYTES + 3)
