"""Benchmark matmul-service end to end: a matrix of sizes x formats x concurrencies x server configurations.

Each configuration (batching off/on, 1 or N HTTP workers) is a fresh server started here on 127.0.0.1
(uvicorn on the app factory, `--workers N`). Each cell is a closed loop (scripts/loadtest.py's) of
`--duration` seconds at most (and `--max-requests`), after `--warmup` requests from each client process that
are left out (the first products of a shape; more would cost minutes at 4096 x 4096 and concurrency 64).
The load comes from `--client-processes` processes sharing the cell's connections and starting together: httpx
slows down with many connections in one process (docs/throughput.md), and the client must not be what limits
small requests.

For each cell: req/s, latency p50/p99, payload GB/s (request + response bytes of the 200 answers per second),
errors, the mean of each phase the server reports in Server-Timing (read, decode, queue, h2d, kernel, d2h,
encode, total) with the client-observed rest (latency less the server's total: HTTP, ASGI and the transport),
and the mean batch size the answers report.

The transport ceiling: on every server, POST /v1/echo (MATMUL_ECHO_ROUTE=true) with the .npy body of the
largest size at each concurrency; the ratio matmul GB/s / echo GB/s is printed for that size. So is
req/s (batching on, N workers) / req/s (batching off, 1 worker) for the smallest size over .npy at the highest
concurrency. `--compare-devices 0 0,1` instead runs one compute-bound cell on MATMUL_DEVICES=0 and =0,1, each
with the echo of its body, and prints the GPU time per product beside the transport ceiling.

    python scripts/bench_service.py --backend gpu --out out/bench
    python scripts/bench_service.py --sizes 64 --formats npy --concurrency 1,8 --configs off-1,on-4 --duration 2
    python scripts/bench_service.py --backend gpu --compare-devices 0 0,1 --workers 12 --client-processes 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
from rich.console import Console
from rich.table import Table

from app.config import Settings
from matmul_client.client import AsyncMatmulClient, RequestFormat
from matmul_tools import loadtest
from matmul_tools.service import LocalService, add_server_options, free_port
from matmul_tools.together import StartSignal, TogetherPool

Route = Literal["matmul", "echo"]
PHASES = ("read", "decode", "queue", "h2d", "kernel", "d2h", "encode", "total", loadtest.CLIENT_SIDE)
JSON_BYTES_PER_ELEMENT = 12
"""orjson writes a float32 drawn from a standard normal in about 11 characters, and a comma."""


@dataclass(frozen=True)
class Config:
    """How a server is started: dynamic batching off or on, and its number of HTTP worker processes."""

    batching: bool
    workers: int

    @property
    def token(self) -> str:
        return f"{'on' if self.batching else 'off'}-{self.workers}"

    @property
    def name(self) -> str:
        return f"batching {'on' if self.batching else 'off'}, {self.workers} worker{'s' if self.workers > 1 else ''}"


def parse_config(text: str) -> Config:
    """`off-1`, `on-4`: batching, then HTTP workers."""
    batching, _, workers = text.strip().partition("-")
    if batching not in ("on", "off") or not workers.isdigit() or int(workers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a configuration is on-N or off-N (batching, HTTP workers)")
    return Config(batching == "on", int(workers))


# ------------------------------------------------------------------------------- the client processes


@dataclass(frozen=True)
class Share:
    """What one client process sends in a cell: its part of the connections and of the request cap."""

    url: str
    route: Route
    shape: loadtest.Shape
    format: RequestFormat
    kernel: str
    concurrency: int
    warmup: int
    requests: int
    duration_s: float
    timeout_s: float


@dataclass
class ShareResult:
    samples: list[loadtest.Sample]
    started: float
    """Wall-clock seconds (comparable across processes) of the first measured request, and of the last answer."""
    finished: float
    request_bytes: int
    response_bytes: int
    batch_sizes: list[int]


@dataclass
class EchoRun(loadtest.Run):
    """Sends each drawn body as it is to POST /v1/echo instead of asking for its product."""

    http: httpx.AsyncClient = field(kw_only=True)

    async def one(self, started: float, due: float) -> None:
        job = self.traffic.next()
        try:
            response = await self.http.post(
                "/v1/echo", content=job.payload.content, headers={"content-type": "application/octet-stream"}
            )
            status = str(response.status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        latency_ms = (time.perf_counter() - due) * 1e3
        self.samples.append(loadtest.Sample(due - started, latency_ms, status, job.size, job.format, "echo", {}))


class EchoCounter:
    """An httpx response hook adding up the Content-Length of the echo route's 200 answers while `counting`."""

    def __init__(self) -> None:
        self.counting = False
        self.bytes = 0

    async def __call__(self, response: httpx.Response) -> None:
        if self.counting and response.status_code == 200:
            self.bytes += int(response.headers.get("content-length", 0))


@dataclass
class ChildState:
    """Set in each client process by `_prepare`: the bodies, encoded once, and the start signal."""

    traffic: dict[tuple[loadtest.Shape, RequestFormat, str], loadtest.Traffic]
    signal: StartSignal


_child: ChildState | None = None


def _prepare(jobs: list[tuple[loadtest.Shape, RequestFormat, str]], signal: StartSignal) -> None:
    global _child
    traffic = {job: loadtest.Traffic([(job[0], 1.0)], [(job[1], 1.0)], [(job[2], 1.0)], "float32", 0) for job in jobs}
    _child = ChildState(traffic, signal)


def _run_share(share: Share) -> ShareResult:
    return asyncio.run(_drive(share))


def _perf_counter_at(wall_s: float) -> float:
    return time.perf_counter() + (wall_s - time.time())


async def _drive(share: Share) -> ShareResult:
    """Warm up, say so, wait for the signal, then run the closed loop until the shared deadline."""
    assert _child is not None, "_prepare runs first in every client process"
    traffic = _child.traffic[share.shape, share.format, share.kernel]
    body_bytes = traffic.next().payload.size
    counter = EchoCounter()
    limits = httpx.Limits(max_connections=share.concurrency, max_keepalive_connections=share.concurrency)
    http = httpx.AsyncClient(
        base_url=share.url,
        timeout=httpx.Timeout(share.timeout_s, pool=None),
        limits=limits,
        event_hooks={"response": [counter]},
    )
    client = AsyncMatmulClient(share.url, timeout=share.timeout_s, connections=share.concurrency)
    async with http, client:

        def new_run() -> loadtest.Run:
            if share.route == "echo":
                return EchoRun(client, traffic, {}, http=http)
            return loadtest.Run(client, traffic, {})

        await loadtest.closed_loop(new_run(), share.concurrency, share.warmup, float("inf"), lambda: None)
        start_at = await asyncio.to_thread(_child.signal.wait_for_start)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        counter.counting = True
        run = new_run()
        started = time.time()
        until = _perf_counter_at(start_at + share.duration_s)
        await loadtest.closed_loop(run, share.concurrency, share.requests, until, lambda: None)
        finished = time.time()
    ok = [sample for sample in run.samples if sample.status == "200"]
    answers = counter.bytes + sum(sample.answer_bytes for sample in ok)
    batch_sizes = [sample.batch_size for sample in ok if sample.batch_size is not None]
    return ShareResult(run.samples, started, finished, len(ok) * body_bytes, answers, batch_sizes)


Clients = TogetherPool[Share, ShareResult]
"""The client processes of a run."""


def client_pool(processes: int, jobs: list[tuple[loadtest.Shape, RequestFormat, str]]) -> Clients:
    """`processes` client processes (spawned, each with every body of the run encoded) that run a cell together."""
    return TogetherPool(processes, _prepare, (jobs,))


# -------------------------------------------------------------------------------------------- the cells


@dataclass(frozen=True)
class Cell:
    route: Route
    shape: loadtest.Shape
    format: RequestFormat
    concurrency: int

    @property
    def size(self) -> str:
        return "x".join(map(str, self.shape))


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal whole shares, larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def measure_cell(clients: Clients, args: argparse.Namespace, url: str, cell: Cell) -> dict[str, Any]:
    """One cell's figures: loadtest's summary of the merged samples, with payload GB/s and the processes used."""
    processes = min(clients.processes, cell.concurrency)
    shares = [
        Share(url, cell.route, cell.shape, cell.format, args.kernel, connections, args.warmup,
              requests, args.duration, args.timeout)
        for connections, requests in zip(
            split(cell.concurrency, processes), split(args.max_requests, processes), strict=True
        )
    ]  # fmt: skip
    results = clients.run(_run_share, shares, 0.0, args.timeout * (args.warmup + 1) + 120, tag=0)
    samples = [sample for result in results for sample in result.samples]
    elapsed_s = max(r.finished for r in results) - min(r.started for r in results)
    summary = loadtest.build_report(argparse.Namespace(url=url), samples, elapsed_s, {})
    payload = sum(r.request_bytes + r.response_bytes for r in results)
    batch_sizes = [size for result in results for size in result.batch_sizes]
    return {
        "route": cell.route,
        "size": cell.size,
        "format": cell.format,
        "concurrency": cell.concurrency,
        "client_processes": processes,
        **{key: summary[key] for key in ("requests", "ok", "errors", "duration_s", "throughput_rps", "latency_ms")},
        "server_ms": summary["server_ms"],
        "payload_bytes": payload,
        "payload_gbps": payload / elapsed_s / 1e9 if elapsed_s > 0 else 0.0,
        "mean_batch_size": sum(batch_sizes) / len(batch_sizes) if batch_sizes else None,
    }


def json_fits(shape: loadtest.Shape, max_json_bytes: int) -> bool:
    """Whether a JSON body of these operands is likely under the server's MATMUL_MAX_JSON_BYTES."""
    m, k, n = shape
    return (m * k + k * n) * JSON_BYTES_PER_ELEMENT <= max_json_bytes


def plan(args: argparse.Namespace) -> tuple[list[Cell], list[dict[str, str]]]:
    """The cells each server runs (products, then the echo of the largest .npy body), and those left out."""
    cells: list[Cell] = []
    skipped: list[dict[str, str]] = []
    max_json_bytes = Settings().max_json_bytes
    for shape in args.sizes:
        for format in args.formats:
            if format == "json" and not json_fits(shape, max_json_bytes):
                size = "x".join(map(str, shape))
                reason = f"a JSON body of {size} exceeds MATMUL_MAX_JSON_BYTES ({max_json_bytes} bytes)"
                skipped.append({"size": size, "format": format, "reason": reason})
                continue
            cells += [Cell("matmul", shape, format, concurrency) for concurrency in args.concurrency]
    if args.echo:
        largest = max(args.sizes, key=lambda shape: shape[0] * shape[1] + shape[1] * shape[2])
        cells += [Cell("echo", largest, "npy", concurrency) for concurrency in args.concurrency]
    return cells, skipped


def server_env(args: argparse.Namespace, config: Config, devices: str | None) -> dict[str, str]:
    """The server's MATMUL_* settings: the configuration's, the flags', and room in the queue for every request."""
    env = {
        "MATMUL_BACKEND": args.backend,
        "MATMUL_ECHO_ROUTE": "true",
        "MATMUL_BATCHING": "true" if config.batching else "false",
        "MATMUL_QUEUE_SIZE": os.environ.get("MATMUL_QUEUE_SIZE", str(max(64, *args.concurrency))),
        "MATMUL_ACCESS_LOG": os.environ.get("MATMUL_ACCESS_LOG", "false"),
    }
    optional = {
        "MATMUL_MAX_BATCH_SIZE": args.max_batch_size,
        "MATMUL_MAX_QUEUE_DELAY_US": args.max_queue_delay_us,
        "MATMUL_DEVICES": devices,
    }
    return env | {name: str(value) for name, value in optional.items() if value is not None}


def run_server(
    clients: Clients, args: argparse.Namespace, config: Config, cells: list[Cell], devices: str | None, log: Console
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start a fresh server for `config`, run every cell against it, stop it: its /v1/info and the cells' figures."""
    log_path = args.out / f"server-{config.token}.log"
    service = LocalService.matmul_service(free_port(), server_env(args, config, devices), log_path, config.workers)
    results = []
    try:
        service.wait_ready(args.ready_timeout)
        info: dict[str, Any] = httpx.get(f"{service.url}/v1/info", timeout=30).json()
        for cell in cells:
            result: dict[str, Any] = {"config": config.token, "batching": config.batching, "workers": config.workers}
            result |= measure_cell(clients, args, service.url, cell)
            results.append(result)
            log.print(
                f"{config.name}: {cell.route} {cell.size} {cell.format} c={cell.concurrency}: "
                f"{result['throughput_rps']:.1f} req/s, {result['payload_gbps']:.3f} GB/s, "
                f"p99 {result['latency_ms'].get('p99', 0):.2f} ms, errors {sum(result['errors'].values())}",
                soft_wrap=True,
            )
    finally:
        service.stop()
    return info, results


# ---------------------------------------------------------------------------------------------- ratios


def find(cells: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((cell for cell in cells if all(cell[key] == value for key, value in match.items())), None)


def transport_ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """matmul payload GB/s / echo payload GB/s, per server and concurrency, for the size the echo carried."""
    ratios = []
    for echo in (cell for cell in cells if cell["route"] == "echo"):
        same = {key: echo[key] for key in ("config", "size", "format", "concurrency")}
        matmul = find(cells, route="matmul", **same)
        if matmul is not None and echo["payload_gbps"] > 0:
            ratio = matmul["payload_gbps"] / echo["payload_gbps"]
            ratios.append(same | {"matmul_gbps": matmul["payload_gbps"], "echo_gbps": echo["payload_gbps"]} | {
                "ratio": ratio})  # fmt: skip
    return ratios


def batching_ratio(cells: list[dict[str, Any]], workers: int) -> dict[str, Any] | None:
    """req/s (batching on, `workers` workers) / req/s (batching off, 1 worker): smallest size, .npy, top concurrency."""
    products = [cell for cell in cells if cell["route"] == "matmul" and cell["format"] == "npy"]
    if not products:
        return None
    size = min((cell["size"] for cell in products), key=lambda size: int(size.split("x")[0]))
    concurrency = max(cell["concurrency"] for cell in products)
    on = find(products, size=size, concurrency=concurrency, batching=True, workers=workers)
    off = find(products, size=size, concurrency=concurrency, batching=False, workers=1)
    if on is None or off is None or off["throughput_rps"] == 0:
        return None
    return {
        "size": size,
        "format": "npy",
        "concurrency": concurrency,
        "on": on["config"],
        "off": off["config"],
        "on_rps": on["throughput_rps"],
        "off_rps": off["throughput_rps"],
        "ratio": on["throughput_rps"] / off["throughput_rps"],
    }


# --------------------------------------------------------------------------------------------- the report


def _ms(summary: dict[str, float], key: str) -> str:
    return f"{summary[key]:.2f}" if key in summary else "-"


def print_report(report: dict[str, Any], console: Console) -> None:
    throughput = Table(title="Throughput")
    for column in ("server", "route", "size", "format", "conc", "req/s", "p50 ms", "p99 ms", "GB/s", "errors"):
        throughput.add_column(column, justify="left" if column in ("server", "route", "format") else "right")
    phases = Table(
        title="Where the time goes: mean ms per request (server phases, the client-observed rest), mean batch size"
    )
    for column in ("server", "size", "format", "conc", *PHASES, "batch"):
        phases.add_column(column, justify="left" if column in ("server", "format") else "right")
    for cell in report["cells"]:
        where = (cell["config"], cell["route"], cell["size"], cell["format"], str(cell["concurrency"]))
        errors = ", ".join(f"{status}: {count}" for status, count in sorted(cell["errors"].items())) or "0"
        latency = cell["latency_ms"]
        throughput.add_row(*where, f"{cell['throughput_rps']:.1f}", _ms(latency, "p50"), _ms(latency, "p99"),
                           f"{cell['payload_gbps']:.3f}", errors)  # fmt: skip
        if cell["route"] == "matmul":
            means = [_ms(cell["server_ms"].get(phase, {}), "mean") for phase in PHASES]
            batch = f"{cell['mean_batch_size']:.1f}" if cell["mean_batch_size"] is not None else "-"
            phases.add_row(cell["config"], cell["size"], cell["format"], str(cell["concurrency"]), *means, batch)
    console.print(throughput)
    console.print(phases)
    for skipped in report["skipped"]:
        console.print(f"skipped {skipped['size']} {skipped['format']}: {skipped['reason']}")
    for ratio in report["ratios"]["transport"]:
        console.print(
            f"transport, {ratio['config']}, {ratio['size']} npy at concurrency {ratio['concurrency']}: matmul "
            f"{ratio['matmul_gbps']:.3f} GB/s / echo {ratio['echo_gbps']:.3f} GB/s = {ratio['ratio']:.2f}"
        )
    batching = report["ratios"]["batching"]
    if batching is not None:
        console.print(
            f"batching, {batching['size']} npy at concurrency {batching['concurrency']}: {batching['on_rps']:.1f} "
            f"req/s ({batching['on']}) / {batching['off_rps']:.1f} req/s ({batching['off']}) = {batching['ratio']:.2f}x"
        )


def plot_report(report: dict[str, Any], path: Path) -> None:
    """req/s of every product cell: one panel per size and format, concurrencies grouped, a bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [cell for cell in report["cells"] if cell["route"] == "matmul"]
    panels = sorted({(cell["size"], cell["format"]) for cell in cells}, key=lambda p: (int(p[0].split("x")[0]), p[1]))
    configs = list(dict.fromkeys(cell["config"] for cell in cells))
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 4), squeeze=False)
    for axis, (size, format) in zip(axes[0], panels, strict=False):
        panel = [cell for cell in cells if (cell["size"], cell["format"]) == (size, format)]
        concurrencies = sorted({cell["concurrency"] for cell in panel})
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            found = [find(panel, concurrency=c, config=config) for c in concurrencies]
            heights = [cell["throughput_rps"] if cell is not None else 0.0 for cell in found]
            axis.bar([x + i * width for x in range(len(concurrencies))], heights, width, label=config)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(concurrencies))], [str(c) for c in concurrencies])
        axis.set(title=f"{size} {format}", xlabel="concurrency", ylabel="req/s")
    axes[0][0].legend(title="batching-workers", fontsize="small")
    figure.suptitle(f"matmul-service, {report['backend']} backend: req/s per cell")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------ the CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="64,512,4096", help="N or MxKxN, comma-separated (default: %(default)s)")
    parser.add_argument("--formats", default="json,npy", help="request bodies, of json, npy (default: %(default)s)")
    parser.add_argument("--concurrency", default="1,8,64", help="connections per cell (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, help="N, the HTTP workers of the N configs (default: 4)")
    parser.add_argument(
        "--configs", help="servers to run, batching-workers: off-1,on-4,... (default: off-1,off-N,on-1,on-N)"
    )
    parser.add_argument("--max-batch-size", type=int, help="MATMUL_MAX_BATCH_SIZE (default: the server's)")
    parser.add_argument("--max-queue-delay-us", type=int, help="MATMUL_MAX_QUEUE_DELAY_US (default: the server's)")
    add_server_options(parser)
    parser.add_argument("--devices", help="MATMUL_DEVICES, e.g. 0 or 0,1 (default: every visible device)")
    parser.add_argument("--kernel", default="auto", help="the kernel every product asks for (default: auto)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds each cell sends for (default: 2)")
    parser.add_argument("--max-requests", type=int, default=20_000, help="requests per cell at most (default: 20000)")
    parser.add_argument("--warmup", type=int, default=2, help="requests per client process first (default: 2)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take (default: 60)")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=8,
        help="processes sending the load, sharing each cell's connections (default: 8; a cell uses at most one "
        "per connection)",
    )
    parser.add_argument("--no-echo", dest="echo", action="store_false", help="skip the /v1/echo transport ceiling")
    parser.add_argument(
        "--compare-devices",
        nargs=2,
        metavar=("ONE", "MANY"),
        help="instead of the matrix: --compare-size over .npy on MATMUL_DEVICES=ONE, then =MANY; prints the ratio",
    )
    parser.add_argument("--compare-size", default="8192", help="the compute-bound shape (default: %(default)s)")
    parser.add_argument("--compare-kernel", default="naive", help="its kernel (default: %(default)s)")
    parser.add_argument("--compare-concurrency", type=int, default=32, help="its connections (default: 32)")
    parser.add_argument("--out", type=Path, default=Path("out/bench-service"), help="folder for JSON, PNG and logs")
    args = parser.parse_args(argv)
    try:
        args.sizes = [loadtest.parse_shape(size) for size in args.sizes.split(",")]
        args.formats = [loadtest.parse_format(format.strip()) for format in args.formats.split(",")]
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
        args.compare_size = loadtest.parse_shape(args.compare_size)
    except ValueError as exc:
        parser.error(str(exc))
    default_configs = f"off-1,off-{args.workers},on-1,on-{args.workers}"
    try:
        args.configs = list(dict.fromkeys(parse_config(c) for c in (args.configs or default_configs).split(",")))
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if min(args.concurrency) < 1 or args.duration <= 0 or args.max_requests < 1 or args.warmup < 0:
        parser.error("--concurrency, --duration and --max-requests must be positive, --warmup not negative")
    if args.client_processes < 1 or args.workers < 1:
        parser.error("--client-processes and --workers must be positive")
    return args


def compare_devices(clients: Clients, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The compute-bound cell on MATMUL_DEVICES=ONE, then on =MANY, on fresh servers: req/s of each and the ratio,
    with each server's transport ceiling (/v1/echo of the same body, unless --no-echo) and the GPU time per
    product, which say whether the cell was bound by the devices or by the transport."""
    config = Config(batching=False, workers=args.workers)
    matmul = Cell("matmul", args.compare_size, "npy", args.compare_concurrency)
    cells = [matmul, Cell("echo", args.compare_size, "npy", args.compare_concurrency)] if args.echo else [matmul]
    servers = []
    for devices in args.compare_devices:
        _, results = run_server(clients, args, config, cells, devices, console)
        servers.append([result | {"devices": devices} for result in results])
    (one, *one_echo), (many, *many_echo) = servers
    ratio = many["throughput_rps"] / one["throughput_rps"] if one["throughput_rps"] else 0.0
    console.print(
        f"devices, {matmul.size} npy, kernel {args.kernel}, concurrency {matmul.concurrency}, {config.name}: "
        f"{many['throughput_rps']:.1f} req/s (MATMUL_DEVICES={many['devices']}) / {one['throughput_rps']:.1f} "
        f"req/s (MATMUL_DEVICES={one['devices']}) = {ratio:.2f}x",
        soft_wrap=True,
    )
    for cell, echo in ((one, one_echo), (many, many_echo)):
        kernel_ms = cell["server_ms"].get("kernel", {}).get("mean", 0.0)
        ceiling = f", transport ceiling (echo) {echo[0]['payload_gbps']:.2f} GB/s" if echo else ""
        console.print(
            f"  MATMUL_DEVICES={cell['devices']}: {cell['payload_gbps']:.2f} GB/s of payload{ceiling}, "
            f"{kernel_ms:.1f} ms of GPU per product",
            soft_wrap=True,
        )
    return {"cells": [one, many], "echo": [*one_echo, *many_echo], "ratio": ratio}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: no 80-column wrap
    progress = Console(stderr=True)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report: dict[str, Any] = {
        "finished": "",
        "backend": args.backend,
        "arguments": {key: str(value) for key, value in vars(args).items()},
    }
    if args.compare_devices:
        args.kernel = args.compare_kernel
        clients = client_pool(args.client_processes, [(args.compare_size, "npy", args.kernel)])
        try:
            report["compare_devices"] = compare_devices(clients, args, progress)
        finally:
            clients.close()
        path = args.out / "bench-devices.json"
    else:
        cells, report["skipped"] = plan(args)
        jobs = list(dict.fromkeys((cell.shape, cell.format, args.kernel) for cell in cells))
        clients = client_pool(args.client_processes, jobs)
        report |= {"servers": {}, "cells": []}
        try:
            for config in args.configs:
                info, results = run_server(clients, args, config, cells, args.devices, progress)
                report["servers"][config.token] = info
                report["cells"] += results
        finally:
            clients.close()
        report["ratios"] = {
            "transport": transport_ratios(report["cells"]),
            "batching": batching_ratio(report["cells"], args.workers),
        }
        print_report(report, console)
        plot_report(report, args.out / "bench-service.png")
        path = args.out / "bench-service.json"
    report["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    report["elapsed_s"] = time.monotonic() - began
    path.write_text(json.dumps(report, indent=1))
    written = "" if args.compare_devices else f" and {args.out / 'bench-service.png'}"
    progress.print(f"{report['elapsed_s']:.0f} s in all; wrote {path}{written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
