"""The data plane's figures in one run: big products against the transport, small ones by the thousand, against an
older checkout and against LitServe, and the time to ready by number of HTTP workers.

The load comes from raw keep-alive sockets in `--client-processes` processes (matmul_tools.raw_load), the same
request bytes for every server, so that the client is not what limits. Servers run one after another on
127.0.0.1 with `--backend`, MATMUL_BATCHING=true, MATMUL_ECHO_ROUTE=true and MATMUL_QUEUE_SIZE=`--queue-size`
(1024: the engine's one queue per device takes every HTTP worker's products, and no cell may overflow it); each
cell runs `--duration` seconds after a warm-up of `--warmup` seconds.

1. This checkout, `matmul-service --workers N` (`--workers`, default 8):
   - big: two 4096^2 float32 `.npy` parts to /matmul (a `.npy` answer) and the same body to /v1/echo answered
     with C's bytes, at `--big-concurrency` (16): products/s, echo requests/s, and payload GB/s (request + answer
     bytes) of each;
   - big-v2: the same operands as v2 binary tensors to /v2/models/matmul/infer (binary answer), and its echo
     (echo-v2): its body to /v1/echo answered with C's bytes (`answer_bytes`), so that it moves what a product
     moves, 128 MiB in and 64 MiB out, `--rounds` times in turn (the order swapped every other round): products/s
     over echoes/s, and payload GB/s over the echo's, in each round, and the rounds' products/s together over their
     echoes/s together (which a drift of the host between cells moves less than any one round's);
   - v2: two 64^2 float32 binary tensors to /v2/models/matmul/infer (binary answer) at `--v2-concurrency` (128):
     requests/s and the mean batch (the answer's `batch_size` parameter);
   - json: the same product as a JSON body to /matmul at `--json-concurrency` (64): requests/s, mean batch.

   Each cell also reads the server's side: the mean milliseconds a request of the cell's route spent in the server
   from its start to its last byte sent (its /metrics, read before and after), the mean of each stage its answers'
   Server-Timing names (read, decode, ..., total), beside the client's mean latency (connections over the rate).
2. `--baseline DIR`: that checkout as it starts itself (`--baseline-workers` uvicorn workers, default 4), the big
   /matmul cell: products/s, and this checkout's over it.
3. `--litserve`: scripts/litserve_matmul.py (LitServe 0.2) with each of `--litserve-api-servers` (default 1,8),
   the json cell sent to its /predict: requests/s, and this checkout's over it.
4. `--ready-workers` (default 1,8): seconds from starting `matmul-service --workers N` until /readyz began the
   run of 200s, each over a new connection, that showed every HTTP worker ready; after a first start left out
   (it fills CuPy's kernel cache).

5. The clients alone (`--no-clients-alone` skips it): the big cells' requests sent by the same client processes
   to a stand-in that answers at once with answers of the same size (matmul_tools.standin): a cell of this
   checkout at CLIENT_BOUND of that rate or above measured its clients, and the run exits 2 once every cell has run.

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
from prometheus_client.parser import text_string_to_metric_families

from matmul_client.client import parse_server_timing
from matmul_tools.bodies import inference_v2_body
from matmul_tools.raw_load import Answer, LoadPool, Tally, npy_matmul_body, post_request, v2_infer_request
from matmul_tools.service import ROOT, LocalService, add_server_options, free_port, start_checkout
from matmul_tools.standin import standing_in

BIG, SMALL = 4096, 64
V2_BATCH_SIZE = re.compile(rb'"batch_size":(\d+)')
TIMING = "timing "
"""The prefix of the figures read from an answer's Server-Timing."""
CLIENT_BOUND = 0.8
"""A cell at this share of its clients' own rate (against the stand-in) or above measured its clients."""
ALONE = ("big", "echo", "big-v2", "echo-v2")
"""The cells whose requests are also sent to the stand-in."""
REQUEST_SECONDS = "matmul_request_duration_seconds"
"""The service's histogram of its requests' time, from start to last byte sent, by route."""


def requests_for(big: int, small: int) -> dict[str, bytes]:
    """Every request of the run, built once in each client process."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((big, big), dtype=np.float32) for _ in range(2))
    big_body, big_content_type = npy_matmul_body(a, b)
    x, y = (rng.standard_normal((small, small), dtype=np.float32) for _ in range(2))
    json_body = orjson.dumps({"a": x, "b": y}, option=orjson.OPT_SERIALIZE_NUMPY)
    v2_body, _ = inference_v2_body(a, b)
    echo = f"/v1/echo?answer_bytes={a.shape[0] * b.shape[1] * a.itemsize}"  # C's data; its header aside (<1 KiB)
    return {
        "big": post_request("/matmul", big_content_type, big_body, accept="application/x-npy"),
        "echo": post_request(echo, "application/octet-stream", big_body),
        "v2": v2_infer_request(x, y),
        "big-v2": v2_infer_request(a, b),
        "echo-v2": post_request(echo, "application/octet-stream", v2_body),
        "json": post_request("/matmul", "application/json", json_body),
        "litserve": post_request("/predict", "application/json", json_body),
    }


def answer_figures(answer: Answer) -> dict[str, float]:
    """The batch a product ran in (X-Matmul-Batch-Size, or the v2 answer's `batch_size` parameter) and the
    server's timing of it (Server-Timing, ms by stage), where the answer has them."""
    timing = parse_server_timing((answer.header(b"server-timing") or b"").decode("latin1"))
    figures = {f"{TIMING}{name}": ms for name, ms in timing.items()}
    header = answer.header(b"x-matmul-batch-size")
    if header is not None:
        figures["batch_size"] = float(header)
    elif (found := V2_BATCH_SIZE.search(answer.opening)) is not None:
        figures["batch_size"] = float(found.group(1))
    return figures


def request_seconds(url: str) -> dict[tuple[str, str], float]:
    """The sum and count of REQUEST_SECONDS by route, from the server's /metrics: {("sum", "/matmul"): ...}."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            name, _, part = sample.name.rpartition("_")
            if name == REQUEST_SECONDS and part in ("sum", "count"):
                key = (part, sample.labels["route"])
                found[key] = found.get(key, 0.0) + sample.value
    return found


def request_means_ms(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, float]:
    """The mean milliseconds of each route's requests between two reads of request_seconds (/metrics's own reads
    left out)."""
    means = {}
    for (part, route), total in after.items():
        count = after[("count", route)] - before.get(("count", route), 0.0)
        if part == "sum" and count > 0 and route != "/metrics":
            means[route] = (total - before.get((part, route), 0.0)) / count * 1e3
    return means


def cell(
    pool: LoadPool, url: str, request: str, connections: int, args: argparse.Namespace, service: bool = True
) -> dict[str, Any]:
    """One request at `connections` for `args.duration` seconds after a warm-up: its figures; with the server's
    side of it where `service` (the stand-in has no /metrics)."""
    port = int(url.rsplit(":", 1)[1])
    pool.run(port, request, connections, args.warmup)
    before = request_seconds(url) if service else {}
    tally, elapsed = pool.run(port, request, connections, args.duration, figures=answer_figures)
    found = summary(request, connections, tally, elapsed)
    if service:
        found["request_ms"] = request_means_ms(before, request_seconds(url))
    return found


def summary(request: str, connections: int, tally: Tally, elapsed: float) -> dict[str, Any]:
    return {
        "request": request,
        "connections": connections,
        "seconds": elapsed,
        "answers": {str(status): count for status, count in sorted(tally.answers.items())},
        "ok_per_s": tally.ok / elapsed,
        "payload_gb_per_s": tally.moved_bytes / elapsed / 1e9,
        "mean_latency_ms": connections / tally.ok * elapsed * 1e3 if tally.ok else None,
        "mean_batch_size": tally.mean("batch_size"),
        "server_timing_ms": {
            name.removeprefix(TIMING): tally.mean(name) for name in tally.figures if name.startswith(TIMING)
        },
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
        this: dict[str, Any] = {
            "auto": httpx.get(f"{service.url}/v1/kernels", timeout=30).json()["auto"],
            "big": cell(pool, service.url, "big", args.big_concurrency, args),
            "echo": cell(pool, service.url, "echo", args.big_concurrency, args),
            "v2_rounds": [],
        }
        for round_ in range(args.rounds):
            order = ("echo-v2", "big-v2") if round_ % 2 == 0 else ("big-v2", "echo-v2")
            found: dict[str, Any] = {name: cell(pool, service.url, name, args.big_concurrency, args) for name in order}
            found["products_per_s_over_echoes_per_s"] = ratio(found["big-v2"], found["echo-v2"])
            found["payload_over_echo"] = ratio(found["big-v2"], found["echo-v2"], "payload_gb_per_s")
            this["v2_rounds"].append(found)
        this["v2"] = cell(pool, service.url, "v2", args.v2_concurrency, args)
        this["json"] = cell(pool, service.url, "json", args.json_concurrency, args)
        return this
    finally:
        service.stop()


def measure_clients_alone(pool: LoadPool, args: argparse.Namespace) -> dict[str, Any]:
    """The big cells' requests from the same client processes to a stand-in that answers at once."""
    with standing_in(args.standin_processes) as url:
        return {name: cell(pool, url, name, args.big_concurrency, args, service=False) for name in ALONE}


def measure_baseline(pool: LoadPool, args: argparse.Namespace) -> dict[str, Any]:
    log = args.out / "server-baseline.log"
    service = start_checkout(args.baseline.resolve(), server_env(args), log, args.baseline_workers)
    try:
        service.wait_ready(args.ready_timeout)
        return cell(pool, service.url, "big", args.big_concurrency, args)
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
        return cell(pool, f"http://127.0.0.1:{port}", "litserve", args.json_concurrency, args, service=False)
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
    rows = [(f"this, {name}", this[name]) for name in ("big", "echo")]
    for round_, found in enumerate(this["v2_rounds"]):
        rows += [(f"this, {name}, round {round_}", found[name]) for name in ("big-v2", "echo-v2")]
    rows += [(f"this, {name}", this[name]) for name in ("v2", "json")]
    if report["baseline"] is not None:
        rows.append(("baseline, big", report["baseline"]))
    rows += [(f"LitServe, {servers} API servers", found) for servers, found in report["litserve"].items()]
    rows += [(f"clients alone, {name}", found) for name, found in report["clients_alone"].items()]
    print(f"{'cell':32s} {'conns':>5s} {'ok/s':>10s} {'GB/s':>7s} {'batch':>6s} {'ms':>8s}  answers")
    for name, found in rows:
        batch = f"{found['mean_batch_size']:.2f}" if found["mean_batch_size"] is not None else "-"
        latency = f"{found['mean_latency_ms']:.1f}" if found["mean_latency_ms"] is not None else "-"
        print(
            f"{name:32s} {found['connections']:5d} {found['ok_per_s']:10.1f} {found['payload_gb_per_s']:7.2f} "
            f"{batch:>6s} {latency:>8s}  {found['answers']}"
        )
    print("\nThe server's side of each cell of this checkout, mean ms: its route's requests from their start to their")
    print("last byte sent (/metrics), then the answers' Server-Timing")
    for name, found in rows:
        if "request_ms" in found:
            said = {**found["request_ms"], **found["server_timing_ms"]}
            print(f"{name:32s} " + ", ".join(f"{key} {ms:.2f}" for key, ms in said.items()))
    print()
    for name, value in report["ratios"].items():
        if isinstance(value, list):
            print(f"{name:48s} " + " / ".join(f"{v:.3f}" if v is not None else "-" for v in value))
        else:
            print(f"{name:48s} {value:.3f}" if value is not None else f"{name:48s} -")
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
    parser.add_argument("--rounds", type=int, default=2, help="big-v2 and its echo, in turn (default: 2)")
    parser.add_argument(
        "--no-clients-alone", dest="clients_alone", action="store_false", help="measure no client against the stand-in"
    )
    parser.add_argument("--standin-processes", type=int, default=8, help="the stand-in's processes (default: 8)")
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
        alone = measure_clients_alone(pool, args) if args.clients_alone else {}
        this = measure_this(pool, args)
        baseline = measure_baseline(pool, args) if args.baseline is not None else None
        litserve = (
            {servers: measure_litserve(pool, servers, args) for servers in args.litserve_api_servers}
            if args.litserve
            else {}
        )
    v2_rounds = this["v2_rounds"]
    ratios: dict[str, float | list[float | None] | None] = {
        "big /matmul products/s over /v1/echo req/s": ratio(this["big"], this["echo"]),
        "big payload GB/s, /matmul over /v1/echo": ratio(this["big"], this["echo"], "payload_gb_per_s"),
        "big v2 products/s over echoes/s of its bytes, by round": [
            found["products_per_s_over_echoes_per_s"] for found in v2_rounds
        ],
        "big v2 payload GB/s over its echo's, by round": [found["payload_over_echo"] for found in v2_rounds],
        "big v2 products/s over echoes/s of its bytes, the rounds together": ratio(
            {"ok_per_s": sum(found["big-v2"]["ok_per_s"] for found in v2_rounds)},
            {"ok_per_s": sum(found["echo-v2"]["ok_per_s"] for found in v2_rounds)},
        ),
        "big /matmul, this over the baseline": ratio(this["big"], baseline),
    }
    big_cells = [("big", this["big"]), ("echo", this["echo"])]
    big_cells += [(name, found[name]) for found in v2_rounds for name in ("big-v2", "echo-v2")]
    bound = []
    for name, found in big_cells:
        found["over_clients_alone"] = ratio(found, alone.get(name))
        if found["over_clients_alone"] is not None and found["over_clients_alone"] >= CLIENT_BOUND:
            bound.append(f"{name} reached {found['over_clients_alone']:.2f} of its clients' own rate")
    ratios["each big cell over its clients alone"] = [found["over_clients_alone"] for _, found in big_cells]
    for servers, found in litserve.items():
        ratios[f"json req/s, this over LitServe with {servers} API servers"] = ratio(this["json"], found)
    report = {
        "settings": {key: str(value) for key, value in vars(args).items()},
        "python": sys.version,
        "this": this,
        "baseline": baseline,
        "litserve": litserve,
        "clients_alone": alone,
        "ratios": ratios,
        "ready_s": ready_s,
    }
    print_report(report)
    (args.out / "bench-dataplane.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'bench-dataplane.json'}")
    for said in bound:
        print(f"CLIENT-BOUND: {said}: run more --client-processes", file=sys.stderr)
    return 2 if bound else 0


if __name__ == "__main__":
    sys.exit(main())
