"""A stand-in for the service that answers at once: what a benchmark's own clients reach when the service costs
nothing, so that a benchmark can tell its clients' limit from the service's.

It answers, computing nothing, with answers of the size the service's would have:

- `POST /matmul` of two `.npy` parts: a `.npy` answer of zeros, C's shape, A's dtype, and the headers
  `MatmulClient` reads (X-Matmul-Kernel `stand-in` and so on);
- `POST /v2/models/<model>/infer`: C's shape and the output parameters the request asked for; C's bytes (zeros)
  after the JSON header where the output asks for binary data (Triton's binary tensor data extension), none where
  it names a shared-memory region (which is not touched: a client that checks finds it unwritten), JSON data else;
- the shared-memory extensions' register and unregister calls: 200;
- `POST /v1/echo`: the body back, or its first `answer_bytes` (a query parameter) as the service answers.

Requests are framed by Content-Length (what every client of the benchmarks sends). `processes` processes of their
own (`python -m matmul_tools.standin PORT`) accept on one port (SO_REUSEPORT), a thread per connection, each body
read into memory its connection keeps and each answer's zeros made once: a stand-in that costs a `recv_into` and a
`sendall` per byte, never the benchmark's limit.
"""

from __future__ import annotations

import functools
import io
import json
import math
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs

import numpy as np

from matmul_client.wire import npy_parts
from matmul_tools.service import free_port

REGION_CALL = re.compile(rb"^/v2/(system|cuda)sharedmemory/region/[^/]+/(register|unregister)$")
INFER = re.compile(rb"^/v2/models/(?P<model>[^/]+)(/versions/[^/]+)?/infer$")
NPY_MAGIC = b"\x93NUMPY"
HEAD_LIMIT = 65536
"""A request head longer than this is refused (the stand-in's clients send a few hundred bytes)."""


class _Request:
    """One request's path, query, lower-cased headers and body (a view of its connection's memory)."""

    def __init__(self, target: bytes, headers: dict[bytes, bytes], body: memoryview) -> None:
        self.path, _, query = target.partition(b"?")
        self.query = parse_qs(query)
        self.headers = headers
        self.body = body


def _npy_header(body: memoryview, start: int) -> tuple[tuple[int, ...], np.dtype, int]:
    """The shape and dtype of the `.npy` array that begins at `start` (NumPy's reader), and where its data begins."""
    opening = io.BytesIO(body[start : start + HEAD_LIMIT])
    version = np.lib.format.read_magic(opening)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(opening)
    return shape, dtype, start + opening.tell()


Answer = list[bytes | memoryview]
"""What answers a request: its head and the pieces of its body, sent in turn."""


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    """C's data (kept: the next request is likely of the same shapes)."""
    return bytes(nbytes)


def _answer_shape(a_shape: Sequence[int], b_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of A @ B as numpy.matmul gives it: matrices, or stacks whose leading dimensions broadcast."""
    return (*np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])), a_shape[-2], b_shape[-1])


@functools.lru_cache(maxsize=16)
def _npy_answer(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: np.dtype) -> Answer:
    """The answer to A @ B: a `.npy` of zeros, C's shape, A's dtype, written as the client writes its operands."""
    opening, data = npy_parts(np.zeros(_answer_shape(a_shape, b_shape), dtype))
    headers = {
        "Content-Type": "application/x-npy",
        "X-Matmul-Kernel": "stand-in",
        "X-Matmul-Precision": "fp32",
        "X-Matmul-Backend": "stand-in",
        "X-Matmul-Device": "stand-in",
        "Server-Timing": "total;dur=0",
    }
    return [_head(200, headers, len(opening) + len(data)), opening, data]


def _matmul_answer(request: _Request) -> Answer:
    """The answer to a body of A's and B's `.npy` parts."""
    body = request.body
    a_shape, dtype, a_data = _npy_header(body, bytes(body[:4096]).find(NPY_MAGIC))
    a_end = a_data + dtype.itemsize * math.prod(a_shape)
    b_shape, _, _ = _npy_header(body, a_end + bytes(body[a_end : a_end + 4096]).find(NPY_MAGIC))
    return _npy_answer(a_shape, b_shape, dtype)


def _inference_answer(model: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
    """The answer to an infer request of A (m x k) and B (k x n), or stacks of them: each requested output with C's
    shape and the request's own parameters, and the binary data that follows the JSON header (none where none is
    asked for)."""
    shapes = {tensor["name"]: tensor["shape"] for tensor in request.get("inputs", [])}
    datatypes = {tensor["name"]: tensor.get("datatype", "FP32") for tensor in request.get("inputs", [])}
    shape = _answer_shape(shapes.get("A", [0, 0]), shapes.get("B", [0, 0]))
    elements = math.prod(shape)
    datatype = datatypes.get("A", "FP32")
    itemsize = {"FP16": 2, "FP64": 8}.get(datatype, 4)
    binary_default = bool(request.get("parameters", {}).get("binary_data_output", False))
    outputs, data = [], []
    for output in request.get("outputs") or [{"name": "C"}]:
        parameters = dict(output.get("parameters", {}))
        answered: dict[str, Any] = {"name": output["name"], "datatype": datatype, "shape": list(shape)}
        if "shared_memory_region" not in parameters and parameters.get("binary_data", binary_default):
            parameters["binary_data_size"] = itemsize * elements
            data.append(_zeros(itemsize * elements))
        elif "shared_memory_region" not in parameters:
            answered["data"] = [0] * elements
        outputs.append(answered | {"parameters": parameters})
    return {"model_name": model, "outputs": outputs}, data


def _infer_answer(model: str, request: _Request) -> Answer:
    header_length = int(request.headers.get(b"inference-header-content-length", len(request.body)))
    answer, data = _inference_answer(model, json.loads(bytes(request.body[:header_length])))
    header = json.dumps(answer).encode()
    headers = {"Content-Type": "application/octet-stream" if data else "application/json"}
    if data:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return [_head(200, headers, len(header) + sum(map(len, data))), header, *data]


def _answer(request: _Request) -> Answer:
    """The head and body answering `request`."""
    if request.path == b"/v1/echo":
        asked = request.query.get(b"answer_bytes")
        echoed = request.body if asked is None else request.body[: int(asked[0])]
        return [_head(200, {"Content-Type": "application/octet-stream"}, len(echoed)), echoed]
    if request.path == b"/matmul":
        return _matmul_answer(request)
    if REGION_CALL.match(request.path):
        return [_head(200, {"Content-Type": "application/json"}, 0)]
    if found := INFER.match(request.path):
        return _infer_answer(found["model"].decode(), request)
    body = b'{"error": "not a route of the stand-in"}'
    return [_head(404, {"Content-Type": "application/json"}, len(body)), body]


def _head(status: int, headers: dict[str, str], length: int) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}"]
    lines += [f"{name}: {value}" for name, value in headers.items()] + [f"Content-Length: {length}", "", ""]
    return "\r\n".join(lines).encode("latin1")


def _serve_connection(sock: socket.socket) -> None:
    """Answer the requests of one keep-alive connection until the client closes it."""
    memory = bytearray()
    received = b""
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(HEAD_LIMIT)
                if not chunk or len(received) > HEAD_LIMIT:
                    return
                received += chunk
            head, _, received = received.partition(b"\r\n\r\n")
            request_line, *header_lines = head.split(b"\r\n")
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get(b"content-length", b"0"))
            if len(memory) < length:
                memory = bytearray(length)
            body = memoryview(memory)[:length]
            got = min(len(received), length)
            body[:got] = received[:got]
            received = received[got:]
            while got < length:
                count = sock.recv_into(body[got:])
                if not count:
                    return
                got += count
            for piece in _answer(_Request(request_line.split(b" ")[1], headers, body)):
                sock.sendall(piece)


def serve(port: int) -> None:
    """One process of the stand-in: accept on `port` beside the others, a thread per connection; says `ready` on
    stdout once it listens."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    print("ready", flush=True)
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(sock,), daemon=True).start()


@contextmanager
def standing_in(processes: int = 1) -> Iterator[str]:
    """A stand-in in `processes` processes listening on a free port of 127.0.0.1 while the block runs: its URL."""
    port = free_port()
    command = [sys.executable, "-m", "matmul_tools.standin", str(port)]
    servers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    try:
        for server in servers:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the stand-in exited with {server.wait()} before listening on port {port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        for server in servers:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
