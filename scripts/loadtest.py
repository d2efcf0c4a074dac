"""Load-test a matmul-service at any URL: latency percentiles, errors, and where the server spent the time.

Closed loop (`--mode closed`, the default): `--concurrency` workers, each sending its next request as soon as
the last one is answered. Open loop (`--mode open`): requests start at a fixed `--rate` whatever the server
does, and each latency is counted from the moment its request was due, so a slow server cannot hide its
queue by slowing the client down (at most `--concurrency` connections are open; a request waiting for one
has that wait in its latency). The run stops after `--requests` requests or `--duration` seconds, whichever
comes first; `--warmup` requests go before it and are left out of every figure.

Each request draws its shape, body format and kernel from the mixes given (`item:weight,item`); bodies are
encoded once, before the run. At the end: a table of throughput, latency percentiles, errors by status and
the server's own breakdown (queue, h2d, kernel, d2h, ... from its Server-Timing headers); `--out` gets the
same as JSON and a PNG (latency over time, latency histogram).

    python scripts/loadtest.py --url http://localhost:8000 --concurrency 8 --duration 30
    python scripts/loadtest.py --mode open --rate 200 --requests 5000 --sizes 256:3,1024 --kernels tiled,cublas
    python scripts/loadtest.py --sizes 512x64x2048 --formats npy,json,npz --dtype float64 --out out/run1

Exit status: 0 when at least one measured request was answered 200 (the others' errors are counted in the report,
not failed on: errors under load are part of what a load test measures); 1 when none was (a wrong URL, kernel or
tile), so that a CI step running it fails; 2 for arguments it refuses.

Progress and tables use rich: one library for both the live bar and the final tables (tqdm draws only bars).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from matmul_tools.loadtest import load_test, parse_args, print_report, write_report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    progress = Console(stderr=True)
    report = load_test(args, progress)
    print_report(report, Console(width=None if sys.stdout.isatty() else 110))  # piped: no 80-column wrap
    write_report(report, Path(args.out), progress)
    if report["ok"] == 0:
        progress.print(f"loadtest: none of the {report['requests']} measured requests was answered 200")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
