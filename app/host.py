"""What the host lets this process use: CPUs and memory, as its CPU affinity and its cgroup (a container's limits)
bound them. The settings derive their defaults from these (app/config.py).

Both cgroup versions are read at their mount point, /sys/fs/cgroup, which is the container's own cgroup where the
runtime gives it a cgroup namespace (Docker and Kubernetes on cgroup v2 do); limits set on a parent cgroup only are
not seen.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota(cgroup: Path = CGROUP) -> int | None:
    """The cgroup's CPU quota in CPUs, rounded up (1.5 CPUs count as 2), or None where there is none: cgroup v2's
    cpu.max (`quota period`, or `max`), else cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)."""
    v2 = _read(cgroup / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else math.ceil(int(quota) / int(period or "100000"))
    for folder in (cgroup / "cpu", cgroup / "cpu,cpuacct"):
        quota_us, period_us = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota_us is not None and period_us is not None:
            return None if int(quota_us) < 0 else math.ceil(int(quota_us) / int(period_us))
    return None


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs this process may run on: those of its affinity, no more than its cgroup's quota; at least 1."""
    cpus = len(os.sched_getaffinity(0))
    quota = cpu_quota(cgroup)
    return max(1, cpus if quota is None else min(cpus, quota))


def memory_limit(cgroup: Path = CGROUP) -> int | None:
    """The cgroup's memory limit in bytes, or None where there is none: cgroup v2's memory.max (`max`: none), else
    cgroup v1's memory.limit_in_bytes (unlimited reads as a number near 2^63, larger than any memory)."""
    v2 = _read(cgroup / "memory.max")
    if v2 is not None:
        return None if v2 == "max" else int(v2)
    v1 = _read(cgroup / "memory" / "memory.limit_in_bytes")
    return None if v1 is None else int(v1)


def total_memory(meminfo: Path = MEMINFO) -> int:
    """The host's memory in bytes: MemTotal of /proc/meminfo."""
    for line in meminfo.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemTotal":
            kib = value.split()[0]
            return int(kib) * 1024
    raise ValueError(f"{meminfo} has no MemTotal line")


def usable_memory_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int:
    """Memory this process may use: the host's, or its cgroup's limit where that is lower."""
    total = total_memory(meminfo)
    limit = memory_limit(cgroup)
    return total if limit is None else min(total, limit)
