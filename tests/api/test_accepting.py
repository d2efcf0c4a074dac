"""The HTTP workers' shared connection table and the acceptor that reads it (app.api.accepting), in this process on a
BalancedLoop, over real sockets: a connection is counted from its accept to its end, left for HANDOFF_S to a live
worker that holds fewer and then taken all the same, counted off when its protocol cannot be made, and a worker
that is gone is neither read nor kept from its slot. Whole servers balancing their workers:
tests/server/test_workers.py.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.api.accepting import HANDOFF_S, Acceptor, BalancedLoop, ConnectionTable

GUARD_S = 10
"""How long a test waits for a connection to be served or counted: a hang guard."""


@pytest.fixture
def table_path(tmp_path: Path) -> str:
    return ConnectionTable.create(str(tmp_path / "table"), slots=4)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not this one: the owner of another worker's slot."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def test_workers_claim_slots_of_their_own(table_path: str, sleeper: subprocess.Popen[bytes]) -> None:
    mine, theirs = ConnectionTable(table_path), ConnectionTable(table_path, pid=sleeper.pid)
    assert mine.slot != theirs.slot
    theirs.add(3)
    assert (mine.held(theirs.slot), theirs.held(), mine.held()) == (3, 3, 0)


def test_the_slot_of_a_worker_that_is_gone_is_not_read_and_is_claimed_again(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    mine, gone = ConnectionTable(table_path), ConnectionTable(table_path, pid=sleeper.pid)
    mine.add(2)
    assert not mine.fewest()  # the other holds none while it lives
    sleeper.kill()
    sleeper.wait()
    assert mine.fewest()
    replacement = ConnectionTable(table_path)
    assert replacement.slot == gone.slot
    assert replacement.held() == 0


def test_a_worker_holding_more_than_a_live_one_is_not_the_fewest(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    mine, theirs = ConnectionTable(table_path), ConnectionTable(table_path, pid=sleeper.pid)
    assert mine.fewest() and theirs.fewest()
    mine.add(1)
    assert not mine.fewest() and theirs.fewest()
    theirs.add(1)
    assert mine.fewest() and theirs.fewest()
    mine.release()
    assert ConnectionTable(table_path).slot == mine.slot  # a released slot is free


def test_a_full_table_says_so(table_path: str, sleeper: subprocess.Popen[bytes]) -> None:
    for _ in range(4):
        ConnectionTable(table_path, pid=sleeper.pid)
    with pytest.raises(RuntimeError, match="no free slot of 4"):
        ConnectionTable(table_path)


class Echo(asyncio.BufferedProtocol):
    """Sends back what it receives, from memory of its own."""

    def __init__(self) -> None:
        self.memory = bytearray(4096)
        self.transport: Any = None  # uvloop's TCPTransport, a WriteTransport in all but its class

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.memory)

    def buffer_updated(self, nbytes: int) -> None:
        self.transport.write(bytes(self.memory[:nbytes]))


def on_balanced_loop(table_path: str, test: Callable[[BalancedLoop, socket.socket], Coroutine[Any, Any, None]]) -> None:
    """Run `test` on a BalancedLoop over the table at `table_path`, with a listening socket bound (as uvicorn binds
    it) and not yet listening."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    loop = BalancedLoop(ConnectionTable(table_path))
    try:
        loop.run_until_complete(asyncio.wait_for(test(loop, listener), GUARD_S))
    finally:
        left = asyncio.all_tasks(loop)  # the acceptor's, and connections' it is still handing on
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        listener.close()
        loop.close()


async def echoed(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    return reader, writer, await reader.readexactly(len(data))


async def until(condition: Callable[[], bool]) -> None:
    """Return once `condition` holds: the count changes in the loop's callbacks, which nothing here can await."""
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(0.001)


def test_a_connection_is_served_and_counted_from_its_accept_to_its_end(table_path: str) -> None:
    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        server = await loop.create_server(Echo, sock=listener, backlog=8)
        assert isinstance(server, Acceptor) and server.is_serving()
        connections = [await echoed(listener.getsockname()[1], b"product %d" % i) for i in range(3)]
        assert [got for _, _, got in connections] == [b"product 0", b"product 1", b"product 2"]
        assert loop.table.held() == 3
        for _, writer, _ in connections[:2]:
            writer.close()
        await until(lambda: loop.table.held() == 1)
        server.close()
        assert not server.is_serving()
        connections[2][1].close()
        await until(lambda: loop.table.held() == 0)
        await server.wait_closed()

    on_balanced_loop(table_path, test)


def test_a_connection_left_to_a_worker_that_holds_fewer_is_taken_once_no_one_has(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """The other worker (a live process that accepts nothing) holds none and this one holds one: the next connection
    waits HANDOFF_S for the other, then this worker serves it."""

    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        ConnectionTable(table_path, pid=sleeper.pid)
        await loop.create_server(Echo, sock=listener)
        port = listener.getsockname()[1]
        first = await echoed(port, b"first")
        assert first[2] == b"first" and not loop.table.fewest()
        began = time.perf_counter()
        second = await echoed(port, b"second")
        assert second[2] == b"second"
        assert time.perf_counter() - began >= HANDOFF_S
        assert loop.table.held() == 2
        for _, writer, _ in (first, second):
            writer.close()
        await until(lambda: loop.table.held() == 0)

    on_balanced_loop(table_path, test)


def test_a_connection_whose_protocol_cannot_be_made_is_closed_and_counted_off(table_path: str) -> None:
    made: list[str] = []

    def protocol() -> asyncio.BaseProtocol:
        made.append("one")
        if len(made) == 1:
            raise RuntimeError("no protocol for the first connection")
        if len(made) == 2:
            return asyncio.Protocol()  # not a BufferedProtocol: refused
        return Echo()

    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        await loop.create_server(protocol, sock=listener)
        port = listener.getsockname()[1]
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await reader.read() == b""  # closed by the server
            writer.close()
        await until(lambda: loop.table.held() == 0)
        _, writer, got = await echoed(port, b"third")
        assert got == b"third" and loop.table.held() == 1
        writer.close()
        await until(lambda: loop.table.held() == 0)

    on_balanced_loop(table_path, test)


def test_servers_of_a_host_and_port_are_uvloops_own(table_path: str) -> None:
    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        server = await loop.create_server(Echo, "127.0.0.1", 0)
        assert not isinstance(server, Acceptor)
        assert server.sockets
        port = server.sockets[0].getsockname()[1]
        _, writer, got = await echoed(port, b"plain")
        assert got == b"plain" and loop.table.held() == 0
        writer.close()
        server.close()

    on_balanced_loop(table_path, test)


def test_the_loop_frees_its_slot_when_it_closes(table_path: str) -> None:
    loop = BalancedLoop(ConnectionTable(table_path))
    slot = loop.table.slot
    loop.close()
    loop.close()  # as asyncio's runners may
    assert ConnectionTable(table_path).slot == slot
