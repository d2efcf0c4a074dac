"""Time to ready of `matmul-service` with its default settings, started cold and warm, side by side.

Each start is a new `matmul-service` with `--workers` HTTP workers, timed from its launch until every worker answers
/readyz with 200 (matmul_tools/service.py), and the engine's own account read from its log: the seconds its backend
took to prepare (load or compile the kernels, self-test, time `auto`'s candidates) and how many kernel programs it
compiled; and how many of CuPy's own kernels it compiled (files it added to CuPy's cache). The starts, in order:

1. `nothing compiled`: a fresh checkout's first start, with an empty kernel cache (MATMUL_KERNEL_CACHE_DIR) and an
   empty CuPy cache (CUPY_CACHE_DIR, CuPy's own kernels);
2. `image`: a fresh container's first start, the kernels compiled ahead by `python -m kernels.prebuild` as the image
   build does (not timed), CuPy's cache empty;
3. `warm`: a restart, both caches as the starts before left them (`--warm` times).

Prints the table; writes OUT/cold-start.json.

    python scripts/bench_cold_start.py --backend gpu --devices 9.0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matmul_tools.service import LocalService, add_server_options, free_port

ENGINE_READY = re.compile(r"backend ready on (?P<device>.+) in (?P<seconds>[\d.]+) s")
COMPILED = re.compile(r"kernels loaded on device \d+: (?P<compiled>\d+) compiled now")


def engine_account(log: str) -> dict[str, Any]:
    """What the engine said of its start in `log`: its device, the seconds its backend took to be ready and the
    kernel programs it compiled (None where the log does not say: the CPU backend compiles nothing)."""
    ready = ENGINE_READY.search(log)
    compiled = COMPILED.search(log)
    return {
        "device": ready["device"] if ready else None,
        "engine_ready_s": float(ready["seconds"]) if ready else None,
        "compiled": int(compiled["compiled"]) if compiled else None,
    }


def start(label: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One start of the service, timed to ready, and stopped; with the CuPy kernels it compiled (the files it added
    to CUPY_CACHE_DIR: CuPy compiles its own kernels on first use, on the engine's path to ready)."""
    log = args.out / f"server-{label.replace(' ', '-')}.log"
    cupy_cache = Path(env["CUPY_CACHE_DIR"])
    cached = _files(cupy_cache)
    began = time.monotonic()
    service = LocalService.matmul_service(free_port(), env, log, args.workers)
    try:
        ready_s = service.wait_ready(args.ready_timeout) - began
    finally:
        service.stop()
    return {
        "start": label,
        "ready_s": round(ready_s, 2),
        **engine_account(log.read_text(errors="replace")),
        "cupy_compiled": len(_files(cupy_cache) - cached),
    }


def _files(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.is_file()} if folder.is_dir() else set()


def prebuild(devices: Sequence[str], into: Path) -> None:
    """The kernels compiled ahead into `into`, as the image build does."""
    subprocess.run([sys.executable, "-m", "kernels.prebuild", *devices, "--into", str(into)], check=True)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    env = {**os.environ, **({"MATMUL_BACKEND": args.backend} if args.backend else {})}
    with tempfile.TemporaryDirectory(prefix="cold-start-") as folder:
        caches = {name: Path(folder) / name for name in ("kernels-fresh", "kernels-image", "cupy-fresh", "cupy-image")}
        starts = [start("nothing compiled", cold_env(env, caches["kernels-fresh"], caches["cupy-fresh"]), args)]
        prebuild(args.devices, caches["kernels-image"])
        image = cold_env(env, caches["kernels-image"], caches["cupy-image"])
        starts.append(start("image", image, args))
        starts += [start(f"warm {i + 1}", image, args) for i in range(args.warm)]
    return starts


def cold_env(env: dict[str, str], kernels: Path, cupy: Path) -> dict[str, str]:
    return {**env, "MATMUL_KERNEL_CACHE_DIR": str(kernels), "CUPY_CACHE_DIR": str(cupy)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_server_options(parser, backend=None)
    parser.add_argument("--workers", type=int, default=8, help="HTTP workers (default: 8, the service's on 16 CPUs)")
    parser.add_argument(
        "--devices", nargs="+", default=["9.0"], help="compute capabilities the image compiles ahead (default: 9.0)"
    )
    parser.add_argument("--warm", type=int, default=2, help="warm starts timed after the cold ones (default: 2)")
    parser.add_argument("--out", type=Path, default=Path("out/bench-cold-start"), help="folder for JSON and logs")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    starts = measure(args)
    print(f"{'start':<18}{'ready (s)':>10}{'engine (s)':>12}{'compiled':>10}{'CuPy compiled':>15}")
    for row in starts:
        engine = "-" if row["engine_ready_s"] is None else f"{row['engine_ready_s']:.2f}"
        compiled = "-" if row["compiled"] is None else str(row["compiled"])
        print(f"{row['start']:<18}{row['ready_s']:>10.2f}{engine:>12}{compiled:>10}{row['cupy_compiled']:>15}")
    report = {"workers": args.workers, "devices_compiled_ahead": args.devices, "starts": starts}
    (args.out / "cold-start.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
