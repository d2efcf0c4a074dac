"""Shared-memory regions that co-located clients register (Triton's shared-memory extensions), held by an engine
process.

System shared memory: a client creates a POSIX shared-memory object (`shm_open`; tritonclient.utils.shared_memory
does it), writes its tensors there and registers a window of it under a name. The engine process maps that window
only, read and write, pins it once (`Backend.pin`, cudaHostRegister on a GPU), and reads operands from it and writes
products into it straight, as it does with the HTTP workers' arenas. The key must name a shared-memory object: one
name under /dev/shm, never a path.

CUDA shared memory: a client allocates device memory and registers its CUDA IPC handle; the engine process of that
device opens the handle once (`Backend.open_device_memory`), and products read their operands from it and write
into it on the device, with no copy through the host.

Region names share one namespace across both kinds. A region in use by products when it is unregistered is closed
(unpinned and unmapped, or its handle closed) once they end, and the unregistration is answered only then: a client
frees or rewrites its memory once it has been told the region is unregistered, and the server must not read or
write that memory after.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import os
import re
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.dataplane.slab import Placement, view
from app.engine.base import Backend
from app.errors import SharedMemoryError

SHARED_MEMORY_FOLDER = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects: shm_open("/name") opens /dev/shm/name."""
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")
MAX_REGIONS = 4096
"""Regions of both kinds one engine process holds at most: every HTTP worker is told their names twice a second."""
MAX_NAME_CHARACTERS = 255


def object_path(key: str) -> Path:
    """The file of the shared-memory object `key` names ("/name" or "name"), or SharedMemoryError."""
    name = key.removeprefix("/")
    if not _OBJECT_NAME.fullmatch(name) or name in {".", ".."}:
        raise SharedMemoryError(
            f"key {key!r} does not name a shared-memory object: one name of letters, digits, '_', '.' or '-', "
            "after an optional leading '/'",
            location=["key"],
        )
    return SHARED_MEMORY_FOLDER / name


@dataclass(kw_only=True)
class Region(ABC):
    """A registered region: its name and size, and the products using it now."""

    name: str
    byte_size: int
    users: int = 0
    unregistered: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on the event loop once the region is closed: no product reads or writes it any more."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """What the protocol's status answer says of the region."""

    def _outside(self, offset: int, nbytes: int, what: str) -> SharedMemoryError:
        return SharedMemoryError(
            f"{what}: {nbytes} bytes at offset {offset} of region '{self.name}' pass its end ({self.byte_size} bytes)",
            location=[what],
        )


@dataclass(kw_only=True)
class SystemRegion(Region):
    """One registered window of a shared-memory object, mapped (and pinned) here."""

    key: str
    offset: int
    mapping: mmap.mmap
    memory: np.ndarray
    """The window's bytes, from `offset` in the object."""
    pinned: np.ndarray
    """The whole mapping, as pinned (from the page `offset` lies in)."""

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
        """The tensor at `offset` of this region, or SharedMemoryError when it does not lie inside it."""
        try:
            return view(self.memory, Placement(offset, shape, dtype.name))
        except ValueError:
            raise self._outside(offset, math.prod(shape) * dtype.itemsize, what) from None


@dataclass(kw_only=True)
class CudaRegion(Region):
    """Another process's device memory, opened here from its CUDA IPC handle."""

    device_id: int
    memory: Any
    """The region's bytes on the device (a CuPy uint8 array)."""

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: np.dtype, what: str) -> Any:
        """The tensor at `offset` of this region, on the device, or SharedMemoryError when it does not lie inside
        it."""
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.byte_size:
            raise self._outside(offset, nbytes, what)
        if (self.memory.data.ptr + offset) % dtype.itemsize:  # the device traps a misaligned load: the context dies
            raise SharedMemoryError(
                f"{what}: a {dtype} tensor in device memory must start at a multiple of {dtype.itemsize} bytes; "
                f"offset {offset} of region '{self.name}' does not",
                location=[what],
            )
        return self.memory[offset : offset + nbytes].view(dtype).reshape(shape)


def open_window(key: str, offset: int, byte_size: int) -> tuple[mmap.mmap, int]:
    """Map [offset, offset + byte_size) of the object `key` names, read and write; the mapping starts at the page
    `offset` lies in, and the window begins that many bytes into it (the second value)."""
    path = object_path(key)
    if offset < 0 or byte_size <= 0:
        raise SharedMemoryError(
            f"a region needs an offset >= 0 and a byte_size > 0, got {offset} and {byte_size}", location=["byte_size"]
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        message = f"shared-memory object {key!r} cannot be opened: {exc.strerror}"
        raise SharedMemoryError(message, location=["key"]) from None
    try:
        facts = os.fstat(fd)
        if not stat.S_ISREG(facts.st_mode):
            raise SharedMemoryError(f"{key!r} is not a shared-memory object", location=["key"])
        if offset + byte_size > facts.st_size:
            raise SharedMemoryError(
                f"shared-memory object {key!r} has {facts.st_size} bytes; the region of {byte_size} bytes at "
                f"offset {offset} passes its end",
                location=["byte_size"],
            )
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, offset - start + byte_size, offset=start)
    finally:
        os.close(fd)
    return mapping, offset - start


class Regions:
    """The regions registered with this engine process, of both kinds, by name.

    `register_*` and `close` block (mapping and pinning take about 0.3 s a GiB on a GPU) and run in a thread; the
    rest runs on the engine's event loop, so that a region is never closed between a product's `get` and `lend`."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._regions: dict[str, Region] = {}

    def check_free(self, name: str) -> None:
        """SharedMemoryError unless a region may be registered under `name` now."""
        if len(name) > MAX_NAME_CHARACTERS:
            raise SharedMemoryError(
                f"a region's name has at most {MAX_NAME_CHARACTERS} characters, not {len(name)}", location=["name"]
            )
        if name in self._regions:
            raise SharedMemoryError(f"a region named '{name}' is already registered", location=["name"])
        if len(self._regions) >= MAX_REGIONS:
            raise SharedMemoryError(
                f"{MAX_REGIONS} regions are registered, the most this server holds; unregister some first",
                location=["name"],
            )

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map and pin the window, and register it (blocks; safe from any thread)."""
        self.check_free(name)
        mapping, start = open_window(key, offset, byte_size)
        whole = np.frombuffer(mapping, np.uint8)
        try:
            self._backend.pin(whole)
        except BaseException:
            del whole
            mapping.close()
            raise
        self._add(
            SystemRegion(
                name=name,
                key=key,
                offset=offset,
                byte_size=byte_size,
                mapping=mapping,
                memory=whole[start : start + byte_size],
                pinned=whole,
            )
        )

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the CUDA IPC handle on this engine's device, and register it (blocks; safe from any thread)."""
        self.check_free(name)
        memory = self._backend.open_device_memory(raw_handle, device_id, byte_size)
        self._add(CudaRegion(name=name, device_id=device_id, byte_size=byte_size, memory=memory))

    def _add(self, region: Region) -> None:
        if self._regions.setdefault(region.name, region) is not region:  # registered by another thread meanwhile
            self.close([region])
            self.check_free(region.name)

    def names(self) -> list[str]:
        return list(self._regions)

    def status(self, kind: type[Region], name: str | None) -> list[dict[str, Any]]:
        """The regions of one kind (SystemRegion or CudaRegion), or the one named (of that kind)."""
        if name is None:
            return [region.status() for region in self._regions.values() if isinstance(region, kind)]
        region = self.get(name)
        if not isinstance(region, kind):
            raise SharedMemoryError(f"no shared-memory region of this kind is named '{name}'", location=[name])
        return [region.status()]

    def get(self, name: str) -> SystemRegion | CudaRegion:
        region = self._regions.get(name)
        if not isinstance(region, SystemRegion | CudaRegion):
            raise SharedMemoryError(f"no shared-memory region named '{name}' is registered", location=[name])
        return region

    def remove(self, kind: type[Region], name: str | None) -> list[Region]:
        """Forget one region of a kind (every one of it when `name` is None; a name not registered is no error, as
        in Triton), and return those removed: the ones no product uses (`users == 0`) are to be closed now, the
        others are closed when their last product gives them back."""
        if name is None:
            removed = [region for region in self._regions.values() if isinstance(region, kind)]
        else:
            removed = [self._regions[name]] if isinstance(self._regions.get(name), kind) else []
        for region in removed:
            del self._regions[region.name]
            region.unregistered = True
        return removed

    @staticmethod
    def lend(region: Region) -> None:
        """Count a product as a user of `region` until it calls `give_back`."""
        region.users += 1

    @staticmethod
    def give_back(region: Region) -> bool:
        """One product less uses `region`; whether it is to be closed now (unregistered, and unused)."""
        region.users -= 1
        return region.users == 0 and region.unregistered

    def close(self, regions: list[Region]) -> None:
        """Unpin and unmap removed system regions, close the handles of CUDA ones (blocks)."""
        for region in regions:
            if isinstance(region, SystemRegion):
                with contextlib.suppress(Exception):
                    self._backend.unpin(region.pinned)
                del region.memory, region.pinned
                with contextlib.suppress(BufferError):
                    region.mapping.close()
            elif isinstance(region, CudaRegion):
                with contextlib.suppress(Exception):
                    self._backend.close_device_memory(region.memory)
                del region.memory
