"""How product answers are sent: as the buffers they are made of, with their metadata in headers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fastapi import Response
from starlette.types import Receive, Scope, Send

from app.product import MatmulMetadata, Timing


class BuffersResponse(Response):
    """For `.npy` and v2 binary answers: the header, then the product's own memory in the shared-memory slab it was
    computed into (a 4096x4096 float32 product is 64 MB that joining would copy once more). `on_sent` is called once the
    last `send` has returned, or when sending fails. The server's transport may still hold views of the buffers
    then (what the socket did not take at once): memory whose owner reuses it on `on_sent` must outlive its views,
    as a slab's bytes do (`app.dataplane.slab`)."""

    def __init__(
        self,
        buffers: Sequence[bytes | memoryview],
        media_type: str,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        self.buffers = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
        self.on_sent = on_sent
        super().__init__(content=None, media_type=media_type, headers=headers)
        self.headers["content-length"] = str(sum(buffer.nbytes for buffer in self.buffers))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = len(self.buffers) - 1
            for i, buffer in enumerate(self.buffers):
                await send({"type": "http.response.body", "body": buffer, "more_body": i < last})
            if not self.buffers:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.buffers = []
            if self.on_sent is not None:
                self.on_sent()


def server_timing(timing: Timing) -> str:
    """The W3C Server-Timing header value: `read;dur=0.021, decode;dur=0.090, ...` in milliseconds."""
    return ", ".join(f"{name.removesuffix('_ms')};dur={value:.3f}" for name, value in timing.model_dump().items())


def product_headers(meta: MatmulMetadata) -> dict[str, str]:
    """Server-Timing and the X-Matmul-* headers of a /matmul answer: its metadata, whatever the body's format."""
    headers = {
        "Server-Timing": server_timing(meta.timing),
        "X-Matmul-Kernel": meta.kernel,
        "X-Matmul-Backend": meta.backend,
        "X-Matmul-Device": meta.device,
        "X-Matmul-Shape": "x".join(map(str, meta.shape)),
        "X-Matmul-Dtype": meta.dtype,
        "X-Matmul-Precision": meta.precision,
        "X-Matmul-Batch-Size": str(meta.batch_size),
    }
    if meta.tile is not None:
        headers["X-Matmul-Tile"] = str(meta.tile)
    if meta.gflops is not None:
        headers["X-Matmul-Gflops"] = f"{meta.gflops:.3f}"
    for group, facts in (("Roofline", meta.roofline), ("Error-Bound", meta.error_bound)):
        for name, value in facts.model_dump(exclude_none=True).items():
            header = f"X-Matmul-{group}-" + "-".join(word.capitalize() for word in name.split("_"))
            headers[header] = str(value)  # the shortest text that reads back as the same number, as in JSON
    return headers
