"""The command-line tools in scripts/ (a folder, not a package), imported as modules so that tests can call their
argument parsing and the little logic they keep; what they share lives in matmul_tools, imported as a package."""

from __future__ import annotations

import importlib.util
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
    """scripts/<name>.py run to its end with `arguments` by this Python; it must exit 0 (else its stderr fails the
    test)."""
    command = [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    return done
