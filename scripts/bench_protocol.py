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
import importlib.util
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np

from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, multipart_body, npy_bytes

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


@dataclass(frozen=True)
class Share:
    """What one client process does: `connections` sockets, each sending its request until `until` (time.time())."""

    port: int
    request: str
    connections: int
    until: float


_requests: dict[str, bytes] = {}
"""The requests, built once in each client process (a 128 MiB body is not sent to it for every cell)."""


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


def _build_requests(echo_bytes: int) -> None:
    _requests.update(requests_for(echo_bytes))


def _read_answer(sock: socket.socket, buffer: bytearray) -> int:
    """Read one HTTP answer (framed by Content-Length); its size in bytes. A status other than 200 raises."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        head += chunk
    head, _, start = head.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"answer {head[:80]!r}")
    length = next(int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length: "))
    left = length - len(start)
    view = memoryview(buffer)
    while left > 0:
        got = sock.recv_into(view[: min(left, len(view))])
        if not got:
            raise ConnectionError("the server closed the connection mid-answer")
        left -= got
    return len(head) + 4 + length


def _drive_share(share: Share) -> tuple[int, int]:
    """Requests completed and bytes moved (both ways) by one client process."""
    totals = [0, 0]
    lock = threading.Lock()
    request = _requests[share.request]

    def connection() -> None:
        buffer = bytearray(1 << 20)
        done = moved = 0
        with socket.create_connection(("127.0.0.1", share.port), timeout=600) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while time.time() < share.until:
                sock.sendall(request)
                moved += len(request) + _read_answer(sock, buffer)
                done += 1
        with lock:
            totals[0] += done
            totals[1] += moved

    threads = [threading.Thread(target=connection) for _ in range(share.connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return totals[0], totals[1]


def measure(pool: Any, processes: int, port: int, workload: Workload, duration_s: float) -> float:
    """The workload's figure (GB/s or req/s) over `duration_s` against the server on `port`."""
    per_process = [workload.connections // processes + (i < workload.connections % processes) for i in range(processes)]
    until = time.time() + duration_s
    shares = [Share(port, workload.request, n, until) for n in per_process if n]
    started = time.perf_counter()
    results = pool.map(_drive_share, shares)
    elapsed = time.perf_counter() - started
    requests, moved = (int(sum(column)) for column in zip(*results, strict=True))
    return moved / elapsed / 1e9 if workload.unit == "GB/s" else requests / elapsed


def workloads(args: argparse.Namespace) -> list[Workload]:
    found = [Workload(f"echo c={c}", "echo", c, "GB/s") for c in args.echo_concurrency]
    found.append(Workload(f"healthz c={args.small_concurrency}", "healthz", args.small_concurrency, "req/s"))
    found.append(Workload(f"matmul 16^3 c={args.small_concurrency}", "matmul", args.small_concurrency, "req/s"))
    return found


def start_checkout(checkout: Path, name: str, env: dict[str, str], log: Path, workers: int) -> Any:
    """A checkout's server, started by its own code for that (matmul_tools/service.py, or the scripts/local_service.py
    of older trees), which starts that tree's server from that tree: its LocalService."""
    for path in (checkout / "matmul_tools" / "service.py", checkout / "scripts" / "local_service.py"):
        spec = importlib.util.spec_from_file_location(f"local_service_{name}", path)
        if path.is_file() and spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            service = module.LocalService
            start = next(
                (getattr(service, name) for name in ("matmul_service", "uvicorn") if hasattr(service, name)), service
            )
            return start(module.free_port(), env, log, workers)
    raise SystemExit(f"{checkout} has neither matmul_tools/service.py nor scripts/local_service.py")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to compare against (its root)")
    parser.add_argument("--candidate", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    parser.add_argument("--backend", choices=["auto", "cpu", "gpu"], default="auto", help="MATMUL_BACKEND")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers of each server (default: 1)")
    parser.add_argument("--echo-bytes", type=int, default=128 << 20, help="the echo body (default: 128 MiB)")
    parser.add_argument(
        "--echo-concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 4], help="default: 1,4"
    )
    parser.add_argument("--small-concurrency", type=int, default=32, help="connections for small requests (32)")
    parser.add_argument("--client-processes", type=int, default=8, help="load-generating processes (default: 8)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every workload on both servers (default: 5)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per workload and server (default: 5)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to be ready")
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
            servers[name] = start_checkout(checkout, name, env, log, args.workers)
        for server in servers.values():
            server.wait_ready(args.ready_timeout)
        figures: dict[str, dict[str, list[float]]] = {}
        with Pool(args.client_processes, initializer=_build_requests, initargs=(args.echo_bytes,)) as pool:
            for workload in workloads(args):
                for name in SERVERS:  # warm-up, left out
                    measure(pool, args.client_processes, servers[name].port, workload, min(1.0, args.duration))
            for round_index in range(args.rounds):
                order = SERVERS if round_index % 2 == 0 else SERVERS[::-1]
                for workload in workloads(args):
                    for name in order:
                        value = measure(pool, args.client_processes, servers[name].port, workload, args.duration)
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
