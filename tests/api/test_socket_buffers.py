"""MATMUL_LOOPBACK_SOCKET_BUFFER_BYTES (app.api.connection.size_loopback_buffers): a connection from a loopback address
gets the send and receive buffers asked instead of the kernel's autotuned ones; one from elsewhere, or any connection
with the setting at 0, keeps the kernel's. Checked on real sockets, and through a real uvicorn server in this process
on each event loop (each transport hands out a socket object of its own), whose connections then move large bodies
whole and keep the buffers asked. Linux reserves twice the buffer asked (socket(7)), which getsockopt reports."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pytest
from pydantic import ValidationError

from app.api import connection
from app.api.connection import TransportSocket, is_loopback_peer, size_loopback_buffers
from app.config import DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES, Settings
from matmul_tools.raw_load import post_request, read_whole_answer
from matmul_tools.service import free_port
from tests.api.in_process import serving

ASKED = 96 << 10
"""Under net.core.rmem_max and wmem_max's stock value (208 KiB), so the kernel grants it whole; and twice it is none of
the sizes the kernel starts a socket with (net.ipv4.tcp_rmem's 128 KiB, tcp_wmem's 16 KiB), so a buffer left unsized
cannot pass for a sized one."""
GUARD_S = 30


class ServerSocket(TransportSocket, Protocol):
    """A transport's socket, as the server's spy keeps it to read its buffers."""

    def getsockopt(self, level: int, option: int, /) -> int: ...


def buffers(sock: socket.socket | ServerSocket) -> tuple[int, int]:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


@pytest.fixture
def accepted() -> Iterator[socket.socket]:
    """The server's end of a TCP connection from 127.0.0.1."""
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_connection(listener.getsockname()[:2], timeout=GUARD_S),
    ):
        server_end, _ = listener.accept()
        with server_end:
            yield server_end


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.5", False),
        ("192.168.1.20", False),
        ("2001:db8::1", False),
        ("::ffff:10.0.0.5", False),
        ("fe80::1%eth0", False),
    ],
)
def test_only_this_hosts_addresses_are_loopback_peers(address: str, loopback: bool) -> None:
    assert is_loopback_peer(address) is loopback


def test_a_connection_from_this_host_gets_the_buffers_asked(accepted: socket.socket) -> None:
    assert size_loopback_buffers(accepted, ASKED)
    assert buffers(accepted) == (2 * ASKED, 2 * ASKED)


def test_at_zero_a_connection_keeps_the_kernels_buffers(accepted: socket.socket) -> None:
    kernels = buffers(accepted)
    assert not size_loopback_buffers(accepted, 0)
    assert buffers(accepted) == kernels


def test_a_socket_that_is_not_tcp_or_not_connected_is_left_alone() -> None:
    left, right = socket.socketpair()
    with left, right:
        kernels = buffers(left)
        assert not size_loopback_buffers(left, ASKED)
        assert buffers(left) == kernels
    with socket.socket() as unconnected:
        assert not size_loopback_buffers(unconnected, ASKED)  # getpeername: ENOTCONN
    assert not size_loopback_buffers(None, ASKED)


@dataclass
class Refusing:
    """A loopback connection's socket whose kernel refuses the size (as BSDs do past kern.ipc.maxsockbuf)."""

    family: int = socket.AF_INET

    def getpeername(self) -> tuple[str, int]:
        return ("127.0.0.1", 40000)

    def setsockopt(self, level: int, option: int, value: int, /) -> None:
        raise OSError(55, "No buffer space available")


def test_a_size_the_kernel_refuses_leaves_the_connection_to_it_without_failing() -> None:
    assert not size_loopback_buffers(Refusing(), ASKED)


def test_the_setting_defaults_to_half_a_mebibyte_and_refuses_a_negative_size() -> None:
    assert Settings().loopback_socket_buffer_bytes == DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES == 512 << 10
    with pytest.raises(ValidationError, match="loopback_socket_buffer_bytes"):
        Settings(loopback_socket_buffer_bytes=-1)


@dataclass
class Served:
    port: int
    sized: dict[int, tuple[bool, ServerSocket]] = field(default_factory=dict)
    """For each connection the server made, by its peer's port: whether it sized its buffers, and its socket."""


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    found = Served(free_port())

    def spied(sock: ServerSocket | None, nbytes: int) -> bool:
        sized = size_loopback_buffers(sock, nbytes)
        if sock is not None:
            found.sized[sock.getpeername()[1]] = (sized, sock)
        return sized

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(connection, "size_loopback_buffers", spied)
        with serving(
            found.port,
            request.param,
            {"MATMUL_ECHO_ROUTE": "true", "MATMUL_LOOPBACK_SOCKET_BUFFER_BYTES": str(ASKED)},
        ):
            yield found


def test_the_server_sizes_a_local_connections_buffers_and_moves_large_bodies_whole_through_them(
    served: Served,
) -> None:
    body = np.random.default_rng(5).integers(0, 256, (24 << 20) + 5, np.uint8).tobytes()
    with socket.create_connection(("127.0.0.1", served.port), timeout=GUARD_S) as sock:
        for _ in range(2):
            sock.sendall(post_request("/v1/echo", "application/octet-stream", body))
            answer, echoed = read_whole_answer(sock)
            assert answer.status == 200 and echoed == body
        sized, server_end = served.sized[sock.getsockname()[1]]
        assert sized
        # still the size asked after 48 MiB each way: the kernel did not grow them meanwhile
        assert buffers(server_end) == (2 * ASKED, 2 * ASKED)
