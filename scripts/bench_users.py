"""What users get: products/s and p50/p99 latency of closed-loop load, by server configuration, client and size.

Each server configuration is started fresh on 127.0.0.1 (`matmul-service`, its log in `--logs`), with no MATMUL_*
setting but its own (inherited ones are left out; `--backend` sets MATMUL_BACKEND for every server):

- `default`: nothing set, the service's defaults;
- `tuned`: MATMUL_HTTP_WORKERS=8, MATMUL_BATCHING=true, MATMUL_MAX_QUEUE_DELAY_US=500;
- `workers=N`: MATMUL_HTTP_WORKERS=N, everything else default (`--servers workers=1,workers=2,...` is a sweep).

Against each, every size (square float32 n x n) is sent by every client kind:

- `client`: the project's MatmulClient, `.multiply(a, b)` (multipart `.npy` to /matmul, an `.npy` answer);
- `triton`: tritonclient.http's InferenceServerClient, A and B as binary FP32 inputs, C asked for in binary;
- `triton-grpc`: tritonclient.grpc's InferenceServerClient, A and B as raw contents, to the gRPC port every server
  is given (MATMUL_GRPC_PORT);
- `raw-npy`, `raw-v2`: raw keep-alive sockets sending the same two requests prebuilt as whole HTTP requests
  (matmul_tools.raw_load), the floor a client library is measured against.

Before the servers, every size is sent by every HTTP client kind to a stand-in that answers at once with answers
of the right size (matmul_tools.standin, `--standin-processes` processes; `--no-clients-alone` skips it): the rate
each client reaches when the service costs nothing. A server's cell at CLIENT_BOUND of that rate or above measured
its clients, not the server: it is marked client-bound, and the run exits 2 once every cell has run.

A cell is closed-loop load from `--processes` client processes sharing the size's connections (`--concurrency`,
size:connections; each connection a thread with its own client object or socket). Every connection checks its first
answer against the float64 product of its own operands (numerics.reference's bound); once all have, `--warmup`
seconds more, then `--seconds` measured: products/s, p50/p99 latency (ms) of the 200 answers, other answers by
status. For `client` and the raw senders, also each one's own cost: the mean of (wall time of an exchange - the
server's timing "total", from the answer's Server-Timing) per product, beside that mean server total; so a gap
between a client and its raw sender shows on which side of the socket it lies. And every cell's CPU a product in
its client processes (user and system, all their threads, over the measured window): what each sender spends of the
cores it shares with the server.

Prints Markdown tables (each cell with its ratio to the raw sender of the same route: client / raw-npy, triton /
raw-v2, and triton-grpc / raw-v2, the protocol over gRPC against its HTTP floor; the client's cost; products/s by
server); writes every figure with the host's facts to `--out` and a chart to `--png` (when matplotlib imports;
`--plot-only JSON` draws it later from the JSON). A wrong answer fails its cell loudly and the run exits 1 once every
cell has run.

A cell takes its first answers, `--warmup` and `--seconds` (about 7 s by default): the default grid, 2 servers x 4
sizes x 5 clients, is 40 cells, about 5 minutes, plus each server's start (`--ready-timeout`). A sweep of six
servers is 96 cells: narrow it with `--clients`, `--sizes` or `--seconds`. `--rounds R` measures each size's clients R
times, in their order and then in reverse, turn about (on a shared host the cell that comes first after another load
runs on a different machine state): each ratio is taken within its round, and the tables and the chart show the
mean of the rounds beside each round's ratios.

    python scripts/bench_users.py --backend gpu
    python scripts/bench_users.py --backend gpu --servers workers=1,workers=2,workers=4,workers=8,workers=12,workers=16
    python scripts/bench_users.py --backend cpu --sizes 64,256 --seconds 1 --processes 2 --concurrency 64:2,256:2 \\
        --servers workers=1 --out out/bench-users/bench-users.json
    python scripts/bench_users.py --plot-only docs/bench/bench-users.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import multiprocessing
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol, cast
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson

from matmul_client.client import MatmulClient, MatmulServiceError, parse_server_timing
from matmul_tools.bodies import load_npy
from matmul_tools.raw_load import (
    Answer,
    npy_matmul_body,
    post_request,
    read_answer,
    read_whole_answer,
    v2_infer_request,
)
from matmul_tools.service import ROOT, LocalService, NotReady, add_server_options, free_port, service_command
from matmul_tools.standin import standing_in
from matmul_tools.together import CLOSED, StartSignal, TogetherPool
from matmul_tools.triton_grpc import fp32_inputs, grpc_address
from numerics.reference import Reference

ClientKind = Literal["client", "triton", "triton-grpc", "raw-npy", "raw-v2"]
CLIENT_KINDS: tuple[ClientKind, ...] = ("client", "triton", "triton-grpc", "raw-npy", "raw-v2")
RAW_OF: MappingProxyType[ClientKind, ClientKind] = MappingProxyType(
    {"client": "raw-npy", "triton": "raw-v2", "triton-grpc": "raw-v2"}
)
"""The raw sender of the same route and wire format as each client library."""
TUNED = MappingProxyType({"MATMUL_HTTP_WORKERS": "8", "MATMUL_BATCHING": "true", "MATMUL_MAX_QUEUE_DELAY_US": "500"})
"""The settings an expert chose by hand before the defaults were derived from the host."""
MODEL = "matmul"
ANSWER_BUFFER_BYTES = 1 << 20
"""What a raw connection reads each answer into, piece after piece, once its first answer has been checked."""
STANDIN = "stand-in"
"""The server name of the cells measured against matmul_tools.standin."""
CLIENT_BOUND = 0.8
"""A server's cell at this share of its clients' own rate (against the stand-in) or above measured its clients."""


# ---------------------------------------------------------------------------------------------- the servers


@dataclass(frozen=True)
class ServerConfig:
    """A server as users may start one: a name and the MATMUL_* settings it is given (nothing else)."""

    name: str
    settings: Mapping[str, str]

    @property
    def workers(self) -> int | None:
        """The HTTP workers set, or None where the service chooses."""
        workers = self.settings.get("MATMUL_HTTP_WORKERS")
        return int(workers) if workers is not None else None


def parse_server(text: str) -> ServerConfig:
    """`default`, `tuned` or `workers=N`."""
    name = text.strip()
    if name == "default":
        return ServerConfig(name, MappingProxyType({}))
    if name == "tuned":
        return ServerConfig(name, TUNED)
    key, _, workers = name.partition("=")
    if key != "workers" or not workers.isdigit() or int(workers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a server is default, tuned or workers=N")
    return ServerConfig(f"workers={int(workers)}", MappingProxyType({"MATMUL_HTTP_WORKERS": str(int(workers))}))


def without_inherited_settings() -> list[str]:
    """Take every MATMUL_* variable out of this process's environment, which the servers inherit: a server gets
    its configuration's settings and nothing else. The names taken out."""
    inherited = sorted(name for name in os.environ if name.startswith("MATMUL_"))
    for name in inherited:
        del os.environ[name]
    return inherited


@dataclass
class Started:
    service: LocalService
    info: dict[str, Any]
    """GET /v1/info once every HTTP worker was ready (its list of kernels left out)."""
    ready_s: float


def start_server(config: ServerConfig, args: argparse.Namespace) -> Started:
    """Start `config` and wait until every HTTP worker is ready; where the service chose how many, ask it first."""
    settings = dict(config.settings) | ({"MATMUL_BACKEND": args.backend} if args.backend else {})
    port = free_port()
    log = args.logs / f"server-{config.name.replace('=', '-')}.log"
    began = time.monotonic()
    with_grpc = {"MATMUL_GRPC_PORT": str(free_port()), **settings}  # a port of its own, for the triton-grpc cells
    service = LocalService(service_command(port), port, with_grpc, log, config.workers or 1)
    try:
        service.wait_ready(args.ready_timeout)
        info = httpx.get(f"{service.url}/v1/info", timeout=30).json()
        if info["http_workers"] > service.workers:
            service.workers = info["http_workers"]
            service.wait_ready(args.ready_timeout)
    except BaseException:
        service.stop()
        raise
    info.pop("kernels", None)
    return Started(service, info | {"settings": settings}, time.monotonic() - began)


# ----------------------------------------------------------------------------------- a client's connections


@dataclass
class Operands:
    """One connection's operands, its own (drawn from its seed); the float64 reference of their product and the raw
    requests that carry them are made on first use and kept for every later cell of that size."""

    n: int
    seed: tuple[int, ...]
    a: np.ndarray = field(init=False, repr=False)
    b: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.a, self.b = (rng.standard_normal((self.n, self.n), np.float32) for _ in range(2))

    @functools.cached_property
    def reference(self) -> Reference:
        return Reference.of(self.a, self.b, np.float32)

    @functools.cached_property
    def npy_request(self) -> bytes:
        body, content_type = npy_matmul_body(self.a, self.b)
        return post_request("/matmul", content_type, body, accept="application/x-npy")

    @functools.cached_property
    def v2_request(self) -> bytes:
        return v2_infer_request(self.a, self.b)

    def mismatch(self, c: np.ndarray) -> str | None:
        """What is wrong with `c` as the product of these operands, or None."""
        if c.shape != (self.n, self.n):
            return f"the answer is {'x'.join(map(str, c.shape))}, not {self.n}x{self.n}"
        return self.reference.mismatch(c)


@dataclass(frozen=True)
class Exchange:
    """One request's outcome: the status ("200", "503", or the name of the error that ended the connection), the
    product where it was read whole, and the server's timing "total" (ms) where the client reports it."""

    status: str
    c: np.ndarray | None = None
    server_total_ms: float | None = None


class Connection(Protocol):
    def exchange(self, keep: bool) -> Exchange:
        """Send the connection's product once; `keep`: read the answer's product whole, to be checked."""

    def close(self) -> None: ...


class ProjectClient:
    """`MatmulClient(url).multiply(a, b)`, as a user calls it."""

    def __init__(self, url: str, operands: Operands) -> None:
        self.client = MatmulClient(url)
        self.operands = operands

    def exchange(self, keep: bool) -> Exchange:
        try:
            product = self.client.multiply(self.operands.a, self.operands.b)
        except MatmulServiceError as exc:
            return Exchange(str(exc.status))
        except (httpx.TransportError, OSError) as exc:
            return Exchange(type(exc).__name__)
        return Exchange("200", product.c, product.timing.get("total"))

    def close(self) -> None:
        self.client.close()


class TritonClient:
    """tritonclient.http, binary tensors in and out, the inputs made for each request as a user's code makes them."""

    def __init__(self, url: str, operands: Operands, timeout_s: float) -> None:
        import tritonclient.http as triton

        self.triton = triton
        self.client = triton.InferenceServerClient(urlsplit(url).netloc, network_timeout=timeout_s)
        self.operands = operands

    def exchange(self, keep: bool) -> Exchange:
        from tritonclient.utils import InferenceServerException

        inputs = [self.triton.InferInput(name, [x.shape[0], x.shape[1]], "FP32") for name, x in self._named()]
        for tensor, (_, x) in zip(inputs, self._named(), strict=True):
            tensor.set_data_from_numpy(x, binary_data=True)
        outputs = [self.triton.InferRequestedOutput("C", binary_data=True)]
        try:
            result = self.client.infer(MODEL, inputs, outputs=outputs)
        except InferenceServerException as exc:
            return Exchange(str(exc.status() or type(exc).__name__))
        except OSError as exc:
            return Exchange(type(exc).__name__)
        c: np.ndarray = result.as_numpy("C")
        return Exchange("200", c)

    def _named(self) -> tuple[tuple[str, np.ndarray], tuple[str, np.ndarray]]:
        return ("A", self.operands.a), ("B", self.operands.b)

    def close(self) -> None:
        self.client.close()


class TritonGrpcClient:
    """tritonclient.grpc, raw contents in and out, the inputs made for each request as a user's code makes them; to
    the port the server's /v1/info names."""

    def __init__(self, url: str, operands: Operands) -> None:
        import tritonclient.grpc as triton

        address = grpc_address(url, httpx.get(f"{url}/v1/info", timeout=30).json())
        self.client = triton.InferenceServerClient(address)
        self.operands = operands

    def exchange(self, keep: bool) -> Exchange:
        from tritonclient.utils import InferenceServerException

        try:
            result = self.client.infer(MODEL, fp32_inputs(self.operands.a, self.operands.b))
        except InferenceServerException as exc:
            return Exchange(str(exc.status() or type(exc).__name__))
        c: np.ndarray = result.as_numpy("C")
        return Exchange("200", c)

    def close(self) -> None:
        self.client.close()


class RawSocket:
    """A keep-alive socket sending one prebuilt request again and again; answers are read piece after piece into
    one buffer, except those kept whole to be checked. Reconnects where the server closes."""

    def __init__(self, url: str, request: bytes, kind: ClientKind, timeout_s: float) -> None:
        where = urlsplit(url)
        self.address = (where.hostname or "127.0.0.1", where.port or 80)
        self.request = request
        self.kind = kind
        self.timeout_s = timeout_s
        self.buffer = bytearray(ANSWER_BUFFER_BYTES)
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def exchange(self, keep: bool) -> Exchange:
        try:
            self.sock.sendall(self.request)
            if keep:
                answer, body = read_whole_answer(self.sock)
            else:
                answer, body = read_answer(self.sock, self.buffer), None
        except OSError as exc:  # ConnectionError and socket timeouts among them
            self.sock.close()
            self.sock = self._connect()
            return Exchange(type(exc).__name__)
        if answer.header(b"connection") == b"close":
            self.sock.close()
            self.sock = self._connect()
        if answer.status != 200:
            return Exchange(str(answer.status))
        total = parse_server_timing((answer.header(b"server-timing") or b"").decode("latin-1")).get("total")
        return Exchange("200", None if body is None else self._product(answer, body), total)

    def _product(self, answer: Answer, body: bytearray) -> np.ndarray:
        if self.kind == "raw-npy":
            return load_npy(bytes(body))
        split = int(answer.header(b"inference-header-content-length") or b"0")
        output = orjson.loads(body[:split])["outputs"][0]
        return np.frombuffer(body, "<f4", offset=split).reshape(output["shape"])

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------- a client process


@dataclass(frozen=True)
class Share:
    """What one client process runs in cell number `cell`: `connections` connections of `kind` sending n x n
    products."""

    cell: int
    url: str
    kind: ClientKind
    n: int
    connections: int
    seconds: float
    timeout_s: float
    check: bool = True
    """Check each connection's first answer (not against the stand-in, whose answers are zeros)."""


@dataclass
class Tally:
    """What connections saw in a cell's measured window (the warm-up's other answers apart)."""

    latencies_ms: list[float] = field(default_factory=list)
    """Wall time of each 200 answer's exchange."""
    errors: Counter[str] = field(default_factory=Counter)
    warmup_errors: Counter[str] = field(default_factory=Counter)
    client_ms: float = 0.0
    """Wall time less the server's timing "total", summed over the answers that report it."""
    server_ms: float = 0.0
    timed: int = 0
    checked: int = 0
    """Connections whose first 200 answer was checked."""
    unchecked: int = 0
    """Connections that had no 200 answer in the whole cell."""
    wrong: list[str] = field(default_factory=list)
    cpu_user_s: float = 0.0
    """CPU seconds of the client processes in the measured window, in user mode (every thread of each)."""
    cpu_system_s: float = 0.0
    """The same in the kernel, on their behalf."""

    def add(self, other: Tally) -> None:
        self.latencies_ms += other.latencies_ms
        self.errors.update(other.errors)
        self.warmup_errors.update(other.warmup_errors)
        self.client_ms += other.client_ms
        self.server_ms += other.server_ms
        self.timed += other.timed
        self.checked += other.checked
        self.unchecked += other.unchecked
        self.wrong += other.wrong
        self.cpu_user_s += other.cpu_user_s
        self.cpu_system_s += other.cpu_system_s


class Window:
    """The measured seconds of a cell (time.time()), set once every process has warmed up; until then both lie in
    the far future and the connections keep warming up."""

    def __init__(self) -> None:
        self.start = float("inf")
        self.end = float("inf")


@dataclass
class ChildState:
    """Set in each client process by `_prepare`: its index (part of its operands' seeds) and the start signal."""

    index: int
    signal: StartSignal


_child: ChildState | None = None


def _prepare(counter: Synchronized[int], signal: StartSignal) -> None:
    global _child
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    _child = ChildState(index, signal)


@functools.cache
def _operands(process: int, n: int, connection: int) -> Operands:
    return Operands(n, (process, n, connection))


def _connect(share: Share, operands: Operands) -> Connection:
    if share.kind == "client":
        return ProjectClient(share.url, operands)
    if share.kind == "triton":
        return TritonClient(share.url, operands, share.timeout_s)
    if share.kind == "triton-grpc":
        return TritonGrpcClient(share.url, operands)
    request = operands.npy_request if share.kind == "raw-npy" else operands.v2_request
    return RawSocket(share.url, request, share.kind, share.timeout_s)


def _closed_loop(
    connection: Connection, operands: Operands, where: str, window: Window, warmed: threading.Barrier, check: bool
) -> Tally:
    """Send until the window closes: the first 200 answer checked (where `check`), then (once every connection of
    the process has had an answer) the warm-up, then the window's answers tallied."""
    tally = Tally()
    first, unchecked = True, check
    while time.time() < window.end:
        began = time.perf_counter()
        exchange = connection.exchange(keep=unchecked)
        wall_ms = (time.perf_counter() - began) * 1e3
        done = time.time()
        if unchecked and exchange.c is not None:
            unchecked = False
            tally.checked += 1
            problem = operands.mismatch(exchange.c)
            if problem is not None:
                tally.wrong.append(f"{where}: {problem}")
        if first:
            first = False
            warmed.wait()
        if done < window.start:
            if exchange.status != "200":
                tally.warmup_errors[exchange.status] += 1
        elif done < window.end:
            if exchange.status != "200":
                tally.errors[exchange.status] += 1
                continue
            tally.latencies_ms.append(wall_ms)
            if exchange.server_total_ms is not None:
                tally.client_ms += wall_ms - exchange.server_total_ms
                tally.server_ms += exchange.server_total_ms
                tally.timed += 1
    tally.unchecked += unchecked
    return tally


def _run_share(share: Share) -> Tally:
    """The share's connections, each a thread: they warm up, this process says so and waits for the signal, then
    they send until the shared window closes."""
    assert _child is not None, "_prepare runs first in every client process"
    child = _child
    window = Window()
    warmed = threading.Barrier(share.connections + 1)
    tallies: list[Tally] = []
    failures: list[BaseException] = []

    def connection(index: int) -> None:
        where = f"{share.kind} {share.n}x{share.n}, process {child.index} connection {index}"
        try:
            operands = _operands(child.index, share.n, index)
            connected = _connect(share, operands)
            try:
                tallies.append(_closed_loop(connected, operands, where, window, warmed, share.check))
            finally:
                connected.close()
        except BaseException as exc:  # re-raised by the process, after the others have stopped
            failures.append(exc)
            warmed.abort()
            window.end = 0.0

    threads = [threading.Thread(target=connection, args=(index,)) for index in range(share.connections)]
    for thread in threads:
        thread.start()
    try:
        warmed.wait(timeout=share.timeout_s)
        start = child.signal.wait_for_start(share.cell, share.timeout_s)
        if start == CLOSED:
            raise TimeoutError("the cell failed, or no start came from the parent")
        window.start = start
        window.end = window.start + share.seconds
        cpu = _cpu_in_window(window)
    except (threading.BrokenBarrierError, TimeoutError) as exc:
        window.end = 0.0
        warmed.abort()
        failures.append(exc)
    for thread in threads:
        thread.join()
    if failures:
        raise next((f for f in failures if not isinstance(f, threading.BrokenBarrierError)), failures[0])
    total = Tally()
    for tally in tallies:
        total.add(tally)
    total.cpu_user_s, total.cpu_system_s = cpu
    return total


def _cpu_in_window(window: Window) -> tuple[float, float]:
    """This process's user and system CPU seconds (all its threads) from the window's start to its end, on the
    thread that waits for them; a window that a failing connection closes early ends there."""
    time.sleep(max(window.start - time.time(), 0.0))
    began = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(max(window.end - time.time(), 0.0))
    ended = resource.getrusage(resource.RUSAGE_SELF)
    return ended.ru_utime - began.ru_utime, ended.ru_stime - began.ru_stime


Clients = TogetherPool[Share, Tally]
"""The client processes of a run."""


def client_pool(processes: int) -> Clients:
    """`processes` client processes (spawned) that run a cell's shares together; each keeps its operands, their
    references and raw requests from cell to cell."""
    counter = multiprocessing.get_context("spawn").Value("i", 0)
    return TogetherPool(processes, _prepare, (counter,))


# --------------------------------------------------------------------------------------------------- the cells


def split(total: int, parts: int) -> list[int]:
    """`total` in at most `parts` near-equal whole shares, larger first, none empty."""
    return [count for count in (total // parts + (i < total % parts) for i in range(parts)) if count]


def measure_cell(
    clients: Clients,
    number: int,
    url: str,
    server: str,
    kind: ClientKind,
    n: int,
    args: argparse.Namespace,
    check: bool = True,
) -> dict[str, Any]:
    """Cell `number` of the run against the server at `url`: its figures, with `failure` set where it could not run
    or an answer was wrong (each connection's first answer checked where `check`)."""
    concurrency = args.concurrency[n]
    connections = split(concurrency, clients.processes)
    cell: dict[str, Any] = {
        "server": server, "size": n, "concurrency": concurrency, "client": kind, "processes": len(connections),
        "seconds": args.seconds, "failure": None,
    }  # fmt: skip
    shares = [Share(number, url, kind, n, count, args.seconds, args.timeout, check) for count in connections]
    try:
        tallies = clients.run(_run_share, shares, args.warmup, args.timeout, tag=number)
    except Exception as exc:  # a cell that cannot run is reported as failed; the others still run
        return cell | {"failure": f"{type(exc).__name__}: {exc}"}
    total = Tally()
    for tally in tallies:
        total.add(tally)
    latencies = np.array(total.latencies_ms)
    cell |= {
        "products": len(latencies),
        "products_per_s": len(latencies) / args.seconds,
        "latency_ms": {
            "p50": float(np.percentile(latencies, 50)) if latencies.size else None,
            "p99": float(np.percentile(latencies, 99)) if latencies.size else None,
            "mean": float(latencies.mean()) if latencies.size else None,
        },
        "errors": dict(total.errors),
        "warmup_errors": dict(total.warmup_errors),
        "checked_connections": total.checked,
        "unchecked_connections": total.unchecked,
        "wrong": total.wrong,
    }
    if latencies.size:
        cell["client_cpu_us"] = {
            "user": 1e6 * total.cpu_user_s / latencies.size,
            "system": 1e6 * total.cpu_system_s / latencies.size,
        }
    if total.wrong:
        cell["failure"] = f"{len(total.wrong)} wrong answers"
    elif not latencies.size:
        cell["failure"] = "no product answered in the measured window"
    elif check and total.unchecked:
        cell["failure"] = f"{total.unchecked} of {concurrency} connections had no product to check"
    if total.timed:  # the senders that read the server's timing: the client and the raw ones
        cell["client_cost"] = {
            "products": total.timed,
            "client_ms": total.client_ms / total.timed,
            "server_total_ms": total.server_ms / total.timed,
        }
    return cell


def _schedule(sizes: list[int], kinds: list[ClientKind], rounds: int) -> list[tuple[int, int, ClientKind]]:
    """(size, round, client kind) in the order measured: each size's kinds `rounds` times, reversed every other."""
    return [
        (n, round_, kind) for n in sizes for round_ in range(rounds) for kind in (kinds[::-1] if round_ % 2 else kinds)
    ]


def add_ratios(cells: list[dict[str, Any]]) -> None:
    """Each client library's products/s over its raw sender's, on the same server, size, concurrency and round."""
    products = {
        (cell["server"], cell["size"], cell.get("round", 0), cell["client"]): cell.get("products_per_s")
        for cell in cells
    }
    for cell in cells:
        found = cell.get("products_per_s")
        floor = products.get((cell["server"], cell["size"], cell.get("round", 0), RAW_OF.get(cell["client"])))
        cell["ratio_to_raw"] = found / floor if found is not None and floor else None


def add_clients_alone(cells: list[dict[str, Any]]) -> None:
    """Each server's cell over the products/s of the same client and size against the stand-in, and whether that is
    CLIENT_BOUND or more."""
    alone = {
        (size, kind): found
        for (server, size, kind), found in mean_products(cells).items()
        if server == STANDIN and found is not None
    }
    for cell in cells:
        ceiling = alone.get((cell["size"], cell["client"]))
        if cell["server"] == STANDIN or ceiling is None or cell.get("products_per_s") is None:
            continue
        cell["over_clients_alone"] = cell["products_per_s"] / ceiling
        cell["client_bound"] = cell["over_clients_alone"] >= CLIENT_BOUND


def mean_products(cells: list[dict[str, Any]]) -> dict[tuple[str, int, str], float | None]:
    """Products/s by (server, size, client), the mean of the rounds that answered."""
    rounds: dict[tuple[str, int, str], list[float]] = {}
    for cell in cells:
        found = rounds.setdefault((cell["server"], cell["size"], cell["client"]), [])
        if cell.get("products_per_s") is not None:
            found.append(cell["products_per_s"])
    return {key: (sum(values) / len(values) if values else None) for key, values in rounds.items()}


def host_facts() -> dict[str, Any]:
    """The CPUs and GPUs of this host, and this Python."""
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        gpus = [line.strip() for line in found.stdout.splitlines() if line.strip()] if found.returncode == 0 else []
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "gpus": gpus,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


# -------------------------------------------------------------------------------------------------- the report


def _figure(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, its columns padded to line up (numbers to the right)."""
    widths = [max([len(headers[i]), *(len(row[i]) for row in rows)]) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if right else c.ljust(w) for c, w, right in zip(cells, widths, numeric, strict=True))
        return f"| {' | '.join(padded)} |"

    dashes = ("-" * (w + 1) + ":" if right else "-" * (w + 2) for w, right in zip(widths, numeric, strict=True))
    rule = f"|{'|'.join(dashes)}|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _errors(cell: dict[str, Any]) -> str:
    if cell["failure"] is not None and "errors" not in cell:
        return "failed"
    counted = ", ".join(f"{status}: {count}" for status, count in sorted(cell["errors"].items()))
    return (counted or "0") + (" WRONG" if cell["wrong"] else "")


def print_report(report: dict[str, Any]) -> None:
    cells = report["cells"]
    several = any(cell.get("round", 0) for cell in cells)
    rows = [
        [
            cell["server"], str(cell["size"]), str(cell["concurrency"]), *([str(cell.get("round", 0))] * several),
            cell["client"], _figure(cell.get("products_per_s"), 1), _figure(cell.get("latency_ms", {}).get("p50")),
            _figure(cell.get("latency_ms", {}).get("p99")), _figure(cell.get("ratio_to_raw"), 3), _errors(cell),
        ]
        for cell in cells
    ]  # fmt: skip
    print("## Products/s and latency (ms), closed loop\n")
    headers = ["server", "size", "conc", *(["round"] * several), "client", "products/s", "p50", "p99", "vs raw"]
    print(markdown([*headers, "errors"], rows))
    measured = [cell for cell in cells if "over_clients_alone" in cell]
    if measured:
        print(f"\n## Each cell over its clients alone (the same clients against the {STANDIN}; {CLIENT_BOUND} or more: "
              "client-bound)\n")  # fmt: skip
        rows = [
            [
                cell["server"], str(cell["size"]), str(cell["concurrency"]), cell["client"],
                _figure(cell["products_per_s"], 1), _figure(cell["products_per_s"] / cell["over_clients_alone"], 1),
                _figure(cell["over_clients_alone"]), "CLIENT-BOUND" if cell["client_bound"] else "no",
            ]
            for cell in measured
        ]  # fmt: skip
        headers = ["server", "size", "conc", "client", "products/s", "clients alone", "share", "client-bound"]
        print(markdown(headers, rows))
    if several:
        print("\n## Each library over its raw sender, round by round, and the mean of the rounds' products/s\n")
        mean = mean_products(cells)
        ratios: dict[tuple[str, int, ClientKind], list[str]] = {}
        for cell in cells:
            if cell["client"] in RAW_OF:
                ratios.setdefault((cell["server"], cell["size"], cell["client"]), []).append(
                    _figure(cell.get("ratio_to_raw"), 3)
                )
        rows = []
        for (server, n, kind), found in ratios.items():
            floor = mean.get((server, n, RAW_OF[kind]))
            mine = mean.get((server, n, kind))
            rows.append([server, str(n), kind, " / ".join(found), _figure(mine / floor if mine and floor else None, 3)])
        print(markdown(["server", "size", "client", "vs raw by round", "vs raw, means"], rows))
    costs = [cell for cell in cells if "client_cost" in cell]
    if costs:
        print("\n## Each sender's own cost per product beside the server's timing total (mean ms), and its processes'"
              " CPU a product (us)\n")  # fmt: skip
        rows = [
            [
                cell["server"], str(cell["size"]), str(cell["concurrency"]), cell["client"],
                _figure(cell["products_per_s"], 1),
                _figure(cell["latency_ms"]["mean"]), _figure(cell["client_cost"]["server_total_ms"]),
                _figure(cell["client_cost"]["client_ms"]), _figure(cell["client_cpu_us"]["user"], 0),
                _figure(cell["client_cpu_us"]["system"], 0),
            ]
            for cell in costs
        ]  # fmt: skip
        headers = ["server", "size", "conc", "client", "products/s", "wall", "server total", "own cost", "user", "sys"]
        print(markdown(headers, rows))
    servers = list(report["servers"])
    if len(servers) > 1:
        print("\n## Products/s by server\n")
        by_cell = {(n, kind, server): found for (server, n, kind), found in mean_products(cells).items()}
        pairs = list(dict.fromkeys((cell["size"], cell["client"]) for cell in cells))
        rows = [[str(n), kind, *(_figure(by_cell.get((n, kind, s)), 1) for s in servers)] for n, kind in pairs]
        print(markdown(["size", "client", *servers], rows))
    for note in report["notes"]:
        print(f"\nNote: {note}")


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Products/s of every cell (the mean of its rounds): a panel per size, the servers along x, a bar per client."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    sizes = sorted({cell["size"] for cell in cells})
    servers = list(report["servers"])
    kinds = [kind for kind in CLIENT_KINDS if any(cell["client"] == kind for cell in cells)]
    mean = mean_products(cells)
    figure, axes = plt.subplots(1, max(1, len(sizes)), figsize=(4.2 * max(1, len(sizes)), 4), squeeze=False)
    width = 0.8 / max(1, len(kinds))
    for axis, n in zip(axes[0], sizes, strict=False):
        for i, kind in enumerate(kinds):
            found = {server: mean.get((server, n, kind)) or 0.0 for server in servers}
            axis.bar(
                [x + i * width for x in range(len(servers))], [found.get(s, 0.0) for s in servers], width, label=kind
            )
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(servers))], servers, rotation=30, fontsize="small")
        concurrency = next(cell["concurrency"] for cell in cells if cell["size"] == n)
        axis.set(title=f"{n}x{n} float32, {concurrency} connections", ylabel="products/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(kinds), title="client")
    host = report["host"]
    devices = [device["name"] for info in report["servers"].values() for device in info["devices"]]
    device = ", ".join(host["gpus"]) or (f"{devices[0]} backend" if devices else "no device")
    figure.suptitle(f"What users get: closed-loop products/s ({device}, {host['cpu_count']} CPUs)")
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw(report: dict[str, Any], path: Path, saved: Path) -> None:
    """The chart of the report saved at `saved`, or a note where matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed here: no chart (draw it where it is with --plot-only {saved})")
        return
    if not report["cells"]:
        print("no cells: no chart")
        return
    plot_report(report, path)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------------------------ the CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--servers", default="default,tuned", help="default, tuned, workers=N (default: %(default)s)")
    parser.add_argument("--clients", default=",".join(CLIENT_KINDS), help="client kinds (default: %(default)s)")
    parser.add_argument("--sizes", default="64,512,2048,4096", help="n of n x n products (default: %(default)s)")
    parser.add_argument(
        "--concurrency",
        default="64:64,512:16,2048:8,4096:8",
        help="connections of each size, size:connections, spread over the processes (default: %(default)s)",
    )
    parser.add_argument("--processes", type=int, default=8, help="client processes (default: 8)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell (default: 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each cell's (default: 1)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="times each size's clients are measured, every other in reverse (1)"
    )
    parser.add_argument(
        "--no-clients-alone", dest="clients_alone", action="store_false", help="measure no client against the stand-in"
    )
    parser.add_argument(
        "--standin-processes", type=int, default=8, help="the stand-in's processes (default: %(default)s)"
    )
    add_server_options(parser, backend=None)
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a cell's connections may take to their first answers (300)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/bench/bench-users.json"), help="the JSON (%(default)s)")
    parser.add_argument("--png", type=Path, help="the chart (default: --out with .png)")
    parser.add_argument("--logs", type=Path, default=Path("out/bench-users"), help="the servers' logs (%(default)s)")
    parser.add_argument("--plot-only", type=Path, metavar="JSON", help="draw the chart of a saved JSON, run nothing")
    args = parser.parse_args(argv)
    if args.plot_only is not None and not args.plot_only.is_file():
        parser.error(f"--plot-only: no file {args.plot_only}")
    try:
        args.servers = list({config.name: config for config in map(parse_server, args.servers.split(","))}.values())
        args.sizes = list(dict.fromkeys(int(n) for n in args.sizes.split(",")))
        args.concurrency = {int(n): int(c) for n, c in (pair.split(":") for pair in args.concurrency.split(","))}
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    args.clients = list(dict.fromkeys(kind.strip() for kind in args.clients.split(",")))
    unknown = [kind for kind in args.clients if kind not in CLIENT_KINDS]
    if unknown:
        parser.error(f"no client kind {unknown}: they are {', '.join(CLIENT_KINDS)}")
    missing = [n for n in args.sizes if n not in args.concurrency]
    if missing:
        parser.error(f"--concurrency has no connections for size {missing}")
    if min(args.sizes) < 1 or min(args.concurrency.values()) < 1 or args.processes < 1 or args.rounds < 1:
        parser.error("--sizes, --concurrency, --processes and --rounds must be positive")
    if args.seconds <= 0 or args.warmup < 0:
        parser.error("--seconds must be positive, --warmup not negative")
    args.png = args.png or (args.plot_only or args.out).with_suffix(".png")
    return args


def run_clients_alone(
    clients: Clients, kinds: list[ClientKind], args: argparse.Namespace, report: dict[str, Any]
) -> None:
    """Every size with every HTTP client kind against the stand-in (none checked: its answers are zeros)."""
    alone: list[ClientKind] = [kind for kind in kinds if kind != "triton-grpc"]
    if len(alone) < len(kinds):
        report["notes"].append(f"triton-grpc is not measured alone: the {STANDIN} speaks HTTP only")
    with standing_in(args.standin_processes) as url:
        for n, _, kind in _schedule(args.sizes, alone, 1):
            cell = measure_cell(clients, len(report["cells"]), url, STANDIN, kind, n, args, check=False)
            report["cells"].append(cell | {"round": 0})
            _say(cell, f"{STANDIN} {n}x{n} c={cell['concurrency']} {kind}:")


def _say(cell: dict[str, Any], said: str) -> None:
    """A cell's line on stderr as it finishes."""
    if cell["failure"] is None:
        print(f"{said} {cell['products_per_s']:.1f} products/s, errors {cell['errors']}", file=sys.stderr)
        return
    print(f"{said} FAILED: {cell['failure']}", file=sys.stderr)
    for wrong in cell.get("wrong", []):
        print(f"  WRONG ANSWER {wrong}", file=sys.stderr)


def run_server(
    clients: Clients,
    config: ServerConfig,
    kinds: list[ClientKind],
    args: argparse.Namespace,
    report: dict[str, Any],
) -> None:
    """Start `config`, run every size with every client kind against it, stop it; all of it into `report`."""
    try:
        started = start_server(config, args)
    except NotReady as exc:
        report["server_failures"][config.name] = str(exc)[-4000:]
        print(f"{config.name}: FAILED to start: {exc}", file=sys.stderr)
        return
    report["servers"][config.name] = started.info | {"ready_s": started.ready_s}
    workers = started.info["http_workers"]
    print(f"{config.name}: ready in {started.ready_s:.1f} s, {workers} HTTP workers", file=sys.stderr)
    try:
        for n, round_, kind in _schedule(args.sizes, kinds, args.rounds):
            number = len(report["cells"])
            cell = measure_cell(clients, number, started.service.url, config.name, kind, n, args) | {"round": round_}
            report["cells"].append(cell)
            said = f"{config.name} {n}x{n} c={cell['concurrency']} {kind}" + (f" (round {round_})" if round_ else "")
            _say(cell, said + ":")
    finally:
        started.service.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only is not None:
        draw(json.loads(args.plot_only.read_text()), args.png, args.plot_only)
        return 0
    began = time.monotonic()
    arguments = {key: str(value) for key, value in vars(args).items()} | {"servers": [c.name for c in args.servers]}
    report: dict[str, Any] = {
        "finished": "",
        "arguments": arguments,
        "host": host_facts(),
        "inherited_settings_left_out": without_inherited_settings(),
        "servers": {},
        "server_failures": {},
        "cells": [],
        "notes": [],
    }
    if (ROOT / ".env").exists():
        report["notes"].append(f"every server also read the settings in {ROOT / '.env'}")
    kinds = [cast(ClientKind, kind) for kind in args.clients]
    if "triton" in kinds and importlib.util.find_spec("tritonclient") is None:
        kinds.remove("triton")
        report["notes"].append("no triton cells: tritonclient is not installed (pip install 'tritonclient[http]')")
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    args.logs.mkdir(parents=True, exist_ok=True)
    clients = client_pool(args.processes)
    try:
        if args.clients_alone:
            run_clients_alone(clients, kinds, args, report)
        for config in args.servers:
            run_server(clients, config, kinds, args, report)
    finally:
        clients.close()
    add_ratios(report["cells"])
    add_clients_alone(report["cells"])
    report["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    report["elapsed_s"] = time.monotonic() - began
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\n{report['elapsed_s']:.0f} s in all; wrote {args.out}")
    draw(report, args.png, args.out)
    failed = [cell for cell in report["cells"] if cell["failure"] is not None]
    if failed or report["server_failures"]:
        print(f"{len(failed)} cells and {len(report['server_failures'])} servers failed: see above", file=sys.stderr)
        return 1
    bound = [cell for cell in report["cells"] if cell.get("client_bound")]
    for cell in bound:
        print(
            f"CLIENT-BOUND: {cell['server']} {cell['size']}x{cell['size']} {cell['client']} reached "
            f"{cell['over_clients_alone']:.2f} of its clients' own rate: run more --processes",
            file=sys.stderr,
        )
    return 2 if bound else 0


if __name__ == "__main__":
    sys.exit(main())
