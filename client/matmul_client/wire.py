"""What the client and the server agree on about bytes: the media types, and a `.npy` file written as its header and
a view of the array's memory, its data aligned where it will stand in a body. The server imports these rather than
holding its own."""

from __future__ import annotations

import numpy as np

JSON_MEDIA_TYPE = "application/json"
NPY_MEDIA_TYPE = "application/x-npy"
NPZ_MEDIA_TYPE = "application/x-npz"
NPY_ALIGNMENT = 64
"""Bytes: NumPy pads a `.npy` header with spaces so that the data begins on a multiple of this."""
NPY_MAGIC_1_0 = b"\x93NUMPY\x01\x00"
"""A `.npy` file's first bytes, format version 1.0 (a header of under 64 KiB, in ASCII)."""


def data_bytes(array: np.ndarray) -> memoryview:
    """An array's elements in C order as bytes: a view of a C-ordered array's memory (which it keeps alive until the
    bytes are sent), a copy of any other; any byte order, empty arrays too."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def npy_header(dtype: np.dtype, shape: tuple[int, ...], starts_at: int = 0) -> bytes:
    """The header (version 1.0) of the `.npy` file of a C-ordered array of `dtype` and `shape`: the text NumPy writes,
    padded as NumPy pads it, with spaces before its newline, so that the data begins on a multiple of NPY_ALIGNMENT
    counted from `starts_at` bytes before the file (where it stands in a larger body: a multipart part's data read
    into aligned memory is then aligned too). Written here rather than by NumPy's writer, which costs tens of
    microseconds a header: a small product's request carries two."""
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    used = starts_at + len(NPY_MAGIC_1_0) + 2 + len(text) + 1  # the magic and version, the length, the text, "\n"
    text += " " * (-used % NPY_ALIGNMENT) + "\n"
    return NPY_MAGIC_1_0 + len(text).to_bytes(2, "little") + text.encode("latin1")


def npy_parts(array: np.ndarray, starts_at: int = 0) -> tuple[bytes, memoryview]:
    """The `.npy` file of an array, always C-ordered, as its `npy_header` (the data aligned from `starts_at`) and its
    `data_bytes`."""
    contiguous = np.ascontiguousarray(array)
    return npy_header(contiguous.dtype, contiguous.shape, starts_at), data_bytes(contiguous)
