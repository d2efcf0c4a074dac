"""The runner of the scripts' tests: a command past its time fails the test at once, its children killed with it."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType

import pytest

from tests.scripts import run_to_end

# A parent that starts a child holding the same stdout, writes the child's pid, and sleeps: killing the parent alone
# would leave the child keeping the pipe open.
PARENT_AND_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
print("started", flush=True)
time.sleep(60)
"""


def test_a_command_past_its_time_fails_with_its_output_and_takes_its_children_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    began = time.monotonic()
    with pytest.raises(AssertionError, match=r"ran past 10 s\nstarted"):  # 10 s: time to start on a loaded machine
        run_to_end([sys.executable, "-c", PARENT_AND_CHILD, str(pid_file)], timeout_s=10)
    assert time.monotonic() - began < 40
    _assert_ends(int(pid_file.read_text()))


class _Stopped(Exception):
    pass


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stopped


def test_a_test_stopped_while_its_command_runs_takes_the_command_and_its_children_with_it(tmp_path: Path) -> None:
    """As pytest-timeout stops a test: an exception raised by SIGALRM's handler in the middle of the wait."""
    pid_file = tmp_path / "child.pid"
    previous = signal.signal(signal.SIGALRM, _stop)
    signal.alarm(10)
    try:
        with pytest.raises(_Stopped):
            run_to_end([sys.executable, "-c", PARENT_AND_CHILD, str(pid_file)], timeout_s=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    _assert_ends(int(pid_file.read_text()))


def _assert_ends(pid: int) -> None:
    deadline = time.monotonic() + 10
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(pid), f"the command's child {pid} outlived it"


def _ended(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (killed, not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_a_command_that_fails_fails_the_test_with_its_output() -> None:
    with pytest.raises(AssertionError, match="said this"):
        run_to_end([sys.executable, "-c", "import sys; print('said this'); sys.exit(3)"], timeout_s=30)
