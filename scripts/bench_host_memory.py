#!/usr/bin/env python3
"""The host's memory under the routes' ratio to /v1/echo: what loopback TCP receives, and what threads copy, while the
GPU copies bytes between pinned host memory and the device.

/v1/echo moves a body through the host's memory once, by the socket's copies. A product's route moves its bytes once
more: the device copies the operands out of the engine's pinned shared memory and writes the answer into it. Both
draw on the same memory, so the echo of a product's bytes is a ceiling the route cannot reach on a host whose memory
is what the socket's copies wait on. This measures what the device's copies cost on the host it runs on:

- copy: `--threads` threads copying buffers of `--copy-mib` MiB (NumPy), GB/s copied; alone, then while a second
  process keeps the device copying 256 MiB each way between pinned host memory and the device (host to device and
  device to host on two streams; its own GB/s in the table beside it);
- receive: `--connections` loopback TCP connections, each fed `--message-mib` MiB messages by a sender process of its
  own, each received by a thread into pinned host memory (as the engine's shared memory is pinned), every socket's
  buffers the size the service gives loopback peers (MATMUL_LOOPBACK_SOCKET_BUFFER_BYTES' default); GB/s received,
  in three modes: `none` (nothing else), `after` (each message copied to the device once it has all arrived, and
  waited for, as the engine copies an operand read whole) and `streamed` (each `--chunk-mib` MiB copied to the
  device as soon as it has arrived, all waited for at the message's end).

Each receive mode runs `--rounds` times, the modes in turn. Without a GPU (or with `--no-device`) only the copy
alone and the receive's `none` run, into ordinary memory. Prints a table; writes `--out` (JSON).

    python scripts/bench_host_memory.py --out docs/bench/bench-host-memory-h200.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from app.config import DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES

MIB = 1 << 20
DEVICE_COPY_BYTES = 256 * MIB
"""Each direction of the background device copies."""
ReceiveMode = Literal["none", "after", "streamed"]
RECEIVE_MODES: tuple[ReceiveMode, ...] = get_args(ReceiveMode)
GO = b"g"
"""What each receiver sends its sender once every receiver is ready: the senders' windows begin together."""
ACK = b"k"
"""A receiver's answer to each whole message: the sender's next message waits for it (a closed loop, as a client's
next request waits for its answer)."""


def _device_copies(seconds: float, started: Event, rate: Queue[float]) -> None:
    """Keeps the device copying DEVICE_COPY_BYTES each way between pinned host memory and the device, on two streams,
    for `seconds`; sets `started` once copying, then puts its GB/s (both directions) into `rate`."""
    import cupy as cp

    host_in = cp.cuda.alloc_pinned_memory(DEVICE_COPY_BYTES)
    host_out = cp.cuda.alloc_pinned_memory(DEVICE_COPY_BYTES)
    source = np.frombuffer(host_in, np.uint8, DEVICE_COPY_BYTES)
    target = np.frombuffer(host_out, np.uint8, DEVICE_COPY_BYTES)
    source[:] = 1
    target[:] = 0
    on_device_in, on_device_out = cp.empty(DEVICE_COPY_BYTES, cp.uint8), cp.zeros(DEVICE_COPY_BYTES, cp.uint8)
    upstream, downstream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    started.set()
    moved, begun = 0, time.perf_counter()
    while time.perf_counter() - begun < seconds:
        on_device_in.set(source, stream=upstream)
        on_device_out.get(out=target, stream=downstream)
        upstream.synchronize()
        downstream.synchronize()
        moved += 2 * DEVICE_COPY_BYTES
    rate.put(moved / (time.perf_counter() - begun) / 1e9)


def copy_gb_per_s(threads: int, nbytes: int, seconds: float) -> float:
    """GB/s that `threads` threads copy together, each from one buffer of `nbytes` into another, for `seconds`."""
    buffers = [(np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)) for _ in range(threads)]
    copied = [0] * threads
    end = time.perf_counter() + seconds

    def copy(index: int) -> None:
        source, target = buffers[index]
        while time.perf_counter() < end:
            np.copyto(target, source)
            copied[index] += nbytes

    workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
    begun = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(copied) / (time.perf_counter() - begun) / 1e9


def _send(port: int, nbytes: int, seconds: float, buffer_bytes: int) -> None:
    """One connection's sender: once its receiver says GO, messages of `nbytes`, each after the last one's ACK, for
    `seconds`."""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        message = memoryview(np.random.default_rng(port).integers(0, 256, nbytes, np.uint8).tobytes())
        if connection.recv(1) != GO:
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            connection.sendall(message)
            if connection.recv(1) != ACK:
                return


class Receiver:
    """One connection's receiving side: whole messages into host memory (pinned where `device`), copied to the device
    as `mode` says (`after` and `streamed` need the device)."""

    def __init__(
        self, connection: socket.socket, nbytes: int, mode: ReceiveMode, chunk_bytes: int, device: bool
    ) -> None:
        if mode != "none" and not device:
            raise ValueError(f"the {mode!r} mode copies to a device")
        self.connection = connection
        self.nbytes, self.mode, self.chunk_bytes = nbytes, mode, chunk_bytes
        self.received = 0
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            connection.setsockopt(socket.SOL_SOCKET, option, DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES)
        self._copy_to_device: Callable[[int, int], None] = lambda offset, size: None
        self._wait: Callable[[], None] = lambda: None
        if device:
            import cupy as cp

            pinned = cp.cuda.alloc_pinned_memory(nbytes)
            self.memory = np.frombuffer(pinned, np.uint8, nbytes)
            on_device = cp.empty(nbytes, cp.uint8)
            stream = cp.cuda.Stream(non_blocking=True)
            source, target = pinned.ptr, on_device.data.ptr
            host_to_device = cp.cuda.runtime.memcpyHostToDevice

            def copy_to_device(offset: int, size: int) -> None:
                cp.cuda.runtime.memcpyAsync(target + offset, source + offset, size, host_to_device, stream.ptr)

            self._copy_to_device, self._wait = copy_to_device, stream.synchronize
            self._device_memory = (pinned, on_device, stream)  # alive as long as the receiver
        else:
            self.memory = np.empty(nbytes, np.uint8)
        self.memory[:] = 0  # every page mapped before the window

    def run(self) -> None:
        """Says GO, then receives messages until the sender closes its connection."""
        view = self.memory.data
        self.connection.sendall(GO)
        while True:
            got = copied = 0
            while got < self.nbytes:
                count = self.connection.recv_into(view[got:])
                if count == 0:
                    return
                got += count
                if self.mode == "streamed":
                    while got - copied >= self.chunk_bytes or (got == self.nbytes and copied < got):
                        size = min(self.chunk_bytes, got - copied)
                        self._copy_to_device(copied, size)
                        copied += size
            if self.mode == "after":
                self._copy_to_device(0, self.nbytes)
            if self.mode != "none":
                self._wait()
            self.received += self.nbytes
            self.connection.sendall(ACK)


def receive_gb_per_s(args: argparse.Namespace, mode: ReceiveMode, device: bool) -> float:
    """GB/s that `args.connections` receivers take in together, in `mode`, over `args.seconds` of senders."""
    nbytes, spawn = args.message_mib * MIB, multiprocessing.get_context("spawn")
    with socket.create_server(("127.0.0.1", 0), backlog=args.connections) as listener:
        port = listener.getsockname()[1]
        senders = [
            spawn.Process(target=_send, args=(port, nbytes, args.seconds, DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES))
            for _ in range(args.connections)
        ]
        for sender in senders:
            sender.start()
        receivers = [
            Receiver(listener.accept()[0], nbytes, mode, args.chunk_mib * MIB, device) for _ in range(args.connections)
        ]
        threads = [threading.Thread(target=receiver.run) for receiver in receivers]
        begun = time.perf_counter()
        for thread in threads:
            thread.start()
        for sender in senders:
            sender.join()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - begun
        for receiver in receivers:
            receiver.connection.close()
    return sum(receiver.received for receiver in receivers) / elapsed / 1e9


def copy_beside_device(args: argparse.Namespace) -> tuple[float, float]:
    """The threads' copy GB/s while the device copies, and the device's own GB/s."""
    spawn = multiprocessing.get_context("spawn")
    started, rate = spawn.Event(), spawn.Queue()
    copier = spawn.Process(target=_device_copies, args=(args.seconds + 2.0, started, rate))
    copier.start()
    started.wait()
    try:
        copied = copy_gb_per_s(args.threads, args.copy_mib * MIB, args.seconds)
        return copied, float(rate.get(timeout=60))
    finally:
        copier.join()


def has_device() -> bool:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no CuPy, no driver, no device: the host-only figures
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8, help="copying threads (8)")
    parser.add_argument("--copy-mib", type=int, default=256, help="MiB each copying thread copies at a time (256)")
    parser.add_argument("--connections", type=int, default=16, help="loopback connections received at once (16)")
    parser.add_argument("--message-mib", type=int, default=32, help="MiB of each message (32)")
    parser.add_argument("--chunk-mib", type=int, default=2, help="MiB of each streamed copy to the device (2)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of each measurement (3)")
    parser.add_argument("--rounds", type=int, default=2, help="times each receive mode runs, in turn (2)")
    parser.add_argument("--no-device", dest="device", action="store_false", help="host memory only")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device and has_device()
    report: dict[str, Any] = {
        "finished": None,
        "device": device,
        "arguments": {key: str(value) for key, value in vars(args).items()},
        "socket_buffer_bytes": DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES,
        "host": {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
    }
    print("| measured | GB/s | beside |")
    print("| --- | ---: | --- |")
    copy_alone = copy_gb_per_s(args.threads, args.copy_mib * MIB, args.seconds)
    report["copy"] = {"alone_gb_per_s": copy_alone}
    print(f"| copy, {args.threads} threads | {copy_alone:.1f} | nothing |", flush=True)
    if device:
        copied, device_rate = copy_beside_device(args)
        report["copy"] |= {"beside_device_gb_per_s": copied, "device_copies_gb_per_s": device_rate}
        print(f"| copy, {args.threads} threads | {copied:.1f} | device copies at {device_rate:.1f} GB/s |", flush=True)
    modes = RECEIVE_MODES if device else RECEIVE_MODES[:1]
    rounds: list[dict[str, float]] = []
    for round_index in range(args.rounds):
        rounds.append({})
        for mode in modes:
            rate = receive_gb_per_s(args, mode, device)
            rounds[-1][mode] = rate
            beside = "nothing" if mode == "none" else f"device copies, {mode}"
            print(
                f"| receive, {args.connections} connections, round {round_index + 1} | {rate:.2f} | {beside} |",
                flush=True,
            )
    report["receive_gb_per_s"] = rounds
    if device:
        ratios = [{mode: round_[mode] / round_["none"] for mode in modes[1:]} for round_ in rounds]
        report["receive_over_none"] = ratios
        print(
            "receive with the device's copies over without, by round: "
            + "; ".join(", ".join(f"{mode} {ratio:.2f}" for mode, ratio in round_.items()) for round_ in ratios)
        )
    report["finished"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
