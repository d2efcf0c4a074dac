"""Where `MatmulClient`'s time goes on small products: its CPU per request beside a raw socket's, on the same request
to the same server, and the functions that take it.

One connection, one request at a time, `--requests` products of `--size`^2 float32 through `MatmulClient` (multipart
`.npy` in, `.npy` out), then the very bytes it sends written by a raw keep-alive socket that reads each answer into
one buffer (matmul_tools/raw_load.py): what the client's own Python costs is the difference of their CPU seconds per
request (this process's, not the server's). Then the client's requests again under cProfile, its functions listed by
their own time per request. The server is `matmul-service` on the backend given, started here, or `--url`.

Prints the table and the profile; writes OUT/profile-client.json.

    python scripts/profile_client.py --sizes 64 512 --requests 2000
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import socket
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from matmul_client.client import MatmulClient, MatmulServiceError
from matmul_tools.outputs import unwritable
from matmul_tools.raw_load import npy_matmul_body, post_request, read_answer
from matmul_tools.service import LocalService, free_port

WARM_UP = 50
"""Requests each way sends before it is measured."""


def per_request(send: Callable[[], object], requests: int) -> dict[str, float]:
    """Wall and CPU (this process) microseconds a request of `send`, after a warm-up."""
    for _ in range(WARM_UP):
        send()
    began_wall, began_cpu = time.perf_counter(), time.process_time()
    for _ in range(requests):
        send()
    return {
        "wall_us": 1e6 * (time.perf_counter() - began_wall) / requests,
        "cpu_us": 1e6 * (time.process_time() - began_cpu) / requests,
    }


def raw_sender(url: str, a: np.ndarray, b: np.ndarray) -> tuple[Callable[[], object], socket.socket]:
    """A raw keep-alive socket sending the request `MatmulClient` sends for a @ b, each answer read into one buffer."""
    body, content_type = npy_matmul_body(a, b)
    request = post_request("/matmul", content_type, body, accept="application/x-npy")
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port or 80))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(1 << 20)

    def send() -> object:
        sock.sendall(request)
        return read_answer(sock, buffer)

    return send, sock


def profile(send: Callable[[], object], requests: int, top: int) -> list[dict[str, Any]]:
    """The `top` functions by their own time under cProfile, per request."""
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [send() for _ in range(requests)])
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls_per_request": calls / requests,
            "own_us": 1e6 * own / requests,
            "with_callees_us": 1e6 * cumulative / requests,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in stats.items()
    ]
    return sorted(rows, key=lambda row: row["own_us"], reverse=True)[:top]


def measure(url: str, size: int, requests: int, top: int) -> dict[str, Any]:
    rng = np.random.default_rng(size)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    with MatmulClient(url, connections=1) as client, ExitStack() as stack:
        ours = per_request(lambda: client.multiply(a, b), requests)
        send, sock = raw_sender(url, a, b)
        stack.callback(sock.close)
        raw = per_request(send, requests)
        functions = profile(lambda: client.multiply(a, b), requests, top)
    return {"size": size, "requests": requests, "client": ours, "raw": raw, "client_functions": functions}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512], help="n of the n x n float32 products")
    parser.add_argument("--requests", type=int, default=2000, help="requests each way sends per size")
    parser.add_argument("--top", type=int, default=15, help="functions of the profile listed per size")
    parser.add_argument("--backend", choices=["cpu", "gpu"], default="cpu", help="the server started here")
    parser.add_argument("--url", help="a running server instead of one started here")
    parser.add_argument("--out", type=Path, default=Path("out/profile-client"))
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.requests < 1 or args.top < 1:
        parser.error("--sizes, --requests and --top must be positive")
    problem = unwritable([args.out / "profile-client.json", args.out / "server.log"])
    if problem:
        parser.error(f"--out: {problem}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        url = args.url
        if url is None:
            env = {"MATMUL_BACKEND": args.backend, "MATMUL_ACCESS_LOG": "false"}
            service = LocalService.matmul_service(free_port(), env, args.out / "server.log")
            stack.callback(service.stop)
            service.wait_ready(300)
            url = service.url
        try:
            cells = [measure(url, size, args.requests, args.top) for size in args.sizes]
        except (httpx.HTTPError, MatmulServiceError, OSError) as exc:
            print(f"profile_client: {url} did not answer a product: {exc!r}", file=sys.stderr)
            return 1
    print("size   client wall / CPU us   raw wall / CPU us   client's own CPU us a request")
    for cell in cells:
        ours, raw = cell["client"], cell["raw"]
        print(
            f"{cell['size']:5d}^2  {ours['wall_us']:8.0f} / {ours['cpu_us']:6.0f}    {raw['wall_us']:8.0f} /"
            f" {raw['cpu_us']:6.0f}    {ours['cpu_us'] - raw['cpu_us']:8.0f}"
        )
    for cell in cells:
        print(f"\n{cell['size']}^2, MatmulClient's functions by their own time, us a request (with callees):")
        for row in cell["client_functions"]:
            print(f"  {row['own_us']:7.1f} ({row['with_callees_us']:7.1f})  {row['function']}")
    (args.out / "profile-client.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                              "cells": cells}, indent=2, default=str))  # fmt: skip
    print(f"\nwrote {args.out / 'profile-client.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
