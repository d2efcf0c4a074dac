"""scripts/bench_protocol.py on tiny workloads, this checkout against itself: its JSON report read back and checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

# a server and a script in subprocesses, each with its own 120 s limit: the per-test limit allows for both
pytestmark = pytest.mark.timeout(300)


def test_two_checkouts_measured_in_alternation(tmp_path: Path) -> None:
    done = run_script(
        "bench_protocol",
        *("--baseline", str(ROOT), "--backend", "cpu"),
        *("--echo-bytes", "65536", "--echo-concurrency", "1", "--small-concurrency", "2", "--client-processes", "2"),
        *("--rounds", "2", "--duration", "0.2", "--out", str(tmp_path)),
        timeout_s=120,
    )
    report = json.loads((tmp_path / "bench-protocol.json").read_text())
    assert report["checkouts"] == {"baseline": str(ROOT), "candidate": str(ROOT)}
    rows = {row["workload"]: row for row in report["results"]}
    assert set(rows) == {"echo c=1", "healthz c=2", "matmul 16^3 c=2"}
    for row in rows.values():
        assert all(len(row["rounds"][name]) == 2 and min(row["rounds"][name]) > 0 for name in ("baseline", "candidate"))
        assert row["ratio"] == row["candidate"] / row["baseline"]
    assert rows["echo c=1"]["unit"] == "GB/s" and rows["healthz c=2"]["unit"] == "req/s"
    assert (tmp_path / "server-baseline.log").exists() and (tmp_path / "server-candidate.log").exists()
    assert "candidate" in done.stdout and "ratio" in done.stdout
