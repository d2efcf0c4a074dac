"""scripts/bench_service.py on a tiny matrix (CPU backend, two servers): its JSON report read back and checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import import_script, run_script

bench = import_script("bench_service")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_a_tiny_matrix_on_two_servers(tmp_path: Path) -> None:
    done = run_script(
        "bench_service",
        *("--backend", "cpu", "--out", str(tmp_path)),
        *("--sizes", "16,32x8x4", "--formats", "npy,json", "--concurrency", "1,3", "--duration", "0.25"),
        *("--configs", "off-1,on-2", "--workers", "2", "--client-processes", "2", "--warmup", "1"),
        timeout_s=120,
    )
    report = json.loads((tmp_path / "bench-service.json").read_text())
    assert (tmp_path / "bench-service.png").read_bytes().startswith(PNG_MAGIC)
    assert 0 < report["elapsed_s"] < 120
    assert set(report["servers"]) == {"off-1", "on-2"} and report["servers"]["on-2"]["backend"] == "cpu"
    cells = report["cells"]
    products = [cell for cell in cells if cell["route"] == "matmul"]
    assert len(products) == 2 * 2 * 2 * 2, "servers x sizes x formats x concurrencies"
    for cell in cells:
        assert cell["errors"] == {} and cell["ok"] == cell["requests"] > 0, cell
        assert cell["throughput_rps"] > 0 and cell["payload_gbps"] > 0
        assert 0 < cell["latency_ms"]["p50"] <= cell["latency_ms"]["p99"]
        assert cell["client_processes"] == min(2, cell["concurrency"])
    for cell in products:
        phases = cell["server_ms"]
        assert {"read", "decode", "queue", "kernel", "encode", "total", "client+network"} <= set(phases)
        assert phases["total"]["count"] == cell["ok"]
        assert cell["mean_batch_size"] >= 1, "every answer says the batch it ran in"
    echoes = [cell for cell in cells if cell["route"] == "echo"]
    assert all(cell["mean_batch_size"] is None for cell in echoes)
    assert {(cell["config"], cell["size"], cell["concurrency"]) for cell in echoes} == {
        (config, "16x16x16", concurrency) for config in ("off-1", "on-2") for concurrency in (1, 3)
    }, "the echo carries the largest .npy body"
    transport = report["ratios"]["transport"]
    assert len(transport) == 4 and all(ratio["ratio"] > 0 for ratio in transport)
    batching = report["ratios"]["batching"]
    assert (batching["size"], batching["concurrency"], batching["on"], batching["off"]) == (
        "16x16x16",
        3,
        "on-2",
        "off-1",
    )
    assert batching["ratio"] == batching["on_rps"] / batching["off_rps"]
    assert "Where the time goes" in done.stdout and "batching, 16x16x16 npy at concurrency 3" in done.stdout


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_the_device_comparison_runs_one_cell_per_device_list(tmp_path: Path) -> None:
    done = run_script(
        "bench_service",
        *("--backend", "cpu", "--out", str(tmp_path)),
        *("--compare-devices", "0", "0", "--compare-size", "16", "--compare-kernel", "numpy"),
        *("--compare-concurrency", "2", "--duration", "0.25", "--workers", "1", "--client-processes", "2"),
        timeout_s=120,
    )
    compared = json.loads((tmp_path / "bench-devices.json").read_text())["compare_devices"]
    one, many = compared["cells"]
    assert [one["devices"], many["devices"]] == ["0", "0"] and one["size"] == "16x16x16"
    assert one["errors"] == many["errors"] == {} and one["concurrency"] == 2
    assert compared["ratio"] == many["throughput_rps"] / one["throughput_rps"]
    assert "MATMUL_DEVICES=0) =" in done.stderr
    assert [echo["route"] for echo in compared["echo"]] == ["echo", "echo"], "each server's transport ceiling"
    assert all(echo["errors"] == {} and echo["payload_gbps"] > 0 for echo in compared["echo"])
    assert "transport ceiling (echo)" in done.stderr and "ms of GPU per product" in done.stderr


def test_json_cells_too_big_for_the_server_are_skipped() -> None:
    args = bench.parse_args(["--sizes", "512,4096", "--concurrency", "1,64", "--no-echo"])
    cells, skipped = bench.plan(args)
    assert {(cell.size, cell.format) for cell in cells} == {
        ("512x512x512", "json"),
        ("512x512x512", "npy"),
        ("4096x4096x4096", "npy"),
    }
    assert [(s["size"], s["format"]) for s in skipped] == [("4096x4096x4096", "json")]
    assert [config.token for config in args.configs] == ["off-1", "off-4", "on-1", "on-4"]


def test_split_shares_out_connections_and_requests() -> None:
    assert bench.split(64, 4) == [16, 16, 16, 16]
    assert bench.split(7, 3) == [3, 2, 2]
    assert sum(bench.split(20_000, 3)) == 20_000
