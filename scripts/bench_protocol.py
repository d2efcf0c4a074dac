"""Two checkouts of matmul-service served side by side and measured in alternation: body throughput and small-request
rate, to tell whether a change to how the service serves HTTP costs anything.

Each checkout is started the way it starts itself (its own matmul_tools/service.py, or scripts/local_service.py in
a tree from before that package: uvicorn with that tree's flags, from that tree's directory) with
MATMUL_ECHO_ROUTE=true, on this Python. Then, for `--rounds` rounds, every
workload runs `--duration` seconds on one server and then on the other, the order swapped each round, so that
drift of the host (clocks, caches, neighbours) falls on both alike. The load comes from raw keep-alive sockets
in `--client-processes` processes (one connection each, or several threads each for small requests):

- echo: POST /v1/echo with a body of `--echo-bytes` (default 128 MiB, two 4096^2 float32 operands), at each
  `--echo-concurrency`: GB/s of request + response bytes;
- healthz: GET /healthz at `--small-concurrency`: req/s of HTTP alone;
- matmul: POST /matmul of two 16x16 float32 .npy parts at `--small-concurrency`: req/s of a small product.

Prints the median of each workload on each server and candidate / baseline; writes OUT/bench-protocol.json
and each server's log (OUT/server-baseline.log, OUT/server-candidate.log).

    python scripts/bench_protocol.py --baseline ../old-checkout --candidate . --backend gpu --out out/bench-protocol
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, multipart_body, npy_bytes
from matmul_tools.raw_load import LoadPool
from matmul_tools.service import add_server_options, start_checkout

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("baseline", "candidate")


@dataclass(frozen=True)
class Workload:
    name: str
    request: str
    """Which of the requests built in every client process (requests_for)."""
    connections: int
    unit: str
    """GB/s (request + response bytes) or req/s."""


def requests_for(echo_bytes: int) -> dict[str, bytes]:
    echo_head = b"POST /v1/echo HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
    operand = npy_bytes(np.ones((16, 16), np.float32))
    body = multipart_body([("a", operand), ("b", operand)])
    return {
        "echo": echo_head + b"Content-Length: %d\r\n\r\n" % echo_bytes + bytes(echo_bytes),
        "healthz": b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n",
        "matmul": b"POST /matmul HTTP/1.1\r\nHost: bench\r\nAccept: application/x-npy\r\n"
        b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n" % (MULTIPART_CONTENT_TYPE.encode(), len(body)) + body,
    }


def measure(pool: LoadPool, port: int, workload: Workload, duration_s: float) -> float:
    """The workload's figure (GB/s or req/s) over `duration_s` against the server on `port`."""
    tally, elapsed = pool.run(port, workload.request, workload.connections, duration_s)
    if set(tally.answers) != {200}:
        raise RuntimeError(f"{workload.name}: answers other than 200: {tally.answers}")
    return tally.moved_bytes / elapsed / 1e9 if workload.unit == "GB/s" else tally.ok / elapsed


def workloads(args: argparse.Namespace) -> list[Workload]:
    found = [Workload(f"echo c={c}", "echo", c, "GB/s") for c in args.echo_concurrency]
    found.append(Workload(f"healthz c={args.small_concurrency}", "healthz", args.small_concurrency, "req/s"))
    found.append(Workload(f"matmul 16^3 c={args.small_concurrency}", "matmul", args.small_concurrency, "req/s"))
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to compare against (its root)")
    parser.add_argument("--candidate", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    add_server_options(parser)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers of each server (default: 1)")
    parser.add_argument("--echo-bytes", type=int, default=128 << 20, help="the echo body (default: 128 MiB)")
    parser.add_argument(
        "--echo-concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 4], help="default: 1,4"
    )
    parser.add_argument("--small-concurrency", type=int, default=32, help="connections for small requests (32)")
    parser.add_argument("--client-processes", type=int, default=8, help="load-generating processes (default: 8)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every workload on both servers (default: 5)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per workload and server (default: 5)")
    parser.add_argument("--out", type=Path, default=Path("out/bench-protocol"), help="folder for the JSON and logs")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {
        "MATMUL_BACKEND": args.backend,
        "MATMUL_ECHO_ROUTE": "true",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_MAX_BODY_BYTES": str(max(1 << 30, args.echo_bytes)),
    }
    checkouts = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    servers: dict[str, Any] = {}
    try:
        for name, checkout in checkouts.items():
            log = (args.out / f"server-{name}.log").resolve()
            servers[name] = start_checkout(checkout, env, log, args.workers)
        for server in servers.values():
            server.wait_ready(args.ready_timeout)
        figures: dict[str, dict[str, list[float]]] = {}
        with LoadPool(args.client_processes, requests_for, (args.echo_bytes,)) as pool:
            for workload in workloads(args):
                for name in SERVERS:  # warm-up, left out
                    measure(pool, servers[name].port, workload, min(1.0, args.duration))
            for round_index in range(args.rounds):
                order = SERVERS if round_index % 2 == 0 else SERVERS[::-1]
                for workload in workloads(args):
                    for name in order:
                        value = measure(pool, servers[name].port, workload, args.duration)
                        figures.setdefault(workload.name, {}).setdefault(name, []).append(value)
                        print(f"round {round_index + 1} {workload.name:22s} {name:9s} {value:12.3f} {workload.unit}")
    finally:
        for server in servers.values():
            server.stop()
    units = {workload.name: workload.unit for workload in workloads(args)}
    rows = []
    for workload_name, by_server in figures.items():
        medians = {name: statistics.median(values) for name, values in by_server.items()}
        ratio = medians["candidate"] / medians["baseline"]
        rows.append({"workload": workload_name, "unit": units[workload_name], "rounds": by_server, **medians,
                     "ratio": ratio, "within_5_percent": ratio >= 0.95})  # fmt: skip
    print(f"\n{'workload':24s} {'unit':6s} {'baseline':>12s} {'candidate':>12s} {'ratio':>7s}")
    for row in rows:
        print(
            f"{row['workload']:24s} {row['unit']:6s} {row['baseline']:12.3f} {row['candidate']:12.3f} "
            f"{row['ratio']:7.3f}{'' if row['within_5_percent'] else '  <- more than 5% slower'}"
        )
    report = {
        "checkouts": {name: str(path) for name, path in checkouts.items()},
        "settings": {key: value for key, value in vars(args).items() if key not in ("baseline", "candidate", "out")},
        "python": sys.version,
        "results": rows,
    }
    (args.out / "bench-protocol.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.out / 'bench-protocol.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
