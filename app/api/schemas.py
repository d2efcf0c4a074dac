"""The shapes of what the service answers, as OpenAPI documents them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.product import BackendName, DtypeName, MatmulMetadata, PrecisionName


class ErrorBody(BaseModel):
    """Every error answer of every route."""

    code: str = Field(description="Stable machine-readable error code, e.g. shape_mismatch, unknown_kernel.")
    message: str = Field(description="What was wrong and where, for a person.")
    location: list[str | int] | None = Field(
        None, description="Where in the request: a parameter name, or a matrix and its row/column, e.g. ['a', 3, 7]."
    )


class MatmulResponse(MatmulMetadata):
    """The JSON answer of POST /matmul."""

    result: list[list[float | None]] = Field(
        description="The product, row-major. JSON has no NaN or Infinity: such elements are null."
    )


class KernelModel(BaseModel):
    name: str
    kind: Literal["cuda", "emulation", "library", "auto"] = Field(
        description="cuda: a kernel of kernels/ on the GPU; emulation: one of them emulated in NumPy on the CPU; "
        "library: cuBLAS or NumPy's BLAS; auto: picks one of the others per shape."
    )
    summary: str
    dtypes: list[str]
    tiles: list[int] = Field(description="Tile widths the request may choose with `tile`; empty if none.")
    default_tile: int | None
    precisions: list[PrecisionName] = Field(description="The `precision`s it computes in.")
    stacks: bool = Field(
        description="Whether it computes stacks of products (operands of shape (B, m, k) and (B, k, n), either "
        "side a matrix broadcast), in one launch on the GPU. A stack asking for a kernel that does not is refused "
        "with 422 naming those that do."
    )


class AutoChoiceModel(BaseModel):
    shape_class: str = Field(description="Products whose size, the cube root of m*n*k, is at most `up_to`.")
    up_to: int | None
    precision: PrecisionName = Field(description="The precision these choices are for.")
    dtype: DtypeName = Field(
        description="The dtype these choices are for: float64 has its own where a kernel computes in float64 alone "
        "(dmma), elsewhere float64 products take float32's; int32 (precision int8) has its own where wgmma runs."
    )
    kernel: str = Field(description="What `auto` runs for this class: the fastest on the probe.")
    probe: list[int] = Field(description="The product timed at start-up for this class, [m, k, n].")
    probe_ms: dict[str, float] = Field(
        description="Milliseconds per product of every kernel on the probe (in `dtype`); with MATMUL_BATCHING on, a "
        "kernel that batches is timed on a batch of up to MATMUL_MAX_BATCH_SIZE products in one launch."
    )


class KernelListing(BaseModel):
    backend: BackendName
    default: str = Field(description="The kernel used when a request names none.")
    kernels: list[KernelModel]
    auto: list[AutoChoiceModel] = Field(description="What `auto` picks per shape class (empty: always the one kernel).")


class QueueModel(BaseModel):
    size: int = Field(description="Requests each engine process may hold waiting before new ones get 503.")
    depth: int = Field(description="Requests waiting now, in every engine process.")


class SlabModel(BaseModel):
    capacity_bytes: int = Field(description="Shared memory of the answering HTTP worker (MATMUL_SLAB_BYTES).")
    used_bytes: int = Field(description="Bytes held now by its requests' operands and products.")
    waiting: int = Field(description="Its requests waiting for room.")


class InfoResponse(BaseModel):
    service: str
    version: str
    backend: BackendName
    state: Literal["starting", "ready", "failed", "stopped"]
    failure: str | None
    http_workers: int = Field(description="HTTP worker processes of the server (MATMUL_HTTP_WORKERS).")
    http_worker_pid: int = Field(description="The process id of the HTTP worker that answered.")
    slabs: SlabModel | None = Field(description="The answering HTTP worker's shared memory.")
    grpc_port: int | None = Field(
        description="The port of the inference protocol over gRPC (MATMUL_GRPC_PORT), or null when it is off."
    )
    devices: list[dict[str, Any]] = Field(
        description="Each device's engine process: name, memory, compute capability, CuPy/CUDA versions, state, "
        "queue depth, `engine_pid`, the HTTP workers connected to it and the bytes of their shared memory it maps "
        "(and, on a GPU, pins); the CPU backend: one entry."
    )
    queue: QueueModel
    kernels: list[KernelModel]


class HealthStatus(BaseModel):
    status: Literal["ok", "ready"]
