"""A stand-in for the service's inference-protocol routes that answers at once: what a benchmark's own clients reach
when the service costs nothing, so that a benchmark can tell its clients' limit from the service's.

It takes the shared-memory extensions' register and unregister calls and answers `POST /v2/models/<model>/infer`
with C's shape and the output parameters the request asked for, computing nothing and touching no region: a client
that checks its answers finds them unwritten, which is expected here. One thread per connection, HTTP/1.1
keep-alive, in the benchmark's own process (the clients are processes of their own).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REGION_CALL = re.compile(r"^/v2/(system|cuda)sharedmemory/region/[^/]+/(register|unregister)$")
INFER = re.compile(r"^/v2/models/(?P<model>[^/]+)/infer$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep the connection: the clients send one request after another
    disable_nagle_algorithm = True  # the head and the body go in two writes: no 40 ms wait for an ACK between them

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if REGION_CALL.match(self.path):
            self._answer(200, b"")
        elif found := INFER.match(self.path):
            # the JSON header alone, before any binary tensors (Triton's binary tensor data extension)
            header = body[: int(self.headers.get("inference-header-content-length", len(body)))]
            self._answer(200, json.dumps(_inference_answer(found["model"], json.loads(header))).encode())
        else:
            self._answer(404, b'{"error": "not a route of the stand-in"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a line per request would cost more than the answer."""


def _inference_answer(model: str, request: dict[str, Any]) -> dict[str, Any]:
    """The answer the service gives an infer request of A (m x k) and B (k x n) with outputs in shared memory: each
    requested output with C's shape and the request's own parameters (its region, offset and size)."""
    shapes = {tensor["name"]: tensor["shape"] for tensor in request.get("inputs", [])}
    m, n = shapes.get("A", [0, 0])[0], shapes.get("B", [0, 0])[-1]
    outputs = request.get("outputs") or [{"name": "C"}]
    return {
        "model_name": model,
        "outputs": [
            {"name": output["name"], "datatype": "FP32", "shape": [m, n], "parameters": output.get("parameters", {})}
            for output in outputs
        ],
    }


@contextmanager
def standing_in() -> Iterator[str]:
    """A stand-in listening on a free port of 127.0.0.1 while the block runs: its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="stand-in", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
