"""Measure the GPU worker's copy/compute overlap: products/s of one worker at pipeline depth 1 and 2, no HTTP.

For each depth a DeviceWorker on a fresh GpuBackend (MATMUL_PIPELINE_DEPTH) takes `--clients` concurrent callers on
one event loop, each sending its share of `--requests` products of one shape, as the routes would (float32
operands as a decoded .npy body holds them). Depth 1 stages, copies in, multiplies and copies out each launch
before the next; depth 2 stages and copies the next launch in while the current kernel runs, and copies the
current result out under the next kernel. Per shape and depth: products/s from the first call to the last answer,
and the mean of each step the answers report (queue, h2d = staging into pinned memory + copy in, kernel, d2h);
the ratio depth 2 / depth 1 is printed per shape, both measured in this run. Writes bench_pipeline.json.

    python scripts/bench_pipeline.py --sizes 1024,4096 --kernel cublas --out out/bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from app.engine import DeviceTiming, DeviceWorker, EngineState, Outcome, ProductRequest
from app.engine.gpu import GpuBackend

DEPTHS = (1, 2)
READY_POLLS = 1200
"""Every 50 ms for a minute: long enough for the worker to compile, self-test and time every kernel."""
WARMUP = 3
"""Products of each shape run first and left out: pinned and device pools fill, cuBLAS loads its kernels."""


async def measure_shape(worker: DeviceWorker, size: int, kernel: str, clients: int, requests: int) -> dict[str, Any]:
    rng = np.random.default_rng(size)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    dtype = np.dtype(np.float32)
    plan = worker.backend.plan(ProductRequest.of(a, b, dtype, kernel))
    for _ in range(WARMUP):
        await worker.matmul(a, b, dtype, plan)
    timings: list[tuple[float, DeviceTiming]] = []
    last: list[Outcome] = []

    async def caller(count: int) -> None:
        for _ in range(count):
            outcome = await worker.matmul(a, b, dtype, plan)
            timings.append((outcome.queue_ms, outcome.device))
            last[:] = [outcome]  # products are dropped as a server drops them once sent: their pinned blocks recycle

    began = time.perf_counter()
    await asyncio.gather(*(caller(requests // clients + (i < requests % clients)) for i in range(clients)))
    elapsed = time.perf_counter() - began
    expected = a.astype(np.float64) @ b.astype(np.float64)
    c = last[0].c
    assert c is not None  # a worker computes into this process's memory
    error = float(np.linalg.norm(c - expected) / np.linalg.norm(expected))
    return {
        "size": size,
        "kernel": plan.kernel,
        "products": len(timings),
        "elapsed_s": elapsed,
        "products_per_s": len(timings) / elapsed,
        "relative_error": error,
        "mean_ms": {
            "queue": statistics.fmean(queue_ms for queue_ms, _ in timings),
            "h2d": statistics.fmean(device.h2d_ms for _, device in timings),
            "kernel": statistics.fmean(device.kernel_ms for _, device in timings),
            "d2h": statistics.fmean(device.d2h_ms for _, device in timings),
        },
    }


async def measure_depth(args: argparse.Namespace, depth: int) -> list[dict[str, Any]]:
    worker = DeviceWorker(GpuBackend(args.device, pipeline_depth=depth), queue_size=args.clients)
    worker.start()
    for _ in range(READY_POLLS):
        if worker.state is not EngineState.STARTING:
            break
        await asyncio.sleep(0.05)
    worker.check_ready()
    try:
        return [
            {"depth": depth} | await measure_shape(worker, size, args.kernel, args.clients, args.requests)
            for size in args.sizes
        ]
    finally:
        await worker.stop()


def print_report(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title=f"One GPU worker, float32, {rows[0]['kernel']}: pipeline depth 1 and 2")
    for column in ("size", "depth", "products/s", "queue ms", "h2d ms", "kernel ms", "d2h ms", "rel. error"):
        table.add_column(column, justify="right")
    for row in rows:
        means = row["mean_ms"]
        table.add_row(str(row["size"]), str(row["depth"]), f"{row['products_per_s']:.1f}",
                      *(f"{means[step]:.2f}" for step in ("queue", "h2d", "kernel", "d2h")),
                      f"{row['relative_error']:.1e}")  # fmt: skip
    console.print(table)
    for size in dict.fromkeys(row["size"] for row in rows):
        one, two = (next(r for r in rows if r["size"] == size and r["depth"] == d) for d in DEPTHS)
        console.print(
            f"{size}x{size}: depth 2 {two['products_per_s']:.1f} products/s / depth 1 "
            f"{one['products_per_s']:.1f} = {two['products_per_s'] / one['products_per_s']:.2f}x"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1024,4096", help="square sides, comma-separated (default: %(default)s)")
    parser.add_argument("--kernel", default="cublas", help="the kernel every product asks for (default: cublas)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent callers (default: 8)")
    parser.add_argument("--requests", type=int, default=64, help="products per shape and depth (default: 64)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="folder for bench_pipeline.json")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error("--sizes takes integers")
    if min(args.sizes) < 1 or args.clients < 1 or args.requests < args.clients:
        parser.error("--sizes and --clients must be positive, --requests at least --clients")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for depth in DEPTHS for row in asyncio.run(measure_depth(args, depth))]
    rows.sort(key=lambda row: (row["size"], row["depth"]))
    backend_facts = GpuBackend(args.device).describe()
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": backend_facts["name"],
        "clients": args.clients,
        "requests": args.requests,
        "kernel": args.kernel,
    }
    print_report(rows, Console(width=None if sys.stdout.isatty() else 160))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_pipeline.json"
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
