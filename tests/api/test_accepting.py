"""The HTTP workers' shared connection table and the acceptor that reads it (app.api.accepting), in this process on a
BalancedLoop, over real sockets: a worker holds a slot only while it accepts, and the table counts every worker's
accepts; a connection is counted from its accept to its end, left for the hand-off to a live worker that holds fewer
and then taken all the same, left again when another worker accepted during the hand-off, counted off when its
protocol cannot be made; a failed accept is skipped or waited out by its cause, a failed acceptor stops its worker;
and a worker that is gone is neither read nor kept from its slot. Whole servers balancing their workers:
tests/server/test_workers.py.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.api import accepting
from app.api.accepting import ACCEPT_RETRY_S, Acceptor, BalancedLoop, ConnectionTable
from app.config import Settings

GUARD_S = 10
"""How long a test waits for a connection to be served or counted: a hang guard."""
TIMER_SLACK_S = 0.005
"""How early a uvloop timer may end by a clock read outside the loop: libuv counts it in milliseconds from the time it
cached at the start of the loop's turn (a 1 s wait measured 0.99985 s)."""
HANDOFF_S = Settings.model_fields["accept_handoff_ms"].default / 1e3
"""The hand-off of the loops here: MATMUL_ACCEPT_HANDOFF_MS' default."""


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
    assert mine.fewer() == {gone.slot: 0}  # the other holds none while it lives
    sleeper.kill()
    sleeper.wait()
    assert mine.fewer() == {}
    replacement = ConnectionTable(table_path)
    assert replacement.slot == gone.slot
    assert replacement.held() == 0


def test_a_worker_holding_more_than_a_live_one_is_not_the_fewest(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    mine, theirs = ConnectionTable(table_path), ConnectionTable(table_path, pid=sleeper.pid)
    assert mine.fewer() == theirs.fewer() == {}
    mine.add(1)
    assert (mine.fewer(), theirs.fewer()) == ({theirs.slot: 0}, {})
    theirs.add(1)
    assert mine.fewer() == theirs.fewer() == {}
    mine.release()
    mine.release()  # once only
    assert ConnectionTable(table_path).slot == mine.slot  # a released slot is free


def test_a_released_slot_is_not_written_again(table_path: str, sleeper: subprocess.Popen[bytes]) -> None:
    """A worker's connections end while it drains, after it released its slot, which another may hold by then."""
    stopping = ConnectionTable(table_path)
    stopping.add(2)
    stopping.release()
    successor = ConnectionTable(table_path, pid=sleeper.pid)
    assert successor.slot == stopping.slot
    stopping.add(-1)
    assert successor.held() == 0


def test_the_table_counts_each_workers_accepts_while_it_holds_its_slot(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    mine, theirs = ConnectionTable(table_path), ConnectionTable(table_path, pid=sleeper.pid)
    mine.accepted_one()
    theirs.accepted_one()
    theirs.accepted_one()
    assert (mine.accepted(), mine.accepted(theirs.slot), mine.held(), theirs.held()) == (1, 2, 1, 2)
    assert theirs.fewer() == {mine.slot: 1}  # with the accepts of each worker that holds fewer
    theirs.add(-2)
    assert mine.accepted(theirs.slot) == 2  # connections that ended were accepted all the same
    theirs.release()
    assert mine.accepted(theirs.slot) == 0
    assert ConnectionTable(table_path, pid=sleeper.pid).accepted() == 0  # a slot claimed again starts from none


def test_a_full_table_says_so(table_path: str, sleeper: subprocess.Popen[bytes]) -> None:
    for _ in range(4):
        ConnectionTable(table_path, pid=sleeper.pid)
    with pytest.raises(RuntimeError, match="no free slot of 4"):
        ConnectionTable(table_path)


OPEN: list[asyncio.BaseTransport] = []
"""Both ends of the connections a test opened, closed after it."""
SERVING: dict[BalancedLoop, list[Acceptor]] = {}
"""The acceptors each loop's test made, closed after it (a test that fails leaves them accepting)."""


class Echo(asyncio.BufferedProtocol):
    """Sends back what it receives, from memory of its own."""

    def __init__(self) -> None:
        self.memory = bytearray(4096)
        self.transport: Any = None  # uvloop's TCPTransport, a WriteTransport in all but its class

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        OPEN.append(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.memory)

    def buffer_updated(self, nbytes: int) -> None:
        self.transport.write(bytes(self.memory[:nbytes]))


def on_balanced_loop(
    table_path: str,
    test: Callable[[BalancedLoop, socket.socket], Coroutine[Any, Any, None]],
    listener: socket.socket | None = None,
    handoff_s: float = HANDOFF_S,
) -> None:
    """Run `test` on a BalancedLoop over the table at `table_path` with a hand-off of `handoff_s`, with a listening
    socket (`listener`, else a new one) bound as uvicorn binds it, and not yet listening."""
    listener = socket.socket() if listener is None else listener
    listener.bind(("127.0.0.1", 0))
    loop = BalancedLoop(table_path, handoff_s)
    try:
        loop.run_until_complete(asyncio.wait_for(test(loop, listener), GUARD_S))
    finally:
        for server in SERVING.pop(loop, []):  # a test that failed left them accepting, and connections open
            server.close()
        while OPEN:
            OPEN.pop().close()
        left = asyncio.all_tasks(loop)  # the acceptor's, and connections' it is still handing on
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(asyncio.sleep(0.01))  # the closes' callbacks
        listener.close()
        loop.close()


async def echoed(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    OPEN.append(writer.transport)
    writer.write(data)
    return reader, writer, await reader.readexactly(len(data))


async def serving(
    loop: BalancedLoop, protocol: Callable[[], asyncio.BaseProtocol], listener: socket.socket
) -> Acceptor:
    server = await loop.create_server(protocol, sock=listener, backlog=8)
    assert isinstance(server, Acceptor) and server.is_serving()
    SERVING.setdefault(loop, []).append(server)
    return server


async def until(condition: Callable[[], bool]) -> None:
    """Return once `condition` holds: the count changes in the loop's callbacks, which nothing here can await."""
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(0.001)


def test_a_connection_is_served_and_counted_from_its_accept_to_its_end(table_path: str) -> None:
    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        server = await serving(loop, Echo, listener)
        connections = [await echoed(listener.getsockname()[1], b"product %d" % i) for i in range(3)]
        assert [got for _, _, got in connections] == [b"product 0", b"product 1", b"product 2"]
        assert server.table.held() == 3
        for _, writer, _ in connections[:2]:
            writer.close()
        await until(lambda: server.table.held() == 1)
        connections[2][1].close()
        await until(lambda: server.table.held() == 0)
        server.close()
        assert not server.is_serving()
        await server.wait_closed()

    on_balanced_loop(table_path, test)


def test_a_connection_left_to_a_worker_that_holds_fewer_is_taken_once_no_one_has(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """The other worker (a live process that accepts nothing) holds none and this one holds one: the next connection
    waits HANDOFF_S for the other, then this worker serves it."""

    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        ConnectionTable(table_path, pid=sleeper.pid)
        server = await serving(loop, Echo, listener)
        port = listener.getsockname()[1]
        first = await echoed(port, b"first")
        assert first[2] == b"first" and server.table.fewer()
        began = loop.time()  # the loop's own clock, the one its timers count (in whole milliseconds)
        second = await echoed(port, b"second")
        assert second[2] == b"second"
        assert loop.time() - began >= HANDOFF_S - 1e-9
        assert server.table.held() == 2
        for _, writer, _ in (first, second):
            writer.close()
        await until(lambda: server.table.held() == 0)

    on_balanced_loop(table_path, test)


def test_a_connection_that_came_during_a_hand_off_in_which_another_worker_accepted_is_left_to_it_again(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """This worker holds one and the other none. The other accepts the connection this one left it, and a second one
    comes during the hand-off: at the hand-off's end this worker leaves the second to the other for a hand-off more
    (it may be the other's to take, as the first was), and takes it when no one accepted in that one."""
    handoff_s = 0.2  # long beside the loop's turns: this loop runs both workers' parts, in its timers' order

    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        theirs = ConnectionTable(table_path, pid=sleeper.pid)
        server = await serving(loop, Echo, listener)
        port = listener.getsockname()[1]
        first = await echoed(port, b"first")
        assert server.table.fewer() == {theirs.slot: 0}
        began = loop.time()
        _, left = await asyncio.open_connection("127.0.0.1", port)
        OPEN.append(left.transport)
        await asyncio.sleep(handoff_s / 4)
        taken, _ = listener.accept()  # the other worker takes the connection left to it, which then ends
        theirs.accepted_one()
        taken.close()
        left.close()
        theirs.add(-1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        OPEN.append(writer.transport)
        writer.write(b"second")
        await asyncio.sleep(began + 1.5 * handoff_s - loop.time())
        assert server.table.held() == 1, "the second connection was taken at the end of the first hand-off"
        assert await reader.readexactly(len(b"second")) == b"second"
        assert loop.time() - began >= 2 * handoff_s - TIMER_SLACK_S
        assert server.table.held() == 2
        for opened in (first[1], writer):
            opened.close()
        await until(lambda: server.table.held() == 0)

    on_balanced_loop(table_path, test, handoff_s=handoff_s)


def test_what_a_worker_that_holds_more_accepts_during_a_hand_off_does_not_hold_this_one_back(
    table_path: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """This worker holds one, a second holds none and never accepts, a third holds five and accepts a connection
    during this one's hand-off: at the hand-off's end this worker takes the connection that waits, after that one
    hand-off. Were the third's accept to count, it would wait a second one, and two waiting workers would hold each
    other back in turn (one took a burst nearly alone). Hand-offs are counted, not timed: a loaded machine may make
    one long, never two of one."""
    busier = subprocess.Popen(["sleep", "60"])

    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        ConnectionTable(table_path, pid=sleeper.pid)
        more = ConnectionTable(table_path, pid=busier.pid)
        more.add(5)
        server = await serving(loop, Echo, listener)
        handoffs: list[dict[int, int]] = []  # what each hand-off waits on: the workers that hold fewer
        fewer = server.table.fewer

        def counted() -> dict[int, int]:
            found = fewer()
            if found:
                handoffs.append(found)
            return found

        server.table.fewer = counted  # type: ignore[method-assign]
        port = listener.getsockname()[1]
        first = await echoed(port, b"first")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        OPEN.append(writer.transport)
        writer.write(b"second")
        await until(lambda: len(handoffs) == 1)  # this worker is in its hand-off, its snapshot taken
        more.accepted_one()  # the busier worker accepts another connection meanwhile
        assert await reader.readexactly(len(b"second")) == b"second"
        assert handoffs == [{0: 0}] and server.table.held() == 2
        for opened in (first[1], writer):
            opened.close()
        await until(lambda: server.table.held() == 0)

    try:
        on_balanced_loop(table_path, test, handoff_s=0.2)
    finally:
        busier.kill()
        busier.wait()


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
        server = await serving(loop, protocol, listener)
        port = listener.getsockname()[1]
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await reader.read() == b""  # closed by the server
            writer.close()
        await until(lambda: server.table.held() == 0)
        _, writer, got = await echoed(port, b"third")
        assert got == b"third" and server.table.held() == 1
        writer.close()
        await until(lambda: server.table.held() == 0)

    on_balanced_loop(table_path, test)


def test_servers_of_a_host_and_port_are_uvloops_own(table_path: str) -> None:
    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        server = await loop.create_server(Echo, "127.0.0.1", 0)
        assert not isinstance(server, Acceptor)
        assert server.sockets
        port = server.sockets[0].getsockname()[1]
        _, writer, got = await echoed(port, b"plain")
        assert got == b"plain"
        writer.close()
        server.close()
        assert ConnectionTable(table_path).slot == 0  # the table untouched: its first slot is free

    on_balanced_loop(table_path, test)


def test_a_worker_holds_a_slot_only_while_it_accepts(table_path: str, sleeper: subprocess.Popen[bytes]) -> None:
    """No slot while the worker starts (its loop made, its socket not yet served), nor once it stops accepting,
    while its connections drain: the others never wait on a worker that cannot take a connection."""

    async def test(loop: BalancedLoop, listener: socket.socket) -> None:
        other = ConnectionTable(table_path, pid=sleeper.pid)
        other.add(1)
        assert other.slot == 0  # this worker, starting, holds none
        server = await serving(loop, Echo, listener)
        assert server.table.slot == 1 and other.fewer() == {1: 0}
        _, draining, got = await echoed(listener.getsockname()[1], b"in flight")
        assert got == b"in flight" and server.table.held() == 1
        server.close()
        assert other.fewer() == {}  # the stopping worker is not read
        successor = ConnectionTable(table_path)
        assert successor.slot == 1
        draining.close()
        await asyncio.sleep(0.05)
        assert successor.held() == 0  # the drained connection's end is not counted on the successor's slot

    on_balanced_loop(table_path, test)


class RefusingListener(socket.socket):
    """A listening socket whose accepts fail with `errors` first, one each."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__()
        self.errors = errors
        self.failed_at: list[float] = []

    def accept(self) -> tuple[socket.socket, Any]:
        if self.errors:
            self.failed_at.append(time.perf_counter())
            raise self.errors.pop(0)
        return super().accept()


@pytest.mark.parametrize(
    ("error", "pause_s"),
    [
        (OSError(errno.EPROTO, "protocol error"), 0.0),  # this connection's own: the next is accepted at once
        (OSError(errno.EMFILE, "too many open files"), ACCEPT_RETRY_S),  # out of sockets: waited out
    ],
)
def test_a_failed_accept_is_skipped_or_waited_out_by_its_cause(table_path: str, error: OSError, pause_s: float) -> None:
    listener = RefusingListener([error])

    async def test(loop: BalancedLoop, listening: socket.socket) -> None:
        server = await serving(loop, Echo, listening)
        _, writer, got = await echoed(listening.getsockname()[1], b"after")
        served = time.perf_counter()
        assert got == b"after" and server.table.held() == 1
        waited = served - listener.failed_at[0]
        assert waited >= pause_s - TIMER_SLACK_S and (pause_s or waited < ACCEPT_RETRY_S)
        writer.close()

    on_balanced_loop(table_path, test, listener)


def test_a_worker_whose_acceptor_fails_is_stopped(
    table_path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its supervisor (uvicorn) starts another in its place; a worker left without one would never accept again."""
    signalled: list[tuple[int, int]] = []
    kill = os.kill

    def record(pid: int, number: int) -> None:
        if number == 0:
            kill(pid, number)  # the table asking whether a worker lives
        else:
            signalled.append((pid, number))

    monkeypatch.setattr(accepting.os, "kill", record)
    listener = RefusingListener([RuntimeError("a fault of the acceptor's own")])

    async def test(loop: BalancedLoop, listening: socket.socket) -> None:
        server = await serving(loop, Echo, listening)
        connection = socket.create_connection(listening.getsockname())
        await until(lambda: bool(signalled))
        assert signalled == [(os.getpid(), signal.SIGTERM)]
        connection.close()
        server.close()

    on_balanced_loop(table_path, test, listener)
    assert [record.getMessage() for record in caplog.records] == ["accepting connections failed; stopping this worker"]
