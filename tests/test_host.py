"""The CPUs and memory the host lets the service use, read from cgroup files of both versions written in tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import host

GIB = 1 << 30


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.fixture
def sixteen_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))


@pytest.mark.usefixtures("sixteen_cpus")
@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({}, 16),  # no cgroup files: the affinity
        ({"cpu.max": "max 100000"}, 16),
        ({"cpu.max": "400000 100000"}, 4),
        ({"cpu.max": "150000 100000"}, 2),  # 1.5 CPUs round up
        ({"cpu.max": "50000 100000"}, 1),
        ({"cpu.max": "3200000 100000"}, 16),  # a quota above the affinity: the affinity
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 16),  # v1, no quota
        ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "250000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 3),
    ],
)
def test_usable_cpus_are_the_affinity_within_the_cgroup_quota(files: dict[str, str], cpus: int, tmp_path: Path) -> None:
    assert host.usable_cpus(write(tmp_path, files)) == cpus


def test_usable_cpus_are_the_affinity_of_this_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    assert host.usable_cpus(tmp_path) == 2


MEMINFO = "MemTotal:       65536000 kB\nMemFree:        1000 kB\nMemAvailable:   50000000 kB"


@pytest.mark.parametrize(
    ("files", "memory"),
    [
        ({}, 65536000 * 1024),  # no cgroup files: MemTotal
        ({"memory.max": "max"}, 65536000 * 1024),
        ({"memory.max": str(8 * GIB)}, 8 * GIB),
        ({"memory.max": str(1 << 50)}, 65536000 * 1024),  # a limit above the host's memory: the host's
        ({"memory/memory.limit_in_bytes": str(4 * GIB)}, 4 * GIB),  # v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712"}, 65536000 * 1024),  # v1, unlimited
    ],
)
def test_usable_memory_is_the_lower_of_memtotal_and_the_cgroup_limit(
    files: dict[str, str], memory: int, tmp_path: Path
) -> None:
    meminfo = write(tmp_path, {"meminfo": MEMINFO}) / "meminfo"
    cgroup = write(tmp_path / "cgroup", files)
    assert host.usable_memory_bytes(meminfo, cgroup) == memory


def test_a_meminfo_without_memtotal_is_an_error(tmp_path: Path) -> None:
    meminfo = write(tmp_path, {"meminfo": "MemFree: 1000 kB"}) / "meminfo"
    with pytest.raises(ValueError, match="MemTotal"):
        host.total_memory(meminfo)


def test_this_host_has_cpus_and_memory() -> None:
    assert 1 <= host.usable_cpus() <= len(os.sched_getaffinity(0))
    assert 0 < host.usable_memory_bytes() <= host.total_memory()
