"""Content negotiation: the media type a product answer is written in, from the request's Accept header."""

from __future__ import annotations

from app.codecs import JSON_MEDIA_TYPE, NPY_MEDIA_TYPE
from app.errors import NotAcceptable


def choose_encoding(accept: str | None) -> str:
    """The media type to answer in, JSON or `.npy`, from an Accept header (q-values honoured)."""
    if not accept:
        return JSON_MEDIA_TYPE
    ranges: list[tuple[float, str]] = []
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        ranges.append((quality, media.lower()))
    for quality, media in sorted(ranges, key=lambda r: -r[0]):
        if quality <= 0:
            continue
        if media in (JSON_MEDIA_TYPE, "application/*", "*/*"):
            return JSON_MEDIA_TYPE
        if media == NPY_MEDIA_TYPE:
            return NPY_MEDIA_TYPE
    raise NotAcceptable(f"cannot answer in {accept!r}; this route answers {JSON_MEDIA_TYPE} or {NPY_MEDIA_TYPE}")
