"""The engine: one worker thread that owns the backend's device, fed through a bounded queue.

The event loop only enqueues and awaits: `matmul()` puts a job on the queue (503 at once when it is full)
and waits on an asyncio future that the worker settles with `call_soon_threadsafe`. The worker compiles
and warms the kernels first (`/readyz` answers 503 until then), then runs jobs one at a time; a job whose
caller has gone away (its future cancelled) is skipped, so no device time is spent for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from time import perf_counter
from typing import Any

import numpy as np

from app.engine.base import Backend, KernelInfo, Outcome, Plan
from app.errors import DeviceFailure, MatmulError, NotReady, Overloaded

log = logging.getLogger(__name__)


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class _Job:
    a: np.ndarray
    b: np.ndarray
    dtype: np.dtype
    plan: Plan
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Outcome]
    enqueued_at: float = field(default_factory=perf_counter)
    abandoned: threading.Event = field(default_factory=threading.Event)


class Engine:
    """Runs products on its backend's device, one at a time, in arrival order."""

    def __init__(self, backend: Backend, queue_size: int) -> None:
        self.backend = backend
        self.queue_size = queue_size
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name=f"{backend.name}-worker", daemon=True)
        self._state = EngineState.STARTING
        self._failure: str | None = None

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the worker; it prepares the backend in the background, so this returns at once."""
        self._thread.start()

    async def stop(self) -> None:
        """Let queued jobs finish, then end the worker and release the device."""
        if self._thread.is_alive():
            await asyncio.to_thread(self._queue.put, None)
            await asyncio.to_thread(self._thread.join)
        self._state = EngineState.STOPPED

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def kernels(self) -> list[KernelInfo]:
        return self.backend.kernels()

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    # --------------------------------------------------------------------------------------- requests

    def plan(self, kernel: str, tile: int | None, m: int, n: int, k: int) -> Plan:
        return self.backend.plan(kernel, tile, m, n, k)

    def check_ready(self) -> None:
        if self._state is EngineState.STARTING:
            raise NotReady("the kernels are still being compiled and warmed; retry shortly")
        if self._state is not EngineState.READY:
            raise NotReady(f"the {self.backend.name} backend is {self._state.value}: {self._failure or 'shut down'}")

    async def matmul(self, a: np.ndarray, b: np.ndarray, dtype: np.dtype, plan: Plan) -> Outcome:
        """a @ b on the device; Overloaded at once when the queue is full."""
        self.check_ready()
        loop = asyncio.get_running_loop()
        job = _Job(a=a, b=b, dtype=dtype, plan=plan, loop=loop, future=loop.create_future())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                f"the {self.backend.name} worker's queue is full ({self.queue_size} waiting); retry later"
            ) from None
        job.future.add_done_callback(lambda f: job.abandoned.set() if f.cancelled() else None)
        return await job.future

    # -------------------------------------------------------------------------------- the worker thread

    def _run(self) -> None:
        started = perf_counter()
        try:
            self.backend.prepare()
        except Exception as exc:
            self._failure = f"preparing the kernels failed: {exc}"
            self._state = EngineState.FAILED
            log.exception("the %s backend failed to start", self.backend.name)
            return
        self._state = EngineState.READY
        log.info(
            "%s backend ready on %s in %.2f s", self.backend.name, self.backend.device_name, perf_counter() - started
        )
        while (job := self._queue.get()) is not None:
            if job.abandoned.is_set():
                continue
            self._execute(job)
        self.backend.close()

    def _execute(self, job: _Job) -> None:
        began = perf_counter()
        settled: Outcome | BaseException
        try:
            c, device = self.backend.multiply(job.a, job.b, job.dtype, job.plan)
            settled = Outcome(c=c, plan=job.plan, queue_ms=(began - job.enqueued_at) * 1e3, device=device)
        except MatmulError as exc:
            settled = exc
        except Exception as exc:
            log.exception("%s failed on the %s backend", job.plan.kernel, self.backend.name)
            settled = DeviceFailure(f"the {self.backend.name} backend failed running '{job.plan.kernel}': {exc}")
            settled.__cause__ = exc
        job.loop.call_soon_threadsafe(_settle, job.future, settled)


def _settle(future: asyncio.Future[Outcome], outcome: Outcome | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
