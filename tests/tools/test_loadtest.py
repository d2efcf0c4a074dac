"""scripts/loadtest.py end to end against a real CPU-backend server: its JSON report read back and checked."""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from matmul_tools import loadtest
from matmul_tools.service import free_port
from tests.scripts import ROOT

SCRIPT = ROOT / "scripts" / "loadtest.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_loadtest(url: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Run the script as a user does; its JSON report and what it printed."""
    command = [sys.executable, str(SCRIPT), "--url", url, "--out", str(out / "run"), "--no-progress", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "run.png").read_bytes().startswith(PNG_MAGIC)
    report: dict[str, Any] = json.loads((out / "run.json").read_text())
    return report, done.stdout


@pytest.mark.timeout(150)  # the script in a subprocess, with its own 120 s limit
def test_a_run_where_no_request_succeeded_exits_1_with_its_report(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    command = [sys.executable, str(SCRIPT), "--url", url, "--out", str(tmp_path / "run"), "--no-progress"]
    done = subprocess.run([*command, "--requests", "3", "--warmup", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "none of the 3 measured requests was answered 200" in done.stderr
    assert json.loads((tmp_path / "run.json").read_text())["errors"] == {"ConnectError": 3}


def assert_ordered(summary: dict[str, float]) -> None:
    assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_closed_loop_over_every_format(served_url: str, tmp_path: Path) -> None:
    report, printed = run_loadtest(
        served_url,
        tmp_path,
        *("--requests", "60", "--concurrency", "4", "--warmup", "5"),
        *("--sizes", "16:2,32x8x4", "--formats", "npy,json,npz", "--kernels", "numpy,auto"),
    )
    assert report["requests"] == report["ok"] == 60 and report["errors"] == {}
    assert report["latency_ms"]["count"] == 60
    assert_ordered(report["latency_ms"])
    assert report["throughput_rps"] > 0 and report["server"]["backend"] == "cpu"
    for phase in ("queue", "h2d", "kernel", "d2h", "total", loadtest.CLIENT_SIDE):
        assert report["server_ms"][phase]["count"] == 60
        assert_ordered(report["server_ms"][phase])
    samples = report["samples"]
    assert {s["format"] for s in samples} == {"npy", "json", "npz"}
    assert {s["size"] for s in samples} == {"16x16x16", "32x8x4"} and {s["kernel"] for s in samples} == {
        "numpy",
        "auto",
    }
    assert sum(group["latency_ms"]["count"] for group in report["by_request"]) == 60
    assert all(s["latency_ms"] >= s["server_ms"]["total"] for s in samples)
    assert "client latency" in printed and "server queue" in printed and "errors: none" in printed
    assert f"(cpu backend, {platform.machine()})" in printed, "the devices /v1/info lists"


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_open_loop_starts_requests_at_the_rate(served_url: str, tmp_path: Path) -> None:
    report, _ = run_loadtest(served_url, tmp_path, "--mode", "open", "--rate", "40", "--duration", "1", "--warmup", "0")
    assert report["requests"] == report["ok"] == 40 and report["errors"] == {}
    assert sorted(s["start_s"] for s in report["samples"]) == pytest.approx([i / 40 for i in range(40)])
    assert_ordered(report["latency_ms"])


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_errors_are_counted_by_status(served_url: str, tmp_path: Path) -> None:
    report, printed = run_loadtest(served_url, tmp_path, "--requests", "12", "--kernels", "numpy:1,no-such-kernel:1")
    assert report["requests"] == 12
    assert report["ok"] + report["errors"]["422"] == 12 and report["errors"]["422"] > 0
    assert report["latency_ms"]["count"] == report["ok"]
    assert f"422: {report['errors']['422']}" in printed


def test_summarize() -> None:
    summary = loadtest.summarize([float(v) for v in range(1, 101)])
    assert (summary["count"], summary["mean"], summary["max"]) == (100, 50.5, 100)
    assert (summary["p50"], summary["p90"], summary["p99"]) == pytest.approx((50.5, 90.1, 99.01))
    assert loadtest.summarize([]) == {"count": 0}


def test_mixes_and_shapes() -> None:
    assert loadtest.parse_mix("256:3,64x8x16", loadtest.parse_shape) == [((256, 256, 256), 3.0), ((64, 8, 16), 1.0)]
    assert loadtest.parse_mix("npy,json:0.5", loadtest.parse_format) == [("npy", 1.0), ("json", 0.5)]
    for bad in ("0", "2x3", "64:-1", "64:nan", "64:inf", "npz"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            loadtest.parse_mix(bad, loadtest.parse_shape)


def test_the_report_goes_to_out_with_json_and_png_added_whatever_dots_out_holds(tmp_path: Path) -> None:
    args = loadtest.parse_args(["--requests", "1", "--out", str(tmp_path / "run.v2")])
    report = loadtest.build_report(args, [], 1.0, {})
    loadtest.write_report(report, tmp_path / "run.v2", Console(file=io.StringIO()))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.v2.json", "run.v2.png"]


@pytest.mark.parametrize(
    "bad",
    [
        *(["--duration", value] for value in ("0", "-1", "nan", "inf")),
        *(["--mode", "open", "--rate", value] for value in ("nan", "inf")),
        *(["--wait-ready", value] for value in ("-1", "nan")),
        *(["--timeout", value] for value in ("0", "nan", "1e9")),
        ["--tile", "0"],
        ["--sizes", "8:nan"],
    ],
)
def test_numbers_that_would_run_forever_run_nothing_or_end_in_a_traceback_are_refused(
    bad: list[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exited:
        loadtest.parse_args([*bad, "--out", str(tmp_path / "run")])
    assert exited.value.code == 2


def test_an_out_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "taken.json").mkdir()
    for out in (tmp_path / "file" / "run", tmp_path / "taken"):
        with pytest.raises(SystemExit) as exited:
            loadtest.parse_args(["--out", str(out)])
        assert exited.value.code == 2
    assert loadtest.parse_args(["--out", str(tmp_path / "new" / "run")]).out == str(tmp_path / "new" / "run")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file", "new", "taken.json"], "no file left behind"
    assert not list((tmp_path / "new").iterdir())
