"""The command-line tools in scripts/ (a folder, not a package), imported as modules so that tests can call their
argument parsing and the little logic they keep; what they share lives in matmul_tools, imported as a package."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def import_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module named <name>, imported once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *arguments: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """scripts/<name>.py run to its end with `arguments` by this Python (`run_to_end`)."""
    return run_to_end([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *arguments], timeout_s)


def run_to_end(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`command` run to its end; it must exit 0 (else its output fails the test). It runs in a session of its own:
    past `timeout_s` the test fails with its output so far, and every process it started (servers, nginx, client
    processes) is killed with it, so that none is left holding its pipes open (a killed command's children would
    keep the test waiting for their end of file); so is it when the test is stopped (its own timeout)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(process.pid)
            stdout, stderr = process.communicate()
            raise AssertionError(f"{' '.join(command)[:200]} ran past {timeout_s:g} s\n{stdout}{stderr}") from None
        except BaseException:  # the test's own timeout, or an interrupt: nothing the command started outlives it
            _kill_session(process.pid)
            raise
    assert process.returncode == 0, stdout + stderr
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _kill_session(leader: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every process of it has ended already
        os.killpg(leader, signal.SIGKILL)
