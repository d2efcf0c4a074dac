"""Triton's shared-memory extensions against what the machine can do without the service, in one run.

1. The ceilings, measured here without the service (`--backend gpu`):
   - data path: A and B in POSIX shared memory pinned with cudaHostRegister, copied in, multiplied by cuBLAS and
     C copied back into the shared memory, two products in flight on two streams: products/s;
   - cuBLAS: A, B and C already on the device: products/s.
2. The service, `matmul-service --workers N` with MATMUL_SHARED_MEMORY=system,cuda, loaded by `--clients` processes
   that each send one request at a time with tritonclient's HTTP client (its own client and shared-memory
   utilities: what a co-located user runs):
   - system: each client's A and B in a POSIX shared-memory region of its own, C into another;
   - cuda (`--backend gpu`): the same in device memory, by CUDA IPC handles.
   Each client checks its first product against a float64 product of its first rows.

Prints a table with each cell over its ceiling; writes OUT/bench-shared-memory.json and the server's log.

    python scripts/bench_shared_memory.py --backend gpu --size 4096 --clients 8 --duration 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from matmul_tools.service import LocalService, free_port

CHECKED_ROWS = 64
"""Rows of C each client checks against a float64 product (all 4096 would take the CPU seconds)."""


def data_path_ceiling(size: int, seconds: float) -> float:
    """Products/s of copy in, cuBLAS, copy out between pinned POSIX shared memory and the device, two in flight."""
    from multiprocessing import shared_memory

    region = shared_memory.SharedMemory(create=True, size=3 * size * size * 4)
    try:
        host = np.ndarray((3, size, size), np.float32, buffer=region.buf)
        try:
            host[:2] = np.random.default_rng(1).standard_normal((2, size, size), dtype=np.float32)
            return _copies_and_products(host, seconds)
        finally:
            del host
    finally:
        region.close()
        region.unlink()


def _copies_and_products(host: np.ndarray, seconds: float) -> float:
    """`data_path_ceiling` once `host` (A, B, C) is in shared memory: pinned here, and unpinned after."""
    import cupy as cp

    size, nbytes = host.shape[1], host[0].nbytes
    cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
    try:
        lanes = [
            (cp.cuda.Stream(non_blocking=True), *(cp.empty((size, size), cp.float32) for _ in range(3)))
            for _ in range(2)
        ]

        def product(lane: tuple[Any, ...]) -> None:
            stream, a, b, c = lane
            with stream:
                for device, source in ((a, host[0]), (b, host[1])):
                    cp.cuda.runtime.memcpyAsync(device.data.ptr, source.ctypes.data, nbytes, 1, stream.ptr)
                cp.matmul(a, b, out=c)
                cp.cuda.runtime.memcpyAsync(host[2].ctypes.data, c.data.ptr, nbytes, 2, stream.ptr)

        return _rate(lambda i: product(lanes[i % 2]), cp.cuda.Device().synchronize, seconds)
    finally:
        cp.cuda.runtime.hostUnregister(host.ctypes.data)


def cublas_ceiling(size: int, seconds: float) -> float:
    """Products/s of cuBLAS with A, B and C on the device."""
    import cupy as cp

    a, b = (cp.random.standard_normal((size, size), dtype=cp.float32) for _ in range(2))
    c = cp.empty((size, size), cp.float32)
    return _rate(lambda _: cp.matmul(a, b, out=c), cp.cuda.Device().synchronize, seconds)


def _rate(step: Any, synchronize: Any, seconds: float) -> float:
    """Calls of `step(i)` per second over `seconds`, after a warm-up of 10 calls, counting to the last finish."""
    for i in range(10):
        step(i)
    synchronize()
    began, count = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        step(count)
        count += 1
        if count % 16 == 0:
            synchronize()
    synchronize()
    return count / (time.perf_counter() - began)


def client(url: str, kind: str, size: int, seconds: float, seed: int, results: Any) -> None:
    """One co-located client (a process of its own): its count and check, or what went wrong."""
    try:
        results.put(_client(url, kind, size, seconds, seed))
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _client(url: str, kind: str, size: int, seconds: float, seed: int) -> dict[str, Any]:
    """Its regions, registered; one infer at a time for `seconds`; its count and check."""
    import tritonclient.http as httpclient

    if kind == "cuda":
        import tritonclient.utils.cuda_shared_memory as memory
    else:
        import tritonclient.utils.shared_memory as memory
    nbytes = size * size * 4
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((size, size), dtype=np.float32), rng.standard_normal((size, size), dtype=np.float32)
    name = f"bench-{uuid.uuid4().hex[:12]}"
    triton = httpclient.InferenceServerClient(url=url.removeprefix("http://"), network_timeout=120)
    if kind == "cuda":
        inputs = memory.create_shared_memory_region(f"{name}-in", 2 * nbytes, 0)
        output = memory.create_shared_memory_region(f"{name}-out", nbytes, 0)
        triton.register_cuda_shared_memory(f"{name}-in", memory.get_raw_handle(inputs), 0, 2 * nbytes)
        triton.register_cuda_shared_memory(f"{name}-out", memory.get_raw_handle(output), 0, nbytes)
    else:
        inputs = memory.create_shared_memory_region(f"{name}-in", f"/{name}-in", 2 * nbytes)
        output = memory.create_shared_memory_region(f"{name}-out", f"/{name}-out", nbytes)
        triton.register_system_shared_memory(f"{name}-in", f"/{name}-in", 2 * nbytes)
        triton.register_system_shared_memory(f"{name}-out", f"/{name}-out", nbytes)
    try:
        memory.set_shared_memory_region(inputs, [a, b])
        tensors = [httpclient.InferInput("A", [size, size], "FP32"), httpclient.InferInput("B", [size, size], "FP32")]
        tensors[0].set_shared_memory(f"{name}-in", nbytes)
        tensors[1].set_shared_memory(f"{name}-in", nbytes, offset=nbytes)
        wanted = httpclient.InferRequestedOutput("C")
        wanted.set_shared_memory(f"{name}-out", nbytes)
        triton.infer("matmul", tensors, outputs=[wanted])
        c = memory.get_contents_as_numpy(output, np.float32, [size, size])
        expected = a[:CHECKED_ROWS].astype(np.float64) @ b.astype(np.float64)
        error = float(np.linalg.norm(c[:CHECKED_ROWS] - expected) / np.linalg.norm(expected))
        began, count = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            triton.infer("matmul", tensors, outputs=[wanted])
            count += 1
        return {"count": count, "seconds": time.perf_counter() - began, "relative_error": error}
    finally:
        unregister = triton.unregister_cuda_shared_memory if kind == "cuda" else triton.unregister_system_shared_memory
        unregister(f"{name}-in")
        unregister(f"{name}-out")
        memory.destroy_shared_memory_region(inputs)
        memory.destroy_shared_memory_region(output)
        triton.close()


def measure_service(url: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """`args.clients` clients at once for `args.duration` seconds: products/s in all, and each one's error."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=client, args=(url, kind, args.size, args.duration, seed, results))
        for seed in range(args.clients)
    ]
    for process in processes:
        process.start()
    found = [results.get(timeout=args.duration + 300) for _ in processes]
    for process in processes:
        process.join()
    failures = [one["error"] for one in found if "error" in one]
    if failures:
        raise RuntimeError(f"{len(failures)} of the {kind} clients failed: {failures[0]}")
    return {
        "kind": kind,
        "clients": args.clients,
        "products": sum(one["count"] for one in found),
        "products_per_s": sum(one["count"] / one["seconds"] for one in found),
        "worst_relative_error": max(one["relative_error"] for one in found),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--size", type=int, default=4096, help="n of the n x n float32 products")
    parser.add_argument("--clients", type=int, default=8, help="client processes, one request in flight each")
    parser.add_argument("--workers", type=int, default=4, help="HTTP worker processes of the service")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds each cell runs")
    parser.add_argument("--out", type=Path, default=Path("out/bench-shared-memory"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = args.backend == "gpu"
    ceilings = (
        {"data_path": data_path_ceiling(args.size, args.duration), "cublas": cublas_ceiling(args.size, args.duration)}
        if gpu
        else {}
    )
    env = {
        "MATMUL_BACKEND": args.backend,
        "MATMUL_SHARED_MEMORY": "system,cuda",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_MAX_DIM": str(max(args.size, 65_536)),
    }
    service = LocalService.matmul_service(free_port(), env, args.out / "server.log", args.workers)
    try:
        service.wait_ready(300)
        cells = [measure_service(service.url, kind, args) for kind in (["system", "cuda"] if gpu else ["system"])]
    finally:
        service.stop()
    for cell in cells:
        ceiling = ceilings.get("data_path" if cell["kind"] == "system" else "cublas")
        cell["over_ceiling"] = None if ceiling is None else cell["products_per_s"] / ceiling
    report = {"settings": {key: str(value) for key, value in vars(args).items()}, "ceilings": ceilings, "cells": cells}
    print(f"{args.size}^2 float32, {args.clients} clients, {args.workers} HTTP workers, {args.duration:g} s a cell")
    for name, rate in ceilings.items():
        print(f"  ceiling {name:10s} {rate:8.1f} products/s")
    for cell in cells:
        over = "" if cell["over_ceiling"] is None else f"  {cell['over_ceiling']:.2f} of its ceiling"
        print(
            f"  service {cell['kind']:10s} {cell['products_per_s']:8.1f} products/s{over}"
            f"  (worst relative error {cell['worst_relative_error']:.1e})"
        )
    (args.out / "bench-shared-memory.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'bench-shared-memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
