"""HTTP over a raw socket, for what an HTTP client library would not send or would tidy up."""

from __future__ import annotations

import socket


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout raises: a hang)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def status_of_a_large_header(port: int, header_bytes: int, path: str = "/healthz") -> tuple[int, bytes]:
    """The status and body of the answer to a GET with one header of `header_bytes`, over a raw socket to
    127.0.0.1:`port`; the server must close the connection after it."""
    request = b"GET %s HTTP/1.1\r\nHost: t\r\nX-Big: %s\r\nConnection: close\r\n\r\n" % (
        path.encode(),
        b"x" * header_bytes,
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
