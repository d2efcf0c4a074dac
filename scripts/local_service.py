"""matmul-service as a local process on a loopback port, for scripts/bench_service.py and scripts/scaleout_local.py.

Each server is uvicorn on the app factory with the service's connection protocol (HTTP_PROTOCOL), in a process
group of its own (so that `--workers N` children go with it), its output in a log file, settings from the
environment given. With several workers it gets a fresh PROMETHEUS_MULTIPROC_DIR, so that /metrics answers for
all of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HTTP_PROTOCOL = ("--http", "app.api.connection:GuardedHttpProtocol")
"""uvicorn's flag for the connection protocol that bounds request headers (app/api/connection.py)."""
READY_PROBES_PER_WORKER = 5
"""Consecutive 200s from /readyz, each over a new connection, asked of every worker: a new connection goes to
whichever worker accepts it first, so one not ready yet is all but sure to be hit."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalService:
    """One server process (uvicorn and its workers) on 127.0.0.1:`port`; `stop` ends the whole group."""

    def __init__(self, port: int, env: Mapping[str, str], log: Path, workers: int = 1) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.workers = workers
        self._metrics_dir = Path(tempfile.mkdtemp(prefix="matmul-metrics-"))
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "app.main:create_app",
            "--factory",
            "--no-access-log",
            *HTTP_PROTOCOL,
        ]
        command += ["--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as output:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **env, "PROMETHEUS_MULTIPROC_DIR": str(self._metrics_dir)},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Return once every worker answers /readyz with 200; raise with the server's log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        in_a_row = 0
        while in_a_row < READY_PROBES_PER_WORKER * self.workers:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.process.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} not ready after {timeout_s:g} s:\n{self.log.read_text()}")
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                ready = False
            in_a_row = in_a_row + 1 if ready else 0
            if not ready:
                time.sleep(0.2)

    def stop(self) -> None:
        stop_group(self.process)
        shutil.rmtree(self._metrics_dir, ignore_errors=True)


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
