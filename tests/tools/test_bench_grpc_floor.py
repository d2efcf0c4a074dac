"""scripts/bench_grpc_floor.py on tiny messages: bare gRPC servers sharing a port, tritonclient.grpc processes, the
rates in its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from matmul_tools.service import free_port
from tests.scripts import run_script


def test_each_run_reports_the_exchanges_its_clients_had_answered(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    done = run_script(
        "bench_grpc_floor",
        *("--size", "64", "--servers", "2,1", "--clients", "2", "--seconds", "0.5"),
        *("--port", str(free_port()), "--out", str(out)),
        timeout_s=100,
    )
    report = json.loads(out.read_text())
    assert report["size"] == 64 and report["exchange_bytes"] == 3 * 64 * 64 * 4
    assert [(run["servers"], run["clients"]) for run in report["runs"]] == [(2, 2), (1, 2)]
    assert all(run["exchanges_per_s"] > 0 for run in report["runs"])
    assert "| 2 | 2 |" in done.stdout and "| 1 | 2 |" in done.stdout
