"""Shared memory for operands and products: one arena per HTTP worker, cut into one slab per request.

An arena is an anonymous shared-memory file (`memfd_create`) of `MATMUL_SLAB_BYTES`, mapped by the HTTP worker that
made it and, through its file descriptor passed over the control socket, by every engine process, which pins it
once (`cudaHostRegister`) and copies straight from and into it. It has no name, so whichever way a process ends
nothing is left in `/dev/shm`: the memory is returned when the last process mapping it closes it. (A named
POSIX segment would outlive a worker killed before it unlinked the name, and a container's `/dev/shm` is 64 MB
by default; a memfd is counted against neither.)

A request reserves one slab for A, B and C back to back, each aligned to `ALIGNMENT`. Slabs are handed out
first-fit, in the order requests asked: one that does not fit now waits for others to be released, until its
deadline (then 503 with Retry-After); one larger than the whole arena is refused at once (413). Everything here
runs on the HTTP worker's event loop.

A large binary body may be read straight into the arena (`Arena.lend`), so that operands sent in the working dtype
are where the engine reads them without a copy; the request then reserves a second slab for C and whatever must
still be converted. Holding one slab while waiting for another could wait forever, each request holding what the
one ahead of it needs; so body memory is never waited for (no room now, or a request waiting: the body is read
elsewhere and copied, as before), bodies hold at most `LENT_SHARE` of the arena together, and while any body is lent
a waiting request that fits beside the lent bodies is served first-fit, before those that do not (which hold no body
and wait until the bodies are back); a request holding a body that could not fit beside them gets 503 at once (413
when it could not fit beside its own). No body is lent while anyone waits, so the lent bytes only shrink during a
wait: once the products granted before have been answered, the smallest first-fit request fits.

When a slab's bytes go back to the arena: once its owner has released it *and* no array or memoryview of them is
left. The owner (the request) releases it when it no longer needs the slab, but readers it handed the memory to
may outlive that: the server's transport keeps views of an `.npy` answer it could not send at once after `send`
returns, and a staging thread may still be writing when its request is cancelled. Every view of a slab is made
from the slab's own array of bytes (`Slab.array`), and every view of a view, NumPy's or a memoryview, keeps that
array alive, so it lives exactly as long as the last of them, whoever holds it; a finalizer on it hands the bytes
back on the event loop. (A memoryview would not do as that root: memoryviews made from one share its buffer, not
itself.) Giving the bytes back when a call returned let the next request's operands and product overwrite an
answer still being sent.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import math
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.errors import Overloaded, PayloadTooLarge
from app.shapes import OPERAND_DIMENSIONS

ALIGNMENT = 256
"""Bytes; every operand starts on a multiple of this (CUDA's copies and NumPy's SIMD loops prefer aligned data)."""


LENT_SHARE = 0.5
"""The most of an arena that bodies read into it hold together (`Arena.lend`)."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Placement:
    """Where one matrix, or a stack of them, lies in an arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def view(memory: np.ndarray, placement: Placement) -> np.ndarray:
    """The matrix `placement` describes, as a view of `memory` (bytes of an arena, mapped in this process), which
    it keeps alive; ValueError when it does not lie wholly inside."""
    offset, nbytes = placement.offset, placement.nbytes
    if len(placement.shape) not in OPERAND_DIMENSIONS:
        raise ValueError(f"a {placement.shape} shape is neither a matrix's nor a stack's")
    if offset < 0 or min(placement.shape) < 0 or offset + nbytes > memory.nbytes:
        raise ValueError(f"a {placement.shape} {placement.dtype} matrix at {offset} is outside the arena")
    matrix: np.ndarray = memory[offset : offset + nbytes].view(placement.dtype).reshape(placement.shape)
    return matrix


class Arena:
    """One shared-memory file, mapped here, with the slabs handed out of it."""

    def __init__(self, capacity: int, name: str = "matmul-slabs") -> None:
        self.capacity = aligned(capacity)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.capacity)
        self._map = mmap.mmap(self.fd, self.capacity)
        self._bytes = memoryview(self._map)
        self.address: int = np.frombuffer(self._bytes, np.uint8).ctypes.data
        """Where the arena is mapped in this process: an array's offset in it is its address less this."""
        self._free: list[tuple[int, int]] = [(0, self.capacity)]
        """Free extents (offset, size), sorted by offset, never adjacent (merged on release)."""
        self._waiters: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()
        self._first_fit: list[tuple[int, asyncio.Future[int]]] = []
        """Requests that began to wait while a body was lent: served before `_waiters`, whichever fits first."""
        self._lent: dict[int, int] = {}
        """Slabs lent to bodies (`lend`) by offset, until their bytes are back: their sizes."""
        self.used_bytes = 0
        self.on_use: Callable[[int], object] | None = None
        """Told `used_bytes` whenever it changes (the worker's gauge of it, which every worker's /metrics sums)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop whose requests reserve slabs: the one a slab's bytes are handed back on."""

    @property
    def waiting(self) -> int:
        return len(self._waiters) + len(self._first_fit)

    @property
    def lent_bytes(self) -> int:
        """Bytes lent to bodies that are not back yet."""
        return sum(self._lent.values())

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where a C-contiguous `array` begins in the arena, if all of it lies there (a view of a slab's bytes)."""
        if not array.flags.c_contiguous:
            raise ValueError("offset_of takes a C-contiguous array")
        return array.__array_interface__["data"][0] - self.address if self.bytes_in(array) else None

    def bytes_in(self, array: np.ndarray) -> int:
        """`array.nbytes` if its memory, whatever its strides, lies in the arena (a view of a lent body), else 0."""
        low = high = array.__array_interface__["data"][0]
        for size, stride in zip(array.shape, array.strides, strict=True):
            if size == 0:
                return 0
            low, high = (low + (size - 1) * stride, high) if stride < 0 else (low, high + (size - 1) * stride)
        inside = self.address <= low and high + array.itemsize <= self.address + self.capacity
        return array.nbytes if inside else 0

    def lend(self, nbytes: int) -> Slab | None:
        """A slab of `nbytes` for a body to be read into, now or never: None when it does not fit at once, when
        requests wait, or when bodies would hold more than LENT_SHARE of the arena."""
        self._loop = asyncio.get_running_loop()
        size = aligned(max(nbytes, 1))
        if self.waiting or self.lent_bytes + size > self.capacity * LENT_SHARE:
            return None
        offset = self._take(size)
        if offset is None:
            return None
        self._lent[offset] = size
        return Slab(self, offset, size)

    async def reserve(self, nbytes: int, timeout_s: float, holding: int = 0) -> Slab:
        """A slab of `nbytes`, once one is free: PayloadTooLarge at once when it could not fit beside the `holding`
        bytes of lent body the request holds; Overloaded when none came free within `timeout_s`, and at once for a
        request holding a body when it could not fit beside the bodies lent now (they go back as their requests
        end: retry). While bodies are lent, a request that fits beside them is served first-fit; one that does not
        (it holds none) waits behind every other until they are back."""
        self._loop = asyncio.get_running_loop()
        size = aligned(max(nbytes, 1))
        if size + holding > self.capacity:
            held = f" beside the {holding} bytes of its body" if holding else ""
            raise PayloadTooLarge(
                f"the operands and product need {nbytes} bytes of shared memory{held}, more than the "
                f"{self.capacity} each HTTP worker has (MATMUL_SLAB_BYTES)"
            )
        beside_bodies = size <= self.capacity - self.lent_bytes
        if holding and not beside_bodies:
            raise Overloaded(
                f"this request's {nbytes} bytes of shared memory do not fit beside the {self.lent_bytes} bytes that "
                "request bodies hold now; retry later"
            )
        first_fit = self.lent_bytes > 0 and beside_bodies
        ahead = self._first_fit if first_fit else self.waiting
        if not ahead and (offset := self._take(size)) is not None:
            return Slab(self, offset, size)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if first_fit:
            self._first_fit.append((size, future))
        else:
            self._waiters.append((size, future))
        try:
            async with asyncio.timeout(timeout_s):
                offset = await future
        except BaseException as exc:
            self._waiters = collections.deque(w for w in self._waiters if w[1] is not future)
            self._first_fit = [w for w in self._first_fit if w[1] is not future]
            if future.done() and not future.cancelled():  # handed a slab just as it gave up
                self._give_back(future.result(), size)
            else:
                self._serve_waiters()  # those it stood in front of may fit now
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"no shared memory came free for this request's {nbytes} bytes within {timeout_s:g} s "
                    f"({self.used_bytes} of {self.capacity} in use); retry later"
                ) from None
            raise
        return Slab(self, offset, size)

    def _take(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._use(size)
                return offset
        return None

    def _unviewed(self, offset: int, size: int) -> None:
        """The last view of a released slab is gone (in whichever thread let go of it): its bytes come back on the
        loop, never in the middle of whatever the loop was doing when the view was dropped."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed, and the arena with it
                self._loop.call_soon_threadsafe(self._give_back, offset, size)

    def _use(self, change: int) -> None:
        self.used_bytes += change
        if self.on_use is not None:
            self.on_use(self.used_bytes)

    def _give_back(self, offset: int, size: int) -> None:
        given = size  # the free extent it joins may grow it
        self._lent.pop(offset, None)
        i = bisect.bisect(self._free, (offset, size))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (offset, size)
        else:
            self._free.insert(i, (offset, size))
        self._use(-given)
        self._serve_waiters()

    def _serve_waiters(self) -> None:
        """Hand slabs to the requests that began to wait while a body was lent, any that fits; once none of them
        waits, to the others in the order they asked, as long as the first of them fits."""
        for size, future in list(self._first_fit):
            if future.done():  # its request gave up
                self._first_fit.remove((size, future))
            elif (offset := self._take(size)) is not None:
                self._first_fit.remove((size, future))
                future.set_result(offset)
        if self._first_fit:
            return
        while self._waiters:
            size, future = self._waiters[0]
            if future.done():  # its request gave up
                self._waiters.popleft()
                continue
            offset = self._take(size)
            if offset is None:
                return
            self._waiters.popleft()
            future.set_result(offset)

    def close(self) -> None:
        """Close the file and unmap it (now, or with the last array that still views it); engine processes keep
        their own mappings until they close theirs."""
        with contextlib.suppress(BufferError):  # a slab's array still views it: the mapping goes with the last
            self._bytes.release()
            self._map.close()
        os.close(self.fd)


class Slab:
    """A reserved run of an arena: its bytes go back once it is released and none of its views is left."""

    def __init__(self, arena: Arena, offset: int, size: int) -> None:
        self.arena = arena
        self.offset = offset
        self.size = size
        self._end = offset
        self._memory: np.ndarray | None = np.frombuffer(arena._bytes, np.uint8, count=size, offset=offset)
        """Every view of the slab derives from this array, so it lives as long as the last of them."""
        returned = weakref.finalize(self._memory, arena._unviewed, offset, size)
        returned.atexit = False

    def place(self, shape: tuple[int, ...], dtype: np.dtype) -> Placement:
        """The next matrix (or stack) of the slab: where it lies (its view is `array(placement)`)."""
        placement = Placement(self._end, shape, dtype.name)
        if self._end + placement.nbytes > self.offset + self.size:
            raise ValueError(f"a {shape} {dtype} matrix does not fit in the rest of a {self.size}-byte slab")
        self._end += aligned(placement.nbytes)
        return placement

    def array(self, placement: Placement) -> np.ndarray:
        """The matrix `placement` describes, as a view of this slab (which keeps the slab's bytes from going back
        while it lives); ValueError when it does not lie wholly inside."""
        if self._memory is None:
            raise RuntimeError("the slab was released")
        return view(self._memory, Placement(placement.offset - self.offset, placement.shape, placement.dtype))

    def memory(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes `start` to `start + nbytes` of the slab, as a view of it (uint8)."""
        if self._memory is None:
            raise RuntimeError("the slab was released")
        if not 0 <= start <= start + nbytes <= self.size:
            raise ValueError(f"bytes {start} to {start + nbytes} are outside a {self.size}-byte slab")
        return self._memory[start : start + nbytes]

    def release(self) -> None:
        """The owner is done with the slab (once; again is nothing): its bytes go back to the arena as soon as no
        view of them is left, which is at once unless a reader still holds one."""
        self._memory = None
