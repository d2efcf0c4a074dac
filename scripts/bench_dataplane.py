"""The data plane's figures in one run: big products against the transport, small ones by the thousand, against an
older checkout and against LitServe, and the time to ready by number of HTTP workers.

The load comes from raw keep-alive sockets in `--client-processes` processes (matmul_tools.raw_load), the same
request bytes for every server, so that the client is not what limits. Servers run one after another on
127.0.0.1 with `--backend`, MATMUL_BATCHING=true, MATMUL_ECHO_ROUTE=true and MATMUL_QUEUE_SIZE=`--queue-size`
(1024: the engine's one queue per device takes every HTTP worker's products, and no cell may overflow it); each
cell runs `--duration` seconds after a warm-up of `--warmup` seconds.

1. This checkout, `matmul-service --workers N` (`--workers`, default 8):
   - big: two 4096^2 float32 `.npy` parts to /matmul (a `.npy` answer) and the same body to /v1/echo, at
     `--big-concurrency` (16): products/s, echo requests/s, and payload GB/s (request + answer bytes) of each;
     then the same operands as v2 binary tensors to /v2/models/matmul/infer (binary answer): products/s;
   - v2: two 64^2 float32 binary tensors to /v2/models/matmul/infer (binary answer) at `--v2-concurrency` (128):
     requests/s and the mean batch (the answer's `batch_size` parameter);
   - json: the same product as a JSON body to /matmul at `--json-concurrency` (64): requests/s, mean batch.
2. `--baseline DIR`: that checkout as it starts itself (`--baseline-workers` uvicorn workers, default 4), the big
   /matmul cell: products/s, and this checkout's over it.
3. `--litserve`: scripts/litserve_matmul.py (LitServe 0.2) with each of `--litserve-api-servers` (default 1,8),
   the json cell sent to its /predict: requests/s, and this checkout's over it.
4. `--ready-workers` (default 1,8): seconds from starting `matmul-service --workers N` until /readyz began the
   run of 200s, each over a new connection, that showed every HTTP worker ready; after a first start left out
   (it fills CuPy's kernel cache).

Prints a table; writes OUT/bench-dataplane.json and every server's log.

    python scripts/bench_dataplane.py --backend gpu --baseline ../checkout-before-the-data-plane --litserve
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from matmul_tools.raw_load import Answer, LoadPool, Tally, npy_matmul_body, post_request, v2_infer_request
from matmul_tools.service import ROOT, LocalService, add_server_options, free_port, start_checkout

BIG, SMALL = 4096, 64
V2_BATCH_SIZE = re.compile(rb'"batch_size":(\d+)')


def requests_for(big: int, small: int) -> dict[str, bytes]:
    """Every request of the run, built once in each client process."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((big, big), dtype=np.float32) for _ in range(2))
    big_body, big_content_type = npy_matmul_body(a, b)
    x, y = (rng.standard_normal((small, small), dtype=np.float32) for _ in range(2))
    json_body = orjson.dumps({"a": x, "b": y}, option=orjson.OPT_SERIALIZE_NUMPY)
    return {
        "big": post_request("/matmul", big_content_type, big_body, accept="application/x-npy"),
        "echo": post_request("/v1/echo", "application/octet-stream", big_body),
        "v2": v2_infer_request(x, y),
        "big-v2": v2_infer_request(a, b),
        "json": post_request("/matmul", "application/json", json_body),
        "litserve": post_request("/predict", "application/json", json_body),
    }


def batch_size(answer: Answer) -> float | None:
    """The batch a product ran in: X-Matmul-Batch-Size, or the v2 answer's `batch_size` parameter."""
    header = answer.header(b"x-matmul-batch-size")
    if header is not None:
        return float(header)
    found = V2_BATCH_SIZE.search(answer.opening)
    return float(found.group(1)) if found else None


def cell(pool: LoadPool, port: int, request: str, connections: int, args: argparse.Namespace) -> dict[str, Any]:
    """One request at `connections` for `args.duration` seconds after a warm-up: its figures."""
    pool.run(port, request, connections, args.warmup)
    tally, elapsed = pool.run(port, request, connections, args.duration, figure=batch_size)
    return summary(request, connections, tally, elapsed)


def summary(request: str, connections: int, tally: Tally, elapsed: float) -> dict[str, Any]:
    return {
        "request": request,
        "connections": connections,
        "seconds": elapsed,
        "answers": {str(status): count for status, count in sorted(tally.answers.items())},
        "ok_per_s": tally.ok / elapsed,
        "payload_gb_per_s": tally.moved_bytes / elapsed / 1e9,
        "mean_batch_size": sum(tally.figures) / len(tally.figures) if tally.figures else None,
    }


def server_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "MATMUL_BACKEND": args.backend,
        "MATMUL_BATCHING": "true",
        "MATMUL_ECHO_ROUTE": "true",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_MAX_BODY_BYTES": str(1 << 30),
        "MATMUL_QUEUE_SIZE": str(args.queue_size),
    }


def measure_this(pool: LoadPool, args: argparse.Namespace) -> dict[str, Any]:
    service = LocalService.matmul_service(free_port(), server_env(args), args.out / "server-this.log", args.workers)
    try:
        service.wait_ready(args.ready_timeout)
        return {
            "auto": httpx.get(f"{service.url}/v1/kernels", timeout=30).json()["auto"],
            "big": cell(pool, service.port, "big", args.big_concurrency, args),
            "echo": cell(pool, service.port, "echo", args.big_concurrency, args),
            "big-v2": cell(pool, service.port, "big-v2", args.big_concurrency, args),
            "v2": cell(pool, service.port, "v2", args.v2_concurrency, args),
            "json": cell(pool, service.port, "json", args.json_concurrency, args),
        }
    finally:
        service.stop()


def measure_baseline(pool: LoadPool, args: argparse.Namespace) -> dict[str, Any]:
    log = args.out / "server-baseline.log"
    service = start_checkout(args.baseline.resolve(), server_env(args), log, args.baseline_workers)
    try:
        service.wait_ready(args.ready_timeout)
        return cell(pool, service.port, "big", args.big_concurrency, args)
    finally:
        service.stop()


def measure_litserve(pool: LoadPool, api_servers: int, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, str(ROOT / "scripts" / "litserve_matmul.py"), "--port", str(port)]
    command += ["--api-servers", str(api_servers)]
    if args.backend == "cpu":
        command += ["--accelerator", "cpu"]
    server = LocalService(command, port, {}, args.out / f"server-litserve-{api_servers}.log", api_servers)
    try:
        server.wait_ready(args.ready_timeout, probe="/health")
        return cell(pool, port, "litserve", args.json_concurrency, args)
    finally:
        server.stop()


def time_to_ready(workers: int, args: argparse.Namespace) -> float:
    started = time.monotonic()
    service = LocalService.matmul_service(
        free_port(), server_env(args), args.out / f"server-ready-{workers}.log", workers
    )
    try:
        # from the start to the first of the run of 200s that showed every worker ready (asking 5 per worker
        # in a row takes longer with more workers, and is not part of being ready)
        return service.wait_ready(args.ready_timeout) - started
    finally:
        service.stop()


def ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None, key: str = "ok_per_s") -> float | None:
    if numerator is None or denominator is None or not denominator[key]:
        return None
    return float(numerator[key] / denominator[key])


def print_report(report: dict[str, Any]) -> None:
    this = report["this"]
    rows = [(f"this, {name}", this[name]) for name in ("big", "echo", "big-v2", "v2", "json")]
    if report["baseline"] is not None:
        rows.append(("baseline, big", report["baseline"]))
    rows += [(f"LitServe, {servers} API servers", found) for servers, found in report["litserve"].items()]
    print(f"{'cell':32s} {'conns':>5s} {'ok/s':>10s} {'GB/s':>7s} {'batch':>6s}  answers")
    for name, found in rows:
        batch = f"{found['mean_batch_size']:.2f}" if found["mean_batch_size"] is not None else "-"
        print(
            f"{name:32s} {found['connections']:5d} {found['ok_per_s']:10.1f} {found['payload_gb_per_s']:7.2f} "
            f"{batch:>6s}  {found['answers']}"
        )
    print()
    for name, value in report["ratios"].items():
        print(f"{name:48s} {value:.2f}" if value is not None else f"{name:48s} -")
    for workers, seconds in report["ready_s"].items():
        print(f"ready with {workers} HTTP workers: {seconds:.1f} s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)

    def numbers(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    add_server_options(parser)
    parser.add_argument("--workers", type=int, default=8, help="this checkout's HTTP workers (default: 8)")
    parser.add_argument("--big", type=int, default=BIG, help=f"the big products' size (default: {BIG})")
    parser.add_argument("--small", type=int, default=SMALL, help=f"the small products' size (default: {SMALL})")
    parser.add_argument("--big-concurrency", type=int, default=16)
    parser.add_argument("--v2-concurrency", type=int, default=128)
    parser.add_argument("--json-concurrency", type=int, default=64)
    parser.add_argument(
        "--queue-size", type=int, default=1024, help="MATMUL_QUEUE_SIZE, above every cell's connections (1024)"
    )
    parser.add_argument("--baseline", type=Path, help="an older checkout to measure the big cell on")
    parser.add_argument("--baseline-workers", type=int, default=4, help="its uvicorn workers (default: 4)")
    parser.add_argument("--litserve", action="store_true", help="measure LitServe on the json cell")
    parser.add_argument("--litserve-api-servers", type=numbers, default=[1, 8], help="default: 1,8")
    parser.add_argument("--ready-workers", type=numbers, default=[1, 8], help="default: 1,8 (empty: skip)")
    parser.add_argument("--client-processes", type=int, default=8, help="load-generating processes (default: 8)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per cell (default: 8)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of each cell first, left out (default: 2)")
    parser.add_argument("--out", type=Path, default=Path("out/bench-dataplane"), help="folder for JSON and logs")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ready_workers:  # a first start, left out, fills CuPy's kernel cache for the ones measured
        time_to_ready(args.ready_workers[0], args)
    ready_s = {workers: time_to_ready(workers, args) for workers in args.ready_workers}
    with LoadPool(args.client_processes, requests_for, (args.big, args.small)) as pool:
        this = measure_this(pool, args)
        baseline = measure_baseline(pool, args) if args.baseline is not None else None
        litserve = (
            {servers: measure_litserve(pool, servers, args) for servers in args.litserve_api_servers}
            if args.litserve
            else {}
        )
    ratios = {
        "big /matmul products/s over /v1/echo req/s": ratio(this["big"], this["echo"]),
        "big v2 binary products/s over /v1/echo req/s": ratio(this["big-v2"], this["echo"]),
        "big payload GB/s, /matmul over /v1/echo": ratio(this["big"], this["echo"], "payload_gb_per_s"),
        "big /matmul, this over the baseline": ratio(this["big"], baseline),
    }
    for servers, found in litserve.items():
        ratios[f"json req/s, this over LitServe with {servers} API servers"] = ratio(this["json"], found)
    report = {
        "settings": {key: str(value) for key, value in vars(args).items()},
        "python": sys.version,
        "this": this,
        "baseline": baseline,
        "litserve": litserve,
        "ratios": ratios,
        "ready_s": ready_s,
    }
    print_report(report)
    (args.out / "bench-dataplane.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'bench-dataplane.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
