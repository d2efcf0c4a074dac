"""What the client and the server agree on about bytes: the media types, and a `.npy` file written as its header and
a view of the array's memory, its data aligned where it will stand in a body. The server imports these rather than
holding its own."""

from __future__ import annotations

import io

import numpy as np

JSON_MEDIA_TYPE = "application/json"
NPY_MEDIA_TYPE = "application/x-npy"
NPZ_MEDIA_TYPE = "application/x-npz"
NPY_ALIGNMENT = 64
"""Bytes: NumPy pads a `.npy` header with spaces so that the data begins on a multiple of this."""


def data_bytes(array: np.ndarray) -> memoryview:
    """An array's elements in C order as bytes: a view of a C-ordered array's memory (which it keeps alive until the
    bytes are sent), a copy of any other; any byte order, empty arrays too."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def npy_parts(array: np.ndarray, starts_at: int = 0) -> tuple[bytes, memoryview]:
    """The `.npy` file of an array, always C-ordered, as its header and its `data_bytes`. The header is padded as
    NumPy pads it, with spaces before its newline, so that the data begins on a multiple of NPY_ALIGNMENT counted
    from `starts_at` bytes before the file (where it stands in a larger body: a multipart part's data read into
    aligned memory is then aligned too)."""
    contiguous = np.ascontiguousarray(array)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(contiguous))
    header = head.getvalue()
    pad = -(starts_at + len(header)) % NPY_ALIGNMENT
    if pad:
        length = int.from_bytes(header[8:10], "little") + pad
        header = header[:8] + length.to_bytes(2, "little") + header[10:-1] + b" " * pad + b"\n"
    return header, data_bytes(contiguous)
