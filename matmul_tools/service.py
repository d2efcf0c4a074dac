"""matmul-service as a local process on a loopback port: started, waited for, stopped.

A server is a command (by default uvicorn on the app factory with the service's connection protocol,
HTTP_PROTOCOL) in a process group of its own, so that uvicorn's
`--workers` children go with it, its output in a log file. It is ready once GET /readyz answers 200; with several
workers, several times in a row over new connections, since each goes to whichever worker accepts it first.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HTTP_PROTOCOL = ("--http", "app.api.connection:GuardedHttpProtocol")
"""uvicorn's flag for the connection protocol that bounds request headers (app/api/connection.py), named as an
import string: the tools start the service as it starts itself without importing its insides."""
READY_PROBES_PER_WORKER = 5
"""Consecutive 200s from /readyz, each over a new connection, asked of every worker: a new connection goes to
whichever worker accepts it first, so one not ready yet is all but sure to be hit."""


class NotReady(RuntimeError):
    """A server that exited, or did not answer /readyz with 200 in time."""


def add_server_options(parser: argparse.ArgumentParser, backend: str | None = "auto") -> None:
    """The options of every tool that starts servers of this checkout: --backend, their MATMUL_BACKEND (None: left
    unset), and --ready-timeout."""
    parser.add_argument(
        "--backend",
        choices=["auto", "cpu", "gpu"],
        default=backend,
        help=f"MATMUL_BACKEND of every server (default: {backend or 'unset'})",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to be ready")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uvicorn_command(port: int, *options: str) -> list[str]:
    """uvicorn serving the app factory with HTTP_PROTOCOL on 127.0.0.1:`port`, with uvicorn's `options` after: one
    HTTP worker, which starts the engine processes itself."""
    command = [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", *HTTP_PROTOCOL]
    return [*command, "--host", "127.0.0.1", "--port", str(port), *options]


def service_command(port: int, *options: str) -> list[str]:
    """`matmul-service` (as `python -m app`) on 127.0.0.1:`port`, with its `options` after (`--workers N`, ...)."""
    return [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port), *options]


def wait_ready(
    url: str,
    timeout_s: float,
    *,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    in_a_row: int = 1,
    interval_s: float = 0.2,
    probe: str = "/readyz",
) -> float:
    """Return once `url` + `probe` answers 200 `in_a_row` times in a row, each over a new connection, with the
    time (time.monotonic()) the first of those was asked; raise NotReady, with the log's text, when `process`
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    ready_in_a_row = 0
    streak_began = time.monotonic()
    while ready_in_a_row < in_a_row:
        output = f":\n{log.read_text()}" if log is not None and log.exists() else ""
        if process is not None and process.poll() is not None:
            raise NotReady(f"{url} exited with {process.returncode}{output}")
        if time.monotonic() > deadline:
            raise NotReady(f"{url} not ready after {timeout_s:g} s{output}")
        asked = time.monotonic()
        try:
            ready = httpx.get(f"{url}{probe}", timeout=5).status_code == 200
        except httpx.TransportError:
            ready = False
        if ready and ready_in_a_row == 0:
            streak_began = asked
        ready_in_a_row = ready_in_a_row + 1 if ready else 0
        if not ready:
            time.sleep(interval_s)
    return streak_began


async def wait_ready_async(http: httpx.AsyncClient, timeout_s: float, interval_s: float = 0.05) -> None:
    """Return once GET /readyz through `http` answers 200; raise NotReady with its last answer after `timeout_s`."""
    import anyio

    deadline = time.monotonic() + timeout_s
    answer = "no answer"
    while True:
        try:
            response = await http.get("/readyz")
            if response.status_code == 200:
                return
            answer = f"{response.status_code} {response.text}"
        except httpx.TransportError as exc:
            answer = type(exc).__name__
        if time.monotonic() > deadline:
            raise NotReady(f"{http.base_url} not ready after {timeout_s:g} s: {answer}")
        await anyio.sleep(interval_s)


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM to a process started in a session of its own and to its children, SIGKILL if they outlive `timeout_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue


class LocalService:
    """One server process (and any workers it starts) on 127.0.0.1:`port`; `stop` ends the whole group."""

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        env: Mapping[str, str],
        log: Path,
        workers: int = 1,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.workers = workers
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as output:
            self.process = subprocess.Popen(
                list(command),
                cwd=ROOT,
                # no gRPC unless `env` gives a port: servers started side by side would share the default one
                env={"MATMUL_GRPC_PORT": "0", **os.environ, **env},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @classmethod
    def matmul_service(cls, port: int, env: Mapping[str, str], log: Path, workers: int = 1) -> LocalService:
        """`matmul-service --workers N`: N HTTP workers in front of one engine process per device; their /metrics
        is merged (the service makes the PROMETHEUS_MULTIPROC_DIR)."""
        return cls(service_command(port, "--workers", str(workers)), port, env, log, workers)

    def wait_ready(self, timeout_s: float, probe: str = "/readyz") -> float:
        """Return once every worker answers `probe` with 200, with the time those answers began (wait_ready);
        raise NotReady with the log if it exits or times out."""
        in_a_row = READY_PROBES_PER_WORKER * self.workers
        return wait_ready(self.url, timeout_s, process=self.process, log=self.log, in_a_row=in_a_row, probe=probe)

    def stop(self) -> None:
        stop_group(self.process)


def start_checkout(checkout: Path, env: Mapping[str, str], log: Path, workers: int) -> LocalService:
    """Another checkout's server, started by that tree's own code for it (its matmul_tools/service.py, or the
    scripts/local_service.py of older trees) from that tree: its LocalService, with `workers` HTTP workers."""
    for path in (checkout / "matmul_tools" / "service.py", checkout / "scripts" / "local_service.py"):
        spec = importlib.util.spec_from_file_location(f"service_of_{checkout.name}", path)
        if path.is_file() and spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            service = module.LocalService
            start = next((getattr(service, n) for n in ("matmul_service", "uvicorn") if hasattr(service, n)), service)
            started: LocalService = start(module.free_port(), env, log, workers)
            return started
    raise SystemExit(f"{checkout} has neither matmul_tools/service.py nor scripts/local_service.py")


@dataclass(frozen=True)
class Server:
    client: httpx.Client
    process: subprocess.Popen[bytes]


@contextmanager
def serving(
    command: Sequence[str], port: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> Iterator[Server]:
    """Start `command` (a server on `port`), wait for /readyz, yield a client of it and its process; then stop it
    with SIGTERM (SIGKILL if it lingers). Its output goes to a log file named in the error when it fails to start."""
    log = Path(tempfile.gettempdir()) / f"matmul-service-{port}.log"
    service = LocalService(command, port, env or {}, log)
    try:
        service.wait_ready(timeout_s)
        with httpx.Client(base_url=service.url, timeout=60) as client:
            yield Server(client=client, process=service.process)
    finally:
        service.stop()


@contextmanager
def running_server(
    command: Sequence[str], port: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> Iterator[httpx.Client]:
    """As `serving`, yielding only the client."""
    with serving(command, port, env, timeout_s) as server:
        yield server.client
