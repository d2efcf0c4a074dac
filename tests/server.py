"""Running the service as a real process on a loopback port, for tests where the wire matters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.scripts import ROOT, import_script

free_port = import_script("local_service").free_port


HTTP_PROTOCOL = import_script("local_service").HTTP_PROTOCOL


def uvicorn_command(port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "app.main:create_app",
        "--factory",
        *HTTP_PROTOCOL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


@dataclass(frozen=True)
class Server:
    client: httpx.Client
    process: subprocess.Popen[bytes]


@contextmanager
def running_server(
    command: list[str], port: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> Iterator[httpx.Client]:
    """Start `command` in its own process group, wait for /readyz, yield a client, then stop it with SIGTERM."""
    with serving(command, port, env, timeout_s) as server:
        yield server.client


@contextmanager
def serving(
    command: list[str], port: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> Iterator[Server]:
    """As running_server, yielding the process too (for tests of how it ends)."""
    log = (ROOT / ".pytest_cache").joinpath(f"server-{port}.log")
    log.parent.mkdir(exist_ok=True)
    with log.open("wb") as output:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                deadline = time.monotonic() + timeout_s
                while True:
                    if process.poll() is not None:
                        raise AssertionError(f"server exited with {process.returncode}:\n{log.read_text()}")
                    try:
                        if client.get("/readyz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise AssertionError(f"server not ready after {timeout_s} s:\n{log.read_text()}")
                    time.sleep(0.2)
                yield Server(client=client, process=process)
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (uvicorn and any workers), SIGKILL if that is not enough."""
    import_script("local_service").stop_group(process)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test: a hang)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def status_of_a_large_header(port: int, header_bytes: int, path: str = "/healthz") -> tuple[int, bytes]:
    """The status and body of the answer to a GET with one header of `header_bytes`, over a raw socket; the
    server must close the connection after it."""
    request = b"GET %s HTTP/1.1\r\nHost: t\r\nX-Big: %s\r\nConnection: close\r\n\r\n" % (
        path.encode(),
        b"x" * header_bytes,
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
