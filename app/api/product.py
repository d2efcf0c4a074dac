"""The steps every product route shares: check, plan, run on the engine, time, and leave a record.

`/matmul` and the inference protocol's `infer` differ only in how bodies are read and answers written;
everything between (shape checks, dtype, kernel plan, the engine, the timing breakdown) lives here, and
the record left on `request.state.product` is what access logs and metrics read.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, TypeVar, cast

import numpy as np
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from app import codecs
from app.api.schemas import DtypeName, MatmulMetadata, RooflineModel, Timing
from app.config import Settings
from app.engine import Engine, Outcome
from app.errors import ClientGone, InvalidParameter, MalformedPayload, MatmulError, PayloadTooLarge
from kernels.roofline import roofline

log = logging.getLogger(__name__)
T = TypeVar("T")
TIMEOUT_HEADER = "X-Request-Timeout"


async def off_loop_if_large(size: int, settings: Settings, function: Callable[..., T], *args: Any) -> T:
    """Run `function` on the event loop for small inputs, in a worker thread for large ones."""
    if size <= settings.inline_codec_bytes:
        return function(*args)
    return await run_in_threadpool(function, *args)


async def decode_client_bytes(what: str, size: int, settings: Settings, decoder: Callable[..., T], *args: Any) -> T:
    """Run a decoder on bytes a client sent (off the loop when large), and decide what its failures are: the
    decoders raise a MatmulError that names what was wrong, and anything else they raise (a parser's failure
    mode nobody foresaw) is still the client's malformed `what`, a 422 naming the exception, never a 500. Such an
    exception is logged once with its traceback, to be given a message of its own."""
    try:
        return await off_loop_if_large(size, settings, decoder, *args)
    except MatmulError:
        raise
    except Exception as exc:
        log.warning("the %s raised %s in %s", what, type(exc).__name__, decoder.__qualname__, exc_info=exc)
        said = str(exc)[:200] or type(exc).__name__
        raise MalformedPayload(f"the {what} cannot be decoded: {said}") from exc


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit` bytes (declared or received)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the {what} is {int(declared)} bytes, over the limit of {limit}")
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise PayloadTooLarge(f"the {what} passed the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after sending {received} bytes of the {what}") from None
    return b"".join(chunks)


def limits_of(settings: Settings) -> codecs.Limits:
    return codecs.Limits(
        max_dim=settings.max_dim,
        max_elements=settings.max_elements,
        max_result_elements=settings.max_result_elements,
    )


@dataclass
class Stopwatch:
    """The checkpoints of one request, in perf_counter seconds."""

    received: float = field(default_factory=perf_counter)
    read_ms: float = 0.0
    decoded: float = 0.0
    computed: float = 0.0

    def mark_decoded(self) -> None:
        self.decoded = perf_counter()


@dataclass(frozen=True)
class Product:
    outcome: Outcome
    dtype: np.dtype
    m: int
    k: int
    n: int


def queue_timeout_s(request: Request, settings: Settings) -> float:
    """How long the product may wait in the queue: X-Request-Timeout (seconds) if sent, at most the default."""
    sent = request.headers.get(TIMEOUT_HEADER)
    if sent is None:
        return settings.request_timeout_s
    try:
        seconds = float(sent)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 86_400:
        raise InvalidParameter(
            f"{TIMEOUT_HEADER} must be a number of seconds in (0, 86400], not {sent!r}", location=[TIMEOUT_HEADER]
        )
    return min(seconds, settings.request_timeout_s)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def compute(
    request: Request, engine: Engine, settings: Settings, operands: codecs.Operands, options: codecs.RequestOptions
) -> Product:
    """Check the operands multiply, resolve dtype and kernel, and run the product on the engine; a client
    that disconnects while its product waits takes the product out of the queue."""
    limits = limits_of(settings)
    a, b = operands.a, operands.b
    codecs.check_product(a, b, limits)
    working = codecs.working_dtype(options.dtype, operands)
    (m, k), n = a.shape, b.shape[1]
    timeout_s = queue_timeout_s(request, settings)
    product = asyncio.ensure_future(engine.matmul(a, b, working, options.kernel or "auto", options.tile, timeout_s))
    disconnect = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({product, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not product.done():
            product.cancel()
    if not product.done() or product.cancelled():
        raise ClientGone("the client disconnected before its product was computed")
    return Product(outcome=product.result(), dtype=working, m=m, k=k, n=n)


def roofline_of(product: Product) -> RooflineModel:
    """The product against the roofs of the device that computed it."""
    outcome = product.outcome
    line = roofline(
        outcome.plan.config,
        (product.m, product.n, product.k),
        product.dtype,
        outcome.batch_size,
        outcome.device.kernel_ms,
        outcome.peaks,
    )
    return RooflineModel.model_validate(line, from_attributes=True)


def describe(request: Request, engine: Engine, product: Product, clock: Stopwatch) -> MatmulMetadata:
    """The metadata of a finished product (encoding done now), also left on request.state for observers."""
    finished = perf_counter()
    device = product.outcome.device
    flops = 2 * product.m * product.n * product.k
    meta = MatmulMetadata(
        shape=(product.m, product.n),
        dtype=cast(DtypeName, product.dtype.name),
        kernel=product.outcome.plan.kernel,
        tile=product.outcome.plan.tile,
        backend=engine.backend_name,
        device=product.outcome.device_name,
        timing=Timing(
            read_ms=clock.read_ms,
            decode_ms=(clock.decoded - clock.received) * 1e3 - clock.read_ms,
            queue_ms=product.outcome.queue_ms,
            h2d_ms=device.h2d_ms,
            kernel_ms=device.kernel_ms,
            d2h_ms=device.d2h_ms,
            encode_ms=(finished - clock.computed) * 1e3,
            total_ms=(finished - clock.received) * 1e3,
        ),
        gflops=flops * product.outcome.batch_size / (device.kernel_ms * 1e6)
        if flops and device.kernel_ms > 0
        else None,
        batch_size=product.outcome.batch_size,
        roofline=roofline_of(product),
    )
    request.state.product = meta
    return meta


def server_timing(timing: Timing) -> str:
    """The W3C Server-Timing header value: `read;dur=0.021, decode;dur=0.090, ...` in milliseconds."""
    return ", ".join(f"{name.removesuffix('_ms')};dur={value:.3f}" for name, value in timing.model_dump().items())
