"""settled and in_thread: a caller cancelled while a thread or a launch works for it waits for that work before it
goes."""

from __future__ import annotations

import asyncio
import threading
import weakref

import pytest

from app.awaiting import _Call, in_thread, settled
from tests.fakes import until

pytestmark = pytest.mark.anyio
GUARD_S = 10


async def test_a_cancelled_caller_leaves_only_once_the_thread_has_finished() -> None:
    release = threading.Event()
    finished = threading.Event()

    def work() -> None:
        release.wait(GUARD_S)
        finished.set()

    thread = asyncio.get_running_loop().run_in_executor(None, work)
    caller = asyncio.ensure_future(settled(thread))
    await asyncio.sleep(0.01)
    for _ in range(3):  # however often it is cancelled
        caller.cancel()
        await asyncio.sleep(0.01)
    assert not caller.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, GUARD_S)
    assert finished.is_set() and not thread.cancelled()


async def test_an_uncancelled_caller_returns_and_leaves_the_outcome_in_the_future() -> None:
    failing = asyncio.get_running_loop().create_future()
    failing.set_exception(ValueError("the work's own failure"))
    await settled(failing)
    with pytest.raises(ValueError, match="own failure"):
        failing.result()


async def test_in_thread_cancelled_mid_call_returns_only_once_the_thread_is_done() -> None:
    """A caller of `in_thread` cancelled while its function runs raises the cancellation only after the function
    returned: the order of the two ends is the function's, then the caller's."""
    release = threading.Event()
    ends: list[str] = []

    def work() -> int:
        release.wait(GUARD_S)
        ends.append("thread")
        return 7

    caller = asyncio.ensure_future(in_thread(work))
    caller.add_done_callback(lambda _: ends.append("caller"))
    await asyncio.sleep(0.01)
    caller.cancel()
    for _ in range(10):  # every turn of the loop a caller leaving at once would take
        await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, GUARD_S)
    assert ends == ["thread", "caller"]


async def test_in_thread_returns_the_functions_result_and_raises_its_exception() -> None:
    assert await in_thread(lambda x, y=1: x + y, 2, y=3) == 5

    def failing() -> None:
        raise ValueError("the function's own failure")

    with pytest.raises(ValueError, match="own failure"):
        await in_thread(failing)


class Lent:
    """Stands for an argument that views lent memory."""


def test_a_threads_call_lets_go_of_its_arguments_as_it_returns() -> None:
    """The executor keeps its work item (the call) a moment after the caller has the result: the call must not keep
    the arguments alive with it."""
    lent = Lent()
    gone = weakref.ref(lent)
    call = _Call(lambda x, y: (type(x).__name__, y), (lent,), {"y": 2})
    del lent
    assert call() == ("Lent", 2) and gone() is None
    with pytest.raises(AssertionError, match="runs once"):
        call()


async def test_in_thread_returns_what_the_function_returns_and_holds_no_argument_after() -> None:
    lent = Lent()
    gone = weakref.ref(lent)
    assert await in_thread(lambda x, y: (x is not None, y), lent, y=3) == (True, 3)
    del lent
    assert gone() is None


@pytest.mark.usefixtures("without_garbage_collection")
async def test_in_thread_holds_no_argument_after_the_function_raised() -> None:
    """The exception's traceback holds the frames of the call: none of them may keep it in a reference cycle with
    the future, which would hold the arguments (lent memory) until a garbage collection."""
    lent = Lent()
    gone = weakref.ref(lent)

    def refusing(x: Lent) -> None:
        raise ValueError(f"{type(x).__name__} refused")

    with pytest.raises(ValueError, match="Lent refused"):
        await in_thread(refusing, lent)
    del lent
    await until(lambda: gone() is None)  # the executor's thread lets go of its work item a moment after
