"""Checked load: client processes, each with operands of its own, every answer compared with the float64 product of
its own request's operands. The failure that matters most under load is a 200 whose matrix belongs to another
request (memory given back while an answer still needed it), so nothing is sampled: every answer is checked.

A client process sends its products in a closed loop, cycling through the ways it is given (a route, a request
encoding and an answer encoding, sent by the project's client, Triton's client or raw HTTP; WAYS) and through the
shapes, with fresh random operands each time. Raw answers are read slowly through a small receive buffer, so that
the server still holds most of an answer after its last `send` returned: where it gives that memory back too
early, the next request's operands and product land in an answer still being sent.

`checked_load` runs the clients in processes of their own and adds up their tallies: per way, the answers checked
and those wrong (each described with its relative error), and every other outcome by status, or `closed` where the
connection ended without a whole answer.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson

from matmul_client.client import MatmulClient, RequestFormat, encode_payload
from matmul_tools.bodies import inference_v2_body, load_npy, npz_bytes
from matmul_tools.triton_grpc import fp32_inputs, grpc_address
from numerics.precision import UNIT_ROUNDOFFS, Precision
from numerics.reference import BOUND_CONSTANT, Reference

Shape = tuple[int, int, int] | tuple[int, int, int, int]
"""(m, k, n): a product of two matrices; (batch, m, k, n): a stack of `batch` of them, B a stack too or, every other
request, one matrix broadcast against A's stack."""
MODEL = "matmul"
SLOW_RECEIVE_BUFFER = 16 << 10
"""The receive buffer of a slow raw reader: small, so that the server cannot hand the answer to the kernel at once."""
SLOW_PAUSE_S = 0.02
"""A slow raw reader's pause after the answer's head and first piece: long enough for other requests to be served
meanwhile."""
PIECE = 256 << 10
TIMEOUT_S = 120.0


class Closed(Exception):
    """The connection ended before a whole answer came."""


@dataclass
class Tally:
    """What one client process, or all of them, saw."""

    checked: Counter[str] = field(default_factory=Counter)
    """200 answers compared with their own product, by way."""
    precisions: Counter[str] = field(default_factory=Counter)
    """The same answers by the precision they were asked in."""
    rounded: Counter[str] = field(default_factory=Counter)
    """Answers asked in a precision that rounds the operands (tf32, bf16, fp16, fp8) whose error is beyond float32's
    own bound, as `way in precision`: they show that the way carried the precision to the service."""
    wrong: list[str] = field(default_factory=list)
    """Each 200 answer that was not its request's product: the way, the shape and how far off it was."""
    other: Counter[str] = field(default_factory=Counter)
    """Every other outcome, as `way status` (`way closed` for a connection that ended without an answer)."""
    messages: Counter[str] = field(default_factory=Counter)
    """The error codes of the answers that were not 200, by status: what a failing run needs to say."""

    def add(self, other: Tally) -> None:
        self.checked.update(other.checked)
        self.precisions.update(other.precisions)
        self.rounded.update(other.rounded)
        self.wrong.extend(other.wrong)
        self.other.update(other.other)
        self.messages.update(other.messages)

    @property
    def answers(self) -> int:
        return sum(self.checked.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "wrong": len(self.wrong),
            "checked": self.answers,
            "checked_by_way": dict(self.checked),
            "checked_by_precision": dict(self.precisions),
            "rounded_beyond_fp32": dict(self.rounded),
            "other_outcomes": dict(self.other),
            "error_codes": dict(self.messages),
            "wrong_answers": self.wrong,
        }


class Refused(Exception):
    """An answer that is not 200: its status and the error code the body names."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"{status} {code}")
        self.status = status
        self.code = code


def _refused(status: int, body: bytes) -> Refused:
    try:
        parsed = orjson.loads(body)
        code = str(parsed.get("code") or parsed.get("error", ""))[:60]
    except (orjson.JSONDecodeError, AttributeError):
        code = body[:60].decode("latin-1")
    return Refused(status, code)


# ------------------------------------------------------------------------------------------------ raw HTTP


@contextmanager
def _connected(url: str) -> Iterator[socket.socket]:
    """A new connection to the server, with a small receive buffer; OSError on it is Closed."""
    where = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RECEIVE_BUFFER)
    sock.settimeout(TIMEOUT_S)
    try:
        sock.connect((where.hostname or "127.0.0.1", where.port or 80))
        yield sock
    except OSError as exc:
        raise Closed(str(exc)) from None
    finally:
        sock.close()


def _head(url: str, path: str, length: int, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {urlsplit(url).netloc}", f"Content-Length: {length}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _raw_exchange(url: str, head: dict[str, str], path: str, body: bytes) -> tuple[dict[str, str], bytes]:
    """One request over a new connection with a small receive buffer, the answer read slowly: its headers (lower
    case) and body; Refused when it is not 200, Closed when the connection ends first."""
    with _connected(url) as sock:
        sock.sendall(_head(url, path, len(body), head))
        sock.sendall(body)
        status, headers, answer = _read_answer(sock)
    if status != 200:
        raise _refused(status, answer)
    return headers, answer


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    received = bytearray()
    while b"\r\n\r\n" not in received:
        piece = sock.recv(PIECE)
        if not piece:
            raise Closed("the connection ended before the answer's head")
        received += piece
    head, _, rest = bytes(received).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    time.sleep(SLOW_PAUSE_S)
    while len(body) < length:
        piece = sock.recv(PIECE)
        if not piece:
            raise Closed(f"the connection ended after {len(body)} of {length} bytes of the answer")
        body += piece
    return int(status_line.split()[1]), headers, bytes(body[:length])


# -------------------------------------------------------------------------------------------------- the ways


@dataclass
class Connections:
    """What a client process holds for the whole run: its project client, its Triton client, its shared-memory
    region (each made on first use, closed at the end)."""

    url: str
    stack: ExitStack = field(default_factory=ExitStack)
    http: httpx.Client | None = None
    clients: dict[str, MatmulClient] = field(default_factory=dict)
    triton: Any = None
    triton_grpc: Any = None
    region: tuple[str, Any] | None = None

    def httpx(self) -> httpx.Client:
        if self.http is None:
            self.http = self.stack.enter_context(httpx.Client(base_url=self.url, timeout=TIMEOUT_S))
        return self.http

    def project_client(self, format: RequestFormat) -> MatmulClient:
        if format not in self.clients:
            self.clients[format] = self.stack.enter_context(MatmulClient(self.url, format=format, timeout=TIMEOUT_S))
        return self.clients[format]

    def triton_client(self) -> Any:
        if self.triton is None:
            import tritonclient.http as triton

            self.triton = triton.InferenceServerClient(urlsplit(self.url).netloc, network_timeout=TIMEOUT_S)
            self.stack.callback(self.triton.close)
        return self.triton

    def triton_grpc_client(self) -> Any:
        """Triton's gRPC client, to the port the server's /v1/info names."""
        if self.triton_grpc is None:
            import tritonclient.grpc as triton

            address = grpc_address(self.url, self.httpx().get("/v1/info").json())
            self.triton_grpc = triton.InferenceServerClient(address)
            self.stack.callback(self.triton_grpc.close)
        return self.triton_grpc

    def system_region(self, nbytes: int) -> tuple[str, Any]:
        """This process's shared-memory region (registered with the server), at least `nbytes` long."""
        import tritonclient.utils.shared_memory as shm

        if self.region is None:
            name = f"integrity-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            handle = shm.create_shared_memory_region(name, f"/{name}", nbytes)
            self.stack.callback(shm.destroy_shared_memory_region, handle)
            self.triton_client().register_system_shared_memory(name, f"/{name}", nbytes)
            self.stack.callback(self._unregister, name)
            self.region = (name, handle)
        return self.region

    def _unregister(self, name: str) -> None:
        """At the end: the server may have lost the region with an engine process; it is the client's to free."""
        from tritonclient.utils import InferenceServerException

        with contextlib.suppress(InferenceServerException, OSError):
            self.triton_client().unregister_system_shared_memory(name)

    def close(self) -> None:
        self.stack.close()


Send = Callable[[Connections, np.ndarray, np.ndarray, Precision], np.ndarray]
"""A way of asking for a product in a precision: its answer, or Refused, or Closed."""
Leave = Callable[[Connections, np.ndarray, np.ndarray], None]


def _from_httpx(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise _refused(response.status_code, response.content)
    return response


def _json_result(body: dict[str, Any], shape: tuple[int, ...]) -> np.ndarray:
    return np.array(body["result"], np.float64).reshape(shape)


def result_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """The shape of np.matmul(a, b): a matrix, or a stack with its batch first."""
    return (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])


def _sides(x: np.ndarray | tuple[int, ...]) -> str:
    return "x".join(map(str, x.shape if isinstance(x, np.ndarray) else x))


def _asked(precision: Precision) -> dict[str, str]:
    """The request's options for `precision`: none for fp32, the service's default for float32 operands, so that
    those requests are what a user sends who names nothing."""
    return {} if precision is Precision.FP32 else {"precision": precision.value}


def _matmul_path(precision: Precision) -> str:
    asked = _asked(precision)
    return f"/matmul?precision={asked['precision']}" if asked else "/matmul"


def matmul_json(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /matmul, a JSON body, a JSON answer."""
    body = orjson.dumps({"a": a, "b": b, **_asked(precision)}, option=orjson.OPT_SERIALIZE_NUMPY)
    response = _from_httpx(conn.httpx().post("/matmul", content=body, headers={"content-type": "application/json"}))
    return _json_result(response.json(), result_shape(a, b))


def matmul_npy_raw(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /matmul, multipart `.npy` parts, an `.npy` answer read slowly over raw HTTP."""
    payload = encode_payload(a, b, "npy")
    head = {"Content-Type": payload.content_type, "Accept": "application/x-npy"}
    return load_npy(_raw_exchange(conn.url, head, _matmul_path(precision), payload.content)[1])


def matmul_npy_to_json(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /matmul, multipart `.npy` parts, a JSON answer."""
    payload = encode_payload(a, b, "npy")
    headers = {"content-type": payload.content_type, "accept": "application/json"}
    response = _from_httpx(conn.httpx().post(_matmul_path(precision), content=payload.content, headers=headers))
    return _json_result(response.json(), result_shape(a, b))


def matmul_npz_raw(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /matmul, an `.npz` body, an `.npy` answer read slowly over raw HTTP."""
    head = {"Content-Type": "application/x-npz", "Accept": "application/x-npy"}
    return load_npy(_raw_exchange(conn.url, head, _matmul_path(precision), npz_bytes(a=a, b=b))[1])


def _project_client(format: RequestFormat) -> Send:
    def send(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
        from matmul_client.client import MatmulServiceError

        try:
            client = conn.project_client(format)
            return client.matmul(a, b) if precision is Precision.FP32 else client.matmul(a, b, precision=precision)
        except MatmulServiceError as exc:
            raise Refused(exc.status, exc.code) from None

    send.__doc__ = f"MatmulClient(format={format!r}).matmul"
    return send


def v2_json(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /v2/models/matmul/infer with JSON tensors, a JSON answer."""
    inputs = [
        {"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        for name, x in (("A", a), ("B", b))
    ]
    request = {"inputs": inputs, "parameters": _asked(precision)}
    response = _from_httpx(conn.httpx().post(f"/v2/models/{MODEL}/infer", json=request))
    output = response.json()["outputs"][0]
    return np.array(output["data"], np.float64).reshape(output["shape"])


def v2_binary_raw(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /v2/models/matmul/infer with binary tensors in and out, the answer read slowly over raw HTTP."""
    body, header_length = inference_v2_body(a, b, _asked(precision))
    head = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_length)}
    headers, answer = _raw_exchange(conn.url, head, f"/v2/models/{MODEL}/infer", body)
    split = int(headers["inference-header-content-length"])
    output = orjson.loads(answer[:split])["outputs"][0]
    return np.frombuffer(answer[split:], "<f4").reshape(output["shape"])


ENDED_MID_ANSWER = ("Incomplete response", "connection closed")
"""How geventhttpclient's parser words an answer cut short by the connection's end (its HTTPParseError, whose
HTTPConnectionClosed subclass it raises only where nothing of the answer came)."""


@contextmanager
def _triton_errors() -> Iterator[None]:
    """Triton's client raises one exception for every failure: a status is Refused, none is a closed connection. Its
    HTTP library's own parse errors for a connection that ended (before a whole answer came, or when the one retry
    it makes for a dropped keep-alive connection found it closed too) are a closed connection as well; any other
    parse error, a malformed answer, is raised as a RuntimeError, which a client process can hand back to the test
    (the parser's own exceptions do not pickle)."""
    from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError
    from tritonclient.utils import InferenceServerException

    try:
        yield
    except InferenceServerException as exc:
        status = exc.status()
        if not status:
            raise Closed(exc.message()) from None
        raise Refused(GRPC_STATUSES.get(status) or int(status), exc.message()[:60]) from None
    except HTTPConnectionClosed as exc:
        raise Closed(str(exc)) from None
    except HTTPParseError as exc:
        if any(words in str(exc) for words in ENDED_MID_ANSWER):
            raise Closed(str(exc)) from None
        raise RuntimeError(f"tritonclient's HTTP parser refused an answer: {exc}") from None


GRPC_STATUSES = {
    "StatusCode.INVALID_ARGUMENT": 400,
    "StatusCode.UNAUTHENTICATED": 401,
    "StatusCode.NOT_FOUND": 404,
    "StatusCode.RESOURCE_EXHAUSTED": 413,
    "StatusCode.INTERNAL": 500,
    "StatusCode.UNAVAILABLE": 503,
    "StatusCode.DEADLINE_EXCEEDED": 504,
}
"""The HTTP status a gRPC status of Triton's gRPC client stands for (app.api.grpc.STATUS_CODES the other way):
a tally counts both alike. A server that went away is UNAVAILABLE, so 503."""


def tritonclient_binary(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """Triton's HTTP client: binary tensors in and out."""
    import tritonclient.http as triton

    inputs = [triton.InferInput(name, list(x.shape), "FP32") for name, x in (("A", a), ("B", b))]
    for tensor, x in zip(inputs, (a, b), strict=True):
        tensor.set_data_from_numpy(x, binary_data=True)
    with _triton_errors():
        outputs = [triton.InferRequestedOutput("C", binary_data=True)]
        result = conn.triton_client().infer(MODEL, inputs, outputs=outputs, parameters=_asked(precision))
    c: np.ndarray = result.as_numpy("C")
    return c


def tritonclient_grpc(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """Triton's gRPC client: raw contents in and out."""
    with _triton_errors():
        result = conn.triton_grpc_client().infer(MODEL, fp32_inputs(a, b), parameters=_asked(precision))
    c: np.ndarray = result.as_numpy("C")
    return c


def tritonclient_system_shm(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """Triton's HTTP client with A, B and C in the client's system shared-memory region."""
    import tritonclient.http as triton
    import tritonclient.utils.shared_memory as shm

    answer = result_shape(a, b)
    b_at, c_at = a.nbytes, a.nbytes + b.nbytes
    with _triton_errors():
        name, handle = conn.system_region(REGION_BYTES)
    shm.set_shared_memory_region(handle, [a])
    shm.set_shared_memory_region(handle, [b], offset=b_at)
    shm.set_shared_memory_region(handle, [np.full(answer, np.nan, np.float32)], offset=c_at)
    inputs = [triton.InferInput("A", list(a.shape), "FP32"), triton.InferInput("B", list(b.shape), "FP32")]
    inputs[0].set_shared_memory(name, a.nbytes, offset=0)
    inputs[1].set_shared_memory(name, b.nbytes, offset=b_at)
    output = triton.InferRequestedOutput("C")
    output.set_shared_memory(name, math.prod(answer) * 4, offset=c_at)
    with _triton_errors():
        conn.triton_client().infer(MODEL, inputs, outputs=[output], parameters=_asked(precision))
    c: np.ndarray = shm.get_contents_as_numpy(handle, np.float32, list(answer), offset=c_at).copy()
    return c


def matmul_npy_hurried(conn: Connections, a: np.ndarray, b: np.ndarray, precision: Precision) -> np.ndarray:
    """POST /matmul, multipart `.npy` parts and a 1 ms deadline (X-Request-Timeout): 504 when the product waited
    longer in the queue, else its `.npy` answer, read slowly."""
    payload = encode_payload(a, b, "npy")
    head = {"Content-Type": payload.content_type, "Accept": "application/x-npy", "X-Request-Timeout": "0.001"}
    return load_npy(_raw_exchange(conn.url, head, _matmul_path(precision), payload.content)[1])


def leaves_mid_upload(conn: Connections, a: np.ndarray, b: np.ndarray) -> None:
    """Sends the head and half the body of an `.npy` request, then closes the connection."""
    payload = encode_payload(a, b, "npy")
    with _connected(conn.url) as sock:
        sock.sendall(_head(conn.url, "/matmul", len(payload.content), {"Content-Type": payload.content_type}))
        sock.sendall(payload.content[: len(payload.content) // 2])


def leaves_mid_download(conn: Connections, a: np.ndarray, b: np.ndarray) -> None:
    """Sends a whole `.npy` request, reads the head and the first piece of the answer, then closes the connection."""
    payload = encode_payload(a, b, "npy")
    head = {"Content-Type": payload.content_type, "Accept": "application/x-npy"}
    with _connected(conn.url) as sock:
        sock.sendall(_head(conn.url, "/matmul", len(payload.content), head) + payload.content)
        sock.recv(SLOW_RECEIVE_BUFFER)


WAYS: dict[str, Send] = {
    "matmul json": matmul_json,
    "matmul npy (raw, read slowly)": matmul_npy_raw,
    "matmul npy -> json": matmul_npy_to_json,
    "matmul npz (raw, read slowly)": matmul_npz_raw,
    "MatmulClient npy": _project_client("npy"),
    "MatmulClient json": _project_client("json"),
    "MatmulClient npz": _project_client("npz"),
    "v2 json": v2_json,
    "v2 binary (raw, read slowly)": v2_binary_raw,
    "tritonclient binary": tritonclient_binary,
    "tritonclient system shm": tritonclient_system_shm,
    "tritonclient gRPC": tritonclient_grpc,
}
"""Every way a product can be asked for and answered, by name: each answers 200 on a healthy server."""
HURRIED_WAYS: dict[str, Send] = {"matmul npy, 1 ms deadline (raw, read slowly)": matmul_npy_hurried}
"""Ways that may be answered 504 (the deadline passed in the queue) or 503 (it passed while the request waited for
shared memory, as MATMUL_SLAB_BYTES says), else with a product to check."""
LEAVING_WAYS: dict[str, Leave] = {"leaves mid-upload": leaves_mid_upload, "leaves mid-download": leaves_mid_download}
"""Clients that go away before their answer: nothing to check, but the server goes on serving everyone else."""
LEFT = "left"
"""The outcome of a leaving way."""
JSON_WAYS = frozenset({"matmul json", "matmul npy -> json", "MatmulClient json", "v2 json"})
"""Ways that carry a matrix as JSON text: each element costs microseconds, so they take the small shapes only."""
SYSTEM_SHM_WAYS = frozenset({"tritonclient system shm"})
"""Ways that need MATMUL_SHARED_MEMORY to enable system shared memory."""
JSON_MAX_ELEMENTS = 64 * 1024
"""The largest operand or product a JSON way carries."""
REGION_BYTES = 64 << 20
"""A client's system shared-memory region: room for A, B and C of the largest shape asked (float32)."""


# ---------------------------------------------------------------------------------------------- a client

FLOAT_PRECISIONS = tuple(precision for precision in Precision if precision is not Precision.INT8)
"""The precisions a float32 product can be asked in: a load may cycle through them (int8 takes int8 operands)."""


@dataclass(frozen=True)
class ClientShare:
    """One client process's part of a run."""

    url: str
    seed: int
    requests: int
    ways: tuple[str, ...]
    shapes: tuple[Shape, ...]
    pause_s: float = 0.0
    """A pause between requests (0: a closed loop)."""
    precisions: tuple[Precision, ...] = (Precision.FP32,)


def _fits(way: str, shape: Shape) -> bool:
    *batch, m, k, n = shape
    products = math.prod(batch)
    if way in JSON_WAYS and products * max(m * k, k * n, m * n) > JSON_MAX_ELEMENTS:
        return False
    return not (way in SYSTEM_SHM_WAYS and 4 * products * (m * k + k * n + m * n) > REGION_BYTES)


def operands(rng: np.random.Generator, shape: Shape, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Fresh float32 operands of a request of `shape`, the `index`th of its client: for a stack, B a stack of its
    own on even requests and one matrix, broadcast against A's stack, on odd ones."""
    *batch, m, k, n = shape
    b_batch = batch if index % 2 == 0 else []
    return (
        rng.standard_normal((*batch, m, k), dtype=np.float32),
        rng.standard_normal((*b_batch, k, n), dtype=np.float32),
    )


def plan(share: ClientShare) -> Iterator[tuple[str, Shape, Precision]]:
    """The (way, shape, precision) of each request of a client: every way in turn, each with the next shape it can
    carry; the precision moves on after each round of the ways, from a place of the client's own (its seed), so
    that the clients together ask every way in every precision."""
    for index in range(share.requests):
        way = share.ways[(share.seed + index) % len(share.ways)]
        fitting = [shape for shape in share.shapes if _fits(way, shape)] or [min(share.shapes, key=np.prod)]
        precision = share.precisions[(share.seed + index // len(share.ways)) % len(share.precisions)]
        yield way, fitting[(share.seed + index) % len(fitting)], precision


def run_client(share: ClientShare) -> Tally:
    """Send a share's requests one after another, each with operands of its own, and check every answer."""
    rng = np.random.default_rng(share.seed)
    tally = Tally()
    connections = Connections(share.url)
    try:
        for index, (way, shape, precision) in enumerate(plan(share)):
            a, b = operands(rng, shape, index)
            _exchange(connections, way, a, b, precision, tally)
            if share.pause_s:
                time.sleep(share.pause_s)
    finally:
        connections.close()
    return tally


def _exchange(
    connections: Connections, way: str, a: np.ndarray, b: np.ndarray, precision: Precision, tally: Tally
) -> None:
    """One request the way named, in `precision`, its outcome added to `tally`: its answer checked against that
    precision's bound, or how it went otherwise."""
    try:
        if way in LEAVING_WAYS:
            LEAVING_WAYS[way](connections, a, b)
            tally.other[f"{way} {LEFT}"] += 1
            return
        c = (WAYS | HURRIED_WAYS)[way](connections, a, b, precision)
    except Refused as exc:
        tally.other[f"{way} {exc.status}"] += 1
        tally.messages[f"{exc.status} {exc.code}"] += 1
        return
    except (Closed, httpx.TransportError, OSError) as exc:
        tally.other[f"{way} closed"] += 1
        tally.messages[f"closed: {type(exc).__name__}"] += 1
        return
    tally.checked[way] += 1
    tally.precisions[precision.value] += 1
    problem = check(c, a, b, precision)
    if problem is not None:
        tally.wrong.append(f"{way}, {_sides(a)} @ {_sides(b)} in {precision.value}: {problem}")
    elif precision in UNIT_ROUNDOFFS and _beyond_fp32(c, a, b):
        tally.rounded[f"{way} in {precision.value}"] += 1


ROUNDING_ROWS = 8
"""The rows of an answer compared with float32's bound, to see its precision's rounding (enough elements, at little
cost for the 4096^2 answers)."""


def _beyond_fp32(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the first rows of `c` (of its first matrix, for a stack) err beyond float32's own bound: a product
    computed in float32 would not."""
    if c.ndim == 3:
        c, a, b = c[0], a[0], (b[0] if b.ndim == 3 else b)
    rows = slice(0, ROUNDING_ROWS)
    return Reference.of(a[rows], b, np.float32).error_ratio(c[rows]) > BOUND_CONSTANT


def check(c: np.ndarray, a: np.ndarray, b: np.ndarray, precision: Precision = Precision.FP32) -> str | None:
    """None when `c` is the product of `a` and `b` in their dtype (float64 if either is), computed in `precision`,
    within its stated bound; else what is wrong."""
    expected = result_shape(a, b)
    if c.shape != expected:
        return f"the answer is {_sides(c)}, not {_sides(expected)}"
    reference = Reference.of(a, b, np.result_type(a.dtype, b.dtype), precision)
    problem = reference.mismatch(c)
    if problem is None:
        return None
    return f"relative error {reference.relative_error(c):.3g}: {problem}"


# --------------------------------------------------------------------------------------------- the run


@contextmanager
def client_pool(processes: int) -> Iterator[ProcessPoolExecutor]:
    """Processes for client shares, started by spawning (they share nothing with the caller's threads)."""
    with ProcessPoolExecutor(max_workers=processes, mp_context=get_context("spawn")) as pool:
        yield pool


def checked_load(
    pool: ProcessPoolExecutor,
    url: str,
    clients: int,
    requests: int,
    ways: Sequence[str],
    shapes: Sequence[Shape],
    seed: int = 0,
    pause_s: float = 0.0,
    during: Callable[[], None] | None = None,
    precisions: Sequence[Precision] = (Precision.FP32,),
) -> Tally:
    """`clients` clients at once in `pool`'s processes, `requests` each over `ways`, `shapes` and `precisions`;
    `during` runs in this process while they do (a fault to inject). The tallies added up."""
    known = WAYS | HURRIED_WAYS | LEAVING_WAYS
    unknown = sorted(set(ways) - set(known))
    if unknown:
        raise ValueError(f"no such way {unknown}; the ways are {list(known)}")
    shares = [
        ClientShare(url, seed * 1000 + index, requests, tuple(ways), tuple(shapes), pause_s, tuple(precisions))
        for index in range(clients)
    ]
    futures = [pool.submit(run_client, share) for share in shares]
    if during is not None:
        during()
    total = Tally()
    for future in futures:
        total.add(future.result())
    return total
