"""The server's console script, `matmul-service` (the client's, `matmul-client`, is matmul_client.cli).

matmul-service --backend gpu --workers 8 --port 8000
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from app import __version__, host
from app.config import MAX_DEFAULT_HTTP_WORKERS, MAX_DEFAULT_SLAB_BYTES, MIN_DEFAULT_SLAB_BYTES, Settings
from app.dataplane.supervisor import ENGINE_SOCKETS_VARIABLE, SUPERVISOR_PID_VARIABLE, EngineSupervisor

FLAG_ALIASES = {"http_workers": ("--workers",)}
"""Shorter flags for settings, as uvicorn and gunicorn spell them."""
ENV_PREFIX = Settings.model_config.get("env_prefix", "")
ENV_FILE = Settings.model_config.get("env_file")
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
GRACEFUL_SHUTDOWN_VARIABLE = "UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN"


def _default_text(field: FieldInfo) -> str:
    """A setting's default as --help shows it: `false`, `auto` as the variable spells them; `none` for an empty list
    or no value (the variable set empty)."""
    value = field.get_default(call_default_factory=True, validated_data={})
    if value is None:
        return "none"
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
    parser.add_argument("--port", default=8000, help="port to listen on, 0 to 65535 (default: 8000)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument(
        "--timeout-graceful-shutdown",
        metavar="SECONDS",
        help="on SIGTERM, how long each HTTP worker waits for the requests in flight before it closes them "
        f"(default: ${GRACEFUL_SHUTDOWN_VARIABLE}, else uvicorn's: no limit)",
    )
    parser.add_argument("--version", action="version", version=f"matmul-service {__version__}")
    _add_setting_flags(parser)
    return parser


class UvicornOptions(BaseModel):
    """What matmul-service passes on to uvicorn beside the settings, checked as they are."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int = Field(ge=0, le=65535)
    timeout_graceful_shutdown: int | None = Field(ge=0)


def uvicorn_options(args: argparse.Namespace) -> UvicornOptions:
    """uvicorn's options from the flags; the graceful shutdown's, where no flag gives it, from
    UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN (uvicorn.run reads no UVICORN_* variable, only uvicorn's own command line does).
    ValidationError where one is invalid."""
    graceful = args.timeout_graceful_shutdown
    if graceful is None:
        graceful = os.environ.get(GRACEFUL_SHUTDOWN_VARIABLE) or None
    return UvicornOptions(host=args.host, port=args.port, timeout_graceful_shutdown=graceful)


def _setting_source(name: str, flags: Collection[str], variables: Collection[str]) -> str:
    """Where a setting's value came from: its flag, else its variable, else the .env file."""
    if name in flags:
        return "--" + name.replace("_", "-")
    variable = f"{ENV_PREFIX}{name}".upper()
    return f"${variable}" if variable in variables else f"{variable} in {ENV_FILE}"


def _problems(error: ValidationError, sources: Mapping[str, str]) -> list[str]:
    """One line for each invalid value of `error`, naming where it came from (`sources`, by field). A default derived
    from an invalid value (MATMUL_SLAB_BYTES' from MATMUL_HTTP_WORKERS') is left out: that value is named."""
    return [
        f"{sources[str(problem['loc'][0])]} {problem['input']!r}: {problem['msg']}"
        for problem in error.errors()
        if problem["type"] != "default_factory_not_called"
    ]


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

    variables = {name.upper() for name, value in os.environ.items() if value}
    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name) is not None}
    # The HTTP workers read their settings from the environment; flags become variables so that they do.
    os.environ.update({f"{ENV_PREFIX}{name}".upper(): str(value) for name, value in given.items()})
    problems: list[str] = []
    try:
        options = uvicorn_options(args)
    except ValidationError as exc:
        flag = args.timeout_graceful_shutdown is not None
        graceful = "--timeout-graceful-shutdown" if flag else f"${GRACEFUL_SHUTDOWN_VARIABLE}"
        problems += _problems(exc, {"port": "--port", "timeout_graceful_shutdown": graceful})
    try:
        settings = Settings()
    except ValidationError as exc:
        problems += _problems(exc, {name: _setting_source(name, given, variables) for name in Settings.model_fields})
    if problems:
        parser.error("\n  ".join(["invalid settings:", *problems]))

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s supervisor %(levelname)s %(message)s")
    logging.getLogger(__name__).info("serving with %s", _serving_line(settings, given))
    supervisor = EngineSupervisor(settings)
    try:
        supervisor.start()
    except RuntimeError as exc:
        supervisor.stop()
        parser.exit(1, f"matmul-service: {exc}\n")
    # The engines are on a start's longest path (CUDA, the kernels, the self-test): the HTTP side's imports, FastAPI
    # and uvicorn among them (0.3-0.4 s), come after they are started, not before.
    from app.api import workers
    from app.api.accepting import TABLE_VARIABLE, ConnectionTable
    from app.api.connection import GuardedHttpProtocol

    os.environ[ENGINE_SOCKETS_VARIABLE] = ",".join(supervisor.sockets)
    os.environ[SUPERVISOR_PID_VARIABLE] = str(os.getpid())
    loop = "auto"
    metrics_dir = None
    if settings.http_workers > 1:
        # every worker's /metrics merges the values all of them keep in this folder (app.metrics)
        metrics_dir = os.environ.setdefault(METRICS_DIR_VARIABLE, supervisor.make_directory("metrics"))
        # and a new connection goes to the worker that holds the fewest (app.api.accepting); room for replacements
        table = os.path.join(supervisor.make_directory("connections"), "table")
        os.environ[TABLE_VARIABLE] = ConnectionTable.create(table, slots=4 * settings.http_workers)
        loop = "app.api.accepting:new_event_loop"
    # No uvicorn access log: the service writes its own, in JSON (MATMUL_ACCESS_LOG).
    served: dict[str, Any] = {
        "app": "app.main:create_app",
        "factory": True,
        "host": options.host,
        "port": options.port,
        "log_level": args.log_level,
        "access_log": False,
        "http": GuardedHttpProtocol,  # a BufferedProtocol, not the Protocol uvicorn types: it calls what it gets
        "timeout_graceful_shutdown": options.timeout_graceful_shutdown,
        "workers": settings.http_workers,
        "loop": loop,
        # no WebSocket routes; and an upgraded connection would leave the protocol that counts its end
        "ws": "none",
    }
    try:
        # with several workers, under a supervisor that replaces any that dies and takes a gone worker's gauges out
        # of the metrics (app.api.workers); the engine processes are the supervisor's
        workers.serve(served, metrics_dir)
    finally:
        supervisor.stop()
    return 0
