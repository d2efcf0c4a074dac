"""Triton's shared-memory extensions against what the machine can do without the service, in one run.

1. The ceilings, measured here without the service (`--backend gpu`), for each `--devices` setting on all of its
   devices at once (a process per device, the products/s added up), so that what the devices share (the host's
   memory and PCIe) caps the ceiling as it caps the service:
   - data path: A and B in POSIX shared memory pinned with cudaHostRegister, copied in, multiplied by cuBLAS and
     C copied back into the shared memory, two products in flight on two streams: products/s;
   - cuBLAS: A, B and C already on the device: products/s.
2. The service, `matmul-service --workers N` with MATMUL_SHARED_MEMORY=system,cuda, loaded by `--clients` processes
   that each send one request at a time with tritonclient's HTTP client (its own client and shared-memory
   utilities: what a co-located user runs), once for each `--devices` setting (MATMUL_DEVICES, e.g. `0 0,1`):
   - system: each client's A and B in a POSIX shared-memory region of its own, C into another (any engine
     process reads them: the least-loaded one computes);
   - cuda (`--backend gpu`): the same in device memory, by CUDA IPC handles, client i's regions on the i-th
     device of the setting in turn (its products computed by that device's engine, never copied across).
   Every answer's first rows are set to NaN before its request and checked against a float64 product of them after
   it (on the device, for CUDA regions): an answer that is not the service's own is counted wrong.
3. The clients alone: the same client processes against a stand-in that answers at once (matmul_tools/standin.py),
   for each kind. A cell at or above `--client-bound` of that rate measured the clients, not the service: the
   script says so and exits with 2. (Until this check, each client's per-answer check called NumPy's BLAS, whose
   idle threads then spin: a core per client process, which on a 16-core host held system shared memory near 60
   products/s whatever the service did. The checks now use no BLAS, and the clients start with one BLAS thread.)

Prints a table with each cell over its setting's ceiling and over the clients alone, and each kind's products/s with
every setting over the first; writes OUT/bench-shared-memory.json and each server's log.

    python scripts/bench_shared_memory.py --backend gpu --size 4096 --clients 8 --duration 10
    python scripts/bench_shared_memory.py --backend gpu --size 4096 --clients 16 --devices 0 0,1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from matmul_tools.service import LocalService, free_port
from matmul_tools.standin import standing_in

CHECKED_ROWS = 64
"""Rows of C each client checks against a float64 product (all 4096 would take the CPU seconds)."""
WRONG_ERROR = 1e-3
"""A relative error of those rows above this is a wrong answer (float32 at k = 4096 is near 1e-6; another
request's product is near 1.4)."""
CLIENT_BOUND = 0.8
"""A cell at this share of the clients' own rate (against a stand-in that answers at once) or above measured them."""
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The client processes' BLAS threads: one, so that no idle pool spins beside the service."""


START_TIMEOUT_S = 300.0
"""How long a client waits for the others to be set up (spawned, regions registered, a first product)."""
STAGE_METRIC = "matmul_stage_duration_seconds"
CEILINGS = ("data_path", "cublas")
CEILING_OF_KIND = {"system": "data_path", "cuda": "cublas"}


def setting_ceilings(devices: list[int], size: int, seconds: float) -> dict[str, float]:
    """Each ceiling of `devices`, measured on all of them at once: the products/s of a process per device, added."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(devices)) as pool:
        rates = {name: pool.starmap(device_ceiling, [(name, d, size, seconds) for d in devices]) for name in CEILINGS}
    return {name: sum(per_device) for name, per_device in rates.items()}


def device_ceiling(name: str, device: int, size: int, seconds: float) -> float:
    """One ceiling (CEILINGS) on one device, in a pool's process."""
    import cupy as cp

    with cp.cuda.Device(device):
        return data_path_ceiling(size, seconds) if name == "data_path" else cublas_ceiling(size, seconds)


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


def client(url: str, kind: str, size: int, seconds: float, seed: int, device: int, start: Any, results: Any) -> None:
    """One co-located client (a process of its own): its count and checks, or what went wrong."""
    try:
        results.put(_client(url, kind, size, seconds, seed, device, start))
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _client(url: str, kind: str, size: int, seconds: float, seed: int, device: int, start: Any) -> dict[str, Any]:
    """Its regions, registered (CUDA ones on `device`), and a first product; then, once every client is that far
    (`start`, a barrier: clients that start measuring while others still set up would each count a share of the
    service that is not theirs), one infer at a time for `seconds`, every answer's first rows checked; its count,
    its worst error and the CPU it used meanwhile."""
    import tritonclient.http as httpclient

    if kind == "cuda":
        import tritonclient.utils.cuda_shared_memory as memory
    else:
        import tritonclient.utils.shared_memory as memory
    nbytes = size * size * 4
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((size, size), dtype=np.float32), rng.standard_normal((size, size), dtype=np.float32)
    expected = a[:CHECKED_ROWS].astype(np.float64) @ b.astype(np.float64)
    name = f"bench-{uuid.uuid4().hex[:12]}"
    triton = httpclient.InferenceServerClient(url=url.removeprefix("http://"), network_timeout=120)
    if kind == "cuda":
        inputs = memory.create_shared_memory_region(f"{name}-in", 2 * nbytes, device)
        output = memory.create_shared_memory_region(f"{name}-out", nbytes, device)
        triton.register_cuda_shared_memory(f"{name}-in", memory.get_raw_handle(inputs), device, 2 * nbytes)
        triton.register_cuda_shared_memory(f"{name}-out", memory.get_raw_handle(output), device, nbytes)
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
        poison, error = _first_rows_check(kind, memory, output, size, device, expected)
        poison()
        triton.infer("matmul", tensors, outputs=[wanted])
        errors = [error()]
        start.wait(timeout=START_TIMEOUT_S)
        setup = resource.getrusage(resource.RUSAGE_SELF)
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            poison()  # an answer the service did not write is caught, not the last one read again
            triton.infer("matmul", tensors, outputs=[wanted])
            errors.append(error())
        elapsed = time.perf_counter() - began
        wrong = sum(not found <= WRONG_ERROR for found in errors)  # NaN is wrong too
        used = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "count": len(errors) - 1,
            "seconds": elapsed,
            "relative_error": max(errors),
            "wrong": wrong,
            "cpu_seconds": used.ru_utime + used.ru_stime - setup.ru_utime - setup.ru_stime,
        }
    finally:
        unregister = triton.unregister_cuda_shared_memory if kind == "cuda" else triton.unregister_system_shared_memory
        unregister(f"{name}-in")
        unregister(f"{name}-out")
        memory.destroy_shared_memory_region(inputs)
        memory.destroy_shared_memory_region(output)
        triton.close()


def _first_rows_check(
    kind: str, memory: Any, output: Any, size: int, device: int, expected: np.ndarray
) -> tuple[Callable[[], None], Callable[[], float]]:
    """Two calls on C's first rows in the output region, where C lies (in the shared memory, or on the device for a
    CUDA region: a 64 MiB copy per answer would be the benchmark): one sets them to NaN before a request, one gives
    their relative error against `expected` after it."""
    if kind != "cuda":
        c = memory.get_contents_as_numpy(output, np.float32, [size, size])

        def poison_here() -> None:
            c[:CHECKED_ROWS] = np.nan

        return poison_here, lambda: _relative_error(c[:CHECKED_ROWS].astype(np.float64), expected)
    import cupy as cp

    with cp.cuda.Device(device):
        c_on_device = cp.from_dlpack(memory.as_shared_memory_tensor(output, "FP32", [size, size]))
        expected_on_device = cp.asarray(expected)

    def poison_on_device() -> None:
        with cp.cuda.Device(device):
            c_on_device[:CHECKED_ROWS] = cp.nan
            cp.cuda.get_current_stream().synchronize()

    def on_device() -> float:
        with cp.cuda.Device(device):
            rows = c_on_device[:CHECKED_ROWS].astype(cp.float64)
            return float(cp.linalg.norm(rows - expected_on_device) / cp.linalg.norm(expected_on_device))

    return poison_on_device, on_device


def _relative_error(found: np.ndarray, expected: np.ndarray) -> float:
    """||found - expected|| / ||expected|| with no BLAS call: np.linalg.norm's dot wakes BLAS threads that then spin
    idle, a core per client process (measured: 0.97 CPU-seconds per second for a check every 100 ms, 0.01 this way)."""
    difference = found - expected
    return float(np.sqrt(np.sum(difference * difference)) / np.sqrt(np.sum(expected * expected)))


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """Client processes started in the block inherit ONE_THREAD (a spawned process reads it as NumPy loads)."""
    before = {name: os.environ.get(name) for name in ONE_THREAD}
    os.environ.update(ONE_THREAD)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def measure_service(url: str, kind: str, devices: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """`args.clients` clients at once for `args.duration` seconds (client i's CUDA regions on devices[i % n]):
    products/s in all, each one's worst error, and the answers found wrong."""
    context = multiprocessing.get_context("spawn")
    results, start = context.Queue(), context.Barrier(args.clients)
    processes = [
        context.Process(
            target=client,
            args=(url, kind, args.size, args.duration, seed, devices[seed % len(devices)], start, results),
        )
        for seed in range(args.clients)
    ]
    with _one_blas_thread():
        for process in processes:
            process.start()
    found = [results.get(timeout=args.duration + 2 * START_TIMEOUT_S) for _ in processes]
    for process in processes:
        process.join()
    failures = [one["error"] for one in found if "error" in one]
    if failures:
        raise RuntimeError(f"{len(failures)} of the {kind} clients failed: {failures[0]}")
    return {
        "kind": kind,
        "devices": _setting(devices),
        "clients": args.clients,
        "products": sum(one["count"] for one in found),
        "products_per_s": sum(one["count"] / one["seconds"] for one in found),
        "answers_checked": sum(one["count"] + 1 for one in found),
        "wrong": sum(one["wrong"] for one in found),
        "worst_relative_error": max(one["relative_error"] for one in found),
        "client_cpu_seconds_per_s": sum(one["cpu_seconds"] / one["seconds"] for one in found),
    }


def _setting(devices: list[int]) -> str:
    """A MATMUL_DEVICES setting as it is written: `0,1`."""
    return ",".join(map(str, devices))


def measure_clients_alone(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same clients against a stand-in that answers at once (their answers unwritten, so none is checked):
    products/s that no service can be measured above with them."""
    with standing_in() as url:
        alone = measure_service(url, kind, [0], args)
    return {
        "kind": kind,
        "products_per_s": alone["products_per_s"],
        "client_cpu_seconds_per_s": alone["client_cpu_seconds_per_s"],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--size", type=int, default=4096, help="n of the n x n float32 products")
    parser.add_argument("--clients", type=int, default=8, help="client processes, one request in flight each")
    parser.add_argument("--workers", type=int, default=4, help="HTTP worker processes of the service")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds each cell runs")
    parser.add_argument(
        "--devices", nargs="+", default=["0"], help="MATMUL_DEVICES settings, one service each (default: 0)"
    )
    parser.add_argument(
        "--client-bound",
        type=float,
        default=CLIENT_BOUND,
        help="a cell at this share of the clients' rate against the stand-in, or above, fails the run (exit 2)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench-shared-memory"))
    args = parser.parse_args(argv)
    try:
        args.devices = [[int(index) for index in setting.split(",")] for setting in args.devices]
    except ValueError:
        parser.error(f"--devices takes comma-separated device indices, not {args.devices}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = args.backend == "gpu"
    ceilings = (
        {_setting(devices): setting_ceilings(devices, args.size, args.duration) for devices in args.devices}
        if gpu
        else {}
    )
    kinds = ["system", "cuda"] if gpu else ["system"]
    alone = {kind: measure_clients_alone(kind, args) for kind in kinds}
    cells = []
    for devices in args.devices:
        cells += measure_setting(devices, args, gpu)
    for cell in cells:
        ceiling = ceilings[cell["devices"]][CEILING_OF_KIND[cell["kind"]]] if gpu else None
        cell["over_ceiling"] = None if ceiling is None else cell["products_per_s"] / ceiling
        cell["over_clients_alone"] = cell["products_per_s"] / alone[cell["kind"]]["products_per_s"]
        cell["client_bound"] = cell["over_clients_alone"] >= args.client_bound
    first = {cell["kind"]: cell["products_per_s"] for cell in cells if cell["devices"] == cells[0]["devices"]}
    for cell in cells:
        cell["over_first_setting"] = cell["products_per_s"] / first[cell["kind"]] if first[cell["kind"]] else None
    report = {
        "settings": {key: str(value) for key, value in vars(args).items()},
        "ceilings": ceilings,
        "clients_alone": list(alone.values()),
        "cells": cells,
    }
    print(f"{args.size}^2 float32, {args.clients} clients, {args.workers} HTTP workers, {args.duration:g} s a cell")
    for setting, rates in ceilings.items():
        for name, rate in rates.items():
            print(f"  ceiling {name:10s} {rate:8.1f} products/s on devices {setting} at once")
    for kind, clients in alone.items():
        print(
            f"  clients alone {kind:6s} {clients['products_per_s']:8.1f} products/s against a stand-in"
            f" ({clients['client_cpu_seconds_per_s']:.2f} CPU-seconds a second)"
        )
    for cell in cells:
        over = "" if cell["over_ceiling"] is None else f"  {cell['over_ceiling']:.2f} of its ceiling"
        print(
            f"  devices {cell['devices']:7s} {cell['kind']:6s} {cell['products_per_s']:7.1f} products/s{over}"
            f"  ({'/'.join(cell['kernels'])})"
            f"  {cell['over_first_setting'] or 0:.2f}x devices {cells[0]['devices']}"
            f"  {cell['over_clients_alone']:.2f} of the clients alone"
            f"  ({cell['answers_checked']} answers checked, {cell['wrong']} wrong,"
            f" worst relative error {cell['worst_relative_error']:.1e})"
        )
    (args.out / "bench-shared-memory.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'bench-shared-memory.json'}")
    if any(cell["wrong"] for cell in cells):
        return 1
    bound = [cell for cell in cells if cell["client_bound"]]
    for cell in bound:
        print(
            f"CLIENT-BOUND: devices {cell['devices']} {cell['kind']} reached {cell['over_clients_alone']:.2f} of what"
            f" the clients alone reach (--client-bound {args.client_bound:g}): it measured the clients, not the"
            " service; run more --clients",
            file=sys.stderr,
        )
    return 2 if bound else 0


def measure_setting(devices: list[int], args: argparse.Namespace, gpu: bool) -> list[dict[str, Any]]:
    """The service on `devices` (MATMUL_DEVICES; the CPU backend has one engine whatever it says): its cells."""
    env = {
        "MATMUL_BACKEND": args.backend,
        "MATMUL_SHARED_MEMORY": "system,cuda",
        "MATMUL_ACCESS_LOG": "false",
        "MATMUL_MAX_DIM": str(max(args.size, 65_536)),
        "MATMUL_DEVICES": _setting(devices),
    }
    log = args.out / f"server-devices-{'-'.join(map(str, devices))}.log"
    service = LocalService.matmul_service(free_port(), env, log, args.workers)
    try:
        service.wait_ready(300)
        cells = []
        for kind in ["system", "cuda"] if gpu else ["system"]:
            before = kernel_counts(service.url)
            cell = measure_service(service.url, kind, devices, args)
            cells.append(cell | {"kernels": sorted(kernel_counts(service.url) - before)})
        return cells
    finally:
        service.stop()


def kernel_counts(url: str) -> Counter[str]:
    """The service's products so far, by the kernel that ran them (its `matmul_stage_duration_seconds` count, stage
    `kernel`)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{STAGE_METRIC}_count" and sample.labels.get("stage") == "kernel":
                counts[sample.labels["kernel"]] += int(sample.value)
    return counts


if __name__ == "__main__":
    sys.exit(main())
