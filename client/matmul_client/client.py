"""A Python client of matmul-service, sync and async.

    with MatmulClient("http://localhost:8000") as client:
        c = client.matmul(a, b, kernel="tiled")          # NumPy in, NumPy out (.npy over the wire)
        product = client.multiply(a, b, format="json")   # the array and what the server said about it
        product.timing["kernel"], product.kernel, product.gflops
        products = client.multiply_many(pairs)           # on up to `connections` connections at once

Requests go as multipart `.npy` parts by default (`format="json"` or `"npz"` to choose another body);
answers come back as `.npy`, or JSON for JSON requests. Whatever the format, the metadata is read from the
`Server-Timing` and `X-Matmul-*` headers, which every product answer carries. Error answers are raised as
the server's `{"code", "message", "location"}`, one exception class per status family::

    MatmulServiceError        any answer that is not a product
    ├── RequestRejected       4xx: the request was wrong (shape_mismatch, unknown_kernel, payload_too_large, ...)
    └── ServerError           5xx: the server failed (device_failure, internal_error, ...)
        └── Unavailable       503: overloaded or not ready; `retry_after_s` says when to try again

Transport failures (connection refused, timeouts, a connection closed mid-answer) are raised as httpx's
`httpx.TransportError`s (ConnectError, ConnectTimeout, ReadTimeout, WriteError, RemoteProtocolError, ...).

What it costs: a 4096x4096 float32 product moves 192 MiB, and a client that copies it on the way (into a
multipart body, out of a socket's chunks, into an array) spends more than the server does. This one writes a
request's head and the operands' own memory (`.npy` parts are a small header and the array's buffer, their framing
made once for each kind of request) with one scatter-gather `sendmsg`, and reads a `.npy` answer's bytes straight
into the result array (`readinto`), on keep-alive connections kept in a pool; answers' heads are read into a dict
(matmul_client/http11.py). Each `.npy` part's data begins on a multiple of 64 bytes of the body, so that the server,
which reads a large body into its shared memory, hands the operands to the engine where they lie; an answer of 1 MiB
or more is read into memory an earlier answer of its size used, once nothing views that one any more
(`AnswerMemory`).
Operands that are not C-contiguous, `.npz` and JSON bodies are encoded into new bytes. `AsyncMatmulClient` runs
the same exchanges on a pool of threads, one per connection: the socket work releases the GIL.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import http.client
import io
import json
import math
import mmap
import re
import secrets
import socket
import ssl
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Self, TypedDict, TypeVar, Unpack
from urllib.parse import quote, urlencode, urlsplit

import httpx
import numpy as np

from matmul_client.http11 import Answer
from matmul_client.wire import JSON_MEDIA_TYPE, NPY_MAGIC_1_0, NPY_MEDIA_TYPE, NPZ_MEDIA_TYPE, data_bytes, npy_header

RequestFormat = Literal["npy", "json", "npz"]
"""How the operands travel: `npy` (multipart, one `.npy` part each), `json`, or one `.npz` body."""
AnswerFormat = Literal["npy", "json"]
FORMATS: tuple[RequestFormat, ...] = ("npy", "json", "npz")
DEFAULT_URL = "http://localhost:8000"
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 86_400.0
"""The longest timeout a client takes: a day (what the operating system's timers take has its own bound)."""
DEFAULT_CONNECTIONS = 8
"""Connections a client opens at most, hence products it has in flight at once (`multiply_many`, async calls)."""
_ACCEPT = {"npy": NPY_MEDIA_TYPE, "json": JSON_MEDIA_TYPE}
_IOV_MAX = 1024
"""Buffers one `sendmsg` takes at most (Linux's IOV_MAX)."""
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""What a header's name may be made of (RFC 9110's token)."""
_STALE = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)
"""How a kept-alive connection that the server closed while it was idle fails on its next request (a TLS one
closed without a close_notify: SSLEOFError)."""
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Headers the client writes itself: one given too would frame the request twice."""
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
"""What a header's value may hold (RFC 9110: visible characters, spaces and tabs; obs-text as latin-1)."""
ERROR_BODY_BYTES = 1 << 16
"""The most of an error answer's body read: its message is cut to 500 characters anyway."""
INFO_BODY_BYTES = 1 << 24
"""The most of a GET /v1/info answer's body read."""
JSON_BYTES_PER_ELEMENT = 32
"""The most bytes a product's element takes in a JSON answer (a float64 written in full is 24, with its comma 25)."""
JSON_BYTES_PER_LIST = 4
"""The most bytes a row (or a stack's matrix) takes in a JSON answer beside its elements: `[],` when it has none."""
JSON_ANSWER_EXTRA_BYTES = 1 << 20
"""The most bytes a JSON answer holds beside its elements (its other fields)."""
T = TypeVar("T")


class MatmulServiceError(Exception):
    """An answer that is not a product: the HTTP status and the server's `code`, `message` and `location`."""

    def __init__(self, status: int, code: str, message: str, location: Sequence[str | int] | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.location = list(location) if location is not None else None


class RequestRejected(MatmulServiceError):
    """A 4xx answer: the request was wrong; sending it again will not help."""


class ServerError(MatmulServiceError):
    """A 5xx answer: the server failed."""


class Unavailable(ServerError):
    """A 503 answer: the worker's queue is full or the kernels are not ready yet."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        location: Sequence[str | int] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(status, code, message, location)
        self.retry_after_s = retry_after_s


_DURATION = re.compile(r'([^\s,;]+)\s*(?:;[^,]*?)?;\s*dur\s*=\s*"?([^\s,;"]*)', re.IGNORECASE)
"""A Server-Timing metric's name and its `dur` parameter's value, wherever that stands among its parameters."""


_PLAIN_TIMING = re.compile(r"[a-z0-9_]+;dur=[0-9]+\.[0-9]+(?:, [a-z0-9_]+;dur=[0-9]+\.[0-9]+)*")
"""A Server-Timing header as this service writes it (`read;dur=0.021, decode;dur=0.090, ...`), which is split
apart in half the time `_DURATION`'s search through it takes (5 us against 11 for ten metrics, on 2 cores)."""


def parse_server_timing(header: str) -> dict[str, float]:
    """A W3C `Server-Timing` header -> milliseconds by metric name (`queue;dur=0.05` -> {"queue": 0.05}); metrics
    without a duration are left out. ValueError for a duration that is not a number."""
    if _PLAIN_TIMING.fullmatch(header):
        return {name: float(value) for name, _, value in (metric.partition(";dur=") for metric in header.split(", "))}
    return {name: float(value) for name, value in _DURATION.findall(header)}


class Options(TypedDict, total=False):
    """What a product request may choose; the server picks what is not given (GET /v1/kernels lists them)."""

    kernel: str
    tile: int
    dtype: str
    precision: str


Buffer = bytes | memoryview


@dataclass(frozen=True)
class Payload:
    """A request body, encoded once: the buffers it is made of (for `.npy` parts, views of the operands
    themselves), their Content-Type, and the answer asked for."""

    parts: tuple[Buffer, ...]
    content_type: str
    answer: AnswerFormat
    product_shape: tuple[int, ...] | None
    """The shape of the product the operands make (numpy.matmul's), which a 200 answer must have; None where they do
    not multiply (the server refuses them)."""

    @property
    def size(self) -> int:
        return sum(memoryview(part).nbytes for part in self.parts)

    @property
    def content(self) -> bytes:
        """The body as one bytes object (a copy), for senders that need one."""
        return b"".join(self.parts)


@functools.lru_cache(maxsize=256)
def _multipart_framing(kinds: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> tuple[tuple[bytes, ...], str]:
    """The bytes around the data of a multipart body of `.npy` parts of these names, dtypes and shapes (C-ordered),
    each part's data on a multiple of 64 bytes of the body (the server reads a large body into aligned memory and an
    operand aligned there is not copied again): one piece before each part's data (its opening and its `.npy`
    header) and the closing; and the body's Content-Type. Made once for each kind of request, with a boundary of its
    own: a client sends products of a few shapes again and again."""
    boundary = secrets.token_hex(16)
    pieces: list[bytes] = []
    size = 0
    for name, dtype, shape in kinds:
        opening = (b"\r\n" if pieces else b"") + (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.npy"\r\n'
            f"Content-Type: {NPY_MEDIA_TYPE}\r\n\r\n"
        ).encode()
        header = npy_header(dtype, shape, starts_at=size + len(opening))
        pieces.append(opening + header)
        size += len(opening) + len(header) + dtype.itemsize * math.prod(shape)
    pieces.append(f"\r\n--{boundary}--\r\n".encode())
    return tuple(pieces), f"multipart/form-data; boundary={boundary}"


def _multipart(parts: Mapping[str, np.ndarray]) -> tuple[tuple[Buffer, ...], str]:
    """A multipart body of `.npy` file parts (`_multipart_framing`) around views of the arrays' memory."""
    arrays = {name: np.ascontiguousarray(array) for name, array in parts.items()}
    if any(array.dtype.hasobject for array in arrays.values()):
        raise ValueError("object arrays cannot be sent: the server reads numbers only")
    kinds = tuple((name, array.dtype, array.shape) for name, array in arrays.items())
    (*openings, closing), content_type = _multipart_framing(kinds)
    buffers: list[Buffer] = []
    for opening, array in zip(openings, arrays.values(), strict=True):
        buffers += [opening, data_bytes(array)]
    buffers.append(closing)
    return tuple(buffers), content_type


def _npz(a: np.ndarray, b: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, a=a, b=b)
    return buffer.getvalue()


def _json_matrix(array: np.ndarray, name: str) -> bytes:
    """A matrix (or a stack of them) as nested JSON lists. JSON has no NaN or Infinity, so an operand holding one is
    refused here: `.npy` and `.npz` bodies carry them."""
    if array.dtype.hasobject:
        raise ValueError("object arrays cannot be sent: the server reads numbers only")
    if array.dtype.kind in "fc" and not np.isfinite(array).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        element = name + "".join(f"[{i}]" for i in where)
        raise ValueError(
            f"{element} is {array[where]}, which JSON cannot carry: send it as .npy or .npz (format='npy')"
        )
    return json.dumps(array.tolist(), separators=(",", ":")).encode()


def product_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape numpy.matmul gives operands of shapes `a` and `b` that are matrices or stacks of them (their leading
    dimensions broadcast), None where they do not multiply."""
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    try:
        stack = np.broadcast_shapes(a[:-2], b[:-2])
    except ValueError:
        return None
    return (*stack, a[-2], b[-1])


def encode_payload(
    a: np.ndarray, b: np.ndarray, format: RequestFormat = "npy", answer: AnswerFormat | None = None
) -> Payload:
    """The body that sends `a` and `b` in `format`; the answer defaults to JSON for JSON, else `.npy`. A `.npy`
    body holds views of `a` and `b`: change them and the payload changes too."""
    answer = answer or ("json" if format == "json" else "npy")
    shape = product_shape(np.shape(a), np.shape(b))
    if format == "npy":
        parts, content_type = _multipart({"a": a, "b": b})
        return Payload(parts, content_type, answer, shape)
    if format == "npz":
        return Payload((_npz(a, b),), NPZ_MEDIA_TYPE, answer, shape)
    if format == "json":
        content = b"".join((b'{"a":', _json_matrix(a, "a"), b',"b":', _json_matrix(b, "b"), b"}"))
        return Payload((content,), JSON_MEDIA_TYPE, answer, shape)
    raise ValueError(f"format {format!r} is not one of {list(FORMATS)}")


@dataclass(frozen=True)
class Product:
    """The product `c` and what the server said about it (from its X-Matmul-* and Server-Timing headers)."""

    c: np.ndarray
    kernel: str
    tile: int | None
    precision: str
    backend: str
    device: str
    gflops: float | None
    batch_size: int = 1
    """Products computed in the same launch as this one (the server's dynamic batching)."""
    timing: dict[str, float] = field(default_factory=dict)
    """Milliseconds by phase, as the server measured them: read, decode, queue, h2d, kernel, d2h, encode, total."""


def _error(status: int, headers: Mapping[str, str], body: bytes) -> MatmulServiceError:
    try:
        said = json.loads(body)
        code, message, location = str(said["code"]), str(said["message"]), said.get("location")
    except (ValueError, KeyError, TypeError):  # json's JSONDecodeError and a body that is not UTF-8 are ValueErrors
        text = body[:500].decode("utf-8", "replace")
        code, message, location = "http_error", text or http.client.responses.get(status, ""), None
    if status == 503:
        retry_after = headers.get("retry-after", "")
        seconds = float(retry_after) if _DELAY_SECONDS.fullmatch(retry_after) else None
        return Unavailable(status, code, message, location, retry_after_s=seconds)
    family = RequestRejected if 400 <= status < 500 else ServerError if status >= 500 else MatmulServiceError
    return family(status, code, message, location)


_DELAY_SECONDS = re.compile(r"[0-9]{1,9}")
"""A Retry-After that is a number of seconds (ASCII digits: str.isdigit would take '²'); an HTTP date is not read."""


def _read_exactly(response: Answer, into: memoryview) -> None:
    """Fill `into` from the answer's body, straight from the socket for all but what was already buffered."""
    done = 0
    while done < into.nbytes:
        got = response.readinto(into[done:])
        if not got:
            raise http.client.IncompleteRead(bytes(into[:done]), into.nbytes - done)
        done += got


POOLED_ANSWER_BYTES = 1 << 20
"""Answers of at least this many bytes are read into AnswerMemory's buffers."""
KEPT_ANSWER_BYTES = 1 << 30
"""The most bytes of buffers a client keeps for answers to come."""


class AnswerMemory:
    """Memory for large answers, kept once the caller has let go of an answer for the next one of its size.

    A 4096^2 float32 answer read into new memory costs the client a page fault and the kernel's zeroing of every one
    of its 64 MiB before the socket's bytes are written there. Callers ask for the same shapes again and again, so
    an answer's array is a view of a buffer of this pool: every view of it, NumPy's or a memoryview, keeps the root
    array it was made from alive, and when the last of them goes a finalizer keeps the buffer for the next answer of
    its size (the `kept` most recent, at most `kept_bytes` together). Safe from any thread."""

    def __init__(self, kept: int, kept_bytes: int = KEPT_ANSWER_BYTES, min_bytes: int = POOLED_ANSWER_BYTES) -> None:
        self.kept = kept
        self.kept_bytes = kept_bytes
        self.min_bytes = min_bytes
        self._free: list[mmap.mmap] = []
        self._returned: collections.deque[mmap.mmap] = collections.deque(maxlen=kept)
        """Buffers whose last view went, the `kept` latest: the finalizer only appends here, never taking the lock (a
        garbage collection may run it in the middle of `take`, on the thread that holds it)."""
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes (uint8) to read an answer into: a kept buffer of that size, else new memory."""
        if nbytes < self.min_bytes:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            while self._returned:
                self._free.append(self._returned.popleft())
            while len(self._free) > self.kept or sum(map(len, self._free)) > self.kept_bytes:
                del self._free[0]  # the longest unused
            found = next((i for i, kept in enumerate(self._free) if len(kept) == nbytes), None)
            buffer = self._free.pop(found) if found is not None else None
        if buffer is None:
            buffer = mmap.mmap(-1, nbytes)  # anonymous: pages are mapped as they are first written
        root = np.frombuffer(buffer, np.uint8)
        weakref.finalize(root, self._returned.append, buffer).atexit = False
        return root


_NUMPY_HEADER = re.compile(
    r"\{'descr': '(?P<descr>[<>|=]?[a-zA-Z][0-9]{0,5})', 'fortran_order': (?P<fortran>True|False), "
    r"'shape': \((?P<shape>[0-9]{1,20}(?:, [0-9]{1,20})*,?)?\), \} *\n"
)
"""The header of a plain array exactly as NumPy (and the server) writes it, read without NumPy's parser, which
evaluates it as a Python literal (tens of microseconds an answer); any other header is NumPy's to read."""
NPY_MAX_HEADER = 10_000
"""The largest `.npy` header read (NumPy's own bound)."""
_NPY_LENGTH_BYTES = {(1, 0): 2, (2, 0): 4}
"""The width of the header's length for each `.npy` version this client reads."""


@functools.lru_cache(maxsize=256)
def _plain_npy_header(text: str) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """The shape, order and dtype a header of `_NUMPY_HEADER`'s form says (None for any other): read once for each
    kind of answer."""
    plain = _NUMPY_HEADER.fullmatch(text)
    if plain is None:
        return None
    sizes = plain["shape"] or ""
    shape = tuple(int(size) for size in sizes.split(",") if size.strip())
    return shape, plain["fortran"] == "True", np.dtype(plain["descr"])


def _npy_header(response: Answer) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A `.npy` answer's shape, order and dtype, read from the response up to its data."""
    opening = response.read(len(NPY_MAGIC_1_0))  # the magic string, then the version's two bytes
    if len(opening) < len(NPY_MAGIC_1_0) or opening[:-2] != NPY_MAGIC_1_0[:-2]:
        raise ValueError(f"it does not begin with .npy's magic string: {opening!r}")
    version = (opening[-2], opening[-1])
    if version not in _NPY_LENGTH_BYTES:
        raise ValueError(f"version {version}, which this client does not read")
    length = response.read(_NPY_LENGTH_BYTES[version])
    if int.from_bytes(length, "little") > NPY_MAX_HEADER:
        raise ValueError(f"a header of {int.from_bytes(length, 'little')} bytes, over NumPy's {NPY_MAX_HEADER}")
    text = response.read(int.from_bytes(length, "little"))
    plain = _plain_npy_header(text.decode("latin1"))
    if plain is not None:
        return plain
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read(io.BytesIO(length + text))
    return shape, fortran_order, dtype


def _check_product(shape: tuple[int, ...], dtype: np.dtype, expected: tuple[int, ...] | None) -> None:
    """A 200 answer's array is the product asked for: numbers, of the shape the operands make."""
    if dtype.kind not in "fiu":
        raise http.client.HTTPException(f"the answer's dtype {dtype.str!r} is not a number's")
    if shape != expected:
        made = "operands that do not multiply" if expected is None else f"the product's {expected}"
        raise http.client.HTTPException(f"the answer's shape is {shape}, not {made}")


def _read_npy(response: Answer, memory: AnswerMemory, expected: tuple[int, ...] | None) -> np.ndarray:
    """A `.npy` answer read into memory from `memory`: its header as NumPy writes it, else through NumPy's own parser
    (no pickles, bounded), then its data into the array's memory, once the header says the product asked for."""
    try:
        shape, fortran_order, dtype = _npy_header(response)
    except ValueError as exc:
        raise http.client.HTTPException(f"the answer is not a .npy file this client reads: {exc}") from exc
    _check_product(shape, dtype, expected)
    count = math.prod(shape)
    if response.length is not None and response.length != count * dtype.itemsize:
        raise http.client.HTTPException(
            f"the answer's .npy header describes {count * dtype.itemsize} bytes, {response.length} follow it"
        )
    data = memory.take(count * dtype.itemsize)
    _read_exactly(response, data.data)
    return data.view(dtype).reshape(shape, order="F" if fortran_order else "C")


def _product(memory: AnswerMemory, expected: tuple[int, ...] | None, response: Answer) -> Product:
    """The product in a 200 answer, which must have the `expected` shape; the error any other answer says."""
    if response.status != 200:
        raise _error(response.status, response.headers, response.read(ERROR_BODY_BYTES))
    headers = response.headers
    try:
        if headers.get("content-type", "").startswith(NPY_MEDIA_TYPE):
            c = _read_npy(response, memory, expected)
        else:
            dtype = np.dtype(headers["x-matmul-dtype"])
            shape = tuple(int(side) for side in headers["x-matmul-shape"].split("x"))  # a matrix's, or a stack's
            _check_product(shape, dtype, expected)
            lists = sum(math.prod(shape[:depth]) for depth in range(1, len(shape)))  # rows, and matrices of a stack
            most = JSON_BYTES_PER_ELEMENT * math.prod(shape) + JSON_BYTES_PER_LIST * lists + JSON_ANSWER_EXTRA_BYTES
            body = _whole(response, most)
            # JSON has no NaN: the server writes non-finite elements as null, which NumPy reads back as NaN.
            c = np.array(json.loads(body)["result"], dtype=np.float64).reshape(shape).astype(dtype)
        tile, gflops = headers.get("x-matmul-tile"), headers.get("x-matmul-gflops")
        return Product(
            c=c,
            kernel=headers["x-matmul-kernel"],
            tile=int(tile) if tile is not None else None,
            precision=headers["x-matmul-precision"],
            backend=headers["x-matmul-backend"],
            device=headers["x-matmul-device"],
            gflops=float(gflops) if gflops is not None else None,
            batch_size=int(headers.get("x-matmul-batch-size", 1)),
            timing=parse_server_timing(headers.get("server-timing", "")),
        )
    except (KeyError, ValueError, TypeError) as exc:  # json's JSONDecodeError is a ValueError
        raise http.client.HTTPException(f"a 200 answer that is not a product of this service: {exc!r}") from exc


def _whole(response: Answer, most: int) -> bytes:
    """An answer's whole body, refused where it is (or says it is) longer than `most` bytes."""
    if response.length is None or response.length <= most:
        body = response.read(most + 1)  # one more: a body that ends with the connection says where it ends
        if len(body) <= most and response.finished():
            return body
    raise http.client.HTTPException(f"an answer of more than {most} bytes")


def _json_object(response: Answer) -> dict[str, Any]:
    if response.status != 200:
        raise _error(response.status, response.headers, response.read(ERROR_BODY_BYTES))
    body = _whole(response, INFO_BODY_BYTES)
    try:
        said = json.loads(body)
    except ValueError as exc:
        raise http.client.HTTPException(f"a 200 answer that is not JSON: {exc}") from exc
    if not isinstance(said, dict):
        raise http.client.HTTPException(f"a 200 answer that is not a JSON object: {body[:100]!r}")
    return said


def _status(response: Answer) -> int:
    response.read(ERROR_BODY_BYTES)  # to its end, which leaves the connection for the next request
    return response.status


def _transport_error(exc: OSError | http.client.HTTPException, stage: str) -> httpx.TransportError:
    """The httpx exception a failure at `stage` (connect, write or read) is raised as."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError):
        timeouts = {"connect": httpx.ConnectTimeout, "write": httpx.WriteTimeout, "read": httpx.ReadTimeout}
        return timeouts[stage](message)
    if isinstance(exc, http.client.HTTPException):
        return httpx.RemoteProtocolError(message)
    errors = {"connect": httpx.ConnectError, "write": httpx.WriteError, "read": httpx.ReadError}
    return errors[stage](message)


class _Closed(Exception):
    """The server closed the connection before any of the answer came (`stage`: while writing or reading)."""

    def __init__(self, cause: OSError | http.client.HTTPException, stage: str) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.stage = stage


_KERNEL_TIMEOUTS = sys.platform != "win32"
"""Whether a plain TCP connection's timeouts are the kernel's (SO_RCVTIMEO and SO_SNDTIMEO, a struct timeval) on a
blocking socket, rather than Python's. A socket with Python's timeout is non-blocking and polls before each call: a
512^2 product's 2 MiB went out in partial writes, each after a poll, and its answer came in reads each after one,
every call letting go of the GIL and taking it again. On a 16-core H200 host, 8 processes of two connections each
spent 281-302 us of user CPU a product that way against a blocking raw socket's 76-85 (docs/throughput.md)."""


def _use_kernel_timeouts(sock: socket.socket, timeout: float) -> None:
    """Make `sock` blocking, each receive and send given up by the kernel after `timeout` seconds."""
    sock.settimeout(None)
    whole = int(timeout)
    micro = max(int((timeout - whole) * 1e6), 0 if whole else 1)  # a zero interval would be no timeout at all
    interval = struct.pack("@ll", whole, micro)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, interval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, interval)


class _SocketReader(io.RawIOBase):
    """A socket's receiving side. On a blocking socket, its timeout the kernel's (`_use_kernel_timeouts`), a receive
    given up is a TimeoutError, as a Python timeout's is (`socket.makefile` would return None for it, which a
    buffered reader takes for a short read). While `polling`, a receive takes only what has come already, and
    returns None where nothing has.

    Each receive returns what has come: MSG_WAITALL would save a 512^2 answer from the stand-in three of its 4.7
    receives, but the kernel's timeout bounds a whole call, so a body that stopped half way would be given up
    only after up to twice the client's timeout."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.polling = False
        self._dontwait = hasattr(socket, "MSG_DONTWAIT") and not isinstance(sock, ssl.SSLSocket)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if self.polling:
            return self._poll_into(buffer)
        try:
            return self.sock.recv_into(buffer)
        except BlockingIOError as exc:
            raise TimeoutError("timed out receiving") from exc

    def _poll_into(self, buffer: Any) -> int | None:
        if self._dontwait:  # one system call
            try:
                return self.sock.recv_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0.0)
        try:
            return self.sock.recv_into(buffer)
        except (BlockingIOError, ssl.SSLWantReadError):
            return None
        finally:
            self.sock.settimeout(timeout)


class _Connection:
    """One keep-alive connection: requests written with scatter-gather `sendmsg` (a request's head and every
    buffer of its body in one system call, none of them joined), answers read through one buffered reader."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._raw = _SocketReader(sock)
        self._reader = io.BufferedReader(self._raw)
        self.served = 0
        """Answers read to their end on this connection, which may serve the next request while this is not 0."""

    def _write(self, head: bytes, body: Sequence[Buffer]) -> None:
        pending = [view for view in (memoryview(head), *(memoryview(part).cast("B") for part in body)) if view.nbytes]
        if isinstance(self.sock, ssl.SSLSocket):  # TLS records are written one buffer at a time
            for view in pending:
                self.sock.sendall(view)
            return
        while pending:
            try:
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
            except BlockingIOError as exc:  # the kernel's send timeout passed with nothing sent
                raise TimeoutError("timed out sending") from exc
            while pending and sent >= pending[0].nbytes:
                sent -= pending.pop(0).nbytes
            if sent:
                pending[0] = pending[0][sent:]

    def exchange(self, method: str, head: bytes, body: Sequence[Buffer]) -> Answer:
        """Send a request and read its answer's head. A server may answer before it has read the whole body (a
        proxy's 413) and close: that answer is returned, and the connection serves no other."""
        try:
            self._write(head, body)
        except OSError as exc:
            try:
                early = Answer(self._reader, method)
            except (OSError, http.client.HTTPException):
                early = None
            if early is None:
                if isinstance(exc, _STALE):
                    raise _Closed(exc, "write") from exc
                raise _transport_error(exc, "write") from exc
            early.will_close = True
            return early
        try:
            return Answer(self._reader, method)
        except _STALE as exc:
            raise _Closed(exc, "read") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _transport_error(exc, "read") from exc

    def holds_more(self) -> bool:
        """Whether bytes beyond the answers read have come (a server that sent more than it framed): the next answer
        read here would be those bytes, so the connection serves no other request."""
        self._raw.polling = True
        try:
            return bool(self._reader.peek(1))
        except OSError:
            return True
        finally:
            self._raw.polling = False

    def reconnect(self, sock: socket.socket) -> None:
        """Go on over a new socket (the server closed the old one)."""
        self.close()
        self.sock, self._raw, self.served = sock, _SocketReader(sock), 0
        self._reader = io.BufferedReader(self._raw)

    def close(self) -> None:
        self._reader.close()  # it holds the socket open until closed
        self.sock.close()


class _Connections:
    """Keep-alive connections to one server, at most `limit` of them, each used by one exchange at a time."""

    def __init__(self, url: str, timeout: float, limit: int, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self.prefix = quote(parts.path.rstrip("/"), safe="/%")
        self.timeout = timeout
        for name, value in headers.items():
            if name.lower() in _FRAMING or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
                raise ValueError(f"the header {name!r}: {value!r} cannot be sent")
        lines = {"Host": parts.netloc.rpartition("@")[2], **headers}
        self._head_lines = "".join(f"{name}: {value}\r\n" for name, value in lines.items())
        self._idle: list[_Connection] = []
        self._slots = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._closed = False

    def _socket(self) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:  # TLS records are read and written by Python's timeouts
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
            elif _KERNEL_TIMEOUTS:
                _use_kernel_timeouts(sock, self.timeout)
        except OSError as exc:
            raise _transport_error(exc, "connect") from exc
        return sock

    @contextlib.contextmanager
    def _connection(self) -> Iterator[_Connection]:
        """A connection, kept for the next exchange when this one ended with an answer read to its end (a product
        or the server's error) that did not close it, and closed otherwise."""
        with self._slots:
            with self._lock:
                idle = self._idle.pop() if self._idle else None
            connection = idle or _Connection(self._socket())
            try:
                yield connection
            except MatmulServiceError:
                self._keep(connection)
                raise
            except BaseException:
                connection.close()
                raise
            self._keep(connection)

    def _keep(self, connection: _Connection) -> None:
        clean = connection.served and not connection.holds_more()
        with self._lock:
            if clean and not self._closed:
                self._idle.append(connection)
                return
        connection.close()

    def exchange(
        self,
        method: str,
        path: str,
        read: Callable[[Answer], T],
        body: Sequence[Buffer] = (),
        headers: Mapping[str, str] | None = None,
    ) -> T:
        """Send a request (its body's buffers as they are) and `read` its answer. A kept-alive connection that
        the server closed while it was idle is replaced and the request sent once more, before any of the answer
        came (products are pure: sending one again is safe)."""
        size = sum(memoryview(part).nbytes for part in body)
        text = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head_lines}Content-Length: {size}\r\n"
        lines = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (text + lines + "\r\n").encode("latin-1")
        with self._connection() as connection:
            try:
                response = connection.exchange(method, head, body)
            except _Closed as closed:
                if not connection.served:
                    raise _transport_error(closed.cause, closed.stage) from closed.cause
                connection.reconnect(self._socket())
                try:
                    response = connection.exchange(method, head, body)
                except _Closed as again:
                    raise _transport_error(again.cause, again.stage) from again.cause
            try:
                answer = read(response)
            except MatmulServiceError:
                self._count(connection, response)
                raise
            except (OSError, http.client.HTTPException) as exc:
                connection.served = 0
                raise _transport_error(exc, "read") from exc
            self._count(connection, response)
            return answer

    @staticmethod
    def _count(connection: _Connection, response: Answer) -> None:
        """An answer read to its end leaves the connection ready for the next request, unless the server closes it."""
        connection.served = 0 if response.will_close or not response.finished() else connection.served + 1

    def close(self) -> None:
        """Close the idle connections now, and those in use once their exchange ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _typed(a: np.ndarray, b: np.ndarray, format: RequestFormat, options: Options) -> Options:
    """`options`, with dtype int32 added for two int8 operands sent as JSON numbers (which carry no dtype) when
    neither a dtype nor a precision is named: the exact product the server gives them as `.npy` or `.npz`."""
    named = options.get("dtype") is not None or options.get("precision") is not None
    if format == "json" and not named and a.dtype == b.dtype == np.dtype(np.int8):
        return {**options, "dtype": "int32"}
    return options


def _product_path(options: Options) -> str:
    params = {key: str(value) for key, value in options.items() if value is not None}
    return "/matmul" + (f"?{urlencode(params)}" if params else "")


STACK_OPERAND_BYTES = 4 << 20
"""The most operand bytes `multiply_stacked` puts in one stack: a request's own cost (its round trip, and the
server's work for a request, a fraction of a millisecond) is then small beside carrying its bytes."""


def stacked_pairs(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], stack_bytes: int, connections: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pairs of matrices of one shape and dtype as stacks, in their order: as many pairs a stack as `stack_bytes` of
    operands hold, but no fewer stacks than `connections` while there are pairs enough. ValueError for pairs of
    different shapes or dtypes, or for operands that are not matrices."""
    kinds = {(a.shape, a.dtype.str, b.shape, b.dtype.str) for a, b in pairs}
    if len(kinds) > 1 or any(a.ndim != 2 or b.ndim != 2 for a, b in pairs[:1]):
        raise ValueError(f"stacked pairs must be matrices of one shape and dtype; got {len(kinds)} kinds: {kinds}")
    if not pairs:
        return []
    first_a, first_b = pairs[0]
    by_bytes = stack_bytes // max(first_a.nbytes + first_b.nbytes, 1)
    size = max(1, min(by_bytes, math.ceil(len(pairs) / connections)))
    return [
        (np.stack([a for a, _ in pairs[i : i + size]]), np.stack([b for _, b in pairs[i : i + size]]))
        for i in range(0, len(pairs), size)
    ]


class MatmulClient:
    """A blocking client, safe to share between threads: each call takes a pooled keep-alive connection.

    `connections` bounds the connections (and products in flight); `api_key` is sent as a bearer token;
    `headers` go with every request."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        format: RequestFormat = "npy",
        timeout: float = DEFAULT_TIMEOUT_S,
        connections: int = DEFAULT_CONNECTIONS,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be at least 1, not {connections}")
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be a number of seconds over 0 and at most {MAX_TIMEOUT_S:g}, not {timeout}")
        self.format = format
        self.connections = connections
        sent = dict(headers or {})
        if api_key is not None:
            if not (api_key.isascii() and api_key.isprintable()):  # error messages end up in logs: the key is not shown
                raise ValueError("the API key (not shown) has a character that is not printable ASCII")
            sent["Authorization"] = f"Bearer {api_key}"
        self._pool = _Connections(url, timeout, connections, sent)
        self._answers = AnswerMemory(kept=connections)
        self._threads: ThreadPoolExecutor | None = None
        self._threads_lock = threading.Lock()

    def matmul(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> np.ndarray:
        """C = A @ B, computed by the server."""
        return self.multiply(a, b, format=format, **options).c

    def multiply(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> Product:
        """C = A @ B with the kernel, tile, device and timing the server reported."""
        chosen = format or self.format
        return self.send(encode_payload(a, b, chosen), **_typed(a, b, chosen, options))

    def multiply_many(
        self,
        pairs: Iterable[tuple[np.ndarray, np.ndarray]],
        *,
        format: RequestFormat | None = None,
        **options: Unpack[Options],
    ) -> list[Product]:
        """The products of many pairs, in their order, computed `connections` at a time; the first error met in
        that order is raised once every product has ended."""
        chosen = format or self.format
        running = [self.threads().submit(self.multiply, a, b, format=chosen, **options) for a, b in pairs]
        concurrent.futures.wait(running)
        return [product.result() for product in running]

    def multiply_stacked(
        self,
        pairs: Sequence[tuple[np.ndarray, np.ndarray]],
        *,
        stack_bytes: int = STACK_OPERAND_BYTES,
        format: RequestFormat | None = None,
        **options: Unpack[Options],
    ) -> list[np.ndarray]:
        """The products of many pairs of matrices of one shape and dtype, in their order, sent as stacks of them (one
        request a stack, `stacked_pairs`), `connections` at a time: what each pair's own exchange would cost is paid
        once a stack. The first error met in order is raised once every stack has ended."""
        stacks = stacked_pairs(pairs, stack_bytes, self.connections)
        return [c for product in self.multiply_many(stacks, format=format, **options) for c in product.c]

    def send(self, payload: Payload, **options: Unpack[Options]) -> Product:
        """Send a body encoded beforehand with `encode_payload` (to send the same operands many times)."""
        headers = {"Content-Type": payload.content_type, "Accept": _ACCEPT[payload.answer]}
        read = partial(_product, self._answers, payload.product_shape)
        return self._pool.exchange("POST", _product_path(options), read, payload.parts, headers)

    def info(self) -> dict[str, Any]:
        """GET /v1/info: backend, state, device, queue and kernels."""
        return self._pool.exchange("GET", "/v1/info", _json_object)

    def ready(self) -> bool:
        """Whether GET /readyz answers 200 (every kernel compiled and self-tested)."""
        return self._pool.exchange("GET", "/readyz", _status) == 200

    def threads(self) -> ThreadPoolExecutor:
        """The client's threads, one per connection, started at first use."""
        with self._threads_lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.connections, thread_name_prefix="matmul-client")
            return self._threads

    def close(self) -> None:
        """Close the idle connections and end the threads (after the products they run)."""
        with self._threads_lock:
            threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ClientSettings(TypedDict, total=False):
    """What `AsyncMatmulClient` passes on to the `MatmulClient` it runs: its keyword arguments."""

    format: RequestFormat
    timeout: float
    connections: int
    api_key: str | None
    headers: Mapping[str, str] | None


class AsyncMatmulClient:
    """The same client for asyncio: each call runs on one of the client's threads (one per connection), so up
    to `connections` products are in flight at once and the event loop never blocks on a socket. A cancelled
    call's product still completes on its thread, which then frees its connection. It takes `MatmulClient`'s
    arguments."""

    def __init__(self, url: str = DEFAULT_URL, **settings: Unpack[ClientSettings]) -> None:
        self._client = MatmulClient(url, **settings)

    @property
    def format(self) -> RequestFormat:
        return self._client.format

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._client.threads(), call)

    async def matmul(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> np.ndarray:
        """C = A @ B, computed by the server."""
        return (await self.multiply(a, b, format=format, **options)).c

    async def multiply(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> Product:
        """C = A @ B with the kernel, tile, device and timing the server reported."""
        return await self._run(partial(self._client.multiply, a, b, format=format, **options))

    async def multiply_many(
        self,
        pairs: Iterable[tuple[np.ndarray, np.ndarray]],
        *,
        format: RequestFormat | None = None,
        **options: Unpack[Options],
    ) -> list[Product]:
        """The products of many pairs, in their order, `connections` at a time; the first error in that order is
        raised once every product has ended."""
        calls = [self.multiply(a, b, format=format, **options) for a, b in pairs]
        settled = await asyncio.gather(*calls, return_exceptions=True)
        for outcome in settled:
            if isinstance(outcome, BaseException):
                raise outcome
        return [outcome for outcome in settled if isinstance(outcome, Product)]

    async def multiply_stacked(
        self,
        pairs: Sequence[tuple[np.ndarray, np.ndarray]],
        *,
        stack_bytes: int = STACK_OPERAND_BYTES,
        format: RequestFormat | None = None,
        **options: Unpack[Options],
    ) -> list[np.ndarray]:
        """The products of many pairs of matrices of one shape and dtype, in their order, sent as stacks of them
        (`MatmulClient.multiply_stacked`)."""
        stacks = stacked_pairs(pairs, stack_bytes, self._client.connections)
        products = await self.multiply_many(stacks, format=format, **options)
        return [c for product in products for c in product.c]

    async def send(self, payload: Payload, **options: Unpack[Options]) -> Product:
        """Send a body encoded beforehand with `encode_payload` (to send the same operands many times)."""
        return await self._run(partial(self._client.send, payload, **options))

    async def info(self) -> dict[str, Any]:
        """GET /v1/info: backend, state, device, queue and kernels."""
        return await self._run(self._client.info)

    async def ready(self) -> bool:
        """Whether GET /readyz answers 200 (every kernel compiled and self-tested)."""
        return await self._run(self._client.ready)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
