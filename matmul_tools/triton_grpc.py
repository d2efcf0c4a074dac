"""Triton's gRPC client (tritonclient.grpc) as the tools drive the service with it: the address of a server's gRPC
port, and a product's operands as the client's inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import numpy as np


def grpc_address(url: str, info: Mapping[str, Any]) -> str:
    """host:port of the gRPC port of the server at `url` (its HTTP URL), from its GET /v1/info answer `info`."""
    port = info["grpc_port"]
    if port is None:
        raise RuntimeError(f"the server at {url} serves no gRPC: start it with MATMUL_GRPC_PORT")
    return f"{urlsplit(url).hostname}:{port}"


def fp32_inputs(a: np.ndarray, b: np.ndarray) -> list[Any]:
    """A and B, float32 matrices, as the FP32 inputs of an infer call, made as a user's code makes them."""
    import tritonclient.grpc as triton  # where it is used: importing this module starts no gRPC

    inputs = [triton.InferInput(name, list(x.shape), "FP32") for name, x in (("A", a), ("B", b))]
    for tensor, x in zip(inputs, (a, b), strict=True):
        tensor.set_data_from_numpy(x)
    return inputs
