"""The same JSON product served by LitServe 0.2, for scripts/bench_dataplane.py to measure against.

POST /predict with this service's JSON body, {"a": [[...]], "b": [[...]]}, answers {"result": [[...]]}: C = A @ B
in float32, on the GPU through CuPy where LitServe gives the API a CUDA device, else NumPy. LitServe is not a
dependency of the service: install it to run this (`pip install 'litserve>=0.2,<0.3'`).

    python scripts/litserve_matmul.py --port 8001 --api-servers 8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import litserve as ls  # type: ignore[import-not-found]
import numpy as np


class MatmulAPI(ls.LitAPI):  # type: ignore[misc]
    """C = A @ B for one JSON request."""

    def setup(self, device: str) -> None:
        self.xp: Any = np
        if device.startswith("cuda"):
            import cupy

            cupy.cuda.Device(int(device.partition(":")[2] or 0)).use()
            self.xp = cupy

    # `request` has no annotation on purpose: LitServe then reads the body as JSON and passes the object parsed.
    def decode_request(self, request) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
        return np.asarray(request["a"], dtype=np.float32), np.asarray(request["b"], dtype=np.float32)

    def predict(self, operands: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        a, b = (self.xp.asarray(operand) for operand in operands)
        c = a @ b
        product: np.ndarray = c.get() if self.xp is not np else c
        return product

    def encode_response(self, c: np.ndarray) -> dict[str, Any]:
        return {"result": c.tolist()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--accelerator", default="auto", help="LitServe's accelerator (auto, cuda, cpu)")
    parser.add_argument("--api-servers", type=int, default=1, help="LitServe's num_api_servers (HTTP processes)")
    parser.add_argument("--workers-per-device", type=int, default=1)
    args = parser.parse_args(argv)
    server = ls.LitServer(MatmulAPI(), accelerator=args.accelerator, workers_per_device=args.workers_per_device)
    server.run(port=args.port, num_api_servers=args.api_servers, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
