"""Framing that lies, over a real socket to a real server: a 4xx and a closed connection, never a hang."""

from __future__ import annotations

import re
import socket

from matmul_tools.raw_http import read_until_closed
from matmul_tools.service import free_port, running_server, uvicorn_command

ENV = {"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false"}


def test_a_content_length_shorter_than_the_body() -> None:
    """Bytes past the declared Content-Length are the start of a next request that is not HTTP: the server
    answers 4xx only (uvicorn's parser says 400 when they come with the body, the service 422 for the cut JSON
    when they come later) and closes the connection. It goes on serving."""
    port = free_port()
    with running_server(uvicorn_command(port), port, env=ENV) as client:
        body = b'{"a": [[1.0]], "b": [[2.0]]}'
        head = b"POST /matmul HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + body)
            received = read_until_closed(sock)
        statuses = [int(status) for status in re.findall(rb"^HTTP/1\.1 (\d{3}) ", received, flags=re.MULTILINE)]
        assert statuses and all(400 <= status < 500 for status in statuses), received
        assert b"connection: close" in received.lower()
        assert client.post("/matmul", json={"a": [[1.0]], "b": [[2.0]]}).json()["result"] == [[2.0]]
