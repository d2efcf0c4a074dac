"""Client processes that start measuring together, for benchmarks whose load comes from several processes.

`TogetherPool` spawns its processes once and runs a cell's shares in them, one share a process. Each share warms
up, says so, and waits for the start (`StartSignal.wait_for_start`): one wall-clock time for all of them, set once
every share of the cell has warmed up, so that their measured windows coincide. A share that fails before the start
raises its error in the parent; then, or when the warm-up takes too long, every share is started at once with a
window long closed, so that none is left waiting.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any, Generic, TypeVar

Share = TypeVar("Share")
Result = TypeVar("Result")
CLOSED = 0.0
"""The start a share gets when the cell failed: a window that closed long ago."""


@dataclass(frozen=True)
class StartSignal:
    """What the client processes share with the parent, given to each when it is spawned."""

    warmed: multiprocessing.Queue[int]
    go: Event
    start_at: Synchronized[float]

    def wait_for_start(self, tag: int = 0, timeout_s: float | None = None) -> float:
        """Say that this share (of the cell `tag`) has warmed up, then wait for the start: its time (time.time()), or
        CLOSED when the cell failed or no start came within `timeout_s`."""
        self.warmed.put(tag)
        if not self.go.wait(timeout=timeout_s):
            return CLOSED
        return float(self.start_at.value)


class TogetherPool(Generic[Share, Result]):
    """`processes` spawned processes, each set up by `initializer(*initargs, signal)` once (what a process keeps from
    cell to cell: encoded bodies, operands), that run the shares of one cell after another."""

    def __init__(self, processes: int, initializer: Callable[..., None], initargs: tuple[Any, ...] = ()) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes = processes
        self.signal = StartSignal(context.Queue(), context.Event(), context.Value("d", CLOSED))
        self._pool = context.Pool(processes, initializer, (*initargs, self.signal))

    def run(
        self, run_share: Callable[[Share], Result], shares: Sequence[Share], warmup_s: float, timeout_s: float, tag: int
    ) -> list[Result]:
        """`run_share(share)` for each share, in a process of its own; their start is `warmup_s` after the last share
        of the cell `tag` said it had warmed up (a late word from an earlier, failed cell is left aside)."""
        signal = self.signal
        signal.go.clear()
        pending = [self._pool.apply_async(run_share, (share,)) for share in shares]
        try:
            deadline = time.monotonic() + timeout_s
            for _ in shares:
                self._wait_warmed(tag, pending, deadline)
            signal.start_at.value = time.time() + warmup_s
        except BaseException:
            signal.start_at.value = CLOSED
            signal.go.set()
            for result in pending:
                result.wait()
            raise
        signal.go.set()
        return [result.get() for result in pending]

    def _wait_warmed(self, tag: int, pending: list[AsyncResult[Result]], deadline: float) -> None:
        while True:
            try:
                if self.signal.warmed.get(timeout=0.5) == tag:
                    return
            except queue.Empty:
                for result in pending:
                    if result.ready():
                        result.get()  # a share cannot end before the start unless it failed: raise its error
                if time.monotonic() > deadline:
                    raise TimeoutError("the client processes did not finish warming up in time") from None

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
