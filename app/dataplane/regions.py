"""Shared-memory regions that co-located clients register (Triton's system shared-memory extension), held by an
engine process.

A client creates a POSIX shared-memory object (`shm_open`; tritonclient.utils.shared_memory does it), writes its
tensors there and registers a window of it under a name. The engine process maps that window only, read and
write, pins it once (`Backend.pin`, cudaHostRegister on a GPU), and reads operands from it and writes products into
it straight, as it does with the HTTP workers' arenas. The key must name a shared-memory object: one name under
/dev/shm, never a path. A region in use by products when it is unregistered is unpinned and unmapped once they end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.dataplane.slab import Placement, view
from app.errors import SharedMemoryError

SHARED_MEMORY_FOLDER = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects: shm_open("/name") opens /dev/shm/name."""
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")


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


@dataclass
class SystemRegion:
    """One registered window of a shared-memory object, mapped (and pinned) here."""

    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    memory: np.ndarray
    """The window's bytes, from `offset` in the object."""
    pinned: np.ndarray
    """The whole mapping, as pinned (from the page `offset` lies in)."""
    users: int = 0
    unregistered: bool = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def tensor(self, offset: int, shape: tuple[int, int], dtype: np.dtype, what: str) -> np.ndarray:
        """The tensor at `offset` of this region, or SharedMemoryError when it does not lie inside it."""
        try:
            return view(self.memory, Placement(offset, shape, dtype.name))
        except ValueError:
            nbytes = shape[0] * shape[1] * dtype.itemsize
            raise SharedMemoryError(
                f"{what}: {nbytes} bytes at offset {offset} of region '{self.name}' pass its end "
                f"({self.byte_size} bytes)",
                location=[what],
            ) from None


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


class SystemRegions:
    """The system shared-memory regions registered with this engine process, by name.

    `register` and `close` block (mapping and pinning take about 0.3 s a GiB on a GPU) and run in a thread; the
    rest runs on the engine's event loop, so that a region is never closed between a product's `get` and `lend`."""

    def __init__(self, pin: Callable[[np.ndarray], None], unpin: Callable[[np.ndarray], None]) -> None:
        self._pin = pin
        self._unpin = unpin
        self._regions: dict[str, SystemRegion] = {}

    def check_free(self, name: str) -> None:
        if name in self._regions:
            raise SharedMemoryError(f"a region named '{name}' is already registered", location=["name"])

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map and pin the window, and register it (blocks; safe from any thread)."""
        self.check_free(name)
        mapping, start = open_window(key, offset, byte_size)
        whole = np.frombuffer(mapping, np.uint8)
        try:
            self._pin(whole)
        except BaseException:
            del whole
            mapping.close()
            raise
        region = SystemRegion(
            name=name,
            key=key,
            offset=offset,
            byte_size=byte_size,
            mapping=mapping,
            memory=whole[start : start + byte_size],
            pinned=whole,
        )
        if self._regions.setdefault(name, region) is not region:  # registered by another thread meanwhile
            self.close([region])
            self.check_free(name)

    def status(self, name: str | None) -> list[dict[str, Any]]:
        if name is None:
            return [region.status() for region in self._regions.values()]
        return [self.get(name).status()]

    def get(self, name: str) -> SystemRegion:
        region = self._regions.get(name)
        if region is None:
            raise SharedMemoryError(f"no shared-memory region named '{name}' is registered", location=[name])
        return region

    def remove(self, name: str | None) -> list[SystemRegion]:
        """Forget one region (every one when `name` is None; a name not registered is no error, as in Triton): the
        removed ones no product uses, to `close` now; the others are closed when their last product gives them
        back."""
        if name is None:
            removed = list(self._regions.values())
        else:
            removed = [self._regions[name]] if name in self._regions else []
        for region in removed:
            del self._regions[region.name]
            region.unregistered = True
        return [region for region in removed if region.users == 0]

    @staticmethod
    def lend(region: SystemRegion) -> None:
        """Count a product as a user of `region` until it calls `give_back`."""
        region.users += 1

    @staticmethod
    def give_back(region: SystemRegion) -> bool:
        """One product less uses `region`; whether it is to be closed now (unregistered, and unused)."""
        region.users -= 1
        return region.users == 0 and region.unregistered

    def close(self, regions: list[SystemRegion]) -> None:
        """Unpin and unmap removed regions (blocks)."""
        for region in regions:
            with contextlib.suppress(Exception):
                self._unpin(region.pinned)
            del region.memory, region.pinned
            with contextlib.suppress(BufferError):
                region.mapping.close()
