"""Soak a running matmul-service: minutes of valid, invalid and oversized requests at a rate above its capacity.

Requests start at a fixed `--rate` whatever the server does (open loop, as in loadtest.py), over up to
`--concurrency` connections (more than the server's queue holds, so that it overflows), from
`--client-processes` processes that share the rate and the connections (one Python process sends a few hundred
requests a second at most: the client must not be what limits the load), drawn from a mix of three kinds
(`--mix`):

- valid: products of four shapes up to 256^3, float32 and float64, as multipart `.npy`, JSON and `.npz` (those
  within `--max-body-bytes`), and each shape once more with a 1 ms deadline (`X-Request-Timeout`), answered 200
  or, when it waited longer in the queue, 504. Every 200 answer is compared with the float64 product of its own
  operands: each client process draws operands of its own, VARIANTS pairs of each request, so that an answer
  carrying another request's product (memory reused too early) shows;
- invalid: malformed, empty and non-object JSON, ragged rows, strings, NaN tokens, truncated `.npy`, shapes
  that do not multiply, unknown kernels, out-of-range and huge parameters, wrong media types, an Accept the
  service cannot answer, garbage `.npz`, broken inference requests and an unknown model;
- oversized: `.npy` headers that claim 2^31 x 2^31, a product whose result would have 2^32 elements (over the
  default limits), and a body one byte over the server's limit (`--max-body-bytes`; sent when at most 64 MiB).

A request due while every connection of its process is busy is not sent, and counted as `not sent`: the server
then has `--concurrency` requests at all times, and the client does not pile up waiting requests until it, not
the server, is what runs slow.

The run stops starting requests after `--minutes` or `--max-requests` (default: rate x duration), whichever
comes first, waits up to `--grace` seconds for the answers still due (those left are counted as `abandoned`;
where the client itself cannot keep up, its lag shows in the latencies), then for the server's queue to
empty. It fails (exit 1) unless:

1. the server answers at least one request (a soak that gets no answer tests nothing);
2. no answer is wrong: not one 200 whose product is not its request's (the first figure the report gives);
3. no answer is a 5xx other than 503 (overloaded, not ready) or 504 (deadline exceeded);
4. the server's resident memory (`process_resident_memory_bytes`) and device pool (`matmul_device_memory_bytes`),
   read from GET /metrics after a warm-up (one of each request) and at the end, grew by at most
   `--max-rss-growth-mib` and `--max-device-growth-mib`;
5. the resident memory, also read every `--memory-every` seconds under load and at its end (a load shorter than
   twice that is first read halfway through), grew by at most `--max-rss-load-growth-mib` from the first of those
   readings to the last: the allocator keeps the high-water mark of the requests in flight at once (a plateau
   reached in seconds), a leak grows with the requests.

    python scripts/soak.py --url http://localhost:8000 --minutes 3 --rate 400
    python scripts/soak.py --minutes 0.1 --rate 100 --mix valid:1,invalid:1 --out out/soak-short

Prints a summary and writes `--out` (default out/soak.json): the configuration, counts by status and kind,
latency by kind, every failure found (request, status, the server's message) and the memory readings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import multiprocessing
import multiprocessing.synchronize
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

from app.codecs import JSON_MEDIA_TYPE, NPY_MEDIA_TYPE, NPZ_MEDIA_TYPE
from matmul_client.client import (
    FORMATS,
    MAX_TIMEOUT_S,
    AsyncMatmulClient,
    MatmulServiceError,
    RequestFormat,
    encode_payload,
)
from matmul_tools.bodies import load_npy, npy_bytes, zip_members
from matmul_tools.integrity import check
from matmul_tools.loadtest import open_loop, parse_mix, server_arguments, summarize, wait_ready
from matmul_tools.outputs import unwritable
from matmul_tools.prometheus import sample_sums

Kind = Literal["valid", "invalid", "oversized"]
KINDS: tuple[Kind, ...] = ("valid", "invalid", "oversized")
TOLERATED_5XX = (503, 504)
"""Overload (queue full, not ready) and deadlines: what a service above its capacity answers, by design."""
RSS_METRIC = "process_resident_memory_bytes"
DEVICE_METRIC = "matmul_device_memory_bytes"
QUEUE_METRIC = "matmul_queue_depth"
OVERSIZED_BODY_CAP = 64 << 20
VALID_SHAPES = ((8, 8, 8), (64, 64, 64), (128, 32, 96), (256, 256, 256))
MIB = 1 << 20
TIGHT_DEADLINE_S = 0.001
"""The deadline of the hurried valid probes: under load some wait longer in the queue, and get 504."""
VARIANTS = 8
"""Operand pairs of each valid request a client process holds, drawn in turn: requests of one shape in flight at
once carry different operands, so that an answer swapped or overwritten between them is caught."""
MEMORY_BOUNDS = (
    (
        "--max-rss-growth-mib",
        640.0,
        "bound on the server's RSS growth over the run: room for the allocator to keep what --concurrency requests "
        "in flight at once held (64 of the largest valid ones, 256^2 float64 as JSON, hold about 9 MiB each: body, "
        "parsed lists, arrays, answer)",
    ),
    (
        "--max-rss-load-growth-mib",
        64.0,
        "bound on the RSS growth from the first reading under load to the last, once that high-water mark is "
        "reached: a leak grows with the requests",
    ),
    (
        "--max-device-growth-mib",
        512.0,
        "bound on the device pool's growth: room for the blocks it caches for the largest products",
    ),
)
"""The memory checks' options (MiB): option, default and what it bounds."""
NOT_SENT = "not sent"
"""The status of a request due while every connection of its process was busy."""
MIN_MEMORY_EVERY_S = 0.5
"""The shortest time between two readings of /metrics under load: each one is a request the server answers too."""


# ------------------------------------------------------------------------------------------- the requests


@dataclass(frozen=True)
class Probe:
    """One request the soak sends again and again; a valid one carries its operands, to check the answer."""

    kind: Kind
    name: str
    content: bytes = field(repr=False)
    content_type: str
    path: str = "/matmul"
    params: dict[str, str] = field(default_factory=dict)
    accept: str = NPY_MEDIA_TYPE
    operands: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    deadline_s: float | None = None
    """Sent as X-Request-Timeout: the longest the product may wait in the server's queue."""


def _header_claiming(shape: tuple[int, int]) -> bytes:
    """A float32 .npy header that claims `shape`, followed by 16 bytes of data."""
    buffer = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + bytes(16)


def _product(
    kind: Kind, name: str, a: np.ndarray, b: np.ndarray, format: RequestFormat = "npy", **params: str
) -> Probe:
    """A /matmul request for a @ b, encoded as the client encodes it."""
    payload = encode_payload(a, b, format)
    accept = JSON_MEDIA_TYPE if payload.answer == "json" else NPY_MEDIA_TYPE
    operands = (a, b) if kind == "valid" else None
    return Probe(kind, name, payload.content, payload.content_type, params=params, accept=accept, operands=operands)


def valid_probes(rng: np.random.Generator, max_body_bytes: int, variants: int = VARIANTS) -> list[Probe]:
    """Every shape x dtype x format whose body the server's limit lets through, `variants` times over with operands
    of their own."""
    probes = []
    for _, (m, k, n) in itertools.product(range(variants), VALID_SHAPES):
        for dtype in ("float32", "float64"):
            a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
            for format in FORMATS:
                probes.append(_product("valid", f"{format} {m}x{k}x{n} {dtype}", a, b, format, dtype=dtype))
        a, b = a.astype(np.float32), b.astype(np.float32)
        hurried = _product("valid", f"npy {m}x{k}x{n} float32, 1 ms deadline", a, b, dtype="float32")
        probes.append(replace(hurried, deadline_s=TIGHT_DEADLINE_S))
    return [probe for probe in probes if len(probe.content) <= max_body_bytes]


def invalid_probes(rng: np.random.Generator) -> list[Probe]:
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    infer, json = "/v2/models/matmul/infer", JSON_MEDIA_TYPE
    lying_infer = (
        b'{"inputs": [{"name": "A", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3]},'
        b' {"name": "B", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'
    )
    bodies = {
        "json not an object": b"[1, 2]",
        "json malformed": b'{"a": [[1, 2]',
        "json empty": b"",
        "json ragged": b'{"a": [[1, 2], [3]], "b": [[1]]}',
        "json strings": b'{"a": [["x"]], "b": [[1]]}',
        "json NaN token": b'{"a": [[NaN]], "b": [[1]]}',
    }
    return [
        *(Probe("invalid", name, body, json, accept=json) for name, body in bodies.items()),
        _product("invalid", "shapes do not multiply", a, a),
        _product("invalid", "unknown kernel", a, b, kernel="no-such-kernel"),
        _product("invalid", "tile out of range", a, b, tile="100000"),
        _product("invalid", "huge query number", a, b, tile="9" * 400),
        _product("invalid", "unsupported dtype", a, b, dtype="float16"),
        Probe("invalid", "truncated npy", zip_members(a=npy_bytes(a)[:100], b=npy_bytes(b)), NPZ_MEDIA_TYPE),
        Probe("invalid", "garbage npz", rng.bytes(512), NPZ_MEDIA_TYPE),
        Probe("invalid", "wrong media type", b"a,b\n1,2\n", "text/csv"),
        Probe(
            "invalid", "not acceptable", zip_members(a=npy_bytes(a), b=npy_bytes(b)), NPZ_MEDIA_TYPE, accept="text/html"
        ),
        Probe("invalid", "infer malformed", b'{"inputs": [', json, path=infer, accept=json),
        Probe("invalid", "infer data short of its shape", lying_infer, json, path=infer, accept=json),
        Probe("invalid", "infer unknown model", b"{}", json, path="/v2/models/no-such-model/infer", accept=json),
    ]


def smallest_product_bytes() -> int:
    """The body of the smallest valid request the soak sends: a --max-body-bytes below it leaves none to send. Read
    from the binary bodies of the smallest shape in float32, whose sizes do not depend on the operands' values."""
    m, k, n = min(VALID_SHAPES, key=lambda shape: shape[0] * shape[1] * shape[2])
    a, b = np.zeros((m, k), np.float32), np.zeros((k, n), np.float32)
    return min(len(encode_payload(a, b, format).content) for format in FORMATS if format != "json")


def oversized_probes(max_body_bytes: int) -> list[Probe]:
    claims = _header_claiming((1 << 31, 1 << 31))
    column, row = np.ones((65_536, 1), np.float32), np.ones((1, 65_536), np.float32)
    probes = [
        Probe("oversized", "npy headers claim 2^31 x 2^31", zip_members(a=claims, b=claims), NPZ_MEDIA_TYPE),
        _product("oversized", "result of 2^32 elements", column, row),
    ]
    if max_body_bytes + 1 <= OVERSIZED_BODY_CAP:
        probes.append(Probe("oversized", "body one byte over the limit", bytes(max_body_bytes + 1), NPZ_MEDIA_TYPE))
    return probes


def build_probes(seed: int, max_body_bytes: int, variants: int = VARIANTS) -> dict[Kind, list[Probe]]:
    """Every request the soak may send, operands drawn from `seed` (each client process has its own)."""
    rng = np.random.default_rng(seed)
    return {
        "valid": valid_probes(rng, max_body_bytes, variants),
        "invalid": invalid_probes(rng),
        "oversized": oversized_probes(max_body_bytes),
    }


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class Sample:
    start_s: float
    """When the request was due, from the start of the measured run."""
    latency_ms: float
    """From when it was due to its answer (open loop: time waiting for a connection counts)."""
    kind: Kind
    name: str
    status: str
    """The HTTP status, or the httpx exception's name where no answer came."""
    checked: bool = False


@dataclass
class Soak:
    """What `loadtest.open_loop` drives: `issued`, and `one()` sending the next request drawn from the mix."""

    http: httpx.AsyncClient
    probes: dict[Kind, list[Probe]]
    mix: list[tuple[Kind, float]]
    seed: int
    limit: int
    """Requests outstanding at most (the process's connections); one due beyond it is not sent."""
    issued: int = 0
    outstanding: int = 0
    samples: list[Sample] = field(default_factory=list)
    server_errors: list[dict[str, str]] = field(default_factory=list)
    wrong_results: list[dict[str, str]] = field(default_factory=list)
    _random: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def draw(self) -> Probe:
        kinds = [kind for kind, _ in self.mix]
        kind = self._random.choices(kinds, weights=[weight for _, weight in self.mix])[0]
        return self._random.choice(self.probes[kind])

    async def one(self, started: float, due: float) -> None:
        probe = self.draw()
        if self.outstanding >= self.limit:
            self.samples.append(Sample(due - started, 0.0, probe.kind, probe.name, NOT_SENT))
            return
        self.outstanding += 1
        try:
            await self._exchange(probe, started, due)
        finally:
            self.outstanding -= 1

    async def _exchange(self, probe: Probe, started: float, due: float) -> None:
        checked = False
        try:
            response = await send(self.http, probe)
            status = str(response.status_code)
            if response.status_code >= 500 and response.status_code not in TOLERATED_5XX:
                self.server_errors.append({"request": probe.name, "status": status, "body": response.text[:300]})
            if probe.operands is not None and response.status_code == 200:
                checked = True
                wrong = wrong_result(response, *probe.operands)
                if wrong is not None:
                    self.wrong_results.append({"request": probe.name, "error": wrong})
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        sample = Sample(due - started, (time.perf_counter() - due) * 1e3, probe.kind, probe.name, status, checked)
        self.samples.append(sample)


async def send(http: httpx.AsyncClient, probe: Probe) -> httpx.Response:
    headers = {"content-type": probe.content_type, "accept": probe.accept}
    if probe.deadline_s is not None:
        headers["x-request-timeout"] = f"{probe.deadline_s:g}"
    return await http.post(probe.path, params=probe.params, headers=headers, content=probe.content)


@dataclass(frozen=True)
class ClientShare:
    """What one client process sends: its part of the rate, the request cap and the connections."""

    index: int
    processes: int
    url: str
    rate: float
    max_requests: int
    concurrency: int
    seconds: float
    grace: float
    timeout: float
    mix: list[tuple[Kind, float]]
    max_body_bytes: int
    seed: int


@dataclass
class ClientResult:
    issued: int
    samples: list[Sample]
    server_errors: list[dict[str, str]]
    wrong_results: list[dict[str, str]]
    load_window: tuple[float, float]
    """When the process started sending and when it stopped waiting for answers (`time.time()`, which every
    process reads alike)."""


_load_started: multiprocessing.synchronize.Event | None = None
"""In a client process: set when it starts sending, for the parent's memory readings under load."""


def share_load_start(event: multiprocessing.synchronize.Event) -> None:
    """The client processes' initializer: the event they set when they start sending."""
    global _load_started
    _load_started = event


def run_client(share: ClientShare) -> ClientResult:
    """A client process: its share of the open loop, then everything it saw."""
    return asyncio.run(_drive(share))


async def _drive(share: ClientShare) -> ClientResult:
    probes = build_probes(share.seed * 1000 + share.index, share.max_body_bytes)
    limits = httpx.Limits(max_connections=share.concurrency, max_keepalive_connections=share.concurrency)
    # A request still waiting for a connection after --timeout s is counted as PoolTimeout, not queued forever.
    async with httpx.AsyncClient(base_url=share.url, timeout=share.timeout, limits=limits) as http:
        run = Soak(http, probes, share.mix, share.seed + 1 + share.index, share.concurrency)
        if _load_started is not None:
            _load_started.set()
        load_start, started = time.time(), time.perf_counter()
        tick = progress_printer(run, started, f"client {share.index + 1}/{share.processes}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                open_loop(run, share.rate, share.max_requests, started + share.seconds, tick),
                share.seconds + share.grace,
            )
    return ClientResult(run.issued, run.samples, run.server_errors, run.wrong_results, (load_start, time.time()))


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def shares(args: argparse.Namespace) -> list[ClientShare]:
    processes = min(args.client_processes, args.concurrency)
    return [
        ClientShare(
            index=i,
            processes=processes,
            url=args.url,
            rate=args.rate / processes,
            max_requests=requests,
            concurrency=concurrency,
            seconds=args.minutes * 60,
            grace=args.grace,
            timeout=args.timeout,
            mix=args.mix,
            max_body_bytes=args.max_body_bytes,
            seed=args.seed,
        )
        for i, (requests, concurrency) in enumerate(
            zip(split(args.max_requests, processes), split(args.concurrency, processes), strict=True)
        )
    ]


def wrong_result(response: httpx.Response, a: np.ndarray, b: np.ndarray) -> str | None:
    """What is wrong with the product in `response` (a .npy or JSON answer), or None when it is a @ b."""
    if response.headers.get("content-type", "").startswith(NPY_MEDIA_TYPE):
        c = load_npy(response.content)
    else:
        # JSON null (NaN, Inf) reads as NaN; a float32 product's numbers read back as exactly its float32 values
        c = np.array(response.json()["result"], dtype=np.float64)
    return check(c, a, b)


async def read_metrics(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's resident memory, device pool and queue depth from GET /metrics (summed over label sets)."""
    response = await http.get("/metrics")
    response.raise_for_status()
    return sample_sums(response.text, (RSS_METRIC, DEVICE_METRIC, QUEUE_METRIC))


async def watch_memory(
    http: httpx.AsyncClient,
    clients: list[asyncio.Future[ClientResult]],
    load_started: multiprocessing.synchronize.Event,
    load_s: float,
    every_s: float,
) -> list[dict[str, float | None]]:
    """The server's resident memory under load, at seconds from its start: the first reading `every_s` seconds in
    (halfway through a load of `load_s` shorter than twice that, so that a short run has two readings too), then
    every `every_s` seconds, and the last when every client process is done."""
    waiting: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(load_started.wait))
    await asyncio.wait([waiting, *clients], return_when=asyncio.FIRST_COMPLETED)
    load_started.set()  # frees the waiting thread where a client process ended before it started sending
    await waiting
    started = time.perf_counter()
    wait_s = min(every_s, load_s / 2)
    timeline: list[dict[str, float | None]] = []
    while not all(client.done() for client in clients):
        await asyncio.wait(clients, timeout=wait_s)
        wait_s = every_s
        try:
            rss: float | None = (await read_metrics(http)).get(RSS_METRIC, 0.0) / MIB
        except httpx.HTTPError:
            rss = None  # the server too busy to answer in time: a gap, not a failure
        timeline.append({"s": round(time.perf_counter() - started, 1), "rss_mib": rss})
        print(f"{timeline[-1]['s']:6.0f} s: server RSS {'-' if rss is None else f'{rss:.1f} MiB'}", flush=True)
    return timeline


async def settle(http: httpx.AsyncClient, seconds: float = 30.0) -> None:
    """Wait (at most `seconds`) for the server's queue to empty, so the end reading sees no request's data."""
    for _ in range(round(seconds / 0.2)):
        if (await read_metrics(http)).get(QUEUE_METRIC, 0.0) == 0:
            return
        await asyncio.sleep(0.2)


# --------------------------------------------------------------------------------------------- the report


def memory_check(name: str, start: dict[str, float], end: dict[str, float], bound_mib: float) -> dict[str, Any]:
    if name not in start or name not in end:
        return {"metric": name, "passed": False, "error": f"GET /metrics does not expose {name}"}
    growth = (end[name] - start[name]) / MIB
    return {
        "metric": name,
        "start_mib": start[name] / MIB,
        "end_mib": end[name] / MIB,
        "growth_mib": growth,
        "bound_mib": bound_mib,
        "passed": growth <= bound_mib,
    }


def steady_rss_check(timeline: list[dict[str, float | None]], bound_mib: float) -> dict[str, Any]:
    """Growth of the server's RSS from the first reading under load to the last: what a leak shows (growth with
    the number of requests) once the allocator has reached the high-water mark of the requests in flight."""
    readings = [(r["s"], r["rss_mib"]) for r in timeline if r["rss_mib"] is not None and r["s"] is not None]
    if len(readings) < 2:
        return {"readings": len(readings), "passed": False, "error": "fewer than two readings under load"}
    (first_s, first), (last_s, last) = readings[0], readings[-1]
    return {
        "from_s": first_s,
        "to_s": last_s,
        "start_mib": first,
        "end_mib": last,
        "growth_mib": last - first,
        "bound_mib": bound_mib,
        "passed": last - first <= bound_mib,
    }


def load_seconds(clients: list[ClientResult]) -> float:
    """From the first client process's start of sending to the last one's end: the processes' start-up, which
    takes seconds, is not time the server had the load."""
    if not clients:
        return 0.0
    windows = [client.load_window for client in clients]
    return max(end for _, end in windows) - min(start for start, _ in windows)


def build_report(
    args: argparse.Namespace,
    clients: list[ClientResult],
    server: Any,
    memory: tuple[dict[str, float], dict[str, float]],
    rss_timeline: list[dict[str, float | None]],
) -> dict[str, Any]:
    samples = [sample for client in clients for sample in client.samples]
    server_errors = [error for client in clients for error in client.server_errors]
    wrong_results = [wrong for client in clients for wrong in client.wrong_results]
    issued = sum(client.issued for client in clients)
    answered = [s for s in samples if s.status.isdigit()]
    abandoned = issued - len(samples)
    load_s = load_seconds(clients)
    checks = {
        "answered": {"count": len(answered), "passed": bool(answered)},
        "no_wrong_results": {
            "wrong": len(wrong_results),
            "checked": sum(s.checked for s in samples),
            "passed": not wrong_results,
        },
        "no_5xx_but_503_504": {"count": len(server_errors), "passed": not server_errors},
        "rss": memory_check(RSS_METRIC, *memory, args.max_rss_growth_mib),
        "rss_under_load": steady_rss_check(rss_timeline, args.max_rss_load_growth_mib),
        "device_pool": memory_check(DEVICE_METRIC, *memory, args.max_device_growth_mib),
    }
    return {
        "wrong_answers": len(wrong_results),
        "url": args.url,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {key: value for key, value in vars(args).items() if key != "out"},
        "server": server,
        "duration_s": load_s,
        "requests": issued,
        "requests_by_client": [client.issued for client in clients],
        "answered_rps": len(answered) / load_s if load_s > 0 else 0.0,
        "by_status": dict(Counter(s.status for s in samples)) | ({"abandoned": abandoned} if abandoned else {}),
        "by_kind": {kind: dict(Counter(s.status for s in samples if s.kind == kind)) for kind in KINDS},
        "latency_ms": {kind: summarize([s.latency_ms for s in answered if s.kind == kind]) for kind in KINDS},
        "server_errors": server_errors[:20],
        "wrong_results": wrong_results[:20],
        "rss_timeline": rss_timeline,
        "checks": checks,
        "passed": all(check["passed"] for check in checks.values()),
    }


def progress_printer(run: Soak, started: float, label: str, every_s: float = 15.0) -> Callable[[], None]:
    """A tick for open_loop that prints the answers so far every `every_s` seconds, so that a run stopped
    from outside still leaves its figures behind."""
    last = started

    def tick() -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last < every_s:
            return
        last = now
        by_status = Counter(sample.status for sample in run.samples)
        print(
            f"{now - started:6.0f} s: {label}: {len(run.samples)} answered ({_counts(dict(by_status))}), "
            f"{len(run.server_errors)} unexpected 5xx, {len(run.wrong_results)} wrong",
            flush=True,
        )

    return tick


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{status}: {count}" for status, count in sorted(counts.items())) or "none"


def _memory_line(label: str, check: dict[str, Any]) -> str:
    if "error" in check:
        return f"{label}: {check['error']}"
    return (
        f"{label} {check['start_mib']:.1f} -> {check['end_mib']:.1f} MiB "
        f"({check['growth_mib']:+.1f}, bound +{check['bound_mib']:g})"
    )


def print_report(report: dict[str, Any]) -> None:
    checks = report["checks"]
    wrong = checks["no_wrong_results"]
    print(f"soak {report['url']}: {wrong['wrong']} wrong answers of {wrong['checked']} checked (every 200 product)")
    print(
        f"  {report['requests']} requests in {report['duration_s']:.1f} s, "
        f"{report['answered_rps']:.1f} answered/s; by status: {_counts(report['by_status'])}"
    )
    for kind in KINDS:
        latency = report["latency_ms"][kind]
        figures = f"p50 {latency['p50']:.1f} ms, p99 {latency['p99']:.1f} ms" if latency["count"] else "no answers"
        print(f"  {kind:9} {_counts(report['by_kind'][kind])} ({figures})")
    verdicts = {True: "ok", False: "FAILED"}
    lines = [
        f"requests answered: {checks['answered']['count']} (a soak that gets no answer tests nothing)",
        f"wrong answers: {wrong['wrong']} of {wrong['checked']} checked against their own float64 products",
        f"5xx other than 503/504: {checks['no_5xx_but_503_504']['count']}",
        _memory_line("server RSS", checks["rss"]),
        _memory_line("server RSS under load (first reading to last)", checks["rss_under_load"]),
        _memory_line("device pool", checks["device_pool"]),
    ]
    for line, outcome in zip(lines, checks.values(), strict=True):
        print(f"  [{verdicts[outcome['passed']]}] {line}")
    readings = [f"{r['rss_mib']:.0f}" if r["rss_mib"] is not None else "-" for r in report["rss_timeline"]]
    if readings:
        print(f"  server RSS readings under load (MiB): {' '.join(readings)}")
    for failure in report["server_errors"] + report["wrong_results"]:
        print(f"  {failure}")
    print("PASSED" if report["passed"] else "FAILED")


# ------------------------------------------------------------------------------------------------ the CLI


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    async with (
        httpx.AsyncClient(base_url=args.url, timeout=args.timeout) as http,
        AsyncMatmulClient(args.url, timeout=args.timeout) as client,
    ):
        if args.wait_ready:
            await wait_ready(http, args.wait_ready)
        try:
            server = await client.info()
        except (MatmulServiceError, httpx.HTTPError, ValueError) as exc:
            raise SystemExit(f"soak: GET {args.url}/v1/info did not answer as matmul-service does: {exc}") from None
        probes = build_probes(args.seed, args.max_body_bytes)
        for probe in (probe for kind in KINDS for probe in probes[kind]):
            await send(http, probe)  # warm-up: one of each, before the first memory reading
        start = await read_metrics(http)
        spawn = multiprocessing.get_context("spawn")
        load_started = spawn.Event()
        load_s = min(args.minutes * 60, args.max_requests / args.rate)
        with ProcessPoolExecutor(
            max_workers=args.client_processes, mp_context=spawn, initializer=share_load_start, initargs=(load_started,)
        ) as pool:
            clients = [asyncio.wrap_future(pool.submit(run_client, share)) for share in shares(args)]
            rss_timeline = await watch_memory(http, clients, load_started, load_s, args.memory_every)
            results = [client.result() for client in clients]
        await settle(http)
        end = await read_metrics(http)
    return build_report(args, results, server, (start, end), rss_timeline)


def parse_kind(text: str) -> Kind:
    for kind in KINDS:
        if text == kind:
            return kind
    raise ValueError(f"a kind is one of {', '.join(KINDS)}")


def report_path(text: str) -> str:
    """Where the report goes, checked before the soak runs: a file that may be written, or a new one in a directory
    that exists or is made now."""
    path = Path(text)
    if not path.name or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name the file to write the report to")
    why = unwritable([path])
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {why}")
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = server_arguments(__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to send (default: %(default)s)")
    parser.add_argument(
        "--rate",
        type=float,
        default=200.0,
        help="requests started per second; above the capacity (default: %(default)s)",
    )
    parser.add_argument("--max-requests", type=int, help="stop after this many requests (default: rate x duration)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=256,
        help="most connections open at once; above the server's MATMUL_QUEUE_SIZE, so that its queue can fill "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="processes sending, each a share of --rate and --concurrency (default: %(default)s)",
    )
    parser.add_argument(
        "--mix", default="valid:6,invalid:3,oversized:1", help="weights of the kinds (default: %(default)s)"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=1 << 30, help="the server's MATMUL_MAX_BODY_BYTES (default: %(default)s)"
    )
    for option, default, meaning in MEMORY_BOUNDS:
        parser.add_argument(option, type=float, default=default, help=f"{meaning} (default: %(default)s)")
    parser.add_argument(
        "--memory-every",
        type=float,
        default=15.0,
        help=f"seconds between RSS readings under load, at least {MIN_MEMORY_EVERY_S:g}; a shorter load is read "
        "halfway through and at its end (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help=f"seconds one request may take, at most {MAX_TIMEOUT_S:g} (default: %(default)s)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds to wait for answers after the last start (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the operands and the draws (default: %(default)s)")
    parser.add_argument(
        "--out", type=report_path, default="out/soak.json", help="the JSON report (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.concurrency < 1:
        parser.error("--minutes, --rate and --concurrency must be positive")
    if args.client_processes < 1:
        parser.error("--client-processes must be positive")
    if args.max_requests is not None and args.max_requests < 1:
        parser.error(f"--max-requests must be positive, not {args.max_requests}")
    if not args.grace >= 0:
        parser.error(f"--grace must be 0 or more seconds, not {args.grace:g}")
    if not args.memory_every >= MIN_MEMORY_EVERY_S:
        parser.error(f"--memory-every must be at least {MIN_MEMORY_EVERY_S:g} s, not {args.memory_every:g}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        parser.error(f"--timeout must be over 0 and at most {MAX_TIMEOUT_S:g} s, not {args.timeout:g}")
    if args.max_body_bytes < (smallest := smallest_product_bytes()):
        parser.error(
            f"--max-body-bytes {args.max_body_bytes} is too small for any product: the smallest the soak sends "
            f"takes {smallest} bytes"
        )
    if args.max_requests is None:
        args.max_requests = max(1, round(args.rate * args.minutes * 60))
    try:
        args.mix = parse_mix(args.mix, parse_kind)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    print_report(report)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
