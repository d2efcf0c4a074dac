"""Waiting for work that goes on whether or not its caller does: a worker thread, a device's launch, a task whose
memory is given back after it.

Cancelling a task that awaits `asyncio.to_thread` (or anyio's) lets the task go on at once while the thread keeps
running; cancelling a task that awaits a launch does not stop the device. Memory such work reads or writes may be
given back only once it has ended, so a caller that lends memory to it waits for it with `settled`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def settled(future: asyncio.Future[Any]) -> None:
    """Return once `future` is done (its result or exception stays in it), however often the caller is cancelled
    meanwhile; a cancellation of the caller is raised then, not before. `future` itself is never cancelled here."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class _Call(Generic[T]):
    """function(*args, **kwargs), run once, letting go of its arguments as it returns: the executor keeps its work
    item (this call) a moment after the caller has the result, and an argument viewing lent memory would keep that
    memory in use past the caller's giving it back (a mapping would not close)."""

    def __init__(self, function: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.parts: tuple[Callable[..., T], tuple[Any, ...], dict[str, Any]] | None = (function, args, kwargs)

    def __call__(self) -> T:
        assert self.parts is not None, "a call runs once"
        function, args, kwargs = self.parts
        self.parts = None
        return function(*args, **kwargs)


async def in_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """function(*args, **kwargs) in a worker thread of the loop's executor, waited for to its end (`settled`)
    even when the caller is cancelled: whatever it reads or writes stays in use until this returns or raises, and
    no longer (the thread holds none of its arguments after)."""
    thread: asyncio.Future[T] = asyncio.get_running_loop().run_in_executor(None, _Call(function, args, kwargs))
    await settled(thread)
    try:
        return thread.result()
    finally:
        # A raised exception's traceback holds this frame, and the frame the future that holds the exception: a
        # cycle, which would keep the call's arguments (lent memory among them) until a garbage collection.
        del thread
