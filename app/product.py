"""What a computed product says about itself: its timing, its roofline, its shape, dtype and kernel.

Domain values, below the API: the service builds them, the answers carry them (JSON fields, X-Matmul-* and
Server-Timing headers, v2 parameters), and metrics, access logs and the v2 statistics read them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

DtypeName = Literal["float32", "float64", "int32"]
PrecisionName = Literal["fp32", "tf32", "3xtf32", "bf16", "fp16", "fp8", "int8"]
BackendName = Literal["cpu", "gpu"]


class Timing(BaseModel):
    """Where the time of one request went, in milliseconds."""

    read_ms: float = Field(description="Receiving the body (and parsing multipart framing).")
    decode_ms: float = Field(description="Parsing JSON / .npy / .npz into arrays and checking them.")
    stage_ms: float = Field(
        description="Converting the operands into the working dtype, into the shared memory the engine process reads "
        "(including any wait for room in it)."
    )
    handoff_ms: float = Field(
        description="Handing the product to the engine process and its answer back (the control channel), beyond "
        "queue, h2d, kernel and d2h."
    )
    queue_ms: float = Field(description="Waiting in the engine's queue, from enqueue to start.")
    h2d_ms: float = Field(
        description="Copying the operands to the device from the pinned shared memory (CUDA events); on the CPU "
        "backend 0, or the conversion of operands not already in the working dtype."
    )
    kernel_ms: float = Field(
        description="The kernel alone, between CUDA events (CPU: wall time of numpy.matmul or of the emulation)."
    )
    d2h_ms: float = Field(description="Copying the product back into pinned host memory (CUDA events); 0 on CPU.")
    encode_ms: float = Field(description="Serialising the product (JSON or .npy).")
    total_ms: float = Field(description="From the request reaching the route to the answer being ready to send.")


class RooflineModel(BaseModel):
    """The product against the device's roofs (docs/roofline.md). Work and traffic are this product's; rates are
    its launch's, like `gflops`. Null where not known (the CPU backend has no peaks) or nothing was timed."""

    flops: int = Field(description="2*m*n*k: the product's floating-point operations.")
    global_bytes: int = Field(
        description="Bytes the kernel requests from global memory by its access pattern (naive: 2*m*n*k elements "
        "read, tiled: 2*m*n*k/TILE, the block-tiled ones once per block row or column; libraries: A and B read "
        "once), plus C written once."
    )
    intensity: float | None = Field(description="flops / global_bytes: FLOPs per byte requested.")
    peak_gflops: float | None = Field(
        description="The device's peak for the product's arithmetic (its dtype, or its tensor-core precision): SMs x "
        "multiply-adds per clock per SM x 2 x clock. Null on the CPU."
    )
    peak_fraction: float | None = Field(description="gflops / peak_gflops.")
    global_gbps: float | None = Field(
        description="global_bytes / kernel time, in GB/s: the rate of requests, which can pass DRAM's where L1 and "
        "L2 serve them."
    )
    dram_gbps: float | None = Field(
        description="The device's DRAM bandwidth: memory clock x bus width x 2 (double data rate). Null on the CPU."
    )


class ErrorBound(BaseModel):
    """What the product promises, element by element, against R, the float64 product of the operands as they were
    converted to the working dtype: |C - R| <= constant * (input_error * sqrt((A*A) @ (B*B)) + sums * sqrt(k) *
    unit_roundoff * (|A| @ |B|)). The first term is the precision's rounding of the operands, the second the
    float32 (or float64) sums' (numerics/reference.py and numerics/precision.py derive both). fp8 adds the
    subnormals' term, (1 + u) * (eta_A * ||B[:, j]|| + eta_B * ||A[i, :]||) + eta_A * eta_B * sqrt(k) with u = 2^-4 and
    eta = 2^-10 * 2^-e for each operand, whose scale 2^e brings its largest magnitude into (224, 448]."""

    constant: float = Field(description="c, the headroom of the statistical bound (4).")
    input_error: float = Field(description="What the precision's rounding of A and B adds per term (0 for fp32).")
    sums: float = Field(description="How many sums of k terms make an element (1; 1.25 for 3xtf32).")
    unit_roundoff: float = Field(
        description="u of the sums: 2^-24 in float32, 2^-53 in float64, 0 in int32 (exact: the bound is 0)."
    )


class MatmulMetadata(BaseModel):
    """What a product answer says about itself; `.npy` answers carry it in X-Matmul-* headers instead."""

    shape: tuple[int, int] | tuple[int, int, int] = Field(
        description="Shape of the result: [m, n], or [batch, m, n] for a stack of products."
    )
    dtype: DtypeName
    precision: PrecisionName = Field(
        description="How the multiplier saw the operands: fp32 (as they are, also for float64), or rounded for the "
        "tensor cores (tf32, bf16, fp16; 3xtf32: split into two TF32 parts; fp8: e4m3, each operand scaled by a "
        "power of two from its largest magnitude); int8 for an int32 product, the exact "
        "sums of int8 operands."
    )
    error_bound: ErrorBound
    kernel: str = Field(description="The kernel that ran (what `auto` resolved to).")
    tile: int | None = Field(description="Tile width for kernels that have one, else null.")
    backend: BackendName
    device: str
    timing: Timing
    gflops: float | None = Field(
        description="2*m*n*k / kernel_ms; null when no arithmetic was done. For a batched product, the launch's "
        "rate: the whole batch's work over its kernel time."
    )
    batch_size: int = Field(
        description="Products computed in the same launch (dynamic batching); its timings are the launch's."
    )
    roofline: RooflineModel
