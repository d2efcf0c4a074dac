"""The malloc arena cap: applied by default, left alone when the operator set MALLOC_ARENA_MAX, and effective
(threads started after it share the capped arenas, counted by glibc's own malloc_stats)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.allocator import ARENA_ENV, DEFAULT_ARENAS, cap_malloc_arenas

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the arena cap is glibc's")

ROOT = Path(__file__).resolve().parents[2]
THREADS = 8
# Each thread mallocs once, all of them at the same time (ctypes calls release the GIL), and keeps the block
# until every thread has allocated; glibc gives a thread without an arena a new one while under the cap.
ARENAS_SCRIPT = f"""
import ctypes, sys, threading
from app.allocator import cap_malloc_arenas
if sys.argv[1] == "cap":
    assert cap_malloc_arenas()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier({THREADS})
def allocate():
    barrier.wait()
    block = libc.malloc(4096)
    barrier.wait()
    libc.free(block)
threads = [threading.Thread(target=allocate) for _ in range({THREADS})]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc.malloc_stats()
"""


def arenas_used(mode: str) -> int:
    """The arenas glibc reports (malloc_stats on stderr) after THREADS threads allocated at once."""
    env = {key: value for key, value in os.environ.items() if key != ARENA_ENV}
    run = subprocess.run(
        [sys.executable, "-c", ARENAS_SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    return len(re.findall(r"^Arena \d+:", run.stderr, flags=re.MULTILINE))


def test_threads_share_the_capped_arenas() -> None:
    assert arenas_used("cap") <= DEFAULT_ARENAS


def test_without_the_cap_each_thread_gets_an_arena() -> None:
    """The control: what the cap prevents happens here (the main thread's arena and more)."""
    assert arenas_used("no-cap") > DEFAULT_ARENAS


def test_an_operator_setting_is_left_to_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARENA_ENV, "4")
    assert cap_malloc_arenas() is False
