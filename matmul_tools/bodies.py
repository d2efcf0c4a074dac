"""Request bodies written by hand: arrays as `.npy` and `.npz` bytes, archives and multipart bodies of given parts."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterable

import numpy as np
import orjson

MULTIPART_BOUNDARY = "xx"
MULTIPART_CONTENT_TYPE = f"multipart/form-data; boundary={MULTIPART_BOUNDARY}"
"""The Content-Type of `multipart_body`'s bodies with the default boundary."""


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


def multipart_body(
    parts: Iterable[tuple[str, bytes] | tuple[str, bytes, bool]],
    filename: str | None = None,
    boundary: str = MULTIPART_BOUNDARY,
    preamble: bytes = b"",
    epilogue: bytes = b"",
) -> bytes:
    """A multipart/form-data body of parts in the order given, names repeated if they are: (name, data) is a file
    part, (name, data, False) a text field. A file part's filename is `filename`, or its name with `.npy`. The
    boundary is written in latin-1, so that a test may send any byte in it; `preamble` and `epilogue` stand
    before the first delimiter and after the closing one."""
    body = [preamble]
    for name, data, *is_file in parts:
        named = f'; filename="{filename or f"{name}.npy"}"' if is_file != [False] else ""
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{named}\r\n\r\n'
        body += [head.encode("latin-1"), data, b"\r\n"]
    body += [f"--{boundary}--\r\n".encode("latin-1"), epilogue]
    return b"".join(body)


def inference_v2_body(a: np.ndarray, b: np.ndarray, parameters: dict[str, str] | None = None) -> tuple[bytes, int]:
    """An Open Inference Protocol v2 infer request for C = A @ B with A and B as binary tensors (little-endian)
    and C asked for in binary (with the request's `parameters`, when given), and the length of its JSON header (the
    Inference-Header-Content-Length)."""
    datatypes = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "int8": "INT8"}
    inputs = [
        {"name": name, "shape": list(x.shape), "datatype": datatypes[x.dtype.name],
         "parameters": {"binary_data_size": x.nbytes}}
        for name, x in (("A", a), ("B", b))
    ]  # fmt: skip
    request = {"inputs": inputs, "outputs": [{"name": "C", "parameters": {"binary_data": True}}]}
    header = orjson.dumps({**request, "parameters": parameters} if parameters else request)
    data = [np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes() for x in (a, b)]
    return b"".join([header, *data]), len(header)
