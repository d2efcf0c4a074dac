"""Bytes <-> matrices: JSON, multipart `.npy` parts and `.npz` in, JSON and `.npy` out, and the inference
protocol's tensors both ways. Nothing here knows HTTP or which device runs the product.

`decode`, `decode_by_headers` and `decode_infer` are the one place where a decoder's failure becomes the client's:
the decoders raise an `InvalidInput` that names what was wrong and where, and anything else they raise (a parser's
failure mode nobody foresaw) is still the client's malformed body, a `MalformedPayload` naming the exception, never
an internal error. Such an exception is logged once with its traceback, to be given a message of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from app.codecs import inference_v2, json, multipart, npy, npz
from app.codecs.inference_v2 import InferRequest
from app.codecs.operands import Body, Limits, Operands, RequestOptions
from app.errors import MalformedPayload, MatmulError, UnsupportedMediaType
from matmul_client.wire import npy_parts

__all__ = [
    "JSON_MEDIA_TYPE",
    "MULTIPART_MEDIA_TYPE",
    "NPY_MEDIA_TYPE",
    "NPZ_MEDIA_TYPE",
    "Body",
    "InferRequest",
    "Limits",
    "Operands",
    "RequestOptions",
    "decodable_media_type",
    "decode",
    "decode_by_headers",
    "decode_infer",
    "encode",
    "encode_json_envelope",
    "inference_v2",
    "json",
    "multipart",
    "npy",
    "npz",
]

log = logging.getLogger(__name__)

JSON_MEDIA_TYPE = json.MEDIA_TYPE
NPY_MEDIA_TYPE = npy.MEDIA_TYPE
NPZ_MEDIA_TYPE = npz.MEDIA_TYPE
MULTIPART_MEDIA_TYPE = multipart.MEDIA_TYPE
_BODIES = {JSON_MEDIA_TYPE: "JSON body", MULTIPART_MEDIA_TYPE: "multipart body", NPZ_MEDIA_TYPE: ".npz archive"}
"""The media types a product request's body may have, and what its failures call it."""
encode_json_envelope = json.encode_json_envelope


def decodable_media_type(content_type: str) -> str:
    """The media type of a Content-Type, if `decode` reads it; else UnsupportedMediaType naming what it reads."""
    media_type = content_type.split(";")[0].strip().lower()
    if media_type not in _BODIES:
        raise UnsupportedMediaType(
            f"Content-Type {media_type or '(none)'!r} is not supported; send {JSON_MEDIA_TYPE}, "
            f"multipart/form-data with .npy parts 'a' and 'b', or {NPZ_MEDIA_TYPE}"
        )
    return media_type


@contextmanager
def _client_bytes(what: str, decoder: Callable[..., object]) -> Iterator[None]:
    """Whatever `decoder` raises on bytes a client sent is the client's malformed `what`."""
    try:
        yield
    except MatmulError:
        raise
    except Exception as exc:
        log.warning("the %s raised %s in %s", what, type(exc).__name__, decoder.__qualname__, exc_info=exc)
        said = str(exc)[:200] or type(exc).__name__
        raise MalformedPayload(f"the {what} cannot be decoded: {said}") from exc


def decode(content_type: str, body: Body, limits: Limits, max_member_bytes: int) -> Operands:
    """A product request's body, in the media type its Content-Type names, -> Operands (an `.npz` member may
    unpack to at most `max_member_bytes`). Multipart `.npy` parts are views of `body`; a JSON or `.npz` body given
    as a memoryview is read from a copy."""
    media_type = decodable_media_type(content_type)
    if media_type == MULTIPART_MEDIA_TYPE:
        with _client_bytes(_BODIES[media_type], multipart.decode_multipart):
            return multipart.decode_multipart(body, content_type, limits)
    whole = bytes(body) if isinstance(body, memoryview) else body
    if media_type == JSON_MEDIA_TYPE:
        with _client_bytes(_BODIES[media_type], json.decode_json):
            return json.decode_json(whole, limits)
    with _client_bytes(_BODIES[media_type], npz.decode_npz):
        return npz.decode_npz(whole, limits, max_member_bytes)


def decode_by_headers(content_type: str, body: Body, limits: Limits) -> Operands | None:
    """`decode`'s Operands where it finds them by reading headers alone, whatever the body's size (a multipart body
    of `.npy` file parts, read by the lengths their headers declare): well under a millisecond, so it runs on the
    event loop. None for any other body, which `decode` reads."""
    if decodable_media_type(content_type) != MULTIPART_MEDIA_TYPE:
        return None
    with _client_bytes(_BODIES[MULTIPART_MEDIA_TYPE], multipart.decode_by_length):
        return multipart.decode_by_length(body, content_type, limits)


def decode_infer(body: Body, header_length: str | None, limits: Limits) -> InferRequest:
    """An inference protocol infer request (with its Inference-Header-Content-Length, if sent) -> InferRequest."""
    with _client_bytes("inference request", inference_v2.decode_infer):
        return inference_v2.decode_infer(body, header_length, limits)


def encode(media_type: str, array: np.ndarray) -> list[bytes | memoryview]:
    """A product in `media_type`, as the buffers to send in order: a `.npy` file as its header and a view of the
    array's memory, or the JSON matrix alone (the answer's `result`, for encode_json_envelope)."""
    if media_type == NPY_MEDIA_TYPE:
        return list(npy_parts(array))
    return [json.encode_json_matrix(array)]
