"""Service settings, read once from `MATMUL_*` environment variables (or a `.env` file) in the lifespan."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, NonNegativeInt, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app import host

MAX_DEFAULT_HTTP_WORKERS = 8
"""Most HTTP workers MATMUL_HTTP_WORKERS defaults to: on a 16-core H100 host 8 workers served the most products of
1, 2, 4, 8, 12 and 16 (512^2: 1,875/s against 1,677 with 12; 4096^2: 62.4/s against 54.8; docs/throughput.md, "The
defaults and why")."""
MIN_DEFAULT_SLAB_BYTES = 256 << 20
"""Least shared memory per HTTP worker MATMUL_SLAB_BYTES defaults to: a 4096^2 float32 product (three 64 MiB
matrices) and a few small ones at once, whatever the host's memory."""
MAX_DEFAULT_SLAB_BYTES = 1 << 30
"""Most shared memory per HTTP worker MATMUL_SLAB_BYTES defaults to: an 8192^2 float32 product (768 MiB) fits."""
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 620
"""MATMUL_KEEP_ALIVE_TIMEOUT_S' default: longer than the pools commonly in front of the service keep an idle
connection (nginx's upstream keepalive_timeout and AWS's Application Load Balancer 60 s, Azure's load balancers 240
s, Google Cloud's load balancers 600 s, fixed, and Google asks backends for more), with 20 s to spare over the
longest, so that the pool always closes first. What an idle connection costs an HTTP worker meanwhile:
docs/deployment.md, "Keep-alive and the proxies in front"."""


DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES = 512 << 10
"""MATMUL_LOOPBACK_SOCKET_BUFFER_BYTES' default. On an H200 host (16 CPUs, 8 HTTP workers, 16 connections sending
stacks of 1,000 64^2 products, 49 MB an exchange) the stack route answered 10-24% more requests a second with it than
with the kernel's autotuned buffers (three pairs of runs), its bodies read in 20-26 ms instead of 25-35, and the
engine's round trip beyond the device's work (Server-Timing's handoff) took 2.3-2.5 ms instead of 3.3-4.1; 4096^2
products went 4-5% faster, their route's time in the server 108-111 ms instead of 128-133 (docs/throughput.md,
"Socket buffers")."""


def default_http_workers(cpus: int, memory_bytes: int) -> int:
    """MATMUL_HTTP_WORKERS when unset: half the usable CPUs, from 1 to MAX_DEFAULT_HTTP_WORKERS, and no more than
    a quarter of the usable memory holds at MIN_DEFAULT_SLAB_BYTES each (a 4 GiB container gets 4 at most). Half,
    because the engine processes (their staging threads and copies) and clients on the same host need cores too."""
    return max(1, min(MAX_DEFAULT_HTTP_WORKERS, cpus // 2, memory_bytes // (4 * MIN_DEFAULT_SLAB_BYTES)))


def default_slab_bytes(http_workers: int, memory_bytes: int) -> int:
    """MATMUL_SLAB_BYTES when unset: a quarter of the usable memory shared by the HTTP workers, from
    MIN_DEFAULT_SLAB_BYTES to MAX_DEFAULT_SLAB_BYTES, rounded down to a MiB."""
    share = (memory_bytes // 4) // http_workers
    return min(MAX_DEFAULT_SLAB_BYTES, max(MIN_DEFAULT_SLAB_BYTES, share)) >> 20 << 20


def _host_http_workers() -> int:
    return default_http_workers(host.usable_cpus(), host.usable_memory_bytes())


def _host_slab_bytes(validated: dict[str, Any]) -> int:
    """The default for the HTTP workers validated before it (this host's default where none were: --help)."""
    workers = validated.get("http_workers") or _host_http_workers()
    return default_slab_bytes(workers, host.usable_memory_bytes())


class BackendChoice(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    GPU = "gpu"


class SharedMemoryKind(StrEnum):
    """Triton's shared-memory extensions (MATMUL_SHARED_MEMORY)."""

    SYSTEM = "system"
    CUDA = "cuda"


class Settings(BaseSettings):
    """Every knob of the service; each field is the env var `MATMUL_<FIELD>`."""

    # An empty variable is the default, as an unset one is: compose passes ${MATMUL_HTTP_WORKERS:-} on.
    model_config = SettingsConfigDict(
        env_prefix="MATMUL_", env_file=".env", env_ignore_empty=True, extra="ignore", frozen=True
    )

    backend: BackendChoice = Field(
        BackendChoice.AUTO, description="cpu, gpu, or auto (the GPU when CuPy sees a device, else the CPU)."
    )
    devices: Annotated[list[NonNegativeInt], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated distinct CUDA device ordinals, one GPU worker each (none: every visible device).",
    )
    http_workers: int = Field(
        default_factory=_host_http_workers,
        ge=1,
        le=256,
        description="HTTP worker processes `matmul-service` starts (--workers); they share one engine process per "
        "device. Default: half the CPUs this process may use (its affinity, within its cgroup's quota), from 1 to "
        f"{MAX_DEFAULT_HTTP_WORKERS}, and no more than a quarter of its memory holds at "
        f"{MIN_DEFAULT_SLAB_BYTES >> 20} MiB of shared memory each.",
    )
    accept_handoff_ms: float = Field(
        2.0,
        ge=0,
        le=1000,
        description="With several HTTP workers, how long one that holds more connections than another leaves a new "
        "connection to those that hold fewer before it takes it itself, when none of them accepted one meanwhile (they "
        "may all be busy): each new connection goes to the worker holding the fewest. 0: whichever worker wakes first "
        "takes it.",
    )
    slab_bytes: int = Field(
        default_factory=_host_slab_bytes,
        ge=1 << 20,
        le=1 << 40,
        description="Shared memory of each HTTP worker for the operands and products of its requests in flight; a "
        "request needing more gets 413, one that finds it full waits within its deadline, then 503. Every HTTP "
        "worker holds this much, which every engine process pins (cudaHostRegister). Default: a quarter of the "
        "memory this process may use (the host's, or its cgroup's limit) over the HTTP workers, from "
        f"{MIN_DEFAULT_SLAB_BYTES >> 20} MiB to {MAX_DEFAULT_SLAB_BYTES >> 20} MiB, so a quarter of the memory at "
        "most in all (more only where the floor exceeds it).",
    )
    queue_size: int = Field(
        64, ge=1, le=100_000, description="Requests waiting in each engine process's queue before 503."
    )
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After sent with 503 answers.")
    max_body_bytes: int = Field(
        1 << 30,
        ge=1024,
        description="Largest request body accepted; larger bodies get 413 before being read. A gRPC message may hold "
        "this and 1 MiB for its other fields, up to 2 GiB - 1 bytes, the most gRPC carries.",
    )
    max_dim: int = Field(65_536, ge=1, le=1 << 30, description="Largest size of any matrix dimension.")
    max_elements: int = Field(1 << 28, ge=1, description="Largest number of elements of either operand.")
    max_result_elements: int = Field(1 << 28, ge=1, description="Largest number of elements of the product.")
    max_json_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Largest JSON body (JSON costs ~20x the memory and time of .npy per element); 413 beyond.",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        le=1 << 24,
        description="Most bytes of a request line and its headers together; 431 beyond, before the body is read.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Longest a connection may take to deliver a request's headers, from connecting (or from the "
        "request's first byte on a kept-alive connection); then it is closed, with 408 if part of a request came.",
    )
    keep_alive_timeout_s: int = Field(
        DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        ge=1,
        le=86_400,
        description="Longest a connection may idle between requests before the server closes it. Whatever keeps "
        "connections to the service in a pool (a proxy, a load balancer, a client) must close them sooner, or it "
        "may send a request into a connection the server is closing: the default outlasts nginx's upstream "
        "keepalive_timeout and AWS's load balancers (60 s), Azure's (240 s) and Google Cloud's (600 s). Once a "
        "request begins, its headers have MATMUL_HEADER_TIMEOUT_S.",
    )
    loopback_socket_buffer_bytes: int = Field(
        DEFAULT_LOOPBACK_SOCKET_BUFFER_BYTES,
        ge=0,
        le=1 << 30,
        description="The send and receive buffers asked (SO_SNDBUF, SO_RCVBUF) for a connection from a loopback "
        "address (127.0.0.0/8, ::1: a benchmark or a proxy on this host, in the same network namespace), in place of "
        "the kernel's autotuning, which may grow them to tens of MiB, so that no turn of an HTTP worker's event loop "
        "drains more than this from one socket while its other connections' answers wait. Linux caps the size at "
        "net.core.wmem_max and rmem_max, then reserves twice it. 0 leaves every connection to the kernel. Other "
        "peers always are (their windows must cover the network's delay), containerised set-ups included: their "
        "peers come from a bridge's addresses.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Longest wait for the next piece of a body that has not all arrived; 408."
    )
    request_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Longest a product may wait in the queue before 504; a request may ask for less with the "
        "X-Request-Timeout header (seconds).",
    )
    engine_silence_s: float = Field(
        10.0,
        ge=1,
        le=3600,
        description="How long an HTTP worker waits for any word from a ready engine process (it sends its status "
        "every 0.5 s, so at least 1 s) before taking it for hung: the products waiting on it get 503 "
        "engine_unresponsive (their shared memory held until the engine answers or exits), and /readyz says so "
        "while no other engine is ready.",
    )
    grpc_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="The port of the inference protocol over gRPC, which every HTTP worker serves (they share it); "
        "0: no gRPC.",
    )
    grpc_host: str = Field("0.0.0.0", description="The address the gRPC server listens on.")
    device_memory_limit_bytes: int = Field(
        0, ge=0, description="Most device memory the worker's pool may hold (0: no limit); beyond it, 503."
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated keys; when set, every route but the health probes needs one "
        "(Authorization: Bearer <key> or X-API-Key).",
    )
    kernel_cache_dir: Path | None = Field(
        None,
        description="Where kernels compiled at start-up are kept for the next start (kernels the image compiled "
        "when it was built are not compiled again); none: $XDG_CACHE_HOME/matmul-service/kernels (by default "
        "~/.cache/matmul-service/kernels).",
    )
    fault_injection: bool = Field(
        False, description="Tests only: accept kernel=fault_trap, which poisons the CUDA context on purpose."
    )
    batching: bool = Field(
        True,
        description="Run queued products of one shape, dtype and kernel as one launch; with no queue delay a lone "
        "product is launched at once.",
    )
    max_batch_size: int = Field(32, ge=1, le=1024, description="Most products in one batched launch.")
    max_queue_delay_us: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Longest the first product of a batch waits for others to join it while the device is idle. 0: "
        "a batch takes only the products already queued, and a lone product never waits; more waits for company, "
        "adding up to this much latency to a product that comes alone.",
    )
    pipeline_depth: int = Field(
        2,
        ge=1,
        le=8,
        description="Launches a GPU worker keeps in flight: at 2, one product's copies run under the previous "
        "one's kernel; 1 runs them one after another.",
    )
    echo_route: bool = Field(
        False,
        description="Benchmarks only: POST /v1/echo answers with the bytes it read, or their first answer_bytes "
        "(transport ceiling).",
    )
    access_log: bool = Field(True, description="One JSON line per request on stderr (logger app.access).")
    inline_codec_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Bodies and results up to this size are decoded/encoded on the event loop; larger ones "
        "in a worker thread so the loop never blocks.",
    )

    shared_memory: Annotated[list[SharedMemoryKind], NoDecode] = Field(
        default_factory=list,
        description="Triton's shared-memory extensions to enable: system, or system,cuda (none by default). "
        "Anyone who can reach the port can then read and write any region they can name: enable them only behind "
        "API keys or on loopback.",
    )

    @field_validator("kernel_cache_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        """MATMUL_KERNEL_CACHE_DIR set empty is the default folder, not the current directory."""
        return None if value == "" else value

    @field_validator("devices")
    @classmethod
    def _each_device_once(cls, devices: list[int]) -> list[int]:
        """MATMUL_DEVICES names a device once: a second engine process on it would share the device, not add one."""
        repeated = sorted({device for device in devices if devices.count(device) > 1})
        if repeated:
            raise ValueError(f"a device may be named once only; repeated: {', '.join(map(str, repeated))}")
        return devices

    @field_validator("api_keys", "devices", "shared_memory", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        """MATMUL_API_KEYS, MATMUL_DEVICES and MATMUL_SHARED_MEMORY are comma-separated lists; empty entries are
        ignored."""
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
