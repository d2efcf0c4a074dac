"""A Python client of matmul-service, sync and async, on httpx.

    with MatmulClient("http://localhost:8000") as client:
        c = client.matmul(a, b, kernel="tiled")          # NumPy in, NumPy out (.npy over the wire)
        product = client.multiply(a, b, format="json")   # the array and what the server said about it
        product.timing["kernel"], product.kernel, product.gflops

Requests go as multipart `.npy` parts by default (`format="json"` or `"npz"` to choose another body);
answers come back as `.npy`, or JSON for JSON requests. Whatever the format, the metadata is read from the
`Server-Timing` and `X-Matmul-*` headers, which every product answer carries. Error answers are raised as
the server's `{"code", "message", "location"}`, one exception class per status family::

    MatmulServiceError        any answer that is not a product
    ├── RequestRejected       4xx: the request was wrong (shape_mismatch, unknown_kernel, payload_too_large, ...)
    └── ServerError           5xx: the server failed (device_failure, internal_error, ...)
        └── Unavailable       503: overloaded or not ready; `retry_after_s` says when to try again

Transport failures (connection refused, timeouts) are httpx's own `httpx.TransportError`s, raised as they are.
"""

from __future__ import annotations

import io
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypedDict, Unpack

import httpx
import numpy as np

from app.codecs import JSON_MEDIA_TYPE, NPY_MEDIA_TYPE, NPZ_MEDIA_TYPE
from app.codecs.json import encode_json_matrix

RequestFormat = Literal["npy", "json", "npz"]
"""How the operands travel: `npy` (multipart, one `.npy` part each), `json`, or one `.npz` body."""
AnswerFormat = Literal["npy", "json"]
FORMATS: tuple[RequestFormat, ...] = ("npy", "json", "npz")
DEFAULT_URL = "http://localhost:8000"
DEFAULT_TIMEOUT_S = 60.0
_ACCEPT = {"npy": NPY_MEDIA_TYPE, "json": JSON_MEDIA_TYPE}


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


def parse_server_timing(header: str) -> dict[str, float]:
    """A W3C `Server-Timing` header -> milliseconds by metric name (`queue;dur=0.05` -> {"queue": 0.05})."""
    durations: dict[str, float] = {}
    for metric in header.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip().lower() == "dur":
                durations[name] = float(value.strip().strip('"'))
    return durations


class Options(TypedDict, total=False):
    """What a product request may choose; the server picks what is not given (GET /v1/kernels lists them)."""

    kernel: str
    tile: int
    dtype: str
    precision: str


@dataclass(frozen=True)
class Payload:
    """A request body, encoded once: the bytes and their Content-Type, and the answer asked for."""

    content: bytes
    content_type: str
    answer: AnswerFormat


def _multipart(parts: Mapping[str, bytes]) -> tuple[bytes, str]:
    boundary = secrets.token_hex(16)
    chunks = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.npy"\r\n'
        f"Content-Type: {NPY_MEDIA_TYPE}\r\n\r\n".encode()
        + data
        + b"\r\n"
        for name, data in parts.items()
    ]
    return b"".join([*chunks, f"--{boundary}--\r\n".encode()]), f"multipart/form-data; boundary={boundary}"


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _npz(a: np.ndarray, b: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, a=a, b=b)
    return buffer.getvalue()


def encode_payload(
    a: np.ndarray, b: np.ndarray, format: RequestFormat = "npy", answer: AnswerFormat | None = None
) -> Payload:
    """The body that sends `a` and `b` in `format`; the answer defaults to JSON for JSON, else `.npy`."""
    answer = answer or ("json" if format == "json" else "npy")
    if format == "npy":
        content, content_type = _multipart({"a": _npy(a), "b": _npy(b)})
        return Payload(content, content_type, answer)
    if format == "npz":
        return Payload(_npz(a, b), NPZ_MEDIA_TYPE, answer)
    if format == "json":
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)  # what orjson can serialise
        content = b"".join((b'{"a":', encode_json_matrix(a), b',"b":', encode_json_matrix(b), b"}"))
        return Payload(content, JSON_MEDIA_TYPE, answer)
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
    timing: dict[str, float] = field(default_factory=dict)
    """Milliseconds by phase, as the server measured them: read, decode, queue, h2d, kernel, d2h, encode, total."""


def _error(response: httpx.Response) -> MatmulServiceError:
    status = response.status_code
    try:
        body = response.json()
        code, message, location = str(body["code"]), str(body["message"]), body.get("location")
    except (ValueError, KeyError, TypeError):
        code, message, location = "http_error", response.text[:500] or response.reason_phrase, None
    if status == 503:
        retry_after = response.headers.get("retry-after")
        seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
        return Unavailable(status, code, message, location, retry_after_s=seconds)
    family = RequestRejected if 400 <= status < 500 else ServerError
    return family(status, code, message, location)


def _product(response: httpx.Response) -> Product:
    if response.status_code != 200:
        raise _error(response)
    headers = response.headers
    dtype = np.dtype(headers["x-matmul-dtype"])
    if headers["content-type"].startswith(NPY_MEDIA_TYPE):
        c = np.load(io.BytesIO(response.content), allow_pickle=False)
    else:
        m, n = (int(side) for side in headers["x-matmul-shape"].split("x"))
        # JSON has no NaN: the server writes non-finite elements as null, which NumPy reads back as NaN.
        c = np.array(response.json()["result"], dtype=np.float64).reshape(m, n).astype(dtype)
    tile, gflops = headers.get("x-matmul-tile"), headers.get("x-matmul-gflops")
    return Product(
        c=c,
        kernel=headers["x-matmul-kernel"],
        tile=int(tile) if tile is not None else None,
        precision=headers["x-matmul-precision"],
        backend=headers["x-matmul-backend"],
        device=headers["x-matmul-device"],
        gflops=float(gflops) if gflops is not None else None,
        timing=parse_server_timing(headers.get("server-timing", "")),
    )


def _request(http: httpx.Client | httpx.AsyncClient, payload: Payload, options: Options) -> httpx.Request:
    params = {key: str(value) for key, value in options.items() if value is not None}
    headers = {"content-type": payload.content_type, "accept": _ACCEPT[payload.answer]}
    return http.build_request("POST", "/matmul", params=params, headers=headers, content=payload.content)


def _json_object(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        raise _error(response)
    body: dict[str, Any] = response.json()
    return body


class MatmulClient:
    """A blocking client. Pass `http` to bring your own httpx.Client (its base_url is the server's)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        format: RequestFormat = "npy",
        timeout: float = DEFAULT_TIMEOUT_S,
        http: httpx.Client | None = None,
    ) -> None:
        self.format = format
        self._http = http or httpx.Client(base_url=url, timeout=timeout)

    def matmul(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> np.ndarray:
        """C = A @ B, computed by the server."""
        return self.multiply(a, b, format=format, **options).c

    def multiply(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> Product:
        """C = A @ B with the kernel, tile, device and timing the server reported."""
        return self.send(encode_payload(a, b, format or self.format), **options)

    def send(self, payload: Payload, **options: Unpack[Options]) -> Product:
        """Send a body encoded beforehand with `encode_payload` (to send the same operands many times)."""
        return _product(self._http.send(_request(self._http, payload, options)))

    def info(self) -> dict[str, Any]:
        """GET /v1/info: backend, state, device, queue and kernels."""
        return _json_object(self._http.get("/v1/info"))

    def ready(self) -> bool:
        """Whether GET /readyz answers 200 (every kernel compiled and self-tested)."""
        return self._http.get("/readyz").status_code == 200

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncMatmulClient:
    """The same client for asyncio. Pass `http` to bring your own httpx.AsyncClient."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        format: RequestFormat = "npy",
        timeout: float = DEFAULT_TIMEOUT_S,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.format = format
        self._http = http or httpx.AsyncClient(base_url=url, timeout=timeout)

    async def matmul(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> np.ndarray:
        """C = A @ B, computed by the server."""
        return (await self.multiply(a, b, format=format, **options)).c

    async def multiply(
        self, a: np.ndarray, b: np.ndarray, *, format: RequestFormat | None = None, **options: Unpack[Options]
    ) -> Product:
        """C = A @ B with the kernel, tile, device and timing the server reported."""
        return await self.send(encode_payload(a, b, format or self.format), **options)

    async def send(self, payload: Payload, **options: Unpack[Options]) -> Product:
        """Send a body encoded beforehand with `encode_payload` (to send the same operands many times)."""
        return _product(await self._http.send(_request(self._http, payload, options)))

    async def info(self) -> dict[str, Any]:
        """GET /v1/info: backend, state, device, queue and kernels."""
        return _json_object(await self._http.get("/v1/info"))

    async def ready(self) -> bool:
        """Whether GET /readyz answers 200 (every kernel compiled and self-tested)."""
        return (await self._http.get("/readyz")).status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
