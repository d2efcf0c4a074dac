"""Starting, watching and stopping the engine processes: one per device, restarted whenever one exits.

The supervisor runs in the process that starts the server: `matmul-service` (which also starts the HTTP workers,
under uvicorn) or, under plain `uvicorn app.main:create_app --factory`, the one HTTP worker's lifespan. It asks
`app.dataplane.devices` which engines the settings need (so that it never imports CuPy itself),
starts one engine process per device, each in a session of its own (a terminal's Ctrl-C reaches only the
supervisor, which stops everything in order) with a pipe on its stdin (if the supervisor dies, the engines see end
of file and drain), and restarts any that exits while the server runs: the exit code 75 of a lost device, a
crash, a kill. A process that dies within `STEADY_S` of starting is restarted after a pause that doubles, up to
`MAX_BACKOFF_S`. The sockets live in a private temporary directory, removed on `stop`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import cast

from pydantic import SecretStr

from app.config import Settings

log = logging.getLogger(__name__)

ENGINE_SOCKETS_VARIABLE = "MATMUL_ENGINE_SOCKETS"
"""Set by `matmul-service` for its HTTP workers: the engine processes' sockets, comma-separated. Not a setting:
an HTTP worker started without it starts engine processes of its own."""
SUPERVISOR_PID_VARIABLE = "MATMUL_SUPERVISOR_PID"
"""Set by `matmul-service` for its HTTP workers: its own pid, the process whose death ends them
(`end_with_supervisor`)."""
PR_SET_PDEATHSIG = 1
"""prctl's option: the signal the kernel sends this process when the thread that started it ends (linux/prctl.h)."""
WATCH_EVERY_S = 0.05
STEADY_S = 10.0
MAX_BACKOFF_S = 5.0
FIRST_BACKOFF_S = 0.1
STOP_TIMEOUT_S = 90.0
"""Longest a stopping engine may drain before it is killed (longer than a product's default deadline)."""


def end_with_supervisor() -> None:
    """In an HTTP worker that `matmul-service` started (as a process of its own: with more than one worker), ask the
    kernel for SIGTERM, a graceful stop, when `matmul-service` dies, whatever kills it (SIGKILL included): an orphaned
    worker would keep the ports and answer /healthz while no engine process ever comes back. uvicorn starts and
    replaces its workers from its main thread, whose end is the process's. Linux only; nothing elsewhere, nor in a
    worker started any other way."""
    supervisor = os.environ.get(SUPERVISOR_PID_VARIABLE)
    if supervisor is None or int(supervisor) == os.getpid() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("this HTTP worker will outlive matmul-service: prctl failed (errno %d)", ctypes.get_errno())
    elif os.getppid() != int(supervisor):  # it died before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)


def engine_environment(settings: Settings) -> dict[str, str]:
    """The environment of an engine process: this one's, with `settings` as the MATMUL_* variables that give them
    (settings passed to create_app in code reach the engines too); a setting left unset (None) is unset there too. API
    keys stay out: engines take no HTTP."""
    variables = dict(os.environ)
    for name, value in settings.model_dump().items():
        if name == "api_keys":
            continue
        variable = f"MATMUL_{name.upper()}"
        if value is None:  # unset: the engine's default, whatever this environment says
            variables.pop(variable, None)
        elif isinstance(value, list):
            variables[variable] = ",".join(map(str, value))
        elif isinstance(value, bool):
            variables[variable] = "true" if value else "false"
        elif not isinstance(value, SecretStr):
            variables[variable] = str(value)
    return variables


@dataclass
class _Engine:
    device: str
    """A CUDA ordinal, or "cpu"."""
    socket: str
    why_cpu: str = ""
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    restarts: int = 0
    exits: list[int] = field(default_factory=list)


class EngineSupervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.environment = engine_environment(settings)
        self.directory = tempfile.mkdtemp(prefix="matmul-engines-")
        self.engines: list[_Engine] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="engine-supervisor", daemon=True)

    def make_directory(self, name: str) -> str:
        """A folder in the supervisor's private directory, removed with it by `stop`."""
        path = os.path.join(self.directory, name)
        os.makedirs(path, exist_ok=True)
        return path

    @property
    def sockets(self) -> list[str]:
        return [engine.socket for engine in self.engines]

    def start(self) -> None:
        """Probe, start every engine process, and watch them. RuntimeError when the settings cannot be served
        (MATMUL_BACKEND=gpu without a usable GPU)."""
        found = self._probe()
        if "cpu" in found:
            self.engines = [_Engine("cpu", os.path.join(self.directory, "cpu.sock"), why_cpu=str(found["cpu"]))]
        else:
            self.engines = [
                _Engine(str(device), os.path.join(self.directory, f"device-{device}.sock"))
                for device in cast(list[int], found["devices"])
            ]
        for engine in self.engines:
            self._spawn(engine)
        self._watcher.start()

    def _probe(self) -> dict[str, object]:
        backend, devices = self.settings.backend.value, ",".join(map(str, self.settings.devices))
        done = subprocess.run(
            # one argument: a value of its own would be read as a flag if it began with "-"
            [sys.executable, "-m", "app.dataplane.devices", "--backend", backend, f"--devices={devices}"],
            env=self.environment,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            raise RuntimeError(f"the engine cannot start: {said}")
        found: dict[str, object] = json.loads(done.stdout)
        return found

    def _spawn(self, engine: _Engine) -> None:
        command = [sys.executable, "-m", "app.dataplane.engine_process", "--device", engine.device]
        command += ["--socket", engine.socket, "--why-cpu", engine.why_cpu]
        engine.process = subprocess.Popen(command, env=self.environment, stdin=subprocess.PIPE, start_new_session=True)
        engine.started_at = time.monotonic()
        log.info("engine process %d started for device %s", engine.process.pid, engine.device)

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_EVERY_S):
            for engine in self.engines:
                process = engine.process
                if process is not None and process.poll() is not None:
                    self._restart(engine, process.returncode)

    def _restart(self, engine: _Engine, code: int) -> None:
        engine.exits.append(code)
        if engine.process is not None and engine.process.stdin is not None:
            engine.process.stdin.close()
        steady = time.monotonic() - engine.started_at >= STEADY_S
        engine.backoff_s = FIRST_BACKOFF_S if steady else min(engine.backoff_s * 2, MAX_BACKOFF_S)
        log.error(
            "engine process for device %s exited with %d; restarting it in %.1f s",
            engine.device,
            code,
            engine.backoff_s,
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(engine.socket)
        if self._stopping.wait(engine.backoff_s):
            return
        with self._lock:
            if not self._stopping.is_set():
                engine.restarts += 1
                self._spawn(engine)

    def stop(self) -> None:
        """Ask every engine to drain (SIGTERM), kill those that take longer than STOP_TIMEOUT_S, remove the
        sockets' directory."""
        self._stopping.set()
        with self._lock:
            processes = [engine.process for engine in self.engines if engine.process is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                log.error("engine process %d did not drain in %.0f s; killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
        if self._watcher.is_alive():
            self._watcher.join()
        shutil.rmtree(self.directory, ignore_errors=True)
