"""The control channel between HTTP workers and engine processes: small JSON messages over a Unix socket.

Why a Unix socket with asyncio streams and not a message library (pyzmq): the descriptors are a few hundred bytes
and the operands travel in shared memory, so the channel's speed hardly matters, but its failures do. When an
engine process dies its sockets close and every HTTP worker reads end-of-file at once, so their requests in
flight get 503 at once; when an HTTP worker dies the engine reads end-of-file and drops that worker's queued
work. A ZeroMQ socket reconnects silently and reports neither, so both would need heartbeats and timeouts. A Unix
socket also carries the arena's file descriptor (SCM_RIGHTS) in the handshake, and needs no new dependency.

Each message is a 4-byte big-endian length and an orjson object with an "op":

    HTTP worker -> engine                        engine -> HTTP worker
    hello   {pid, arena_bytes} + the arena's fd  welcome {engine_pid, backend, device_index, device_name,
                                                          queue_size, kernels, peaks}
                                                 status  {state, failure, queue_depth, load, describe,
                                                          memory_held, compiled_instances, auto, http_workers,
                                                          shared_memory_bytes, regions}
    matmul  {id, a, b, c, dtype, kernel, tile,   done    {id, kernel, tile, label, queue_ms, h2d_ms,
             precision, timeout_s}                        kernel_ms, d2h_ms, batch_size, load}
             (a, b, c: [offset, rows, cols]      failed  {id, code, message, location, load}
             in the arena)
    cancel  {id}
    register_region {id, name, key, offset,      done    {id, load}, or failed
             byte_size}
    register_cuda_region {id, name, raw_handle,  done    {id, load}, or failed
             device_id, byte_size}
    unregister_region {id, kind, name}           done    {id, load}, or failed
             (kind: system or cuda; name null: all of that kind)
    region_status {id, kind, name}               done    {id, regions: [...], load}, or failed

A, B or C of a matmul may instead lie in a client's registered region: {region, offset, shape, dtype}.

Every matmul gets exactly one done or failed, also when cancelled; until then the engine may still write its C.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import orjson

LENGTH = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20
"""Far more than any message needs (the largest, the status of every registered region, takes under 600 bytes a
region, and an engine holds at most 4,096 regions: app.dataplane.regions); a longer length means the stream is
corrupt."""

Message = dict[str, Any]


class ChannelClosed(ConnectionError):
    """The other end went away (end of file, or a corrupt stream)."""


class ChannelCorrupt(ChannelClosed):
    """What came is not a message: the other end may still be running (and using the memory it was lent)."""


def frame(message: Message) -> bytes:
    body = orjson.dumps(message)
    return LENGTH.pack(len(body)) + body


def send(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue one message (the socket takes it as soon as it can; no message waits for the reader)."""
    if writer.is_closing():
        raise ChannelClosed("the channel is closed")
    writer.write(frame(message))


async def receive(reader: asyncio.StreamReader) -> Message:
    """The next message; ChannelClosed at end of file."""
    try:
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise ChannelCorrupt(f"a message of {length} bytes: the stream is corrupt")
        message: Message = orjson.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed(str(exc) or "end of file") from exc
    except orjson.JSONDecodeError as exc:
        raise ChannelCorrupt(f"a message that is not JSON ({exc}): the stream is corrupt") from exc
    return message


def send_hello(sock: socket.socket, message: Message, fd: int) -> None:
    """The handshake's first message, with a file descriptor, on a blocking socket."""
    socket.send_fds(sock, [frame(message)], [fd])


def receive_hello(sock: socket.socket) -> tuple[Message, int]:
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
    message: Message = orjson.loads(data[LENGTH.size : LENGTH.size + length])
    return message, fds[0]
