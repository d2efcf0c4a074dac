"""matmul_tools.raw_load's reading of answers, over a socket pair: framing by Content-Length, whatever the pieces."""

from __future__ import annotations

import socket
import threading

import pytest

from matmul_tools.raw_load import OPENING_BYTES, read_answer


def _answered(pieces: list[bytes], buffer_bytes: int = 64) -> list[object]:
    """What read_answer makes of `pieces` sent one after another (and then of nothing more)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:

        def send() -> None:
            for piece in pieces:
                theirs.sendall(piece)
            theirs.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        answer = read_answer(ours, bytearray(buffer_bytes))
        sender.join()
        return [answer.status, answer.size, answer.opening, answer.header(b"x-matmul-batch-size")]


def test_an_answer_framed_by_content_length_in_pieces_of_any_size() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 300\r\nX-Matmul-Batch-Size:  3 \r\n\r\n"
    body = bytes(range(256)) + bytes(44)
    whole = head + body
    expected = [200, len(whole), body, b"3"]
    assert _answered([whole]) == expected
    assert _answered([whole[:10], whole[10 : len(head) + 5], whole[len(head) + 5 :]]) == expected
    assert _answered([whole[i : i + 7] for i in range(0, len(whole), 7)], buffer_bytes=16) == expected


def test_the_opening_is_the_bodys_first_bytes_only() -> None:
    body = b"x" * (OPENING_BYTES + 100)
    head = b"HTTP/1.1 503 Busy\r\nContent-Length: %d\r\n\r\n" % len(body)
    assert _answered([head, body]) == [503, len(head) + len(body), body[:OPENING_BYTES], None]


def test_a_connection_closed_before_the_end_of_the_answer_raises() -> None:
    with pytest.raises(ConnectionError, match="mid-answer"):
        _answered([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"])
    with pytest.raises(ConnectionError, match="closed the connection"):
        _answered([b"HTTP/1.1 200 OK\r\nContent-"])
