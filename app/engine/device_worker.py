"""A worker: one thread that owns one backend's device, fed through a bounded queue.

The event loop only enqueues and awaits: `matmul()` puts a job on the queue (503 at once when it is full)
and waits on an asyncio future that the worker settles with `call_soon_threadsafe`. The worker compiles
and warms the kernels first (`/readyz` answers 503 until then), then runs jobs in arrival order. Where the
backend allows more than one launch in flight (`max_in_flight`), the worker submits the next launch while the
previous one still runs, so its staging and copy in overlap the previous kernel; with launches running and
nothing queued it sleeps until a job arrives or the device calls back. A finished launch is always answered
before anything new is submitted, and the batching window is only waited for when the device is idle.

A job leaves the queue unrun when its caller goes away (cancelled) or its deadline passes while it still
waits (504): whichever of the worker (starting it) and the event loop (dropping it) comes first wins, under
the job's lock, so no device time is spent for nobody and no answer is lost. A caller cancelled while its job
runs still waits for the launch to end before the cancellation goes on: when `matmul` returns or raises, the
device no longer reads its operands or writes its output, so their memory may be reused at once. A dropped job
frees its place in the queue at once (the bound counts jobs still waiting, not entries) and lets go of its
operands; the worker skips its empty entry when it comes to it.

When the backend reports the device lost (a sticky CUDA error poisons the process's context), the engine
fails, answers every queued job with 503, and calls `on_device_lost` so the process can exit and be
restarted with a fresh context.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from time import perf_counter

import numpy as np

from app.awaiting import settled
from app.engine.base import Backend, Launch, Outcome, Plan
from app.errors import (
    DeadlineExceeded,
    DeviceFailure,
    DeviceLost,
    InvalidInput,
    MatmulError,
    NotReady,
    Overloaded,
)
from app.shapes import products_in

log = logging.getLogger(__name__)


WAKE_CHECK_S = 0.05
"""Longest the worker sleeps on launches in flight without looking at them: a lost device may never call back."""


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class BatchPolicy:
    """Dynamic batching: up to `max_size` queued products of one shape, dtype and kernel run as one launch,
    the first waiting at most `max_delay_s` for others to join."""

    max_size: int
    max_delay_s: float


class _JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DROPPED = "dropped"


@dataclass
class _Job:
    pair: tuple[np.ndarray, np.ndarray] | None
    """The operands, until the job is dropped."""
    dtype: np.dtype
    plan: Plan
    out: np.ndarray | None
    """Where the product goes; None: where the backend puts it."""
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Outcome]
    left_queue: Callable[[], None]
    """Called once, when the job stops waiting (started or dropped)."""
    batch_key: tuple[object, ...]
    """Jobs with equal keys can run as one batched launch (all of them with outputs given, or none)."""
    stack: bool
    """Whether the product is a stack (app/shapes.py): a launch of its own, never merged with other jobs. Kept
    apart from the operands, which a dropped job lets go."""
    enqueued_at: float
    state: _JobState = _JobState.QUEUED
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _leave_queue(self, to: _JobState) -> bool:
        with self.lock:
            if self.state is not _JobState.QUEUED:
                return False
            self.state = to
            if to is _JobState.DROPPED:
                self.pair = None
        self.left_queue()
        return True

    def start(self) -> bool:
        """The worker takes the job; False when the event loop dropped it first."""
        return self._leave_queue(_JobState.RUNNING)

    def drop(self) -> bool:
        """The event loop gives the job up (on the loop's thread); False when the worker already started it."""
        if not self._leave_queue(_JobState.DROPPED):
            return False
        # Cancelling the future also lets go of its callbacks, and so of the caller's frames and operands, which
        # the entry in the queue would otherwise keep until the worker comes to it.
        self.future.cancel()
        return True

    def operands(self) -> tuple[np.ndarray, np.ndarray]:
        """The pair to multiply: only a started job is submitted, and only a dropped one has let it go."""
        if self.pair is None:
            raise RuntimeError("a dropped job was submitted")
        return self.pair


@dataclass(frozen=True)
class _InFlight:
    """Jobs submitted to the backend as one launch, not yet answered."""

    jobs: list[_Job]
    launch: Launch
    began: float


class DeviceWorker:
    """Runs products on its backend's device, in arrival order."""

    def __init__(
        self,
        backend: Backend,
        queue_size: int,
        on_device_lost: Callable[[], None] | None = None,
        batching: BatchPolicy | None = None,
    ) -> None:
        self.backend = backend
        self.queue_size = queue_size
        self.batching = batching
        self._held: collections.deque[_Job | None] = collections.deque()
        self._on_device_lost = on_device_lost
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        """Jobs in arrival order, dropped ones included until the worker skips them; None asks it to stop."""
        self._waiting = 0
        """Jobs queued and neither started nor dropped: what `queue_size` bounds."""
        self._waiting_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"{backend.name}-worker-{backend.device_name}", daemon=True
        )
        self._state = EngineState.STARTING
        self._failure: str | None = None
        self._device_lost = False
        self._running = 0
        self._wake = threading.Event()
        """Set when a job is queued or a launch finishes: what the worker sleeps on while launches run."""

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the worker; it prepares the backend in the background, so this returns at once."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._thread.start()

    async def stop(self) -> None:
        """Let queued jobs finish, then end the worker and release the device."""
        if self._thread.is_alive():
            self._queue.put_nowait(None)
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
        self._state = EngineState.STOPPED

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def device_lost(self) -> bool:
        """Whether a sticky device error ended the engine: the process must restart to use the device again."""
        return self._device_lost

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def queue_depth(self) -> int:
        """Products waiting (dropped ones no longer count)."""
        return self._waiting

    @property
    def load(self) -> int:
        """Products waiting or running: what least-loaded dispatch compares."""
        return self._waiting + self._running

    @property
    def has_room(self) -> bool:
        return self._waiting < self.queue_size

    # --------------------------------------------------------------------------------------- requests

    def check_ready(self) -> None:
        if self._state is EngineState.STARTING:
            raise NotReady("the kernels are still being compiled and warmed; retry shortly")
        if self._state is not EngineState.READY:
            raise NotReady(f"the {self.backend.name} backend is {self._state.value}: {self._failure or 'shut down'}")

    async def matmul(
        self,
        a: np.ndarray,
        b: np.ndarray,
        dtype: np.dtype,
        plan: Plan,
        timeout_s: float | None = None,
        out: np.ndarray | None = None,
    ) -> Outcome:
        """a @ b on the device, into `out` when given. Overloaded at once when the queue is full;
        DeadlineExceeded when the job is still queued `timeout_s` after it was enqueued (a job already running is
        waited for)."""
        self.check_ready()
        loop = asyncio.get_running_loop()
        with self._waiting_lock:
            if self._waiting >= self.queue_size:
                raise self.overloaded()
            self._waiting += 1
        label = plan.config.label if plan.config is not None else None
        job = _Job(
            pair=(a, b),
            dtype=dtype,
            plan=plan,
            out=out,
            loop=loop,
            future=loop.create_future(),
            left_queue=self._left_queue,
            batch_key=(a.shape, b.shape, dtype, plan.kernel, label, plan.precision, *_where(a, b, out)),
            stack=a.ndim > 2 or b.ndim > 2,
            enqueued_at=perf_counter(),
        )
        self._queue.put(job)
        self._wake.set()
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(job.future)
            except TimeoutError:
                if job.drop():
                    raise DeadlineExceeded(
                        f"the product was still queued after its deadline of {timeout_s:g} s and was dropped"
                    ) from None
            except asyncio.CancelledError:
                if not job.drop():
                    await settled(job.future)
                raise
            # past its deadline but running: its launch is waited for, and a cancellation waits for it to end too
            try:
                return await asyncio.shield(job.future)
            except asyncio.CancelledError:
                await settled(job.future)
                raise
        finally:
            # A refusal's traceback holds this frame, and the frame the job, whose future holds the refusal: a cycle,
            # which would keep the operands until a garbage collection.
            del job

    def overloaded(self) -> Overloaded:
        return Overloaded(f"the {self.backend.name} worker's queue is full ({self.queue_size} waiting); retry later")

    def _left_queue(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

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
        in_flight: collections.deque[_InFlight] = collections.deque()
        depth = self.backend.max_in_flight
        while True:
            self._wake.clear()
            waiting = bool(self._held) or not self._queue.empty()
            if in_flight and (in_flight[0].launch.done() or len(in_flight) >= depth):
                self._finish(in_flight.popleft())
            elif self._state is EngineState.FAILED:
                break
            elif in_flight and not waiting:
                self._wake.wait(WAKE_CHECK_S)
            elif not self._start_next(in_flight):
                break
            self._running = sum(len(launch.jobs) for launch in in_flight)
        while in_flight:
            self._finish(in_flight.popleft())
        self._running = 0
        if self._state is EngineState.FAILED:
            self._fail_queued()
        else:
            self.backend.close()

    def _start_next(self, in_flight: collections.deque[_InFlight]) -> bool:
        """Take the next job and those that batch with it, and submit them; False when the queue says to stop.
        A method of its own so that no variable of the loop keeps the last jobs' operands and products alive
        after they are answered (a client's shared-memory region is unmapped only once none does)."""
        job = self._next_job()
        if job is None:
            return False
        batch = [j for j in self._gather(job, device_idle=not in_flight) if j.start()]
        self._running += len(batch)
        in_flight.extend(self._submit(batch) if batch else [])
        return True

    def _next_job(self) -> _Job | None:
        return self._held.popleft() if self._held else self._queue.get()

    def _gather(self, first: _Job, device_idle: bool) -> list[_Job]:
        """`first` and the jobs of the same shape, dtype and kernel that arrive within the batching delay (none
        while the device is busy: the batch takes what is queued), up to the batch size; other jobs pulled
        meanwhile are held, in order, for the next rounds. A stack is a launch of its own: it is never merged."""
        policy = self.batching
        if policy is None or policy.max_size == 1 or first.stack or not self.backend.batchable(first.plan):
            return [first]
        batch = [first]
        deadline = perf_counter() + (policy.max_delay_s if device_idle else 0.0)
        while len(batch) < policy.max_size:
            try:
                job = self._queue.get(timeout=max(deadline - perf_counter(), 0.0))
            except queue.Empty:
                break
            if job is not None and job.batch_key == first.batch_key:
                batch.append(job)
            else:
                self._held.append(job)
            if job is None:
                break
        return batch

    def _submit(self, batch: list[_Job]) -> list[_InFlight]:
        """Submit the batch as one launch; if one operand spoils it (an overflowing value), submit each job
        alone so that only its own request gets the error."""
        began = perf_counter()
        first = batch[0]
        try:
            outputs = None if first.out is None else [j.out for j in batch if j.out is not None]
            pairs = [j.operands() for j in batch]
            launch = self.backend.submit(pairs, first.dtype, first.plan, self._wake.set, outputs)
        except InvalidInput as exc:
            if len(batch) > 1:
                return [submitted for job in batch for submitted in self._submit([job])]
            self._answer(batch, [exc])
            return []
        except Exception as exc:
            self._answer(batch, [self._failure_of(exc, first.plan)] * len(batch))
            return []
        return [_InFlight(jobs=batch, launch=launch, began=began)]

    def _finish(self, submitted: _InFlight) -> None:
        """Wait for a launch and answer its jobs."""
        jobs = submitted.jobs
        settled: list[Outcome | BaseException]
        try:
            products, device = submitted.launch.result()
            a, b = jobs[0].operands()
            (m, k), n = a.shape[-2:], b.shape[-1]
            elements = jobs[0].plan.global_elements(m, n, k)  # one launch: one shape, one kernel
            launched = len(jobs) * products_in(a, b)
            settled = [
                Outcome(
                    c=c,
                    plan=j.plan,
                    queue_ms=(submitted.began - j.enqueued_at) * 1e3,
                    device=device,
                    device_name=self.backend.device_name,
                    peaks=self.backend.peaks,
                    global_elements=elements,
                    batch_size=launched,
                )
                for j, c in zip(jobs, products, strict=True)
            ]
        except Exception as exc:
            settled = [self._failure_of(exc, jobs[0].plan)] * len(jobs)
        self._answer(jobs, settled)

    def _failure_of(self, exc: Exception, plan: Plan) -> MatmulError:
        """What a launch's failure tells its requests; a lost device also fails the worker."""
        if isinstance(exc, DeviceLost):
            log.critical("device lost running '%s': %s", plan.kernel, exc.message)
            self._failure = f"the device was lost: {exc.message}"
            self._device_lost = True
            self._state = EngineState.FAILED
            return exc
        if isinstance(exc, MatmulError):
            return exc
        log.exception("%s failed on the %s backend", plan.kernel, self.backend.name)
        failure = DeviceFailure(f"the {self.backend.name} backend failed running '{plan.kernel}': {exc}")
        failure.__cause__ = exc
        return failure

    @staticmethod
    def _answer(jobs: list[_Job], results: list[Outcome | BaseException]) -> None:
        """Settle the jobs' futures on their loops: one wake-up of each loop per launch, not one per job."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Outcome], Outcome | BaseException]]] = {}
        for job, result in zip(jobs, results, strict=True):
            answered = _without_tracebacks(result) if isinstance(result, BaseException) else result
            by_loop.setdefault(job.loop, []).append((job.future, answered))
        for loop, outcomes in by_loop.items():
            loop.call_soon_threadsafe(_settle_all, outcomes)

    def _fail_queued(self) -> None:
        """After the device is lost: answer every queued job with 503, then tell the process."""
        while True:
            try:
                job = self._held.popleft() if self._held else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.start():
                job.loop.call_soon_threadsafe(_settle, job.future, NotReady(self._failure or "the device was lost"))
        if self._on_device_lost is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_device_lost)


def _where(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> tuple[bool, bool, bool | None]:
    """Whether A, B and C lie in host memory (else a client's device memory; C: None when the backend allocates it),
    part of a job's batch key: one launch copies all of its A, B and C one way."""
    return isinstance(a, np.ndarray), isinstance(b, np.ndarray), None if out is None else isinstance(out, np.ndarray)


def _without_tracebacks(error: BaseException) -> BaseException:
    """`error`, and the errors it was raised from or while handling, without their tracebacks: it is answered to a
    request. A traceback holds the frames it passed through, here the worker's, which hold the launch's jobs, whose
    futures would then hold the error: a reference cycle, keeping every operand of the launch (a lent body, a
    client's shared-memory region) until a garbage collection. An unexpected failure was logged with its traceback
    before (`_failure_of`); the service's own errors are answered by their code and message."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        pending += [link.__cause__, link.__context__]
    return error


def _settle_all(settled: list[tuple[asyncio.Future[Outcome], Outcome | BaseException]]) -> None:
    for future, outcome in settled:
        _settle(future, outcome)


def _settle(future: asyncio.Future[Outcome], outcome: Outcome | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
