"""What a product route does with HTTP around the service, each piece on a real Starlette request: the body read
under its limit, the deadline header read, a codec run on or off the event loop, and a product taken back when its
client leaves."""

from __future__ import annotations

import asyncio
import threading
import weakref

import numpy as np
import pytest
from starlette.requests import Request

from app.api import exchange
from app.api.limits import BodyLimit
from app.config import Settings
from app.engine import LentMemory
from app.errors import ClientGone, InvalidParameter, MalformedPayload, PayloadTooLarge

pytestmark = pytest.mark.anyio

GUARD_S = 10
"""A hang guard only: how long a test waits for something that happens at once when the code is right."""

Message = dict[str, object]
POOL = exchange.BodyBuffers()
"""For bodies under its min_bytes (1 MiB), which are joined from their pieces."""
JSON_5 = BodyLimit(5, "JSON body", "MATMUL_MAX_JSON_BYTES")


def limit(max_bytes: int, what: str = "body") -> BodyLimit:
    return BodyLimit(max_bytes, what, "MATMUL_MAX_BODY_BYTES")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def request(receive: Receiving, headers: dict[str, str] | None = None) -> Request:
    scope = {
        "type": "http", "method": "POST", "path": "/matmul", "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }  # fmt: skip
    return Request(scope, receive)  # type: ignore[arg-type]


class Receiving:
    """A receive() that hands out `messages` in order, then waits for ever (a client that sends nothing more);
    `drained` is set once it has handed them all out."""

    def __init__(self, *messages: Message) -> None:
        self.queue = list(messages)
        self.drained = asyncio.Event()

    async def __call__(self) -> Message:
        await asyncio.sleep(0)
        if self.queue:
            return self.queue.pop(0)
        self.drained.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def receiving(*messages: Message) -> Receiving:
    return Receiving(*messages)


def chunk(body: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


# ------------------------------------------------------------------------------------------------ read_body


async def test_a_body_of_exactly_the_limit_is_read_whole() -> None:
    got = await exchange.read_body(request(receiving(chunk(b"abc"), chunk(b"de", more=False))), JSON_5, POOL)
    assert got == b"abcde"


async def test_a_declared_size_over_the_limit_is_refused_before_reading() -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        await exchange.read_body(request(receiving(chunk(b"ab", False)), {"content-length": "6"}), JSON_5, POOL)
    assert caught.value.message == "the JSON body is 6 bytes, over the limit of 5 (MATMUL_MAX_JSON_BYTES)"
    small = request(receiving(chunk(b"ab", False)), {"content-length": "5"})
    assert await exchange.read_body(small, limit(5, "x"), POOL) == b"ab"


async def test_a_streamed_body_is_refused_once_it_passes_the_limit() -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        await exchange.read_body(request(receiving(chunk(b"abc"), chunk(b"def", more=False))), limit(5), POOL)
    assert caught.value.message == "the body passed the limit of 5 bytes (MATMUL_MAX_BODY_BYTES)"


async def test_a_client_that_leaves_during_the_body_is_gone() -> None:
    leaving = request(receiving(chunk(b"abc"), {"type": "http.disconnect"}))
    with pytest.raises(ClientGone) as caught:
        await exchange.read_body(leaving, limit(5, "npz body"), POOL)
    assert caught.value.message == "the client disconnected after sending 3 bytes of the npz body"


# ------------------------------------------------------------------------------------------------ BodyBuffers


def declaring(*pieces: bytes) -> Request:
    """A request whose Content-Length is the sum of `pieces`, sent as those pieces."""
    messages = [chunk(piece, more=i < len(pieces) - 1) for i, piece in enumerate(pieces)]
    return request(receiving(*messages), {"content-length": str(sum(map(len, pieces)))})


async def test_a_large_body_is_read_into_a_lent_buffer_that_the_next_body_of_its_size_reuses() -> None:
    buffers = exchange.BodyBuffers(kept=2, min_bytes=4)
    first = await exchange.read_body(declaring(b"abc", b"de"), limit(100), buffers)
    assert isinstance(first, bytearray) and first == b"abcde"
    buffers.give(first)
    second = await exchange.read_body(declaring(b"vwxyz"), limit(100), buffers)
    assert second is first and second == b"vwxyz"  # the same memory, overwritten
    other = await exchange.read_body(declaring(b"123456"), limit(100), buffers)
    assert other is not first and other == b"123456"  # another size: a buffer of its own
    assert isinstance(await exchange.read_body(declaring(b"abcd"), limit(100), buffers), bytearray)  # at min_bytes
    assert await exchange.read_body(declaring(b"abc"), limit(100), buffers) == b"abc"  # under min_bytes: joined
    assert isinstance(await exchange.read_body(request(receiving(chunk(b"abcde", False))), limit(9), buffers), bytes)


async def test_buffers_keep_the_most_recently_given_back() -> None:
    buffers = exchange.BodyBuffers(kept=2, min_bytes=1)
    made = [buffers.take(size) for size in (1, 2, 3)]
    for buffer in made:
        buffers.give(buffer)
    assert buffers.take(1) is not made[0]  # forgotten: three were given back, two are kept
    assert buffers.take(3) is made[2] and buffers.take(2) is made[1]
    assert len(buffers.take(7)) == 7


def test_buffers_keep_at_most_kept_bytes_together() -> None:
    buffers = exchange.BodyBuffers(kept=4, min_bytes=1, kept_bytes=10)
    made = [buffers.take(size) for size in (4, 5, 11, 6)]
    for buffer in made:
        buffers.give(buffer)
    # the 11 bytes push the total past 10: the older buffers go, then those 11 bytes too (over the bound alone)
    assert buffers.take(11) is not made[2] and buffers.take(4) is not made[0] and buffers.take(5) is not made[1]
    assert buffers.take(6) is made[3]


def test_a_kept_buffer_of_the_size_is_found_wherever_it_stands() -> None:
    buffers = exchange.BodyBuffers(kept=4, min_bytes=1)
    made = [buffers.take(size) for size in (2, 3, 4, 5)]
    for buffer in made:
        buffers.give(buffer)
    taken = [buffers.take(size) for size in (4, 2, 5, 3)]  # equal contents are not enough: the same objects
    assert all(got is kept for got, kept in zip(taken, [made[2], made[0], made[3], made[1]], strict=True))


@pytest.mark.parametrize(
    ("messages", "error", "message"),
    [
        ([chunk(b"abc"), chunk(b"defg", more=False)], MalformedPayload, "longer than its Content-Length of 6 bytes"),
        ([chunk(b"abc"), chunk(b"d", more=False)], MalformedPayload, "is 4 bytes, not its Content-Length of 6"),
        ([chunk(b"abc"), {"type": "http.disconnect"}], ClientGone, "disconnected after sending 3 bytes of the body"),
    ],
)
async def test_a_body_that_breaks_its_content_length_is_refused_and_its_buffer_given_back(
    messages: list[Message], error: type[Exception], message: str
) -> None:
    given: list[bytearray] = []

    class Counting(exchange.BodyBuffers):
        def give(self, buffer: bytearray) -> None:
            given.append(buffer)
            super().give(buffer)

    buffers = Counting(kept=2, min_bytes=4)
    with pytest.raises(error, match=message):
        await exchange.read_body(request(receiving(*messages), {"content-length": "6"}), limit(100), buffers)
    assert len(given) == 1 and len(given[0]) == 6 and buffers.take(6) is given[0]  # the one lent came back, once


async def test_reading_body_gives_a_lent_buffer_back_when_the_block_ends() -> None:
    buffers = exchange.BodyBuffers(kept=2, min_bytes=4)
    async with exchange.reading_body(with_buffers(declaring(b"abcdef"), buffers), limit(100)) as body:
        assert body == b"abcdef"
    assert buffers.take(6) is body


class Lender:
    """An engine's `lend` as the routes call it: memory for the sizes asked while it has some (None after)."""

    def __init__(self, lends: int) -> None:
        self.lends = lends
        self.asked: list[int] = []
        self.released: list[np.ndarray] = []

    def __call__(self, nbytes: int) -> LentMemory | None:
        self.asked.append(nbytes)
        if len(self.asked) > self.lends:
            return None
        memory = np.zeros(nbytes, np.uint8)
        return LentMemory(memory, lambda: self.released.append(memory))


def with_buffers(lent: Request, buffers: exchange.BodyBuffers) -> Request:
    lent.scope["app"] = type("App", (), {"state": type("State", (), {"body_buffers": buffers})()})()
    return lent


async def test_a_large_body_is_read_into_memory_the_engine_lends_and_given_back_when_the_block_ends() -> None:
    buffers, lender = exchange.BodyBuffers(kept=2, min_bytes=4), Lender(lends=1)
    async with exchange.reading_body(with_buffers(declaring(b"abcdef"), buffers), limit(100), lender) as body:
        assert isinstance(body, memoryview) and body == b"abcdef" and lender.released == []
    assert lender.asked == [6] and len(lender.released) == 1 and bytes(lender.released[0]) == b"abcdef"


async def test_a_body_the_engine_lends_no_memory_for_is_read_as_before() -> None:
    buffers, lender = exchange.BodyBuffers(kept=2, min_bytes=4), Lender(lends=0)
    async with exchange.reading_body(with_buffers(declaring(b"abcdef"), buffers), limit(100), lender) as body:
        assert isinstance(body, bytearray) and body == b"abcdef"
    async with exchange.reading_body(with_buffers(declaring(b"abc"), buffers), limit(100), lender) as small:
        assert small == b"abc"
    assert lender.asked == [6]  # a small body is joined from its pieces, never lent memory


async def test_lent_memory_is_given_back_when_the_body_breaks_its_content_length() -> None:
    buffers, lender = exchange.BodyBuffers(kept=2, min_bytes=4), Lender(lends=1)
    short = with_buffers(request(receiving(chunk(b"abc", more=False)), {"content-length": "6"}), buffers)
    with pytest.raises(MalformedPayload, match="is 3 bytes, not its Content-Length of 6"):
        async with exchange.reading_body(short, limit(100), lender):
            raise AssertionError("a body shorter than declared was read")
    assert len(lender.released) == 1


# ---------------------------------------------------------------------------------------- X-Request-Timeout


@pytest.mark.parametrize(("sent", "seconds"), [(None, None), ("2.5", 2.5), ("86400", 86400.0), (" 7 ", 7.0)])
async def test_the_deadline_header(sent: str | None, seconds: float | None) -> None:
    headers = {} if sent is None else {exchange.TIMEOUT_HEADER: sent}
    assert exchange.requested_deadline_s(request(receiving(), headers)) == seconds


@pytest.mark.parametrize("sent", ["0", "-1", "86400.5", "nan", "inf", "soon", ""])
async def test_a_deadline_header_out_of_range_is_refused(sent: str) -> None:
    with pytest.raises(InvalidParameter) as caught:
        exchange.requested_deadline_s(request(receiving(), {exchange.TIMEOUT_HEADER: sent}))
    assert caught.value.message == f"X-Request-Timeout must be a number of seconds in (0, 86400], not {sent!r}"
    assert caught.value.location == ["X-Request-Timeout"]


# ------------------------------------------------------------------------------------------ off the loop


async def test_a_codec_runs_on_the_loop_up_to_the_threshold_and_in_a_thread_past_it() -> None:
    settings = Settings(backend="cpu", inline_codec_bytes=100)

    def where(x: int, y: int) -> tuple[int, int]:
        return threading.get_ident(), x + y

    loop_thread = threading.get_ident()
    assert await exchange.off_loop_if_large(100, settings, where, 1, 2) == (loop_thread, 3)
    thread, total = await exchange.off_loop_if_large(101, settings, where, 3, 4)
    assert thread != loop_thread and total == 7


# ----------------------------------------------------------------------------------- a client that leaves


async def test_work_finishes_while_the_client_stays() -> None:
    """A client still connected sends messages that are not a disconnect: the work's result is returned."""
    finish = asyncio.Event()

    async def work() -> str:
        await finish.wait()
        return "product"

    receive = receiving({"type": "http.request", "body": b"", "more_body": False})
    waiting = asyncio.ensure_future(exchange.unless_disconnected(request(receive), work()))
    await asyncio.wait_for(receive.drained.wait(), GUARD_S)
    finish.set()
    assert await asyncio.wait_for(waiting, GUARD_S) == "product"


async def test_a_client_that_leaves_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    leaves = request(receiving({"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}))
    with pytest.raises(ClientGone) as caught:
        await asyncio.wait_for(exchange.unless_disconnected(leaves, work()), GUARD_S)
    assert caught.value.message == "the client disconnected before its product was computed"
    await asyncio.wait_for(cancelled.wait(), GUARD_S)


async def test_a_client_that_leaves_gets_its_answer_only_once_the_work_has_unwound() -> None:
    """The work reads the request's body, which is given back when unless_disconnected returns: a cancelled work that
    takes time to let go (a staging thread it waits for) has let go by then."""
    unwound = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.to_thread(threading.Event().wait, 0.2)  # the thread it lent the body to
            unwound.set()
            raise
        return "never"

    leaves = request(receiving({"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}))
    with pytest.raises(ClientGone):
        await asyncio.wait_for(exchange.unless_disconnected(leaves, work()), GUARD_S)
    assert unwound.is_set()


class Body:
    """Stands for the memory a request's body was read into, which the work's frames view."""


@pytest.mark.usefixtures("without_garbage_collection")
async def test_a_refused_works_body_is_held_by_nothing_once_the_refusal_is_raised() -> None:
    """The refusal's traceback holds the work's frames, and they its body: no frame of unless_disconnected may keep
    the refusal in a reference cycle with the task that raised it, which would hold the body until a garbage
    collection."""
    body = Body()
    gone = weakref.ref(body)

    async def work(viewed: Body) -> str:
        raise InvalidParameter(f"the {type(viewed).__name__.lower()} is refused", location=["body"])

    stays = request(receiving({"type": "http.request", "body": b"", "more_body": False}))
    with pytest.raises(InvalidParameter, match="the body is refused"):
        await exchange.unless_disconnected(stays, work(body))  # not through wait_for, whose task would hold it
    del body
    assert gone() is None
