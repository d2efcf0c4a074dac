"""Request bodies written by hand: arrays as `.npy` and `.npz` bytes, archives and multipart bodies of given parts."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterable

import numpy as np

MULTIPART_BOUNDARY = "xx"
MULTIPART_CONTENT_TYPE = f"multipart/form-data; boundary={MULTIPART_BOUNDARY}"
"""The Content-Type of `multipart_body`'s bodies."""


def npy_bytes(array: np.ndarray) -> bytes:
    """`array` as an `.npy` file (np.save, no pickles)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def npz_bytes(**arrays: np.ndarray) -> bytes:
    """The arrays as an `.npz` archive (np.savez), one member per keyword."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def load_npy(content: bytes) -> np.ndarray:
    """An `.npy` file's array (no pickles)."""
    array: np.ndarray = np.load(io.BytesIO(content), allow_pickle=False)
    return array


def zip_members(compressed: bool = False, **members: bytes) -> bytes:
    """An `.npz`-style archive of member files given as they are (whole, cut short, or only a header): `name.npy`
    for each keyword, deflated when `compressed`."""
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", compression=method) as archive:
        for name, data in members.items():
            archive.writestr(f"{name}.npy", data)
    return buffer.getvalue()


def multipart_body(parts: Iterable[tuple[str, bytes]], filename: str | None = None) -> bytes:
    """A multipart/form-data body (boundary `MULTIPART_BOUNDARY`) of file parts in the order given, names repeated
    if they are; each part's filename is `filename`, or its name with `.npy`."""
    chunks = [
        b'--%s\r\nContent-Disposition: form-data; name="%s"; filename="%s"\r\n\r\n%s\r\n'
        % (MULTIPART_BOUNDARY.encode(), name.encode(), (filename or f"{name}.npy").encode(), data)
        for name, data in parts
    ]
    return b"".join([*chunks, b"--%s--\r\n" % MULTIPART_BOUNDARY.encode()])
