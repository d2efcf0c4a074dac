"""The console scripts: `matmul-client` (multiply two .npy files on a server) and `matmul-service` (serve).

matmul-client a.npy b.npy -o c.npy --kernel tiled --url http://gpu-box:8000
matmul-service --backend gpu --workers 8 --port 8000
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Collection, Sequence
from enum import Enum
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from app import __version__, host
from app.api.connection import GuardedHttpProtocol
from app.client import DEFAULT_TIMEOUT_S, DEFAULT_URL, FORMATS, MatmulClient, MatmulServiceError, Options, Product
from app.config import MAX_DEFAULT_HTTP_WORKERS, MAX_DEFAULT_SLAB_BYTES, MIN_DEFAULT_SLAB_BYTES, Settings
from app.dataplane.supervisor import ENGINE_SOCKETS_VARIABLE, EngineSupervisor

URL_VARIABLE = "MATMUL_URL"
API_KEY_VARIABLE = "MATMUL_API_KEY"
FLAG_ALIASES = {"http_workers": ("--workers",)}
"""Shorter flags for settings, as uvicorn and gunicorn spell them."""
ENV_PREFIX = Settings.model_config.get("env_prefix", "")
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
GRACEFUL_SHUTDOWN_VARIABLE = "UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN"


def _load_operand(path: str, parser: argparse.ArgumentParser) -> np.ndarray:
    try:  # mapped, not read: the file's pages go to the socket as they are
        array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {path} as a .npy file: {exc}")
    return array


def _summary(product: Product, output: str) -> str:
    tile = f" (tile {product.tile})" if product.tile is not None else ""
    tile += f" in {product.precision}" if product.precision != "fp32" else ""
    phases = ", ".join(f"{name} {ms:.3f}" for name, ms in product.timing.items() if name != "total")
    gflops = f", {product.gflops:.1f} GFLOP/s" if product.gflops is not None else ""
    return (
        f"{output}: {'x'.join(map(str, product.c.shape))} {product.c.dtype} by kernel {product.kernel}{tile} on "
        f"{product.backend} ({product.device}){gflops}\n"
        f"server ms: total {product.timing.get('total', float('nan')):.3f} = {phases}"
    )


def client_main(argv: Sequence[str] | None = None) -> int:
    """matmul-client: C = A @ B computed by a matmul-service, from .npy files to a .npy file."""
    parser = argparse.ArgumentParser(
        prog="matmul-client", description="Multiply two .npy matrices on a matmul-service and save the product."
    )
    parser.add_argument("a", help="the left operand, a 2-D .npy file")
    parser.add_argument("b", help="the right operand, a 2-D .npy file")
    parser.add_argument("-o", "--output", required=True, help="where to save the product (.npy)")
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_VARIABLE, DEFAULT_URL),
        help=f"the server (default: ${URL_VARIABLE}, else {DEFAULT_URL})",
    )
    parser.add_argument("--kernel", help="a kernel the server has (GET /v1/kernels); default: the server's auto")
    parser.add_argument("--tile", type=int, help="tile width, for the tiled kernel")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64", "int32"],
        help="working dtype (default: from the operands; two int8 operands: int32, their exact product)",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "tf32", "3xtf32", "bf16", "fp16", "fp8", "int8"],
        help="how the multiplier rounds float32 operands (default: fp32, as they are; fp8: e4m3, each operand scaled "
        "by a power of two); int8: int8 operands, exactly",
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="npy", help="request body: npy (multipart, the default), json or npz"
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the answer")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"sent as a bearer token, for servers with MATMUL_API_KEYS (default: ${API_KEY_VARIABLE})",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    args = parser.parse_args(argv)

    a, b = _load_operand(args.a, parser), _load_operand(args.b, parser)
    options = Options()
    if args.kernel is not None:
        options["kernel"] = args.kernel
    if args.tile is not None:
        options["tile"] = args.tile
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.precision is not None:
        options["precision"] = args.precision
    try:
        with MatmulClient(args.url, format=args.format, timeout=args.timeout, api_key=args.api_key) as client:
            product = client.multiply(a, b, **options)
    except MatmulServiceError as exc:
        where = f" (at {exc.location})" if exc.location else ""
        print(f"matmul-client: the server answered {exc.status} {exc.code}: {exc.message}{where}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"matmul-client: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    np.save(Path(args.output), product.c, allow_pickle=False)
    if not args.quiet:
        print(_summary(product, args.output), file=sys.stderr)
    return 0


def _default_text(field: FieldInfo) -> str:
    """A setting's default as --help shows it: `false`, `auto` as the variable spells them; `none` for an empty list."""
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return str(value)


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field (`queue_size` -> --queue-size), so that the two never drift apart.

    Values stay strings here: Settings validates them, with the same rules as the environment variables.
    """
    for name, field in Settings.model_fields.items():
        variable = f"{ENV_PREFIX}{name}".upper()
        flags = [f"--{name.replace('_', '-')}", *FLAG_ALIASES.get(name, ())]
        text = f"{field.description} Overrides ${variable} (default {_default_text(field)})."
        if isinstance(field.annotation, type) and issubclass(field.annotation, Enum):
            choices = [member.value for member in field.annotation]
            parser.add_argument(*flags, dest=name, choices=choices, help=text)
        else:
            metavar = getattr(field.annotation, "__name__", "value").upper()
            parser.add_argument(*flags, dest=name, metavar=metavar, help=text)


def service_parser() -> argparse.ArgumentParser:
    """matmul-service's flags: uvicorn's few that it passes on, then one per setting."""
    parser = argparse.ArgumentParser(
        prog="matmul-service",
        description="Serve POST /matmul. Each flag sets the MATMUL_* variable of the same name; "
        "what no flag sets comes from the environment (or .env), else the default.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # uvicorn.run reads no UVICORN_* variable (only uvicorn's own command line does), so this one is read here.
    parser.add_argument(
        "--timeout-graceful-shutdown",
        type=int,
        default=os.environ.get(GRACEFUL_SHUTDOWN_VARIABLE),
        metavar="SECONDS",
        help="on SIGTERM, how long each HTTP worker waits for the requests in flight before it closes them "
        f"(default: ${GRACEFUL_SHUTDOWN_VARIABLE}, else uvicorn's: no limit)",
    )
    parser.add_argument("--version", action="version", version=f"matmul-service {__version__}")
    _add_setting_flags(parser)
    return parser


def _serving_line(settings: Settings, flags: Collection[str]) -> str:
    """The figures that set the service's throughput, each with where it came from: a flag, a variable (or .env), or
    the default, with the host's CPUs and memory where the default is derived from them."""

    def source(name: str, default: str) -> str:
        if name in flags:
            return "--" + name.replace("_", "-")
        if name in settings.model_fields_set:
            return f"${ENV_PREFIX}{name}".upper()
        return default

    cpus, memory_gib = host.usable_cpus(), host.usable_memory_bytes() / (1 << 30)
    workers = source(
        "http_workers",
        f"half of {cpus} usable CPUs, at most {MAX_DEFAULT_HTTP_WORKERS} and as many as a quarter of "
        f"{memory_gib:.1f} GiB holds at {MIN_DEFAULT_SLAB_BYTES >> 20} MiB each",
    )
    delay = source("max_queue_delay_us", "default" if settings.max_queue_delay_us else "default: no wait")
    slab = source(
        "slab_bytes",
        f"a quarter of {memory_gib:.1f} GiB usable memory over the HTTP workers, "
        f"{MIN_DEFAULT_SLAB_BYTES >> 20} MiB to {MAX_DEFAULT_SLAB_BYTES >> 20} MiB",
    )
    return (
        f"{settings.http_workers} HTTP worker(s) ({workers}); "
        f"batching {'on' if settings.batching else 'off'} ({source('batching', 'default')}), "
        f"queue delay {settings.max_queue_delay_us} us ({delay}); "
        f"{settings.slab_bytes >> 20} MiB of shared memory per HTTP worker ({slab})"
    )


def service_main(argv: Sequence[str] | None = None) -> int:
    """matmul-service: one engine process per device and the HTTP workers in front of them (under uvicorn),
    settings from flags or MATMUL_* variables. SIGTERM or Ctrl-C stops the HTTP workers (each finishes its
    answers), then the engines."""
    parser = service_parser()
    args = parser.parse_args(argv)

    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name) is not None}
    # The HTTP workers read their settings from the environment; flags become variables so that they do.
    os.environ.update({f"{ENV_PREFIX}{name}".upper(): str(value) for name, value in given.items()})
    try:
        settings = Settings()
    except ValidationError as exc:
        problem = exc.errors()[0]
        flag = "--" + str(problem["loc"][0]).replace("_", "-")
        parser.error(f"{flag} {problem['input']!r}: {problem['msg']}")

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s supervisor %(levelname)s %(message)s")
    logging.getLogger(__name__).info("serving with %s", _serving_line(settings, given))
    supervisor = EngineSupervisor(settings)
    try:
        supervisor.start()
    except RuntimeError as exc:
        supervisor.stop()
        parser.exit(1, f"matmul-service: {exc}\n")
    os.environ[ENGINE_SOCKETS_VARIABLE] = ",".join(supervisor.sockets)
    if settings.http_workers > 1:
        # every worker's /metrics merges the values all of them keep in this folder (app.metrics)
        os.environ.setdefault(METRICS_DIR_VARIABLE, supervisor.make_directory("metrics"))
    try:
        # No uvicorn access log: the service writes its own, in JSON (MATMUL_ACCESS_LOG). With several workers
        # uvicorn replaces any that dies; the engine processes are the supervisor's.
        uvicorn.run(
            "app.main:create_app",
            factory=True,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            http=GuardedHttpProtocol,
            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
            workers=settings.http_workers,
        )
    finally:
        supervisor.stop()
    return 0
