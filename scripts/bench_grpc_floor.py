#!/usr/bin/env python3
"""The floor of Python gRPC under the service's gRPC cells: what tritonclient.grpc gets from bare grpc.aio servers that
do nothing but answer, with the messages of a product of two n x n FP32 matrices.

N server processes share one port (SO_REUSEPORT, as the service's HTTP workers share MATMUL_GRPC_PORT); each answers a
ModelInferRequest of two raw input contents with one raw output of n x n FP32, reading the inputs as the service does
and computing nothing. M client processes send as `scripts/bench_users.py --clients triton-grpc` does
(tritonclient.grpc, the inputs made for each request, the answer read as an array), one call at a time each, for the
window. A service cell near this rate is bounded by Python gRPC (both ends), not by its engine.

    python scripts/bench_grpc_floor.py --size 4096 --servers 8,1 --clients 8 --out docs/bench/bench-grpc-floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from matmul_tools.triton_grpc import fp32_inputs

MESSAGE_LIMIT = 1 << 30
START_S = 3.0
"""How long the clients get to start and send before the window opens."""


def _serve(port: int, n: int, ready: Any) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    answer = np.ones((n, n), np.float32)

    class Answering(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
        async def ModelInfer(self, request: Any, context: Any) -> Any:
            _a, _b = (memoryview(raw) for raw in request.raw_input_contents)
            response = pb.ModelInferResponse(model_name=request.model_name, model_version="1")
            response.outputs.append(pb.ModelInferResponse.InferOutputTensor(name="C", datatype="FP32", shape=[n, n]))
            response.raw_output_contents.append(answer.tobytes())
            return response

    async def run() -> None:
        options = [
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", MESSAGE_LIMIT),
            ("grpc.max_send_message_length", MESSAGE_LIMIT),
        ]
        server = grpc.aio.server(options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Answering(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.put(os.getpid())
        await server.wait_for_termination()

    asyncio.run(run())


def _send(port: int, n: int, window: tuple[float, float], results: Any) -> None:
    """Put the number of answers within the window, or what went wrong."""
    import tritonclient.grpc as triton

    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        rng = np.random.default_rng(os.getpid())
        a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        start, end = window
        answered = 0
        while time.time() < end:
            c = client.infer("matmul", fp32_inputs(a, b)).as_numpy("C")
            if c is None or c.shape != (n, n):
                raise ValueError(f"the answer is {None if c is None else c.shape}, not ({n}, {n})")
            if start <= time.time() <= end:
                answered += 1
        client.close()
        results.put(answered)
    except Exception as exc:  # reported by the parent, which would otherwise wait for a count
        results.put(repr(exc))


def measure(n: int, servers: int, clients: int, seconds: float, port: int) -> float:
    """Exchanges per second over the window, summed over the clients."""
    ready: Any = multiprocessing.Queue()
    serving = [multiprocessing.Process(target=_serve, args=(port, n, ready), daemon=True) for _ in range(servers)]
    for process in serving:
        process.start()
    try:
        for _ in serving:  # every server listens before a client connects: a connection stays with its server
            ready.get(timeout=60)
        start = time.time() + START_S
        results: Any = multiprocessing.Queue()
        sending = [
            multiprocessing.Process(target=_send, args=(port, n, (start, start + seconds), results))
            for _ in range(clients)
        ]
        for process in sending:
            process.start()
        counts = [results.get(timeout=START_S + seconds + 600) for _ in sending]
        for process in sending:
            process.join()
        failures = [count for count in counts if isinstance(count, str)]
        if failures:
            raise RuntimeError(f"clients failed: {failures}")
        return float(sum(counts)) / seconds
    finally:
        for process in serving:
            process.kill()
            process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4096, help="n of the n x n FP32 operands and answer (4096)")
    parser.add_argument("--servers", default="8,1", help="server processes of each run, comma-separated (8,1)")
    parser.add_argument("--clients", type=int, default=8, help="client processes (8)")
    parser.add_argument("--seconds", type=float, default=8.0, help="the measured window of each run (8)")
    parser.add_argument("--port", type=int, default=50123, help="the port the servers share (50123)")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args()
    n = args.size
    exchange_bytes = 3 * n * n * 4
    runs = []
    print(f"| server processes | client processes | {n}^2 exchanges/s | GB/s (in + out) |")
    print("|---:|---:|---:|---:|")
    for servers in (int(count) for count in args.servers.split(",")):
        rate = measure(n, servers, args.clients, args.seconds, args.port)
        runs.append({"servers": servers, "clients": args.clients, "exchanges_per_s": rate})
        print(f"| {servers} | {args.clients} | {rate:.1f} | {rate * exchange_bytes / 1e9:.2f} |", flush=True)
    if args.out is not None:
        report = {
            "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "size": n,
            "seconds": args.seconds,
            "exchange_bytes": exchange_bytes,
            "host": {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
