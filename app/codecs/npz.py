"""`.npz` bodies (np.savez, np.savez_compressed) holding `a.npy` and `b.npy`, each member inflated only once its
header has passed the limits."""

from __future__ import annotations

import io
import lzma
import zipfile
import zlib
from typing import cast

from app.codecs.npy import NPY_MAX_HEADER, data_size_error, decode_parts, read_npy_header
from app.codecs.operands import Limits, Operands, require_operands
from app.errors import InvalidMatrix, MalformedPayload
from matmul_client.wire import NPZ_MEDIA_TYPE

MEDIA_TYPE = NPZ_MEDIA_TYPE


def _read_npz_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, limits: Limits) -> bytearray:
    """One member of an `.npz`, inflated only once its header has passed the limits and its declared size
    matches that header: a small archive whose header claims a huge matrix is refused before anything large is
    allocated. zipfile reads no more than the declared size."""
    with cast(zipfile.ZipExtFile, archive.open(info)) as stream:
        head = stream.read(NPY_MAX_HEADER + 16)
        header = read_npy_header(head, name, limits)
        if info.file_size != header.file_bytes:
            raise data_size_error(header, name, present=info.file_size - header.offset)
        member = bytearray(header.file_bytes)
        member[: len(head)] = head
        got = len(head) + stream.readinto(memoryview(member)[len(head) :])
    if got != header.file_bytes:
        raise data_size_error(header, name, present=got - header.offset)
    return member


def decode_npz(body: bytes | bytearray, limits: Limits, max_member_bytes: int) -> Operands:
    """An `.npz` archive (as written by np.savez or np.savez_compressed) holding `a.npy` and `b.npy`."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        members: dict[str, zipfile.ZipInfo] = {}
        for info in archive.infolist():
            member = info.filename.removesuffix(".npy")
            if member in members:  # a dict would keep the last: refused, as multipart refuses a part sent twice
                raise InvalidMatrix(
                    f"the .npz archive holds '{member}' twice (members '{members[member].filename}' and "
                    f"'{info.filename}')",
                    location=[member],
                )
            members[member] = info
        require_operands(members, ".npz archive")
        parts: dict[str, bytearray] = {}
        for member, info in members.items():
            if info.file_size > max_member_bytes:
                raise InvalidMatrix(
                    f"member '{info.filename}' of the .npz unpacks to {info.file_size} bytes, over the "
                    f"limit of {max_member_bytes}",
                    location=[member],
                )
            parts[member] = _read_npz_member(archive, info, member, limits)
    # zipfile lets the errors of what it reads through: a negative seek (ValueError), an encrypted member
    # (RuntimeError), data that zlib or lzma cannot inflate (bz2 raises OSError).
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        NotImplementedError,
        EOFError,
        OSError,
        ValueError,
        RuntimeError,
        zlib.error,
        lzma.LZMAError,
    ) as exc:
        raise MalformedPayload(f"the body is not a valid .npz archive: {exc}") from exc
    return decode_parts(parts, limits, container=".npz archive")
