"""An answer sent as the buffers it is made of, in order, without first joining them into one bytes object."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fastapi import Response
from starlette.types import Receive, Scope, Send


class BuffersResponse(Response):
    """For `.npy` answers: the header, then the product's own memory (a 4096x4096 float32 product is 64 MB that
    joining would copy once more). The buffers must stay unchanged until the answer is sent."""

    def __init__(self, buffers: Sequence[bytes | memoryview], media_type: str, headers: Mapping[str, str]) -> None:
        self.buffers = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
        super().__init__(content=None, media_type=media_type, headers=headers)
        self.headers["content-length"] = str(sum(buffer.nbytes for buffer in self.buffers))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.buffers) - 1
        for i, buffer in enumerate(self.buffers):
            await send({"type": "http.response.body", "body": buffer, "more_body": i < last})
        if not self.buffers:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
