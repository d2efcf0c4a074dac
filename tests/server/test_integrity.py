"""Every answer is the product of its own request, under load: client processes, each with operands of its own,
against `matmul-service` running as real processes (CPU backend), every answer checked against its own float64
product (matmul_tools/integrity.py).

The configurations cross what decides how memory is lent and reused: one and several HTTP workers, batching off and
on, shared memory scarce (one large request's slab at a time: the others wait for it) and plentiful; every route and
answer encoding, through the project's client, Triton's client and raw HTTP read slowly. `.npy` answers used to be
sent straight from their slab, which was given back when the last `send` returned while the server's transport still
held most of the answer: the next request's operands and product overwrote it (3 of 24 answers wrong in the first
report). `test_an_answer_still_being_sent_keeps_its_memory` is that case alone, step by step.

tests/server/test_faults.py puts the same load through killed processes, disconnecting clients and deadlines.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import orjson
import pytest

from matmul_client.client import encode_payload
from matmul_tools.bodies import inference_v2_body, load_npy
from matmul_tools.integrity import FLOAT_PRECISIONS, WAYS, checked_load
from matmul_tools.raw_http import read_until_closed
from numerics.precision import UNIT_ROUNDOFFS, Precision
from tests.server.conftest import CLIENTS, GPU_SHAPES, SHAPES, STACK_SHAPES, Serve

pytestmark = pytest.mark.timeout(600)
MIB = 1 << 20
SCARCE_SLAB_BYTES = 20 * MIB
"""Room for one 2048x8 @ 8x2048 request (16.1 MiB) at a time: the others wait for its slab."""


@dataclass(frozen=True)
class Configuration:
    workers: int
    batching: bool
    slab_bytes: int

    def __str__(self) -> str:
        memory = "scarce" if self.slab_bytes == SCARCE_SLAB_BYTES else "plentiful"
        return f"{self.workers} worker(s), batching {'on' if self.batching else 'off'}, shared memory {memory}"

    def env(self) -> dict[str, str]:
        return {
            "MATMUL_BACKEND": "cpu",
            "MATMUL_ACCESS_LOG": "false",
            "MATMUL_SHARED_MEMORY": "system",
            "MATMUL_BATCHING": str(self.batching).lower(),
            "MATMUL_SLAB_BYTES": str(self.slab_bytes),
        }


CONFIGURATIONS = [
    Configuration(workers=1, batching=False, slab_bytes=SCARCE_SLAB_BYTES),
    Configuration(workers=2, batching=True, slab_bytes=SCARCE_SLAB_BYTES),
    Configuration(workers=2, batching=False, slab_bytes=256 * MIB),
    Configuration(workers=1, batching=True, slab_bytes=256 * MIB),
]


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=str)
def test_every_answer_is_its_own_requests_product(
    clients: ProcessPoolExecutor, serve: Serve, configuration: Configuration
) -> None:
    service = serve(configuration.env(), configuration.workers)
    shapes = (*SHAPES, *STACK_SHAPES)
    tally = checked_load(clients, service.url, CLIENTS, requests=len(WAYS), ways=list(WAYS), shapes=shapes)
    assert tally.wrong == [], f"{len(tally.wrong)} wrong answers of {tally.answers}, under {configuration}"
    assert tally.other == {}, f"answers that were not 200 under {configuration}: {tally.as_dict()}"
    assert tally.answers == CLIENTS * len(WAYS)
    assert set(tally.checked) == set(WAYS)


def test_every_way_carries_every_precision_and_each_answer_holds_its_bound(
    clients: ProcessPoolExecutor, serve: Serve
) -> None:
    """The load in every precision a float32 product can be asked in: each client moves to the next precision after
    each round of the ways, so that the six clients ask every way in every precision. Each answer is checked
    against its precision's bound, and an answer asked in a precision that rounds the operands must show that
    rounding (an error beyond float32's own bound): a way that dropped the precision would be answered in fp32."""
    service = serve(Configuration(workers=2, batching=True, slab_bytes=256 * MIB).env(), 2)
    rounds = math.ceil(len(FLOAT_PRECISIONS) / CLIENTS)
    tally = checked_load(
        clients,
        service.url,
        CLIENTS,
        rounds * len(WAYS),
        list(WAYS),
        (*SHAPES, *STACK_SHAPES),
        precisions=FLOAT_PRECISIONS,
    )
    assert tally.wrong == [], f"{len(tally.wrong)} wrong answers of {tally.answers}: {tally.wrong[:5]}"
    assert tally.other == {}, tally.as_dict()
    assert set(tally.precisions) == {precision.value for precision in FLOAT_PRECISIONS}
    rounding = {f"{way} in {precision.value}" for way in WAYS for precision in UNIT_ROUNDOFFS}
    assert rounding <= set(tally.rounded), sorted(rounding - set(tally.rounded))


GPU_STACK_PRECISIONS = tuple(precision for precision in FLOAT_PRECISIONS if precision is not Precision.FP8)
"""What the GPU computes stacks in: fp8 only on `wgmma`, which takes one product a launch (GET /v1/kernels)."""
GPU_CONFIGURATIONS = [
    {},  # matmul-service as it starts with no setting
    {"MATMUL_BATCHING": "true", "MATMUL_SLAB_BYTES": str(200 * MIB), "MATMUL_PIPELINE_DEPTH": "1"},
]
"""The defaults, and two workers batching with shared memory for one 4096^2 request (192 MiB) at a time each."""


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("settings", GPU_CONFIGURATIONS, ids=["defaults", "batching, scarce shared memory"])
def test_on_the_gpu_every_answer_is_its_own_requests_product(
    clients: ProcessPoolExecutor, serve: Serve, settings: dict[str, str]
) -> None:
    workers = 2 if settings else 1
    env = {"MATMUL_BACKEND": "gpu", "MATMUL_ACCESS_LOG": "false", "MATMUL_SHARED_MEMORY": "system", **settings}
    service = serve(env, workers)
    for shapes, precisions in ((GPU_SHAPES, FLOAT_PRECISIONS), (STACK_SHAPES, GPU_STACK_PRECISIONS)):
        tally = checked_load(clients, service.url, CLIENTS, 2 * len(WAYS), list(WAYS), shapes, precisions=precisions)
        assert tally.wrong == [], f"{len(tally.wrong)} wrong answers of {tally.answers}: {tally.wrong[:5]}"
        assert tally.other == {}, tally.as_dict()
        assert tally.answers == CLIENTS * 2 * len(WAYS)


def _request(route: str, a: np.ndarray, b: np.ndarray) -> bytes:
    """A whole request for a @ b on `route` (an `.npy` answer, or a v2 binary one), its connection closed after."""
    if route == "npy":
        payload = encode_payload(a, b, "npy")
        body, path, extra = payload.content, "/matmul", f"Content-Type: {payload.content_type}\r\n"
        extra += "Accept: application/x-npy\r\n"
    else:
        body, header_length = inference_v2_body(a, b)
        path, extra = "/v2/models/matmul/infer", f"Inference-Header-Content-Length: {header_length}\r\n"
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\n{extra}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode("latin-1") + body


def _product(route: str, answer: bytes) -> np.ndarray:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    if route == "npy":
        return load_npy(body)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"inference-"))
    shape = orjson.loads(body[:length])["outputs"][0]["shape"]
    return np.frombuffer(body[length:], np.float32).reshape(shape)


@pytest.mark.parametrize("route", ["npy", "v2 binary"])
def test_an_answer_still_being_sent_keeps_its_memory(serve: Serve, route: str) -> None:
    """A reads the head of its 16 MiB answer (`.npy`, or v2 binary tensors: both are sent from the product's
    shared memory) and stops reading; B, whose operands and product need the same shared memory, is sent meanwhile;
    a second later A reads the rest. A's answer is its own product, B's its own."""
    service = serve(Configuration(workers=1, batching=False, slab_bytes=20 * MIB).env(), 1)
    n = 2048
    a_first, b_first = np.ones((n, 1), np.float32), np.arange(n, dtype=np.float32)[None, :]
    a_second, b_second = np.full((n, 1), 7, np.float32), np.full((1, n), 3, np.float32)
    answers: dict[str, np.ndarray] = {}

    def second() -> None:
        with socket.create_connection(("127.0.0.1", service.port)) as sock:
            sock.sendall(_request(route, a_second, b_second))
            answers["second"] = _product(route, read_until_closed(sock))

    with socket.socket() as first:
        first.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        first.connect(("127.0.0.1", service.port))
        first.sendall(_request(route, a_first, b_first))
        received = first.recv(4096)  # the head: the answer is being sent
        meanwhile = threading.Thread(target=second)
        meanwhile.start()
        time.sleep(1.0)
        while piece := first.recv(1 << 20):
            received += piece
    meanwhile.join(timeout=60)
    np.testing.assert_array_equal(_product(route, received), a_first @ b_first)
    np.testing.assert_array_equal(answers["second"], a_second @ b_second)
