"""The control channel between HTTP workers and engine processes: typed messages over a Unix socket.

Why a Unix socket with asyncio streams and not a message library (pyzmq): the messages are a few hundred bytes
and the operands travel in shared memory, so the channel's speed hardly matters, but its failures do. When an
engine process dies its sockets close and every HTTP worker reads end-of-file at once, so their requests in
flight get 503 at once; when an HTTP worker dies the engine reads end-of-file and drops that worker's queued
work. A ZeroMQ socket reconnects silently and reports neither, so both would need heartbeats and timeouts. A Unix
socket also carries the arena's file descriptor (SCM_RIGHTS) in the handshake, and needs no new dependency.

Each message is a 4-byte big-endian length and a msgspec struct as JSON, tagged by its "op". The classes below are
the schema: msgspec encodes each and decodes it back into its class, checking every field's type, so a reader
never meets a missing key. The exchange:

    HTTP worker -> engine                            engine -> HTTP worker
    Hello + the arena's file descriptor              Welcome, then a Status every STATUS_EVERY_S and on change
    Matmul                                           Computed or Failed, exactly once, also when cancelled
    Cancel                                           (the Matmul's Failed, "client_gone", or its Computed)
    RegisterRegion, RegisterCudaRegion,              RegionsDone or Failed
    UnregisterRegion, RegionStatus

Until a Matmul's reply the engine may still write its C and read its operands. Both sides send PROTOCOL_VERSION in
Hello and Welcome; an engine refuses a Hello of another version (an HTTP worker of an older or newer build than the
engine it reached), and the worker refuses such a Welcome.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
from typing import Any, Literal

import msgspec

from app.engine.base import KernelInfo, ProductRequest
from numerics.roofline import DevicePeaks

PROTOCOL_VERSION = 2
"""Raised whenever a message changes in a way an older reader could not decode."""
LENGTH = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20
"""Far more than any message needs (the largest, the status of every registered region, takes under 600 bytes a
region, and an engine holds at most 4,096 regions: app.dataplane.regions); a longer length means the stream is
corrupt."""
UNNUMBERED = -1
"""The id of a request before its link numbers it (`EngineLink` gives each request its own)."""

RegionKind = Literal["system", "cuda"]


def _op(class_name: str) -> str:
    """A message's "op": its class's name in snake_case (RegisterCudaRegion is "register_cuda_region")."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()


class _Message(msgspec.Struct, frozen=True, tag_field="op", tag=_op):
    """A message of the channel; each subclass is one "op", tagged by its name."""


class _Request(_Message, kw_only=True, frozen=True):
    """What an HTTP worker asks of an engine, answered once by a reply of the same `id`."""

    id: int = UNNUMBERED


class _Reply(_Message, frozen=True):
    """The answer to the request of `id`, with the engine's load (products queued or running) after it."""

    id: int
    load: int


# ------------------------------------------------------------------------------------- where a matrix lies


class InArena(msgspec.Struct, frozen=True, tag="arena", tag_field="in"):
    """A matrix, or a stack of matrices (app/shapes.py), at `offset` of the HTTP worker's arena, C-ordered, in the
    product's dtype."""

    offset: int
    shape: tuple[int, ...]


class InRegion(msgspec.Struct, frozen=True, tag="region", tag_field="in"):
    """A matrix, or a stack of matrices, at `offset` of a client's registered region (system or CUDA shared
    memory)."""

    region: str
    offset: int
    shape: tuple[int, ...]
    dtype: str


Place = InArena | InRegion


# ------------------------------------------------------------------------------- HTTP worker -> engine


class Hello(_Message, frozen=True):
    """The handshake's first message; the socket carries the arena's file descriptor beside it."""

    pid: int
    arena_bytes: int
    version: int = PROTOCOL_VERSION


class Matmul(_Request, frozen=True):
    """C = A @ B where the places say, as `request` asks; dropped, never run, if still queued after `timeout_s`."""

    a: Place
    b: Place
    c: Place
    request: ProductRequest
    timeout_s: float


class Cancel(_Message, frozen=True):
    id: int


class RegisterRegion(_Request, frozen=True):
    """A window of a system shared-memory object (`key`) for products to name, mapped and pinned by the engine."""

    name: str
    key: str
    offset: int
    byte_size: int


class RegisterCudaRegion(_Request, frozen=True):
    """Device memory of another process, opened from its CUDA IPC handle (base64)."""

    name: str
    raw_handle: str
    device_id: int
    byte_size: int


class UnregisterRegion(_Request, frozen=True):
    """Forget the region of this kind named (every one of the kind when `name` is None)."""

    kind: RegionKind
    name: str | None


class RegionStatus(_Request, frozen=True):
    """The registered regions of this kind (the one named)."""

    kind: RegionKind
    name: str | None


Request = Matmul | RegisterRegion | RegisterCudaRegion | UnregisterRegion | RegionStatus
"""What an HTTP worker asks of an engine, each answered once."""
ToEngine = Request | Cancel


# ------------------------------------------------------------------------------- engine -> HTTP worker


class Welcome(_Message, frozen=True):
    """The engine's answer to Hello: what it is and what it computes."""

    engine_pid: int
    backend: Literal["cpu", "gpu"]
    device_index: int | None
    device_name: str
    queue_size: int
    kernels: list[KernelInfo]
    peaks: DevicePeaks
    version: int = PROTOCOL_VERSION


class AutoPick(msgspec.Struct, frozen=True):
    """What `auto` runs for one shape class, precision and dtype, from the probe's times (`AutoChoice`)."""

    shape_class: str
    precision: str
    dtype: str
    kernel: str
    probe_ms: dict[str, float]


class Status(_Message, frozen=True):
    """The engine's state and figures, sent to every HTTP worker."""

    state: Literal["starting", "ready", "failed", "stopped"]
    failure: str | None
    queue_depth: int
    load: int
    """Products queued or running."""
    describe: dict[str, Any]
    """The device as `GET /v1/info` shows it (the backend's `describe`)."""
    memory_held: int
    compiled_instances: int
    shared_memory_bytes: int
    http_workers: int
    regions: list[str]
    """The names of the clients' regions this engine holds."""
    auto: list[AutoPick]


class Computed(_Reply, frozen=True):
    """A Matmul's product is in its C: how it was made, with what the answer's roofline needs."""

    kernel: str
    """The kernel that ran (`auto` resolved)."""
    tile: int | None
    global_elements: int
    """The elements the kernel moves to and from global memory for this shape (`LaunchConfig.global_elements`)."""
    queue_ms: float
    h2d_ms: float
    kernel_ms: float
    d2h_ms: float
    batch_size: int


class RegionsDone(_Reply, frozen=True):
    """A region request succeeded; RegionStatus's answer lists the regions (the protocol's status objects)."""

    regions: list[dict[str, str | int]] = []


class Failed(_Reply, frozen=True):
    """A request failed: the error the HTTP worker raises (`app.errors.error_of`)."""

    code: str
    message: str
    location: list[str | int] | None = None


Reply = Computed | RegionsDone | Failed
FromEngine = Welcome | Status | Reply

_encoder = msgspec.json.Encoder()
_to_engine = msgspec.json.Decoder(ToEngine)
_from_engine = msgspec.json.Decoder(FromEngine)
_hello = msgspec.json.Decoder(Hello)


class ChannelClosed(ConnectionError):
    """The other end went away (end of file, or a corrupt stream)."""


class ChannelCorrupt(ChannelClosed):
    """What came is not a message: the other end may still be running (and using the memory it was lent)."""


def frame(message: _Message) -> bytes:
    body = _encoder.encode(message)
    return LENGTH.pack(len(body)) + body


def send(writer: asyncio.StreamWriter, message: _Message) -> None:
    """Queue one message (the socket takes it as soon as it can; no message waits for the reader)."""
    if writer.is_closing():
        raise ChannelClosed("the channel is closed")
    writer.write(frame(message))


async def _receive(reader: asyncio.StreamReader, decoder: msgspec.json.Decoder[Any]) -> Any:
    try:
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise ChannelCorrupt(f"a message of {length} bytes: the stream is corrupt")
        return decoder.decode(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed(str(exc) or "end of file") from exc
    except msgspec.DecodeError as exc:
        raise ChannelCorrupt(f"a message that is not one of the channel's ({exc}): the stream is corrupt") from exc


async def receive_from_engine(reader: asyncio.StreamReader) -> FromEngine:
    """The engine's next message; ChannelClosed at end of file, ChannelCorrupt if it is not one."""
    message: FromEngine = await _receive(reader, _from_engine)
    return message


async def receive_from_worker(reader: asyncio.StreamReader) -> ToEngine:
    """The HTTP worker's next message; ChannelClosed at end of file, ChannelCorrupt if it is not one."""
    message: ToEngine = await _receive(reader, _to_engine)
    return message


def send_hello(sock: socket.socket, hello: Hello, fd: int) -> None:
    """The handshake's first message, with a file descriptor, on a blocking socket."""
    socket.send_fds(sock, [frame(hello)], [fd])


def receive_hello(sock: socket.socket) -> tuple[Hello, int]:
    """The handshake's first message and the file descriptor it carries, from a blocking socket."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
    if len(fds) != 1 or len(data) < LENGTH.size:
        for fd in fds:
            socket.close(fd)
        raise ChannelClosed("the peer's hello carried no shared memory")
    (length,) = LENGTH.unpack(data[: LENGTH.size])
    while len(data) < LENGTH.size + length:
        more = sock.recv(LENGTH.size + length - len(data))
        if not more:
            socket.close(fds[0])
            raise ChannelClosed("end of file in the hello")
        data += more
    try:
        hello = _hello.decode(data[LENGTH.size : LENGTH.size + length])
    except msgspec.DecodeError as exc:
        socket.close(fds[0])
        raise ChannelCorrupt(f"a hello that is not one ({exc})") from exc
    return hello, fds[0]
