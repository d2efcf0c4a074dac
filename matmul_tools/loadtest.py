"""Load tests of a matmul-service at any URL: traffic drawn from mixes, closed and open loops, and their report.

Closed loop: `concurrency` workers, each sending its next request as soon as the last one is answered. Open loop:
requests start at a fixed rate whatever the server does, and each latency is counted from the moment its request
was due, so a slow server cannot hide its queue by slowing the client down. Each request draws its shape, body
format and kernel from the mixes given; bodies are encoded once, before the run. The report: throughput, latency
percentiles, errors by status and the server's own breakdown (queue, h2d, kernel, d2h, ... from its Server-Timing
headers), as JSON, a rich table and a PNG (latency over time, latency histogram).

Progress and tables use rich: one library for both the live bar and the final tables (tqdm draws only bars).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from matmul_client.client import (
    FORMATS,
    MAX_TIMEOUT_S,
    AsyncMatmulClient,
    MatmulServiceError,
    Payload,
    RequestFormat,
    encode_payload,
)
from matmul_tools.outputs import unwritable
from matmul_tools.service import NotReady, wait_ready_async

T = TypeVar("T")
Shape = tuple[int, int, int]
"""(m, k, n): A is m x k, B is k x n."""
PERCENTILES = (50, 90, 99)
DESCRIPTION = "Load-test a matmul-service at any URL: latency percentiles, errors, and where the server spent the time."
CLIENT_SIDE = "client+network"
"""Latency less the server's total: the wire, HTTP framing and the client's own decoding."""


# -------------------------------------------------------------------------------------------- statistics


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, mean, p50, p90, p99 and max of `values` (linear interpolation between ranks); empty -> count 0."""
    if not values:
        return {"count": 0}
    data = np.asarray(values, dtype=np.float64)
    summary = {"count": float(data.size), "mean": float(data.mean())}
    summary |= {f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(data, PERCENTILES), strict=True)}
    return summary | {"max": float(data.max())}


# ------------------------------------------------------------------------------------------- the traffic


def parse_mix(text: str, convert: Callable[[str], T]) -> list[tuple[T, float]]:
    """`a:3,b` -> [(a, 3.0), (b, 1.0)]: the items of a mix and their weights (1 where none is given)."""
    mix: list[tuple[T, float]] = []
    for entry in text.split(","):
        item, _, weight = entry.strip().rpartition(":") if ":" in entry else (entry.strip(), "", "1")
        try:
            mix.append((convert(item), float(weight)))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{entry!r}: {exc}") from exc
        if not (math.isfinite(mix[-1][1]) and mix[-1][1] > 0):
            raise argparse.ArgumentTypeError(f"{entry!r}: a weight must be a positive finite number")
    return mix


def parse_shape(text: str) -> Shape:
    """`512` -> 512x512x512; `MxKxN` -> (m, k, n)."""
    sides = [int(side) for side in text.lower().split("x")]
    if len(sides) == 1:
        sides *= 3
    if len(sides) != 3 or min(sides) < 1:
        raise ValueError("a size is N or MxKxN, with positive sides")
    return sides[0], sides[1], sides[2]


def parse_format(text: str) -> RequestFormat:
    for format in FORMATS:
        if text == format:
            return format
    raise ValueError(f"a format is one of {', '.join(FORMATS)}")


@dataclass(frozen=True)
class Job:
    shape: Shape
    format: RequestFormat
    kernel: str
    payload: Payload = field(repr=False)

    @property
    def size(self) -> str:
        return "x".join(map(str, self.shape))


class Traffic:
    """Draws each request's shape, format and kernel from the mixes; every body is encoded once, up front."""

    def __init__(
        self,
        sizes: list[tuple[Shape, float]],
        formats: list[tuple[RequestFormat, float]],
        kernels: list[tuple[str, float]],
        dtype: str,
        seed: int,
    ) -> None:
        self._random = random.Random(seed)
        self._mixes = (sizes, formats, kernels)
        rng = np.random.default_rng(seed)
        self._payloads: dict[tuple[Shape, RequestFormat], Payload] = {}
        for (m, k, n), _ in sizes:
            a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
            for format, _ in formats:
                self._payloads[(m, k, n), format] = encode_payload(a, b, format)

    def _draw(self, mix: list[tuple[T, float]]) -> T:
        return self._random.choices([item for item, _ in mix], weights=[weight for _, weight in mix])[0]

    def next(self) -> Job:
        sizes, formats, kernels = self._mixes
        shape, format = self._draw(sizes), self._draw(formats)
        return Job(shape, format, self._draw(kernels), self._payloads[shape, format])


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class Sample:
    start_s: float
    """When the request was sent (open loop: when it was due), from the start of the measured run."""
    latency_ms: float
    status: str
    """The HTTP status, or the httpx exception's name where no answer came."""
    size: str
    format: str
    kernel: str
    server_ms: dict[str, float]
    batch_size: int | None = None
    """The launch's products, as the server said (None: no product came)."""
    answer_bytes: int = 0
    """Bytes of the product's data (0: no product came)."""


@dataclass
class Run:
    client: AsyncMatmulClient
    traffic: Traffic
    options: dict[str, Any]
    issued: int = 0
    samples: list[Sample] = field(default_factory=list)

    async def one(self, started: float, due: float) -> None:
        """Send the next request; its latency counts from `due` (perf_counter seconds)."""
        job = self.traffic.next()
        status, server_ms, batch_size, answer_bytes = "200", {}, None, 0
        try:
            product = await self.client.send(job.payload, kernel=job.kernel, **self.options)
            server_ms, batch_size, answer_bytes = product.timing, product.batch_size, product.c.nbytes
        except MatmulServiceError as exc:
            status = str(exc.status)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        done = time.perf_counter()
        latency_ms = (done - due) * 1e3
        sample = Sample(
            due - started, latency_ms, status, job.size, job.format, job.kernel, server_ms, batch_size, answer_bytes
        )
        self.samples.append(sample)


async def closed_loop(run: Run, concurrency: int, requests: int | None, until: float, tick: Callable[[], None]) -> None:
    started = time.perf_counter()

    async def worker() -> None:
        while (requests is None or run.issued < requests) and time.perf_counter() < until:
            run.issued += 1
            await run.one(started, time.perf_counter())
            tick()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


class Sender(Protocol):
    """What open_loop drives: a count of requests issued, and the sending of the next one."""

    issued: int

    async def one(self, started: float, due: float) -> None: ...


async def open_loop(run: Sender, rate: float, requests: int | None, until: float, tick: Callable[[], None]) -> None:
    started = time.perf_counter()
    pending: set[asyncio.Task[None]] = set()

    async def one(due: float) -> None:
        await run.one(started, due)
        tick()

    while requests is None or run.issued < requests:
        due = started + run.issued / rate
        if due >= until:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        run.issued += 1
        task = asyncio.create_task(one(due))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)


async def wait_ready(http: httpx.AsyncClient, seconds: float) -> None:
    """Wait up to `seconds` for /readyz to answer 200; end the tool, saying so, when it does not."""
    try:
        await wait_ready_async(http, seconds, interval_s=0.5)
    except NotReady:
        raise SystemExit(f"loadtest: the server did not become ready within {seconds:g} s") from None


async def measure(args: argparse.Namespace, traffic: Traffic, console: Console) -> tuple[list[Sample], float, Any]:
    """The measured samples, the seconds the measured run took, and what the server says about itself."""
    options = {key: value for key, value in (("tile", args.tile), ("dtype", args.dtype)) if value is not None}
    if args.wait_ready:
        async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout) as http:
            await wait_ready(http, args.wait_ready)
    async with AsyncMatmulClient(args.url, timeout=args.timeout, connections=args.concurrency) as client:
        try:
            server: Any = await client.info()
        except (MatmulServiceError, httpx.HTTPError, ValueError) as exc:
            server = {"error": str(exc)}
        if args.warmup:
            await closed_loop(Run(client, traffic, options), args.concurrency, args.warmup, float("inf"), lambda: None)
        run = Run(client, traffic, options)
        until = time.perf_counter() + args.duration if args.duration is not None else float("inf")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, disable=args.no_progress) as progress:
            task = progress.add_task(f"{args.mode} loop", total=args.requests)
            started = time.perf_counter()

            def tick() -> None:
                progress.advance(task)

            if args.mode == "closed":
                await closed_loop(run, args.concurrency, args.requests, until, tick)
            else:
                await open_loop(run, args.rate, args.requests, until, tick)
            elapsed = time.perf_counter() - started
    return run.samples, elapsed, server


# --------------------------------------------------------------------------------------------- the report


def build_report(args: argparse.Namespace, samples: list[Sample], elapsed_s: float, server: Any) -> dict[str, Any]:
    ok = [s for s in samples if s.status == "200"]
    phases: dict[str, list[float]] = {}
    for s in ok:
        for name, ms in s.server_ms.items():
            phases.setdefault(name, []).append(ms)
        if "total" in s.server_ms:
            phases.setdefault(CLIENT_SIDE, []).append(s.latency_ms - s.server_ms["total"])
    groups: dict[tuple[str, str, str], list[float]] = {}
    for s in ok:
        groups.setdefault((s.kernel, s.size, s.format), []).append(s.latency_ms)
    return {
        "url": args.url,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {key: value for key, value in vars(args).items() if key not in ("out", "no_progress")},
        "server": server,
        "requests": len(samples),
        "ok": len(ok),
        "errors": dict(Counter(s.status for s in samples if s.status != "200")),
        "duration_s": elapsed_s,
        "throughput_rps": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "latency_ms": summarize([s.latency_ms for s in ok]),
        "server_ms": {name: summarize(values) for name, values in phases.items()},
        "by_request": [
            {"kernel": kernel, "size": size, "format": format, "latency_ms": summarize(values)}
            for (kernel, size, format), values in sorted(groups.items())
        ],
        "samples": [asdict(s) for s in samples],
    }


def load_test(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Run the load test `args` describe (as `parse_args` reads them), its progress on `console`: its report."""
    traffic = Traffic(args.sizes, args.formats, args.kernels, args.dtype, args.seed)
    samples, elapsed_s, server = asyncio.run(measure(args, traffic, console))
    return build_report(args, samples, elapsed_s, server)


def report_paths(out: Path) -> tuple[Path, Path]:
    """OUT.json and OUT.png: the suffixes added to `out`, whatever dots it holds (`run.v2` -> `run.v2.json`)."""
    return out.with_name(f"{out.name}.json"), out.with_name(f"{out.name}.png")


def write_report(report: dict[str, Any], out: Path, console: Console) -> None:
    """OUT.json and OUT.png (`plot_report`), saying so on `console`."""
    json_path, png_path = report_paths(out)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    plot_report(report, png_path)
    console.print(f"wrote {json_path} and {png_path}")


def _row(name: str, summary: dict[str, float]) -> list[str]:
    return [name, f"{summary['count']:.0f}"] + [
        f"{summary[key]:.2f}" if key in summary else "-" for key in ("mean", "p50", "p90", "p99", "max")
    ]


def print_report(report: dict[str, Any], console: Console) -> None:
    server = report["server"]
    devices = ", ".join(device.get("name", "?") for device in server.get("devices", [])) or "?"
    where = f"{server.get('backend')} backend, {devices}" if "backend" in server else ""
    errors = ", ".join(f"{status}: {count}" for status, count in sorted(report["errors"].items())) or "none"
    console.print(
        f"{report['url']} ({where}): {report['requests']} requests in {report['duration_s']:.2f} s, "
        f"{report['ok']} answered 200, {report['throughput_rps']:.1f} req/s; errors: {errors}",
        soft_wrap=True,
    )
    table = Table(title="Latency (ms)")
    for column in ("", "n", "mean", "p50", "p90", "p99", "max"):
        table.add_column(column, justify="left" if not column else "right", no_wrap=not column)
    table.add_row(*_row("client latency", report["latency_ms"]))
    for group in report["by_request"]:
        table.add_row(*_row(f"  {group['kernel']} {group['size']} {group['format']}", group["latency_ms"]))
    table.add_section()
    for name, summary in report["server_ms"].items():
        table.add_row(*_row(f"server {name}" if name != CLIENT_SIDE else name, summary))
    console.print(table)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Latency over time (errors marked) beside a histogram of latencies with the percentiles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    ok = [s for s in samples if s["status"] == "200"]
    failed = [s for s in samples if s["status"] != "200"]
    figure, (over_time, histogram) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=(3, 2))
    over_time.scatter([s["start_s"] for s in ok], [s["latency_ms"] for s in ok], s=4, alpha=0.5, label="200")
    if failed:
        over_time.scatter(
            [s["start_s"] for s in failed], [s["latency_ms"] for s in failed], s=12, marker="x", c="red", label="error"
        )
    over_time.set(xlabel="time since start (s)", ylabel="latency (ms)", title="Latency over time")
    over_time.legend(loc="upper right")
    latency = report["latency_ms"]
    if ok:
        histogram.hist([s["latency_ms"] for s in ok], bins=50)
        for q, style in zip(PERCENTILES, (":", "--", "-."), strict=True):
            histogram.axvline(latency[f"p{q}"], color="black", linestyle=style, label=f"p{q} {latency[f'p{q}']:.2f}")
        histogram.legend(loc="upper right")
    histogram.set(xlabel="latency (ms)", ylabel="requests", title="Latency histogram")
    figure.suptitle(f"{report['url']}: {report['config']['mode']} loop, {report['throughput_rps']:.1f} req/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------ the CLI


def server_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options of every tool that loads a running server: --url and --wait-ready."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default="http://localhost:8000", help="the server (default: %(default)s)")
    parser.add_argument("--wait-ready", type=float, default=0, help="first wait up to this many seconds for /readyz")
    return parser


EXIT_STATUS = (
    "exit status: 0 when at least one measured request was answered 200 (the others' errors are counted in the "
    "report); 1 when none was; 2 for refused arguments"
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = server_arguments(DESCRIPTION)
    parser.epilog = EXIT_STATUS
    parser.add_argument("--mode", choices=["closed", "open"], default="closed", help="closed or open loop")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="closed loop: the workers; open loop: the most connections open at once (default: %(default)s)",
    )
    parser.add_argument("--rate", type=float, help="open loop: requests started per second")
    parser.add_argument("--requests", type=int, help="stop after this many measured requests")
    parser.add_argument("--duration", type=float, help="stop after this many seconds (default 10 without --requests)")
    parser.add_argument("--warmup", type=int, default=10, help="requests sent first and left out (default: 10)")
    parser.add_argument(
        "--sizes", default="256", help="mix of shapes, N or MxKxN with optional :weight (default: %(default)s)"
    )
    parser.add_argument("--formats", default="npy", help=f"mix of request bodies among {', '.join(FORMATS)}")
    parser.add_argument("--kernels", default="auto", help="mix of kernels (GET /v1/kernels lists them)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--tile", type=int, help="tile width for the tiled kernel")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take")
    parser.add_argument("--seed", type=int, default=0, help="seed of the operands and of the mix draws")
    parser.add_argument("--out", default="out/loadtest", help="writes OUT.json and OUT.png (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.mode == "open" and not (args.rate and args.rate > 0):
        parser.error("--mode open needs a positive --rate")
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1) or args.warmup < 0:
        parser.error("--concurrency and --requests must be positive, --warmup not negative")
    for name in ("rate", "duration"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name} must be a positive finite number, not {value}")
    if not (math.isfinite(args.wait_ready) and args.wait_ready >= 0):
        parser.error(f"--wait-ready must be a finite number of seconds, 0 or more, not {args.wait_ready}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # nan fails it too
        parser.error(f"--timeout must be a number of seconds over 0 and at most {MAX_TIMEOUT_S:g}, not {args.timeout}")
    if args.tile is not None and args.tile < 1:
        parser.error("--tile must be positive")
    if args.requests is None and args.duration is None:
        args.duration = 10.0
    try:
        args.sizes = parse_mix(args.sizes, parse_shape)
        args.formats = parse_mix(args.formats, parse_format)
        args.kernels = parse_mix(args.kernels, str)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    problem = unwritable(list(report_paths(Path(args.out))))
    if problem:
        parser.error(f"--out: {problem}")
    return args
