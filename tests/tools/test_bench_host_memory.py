"""scripts/bench_host_memory.py on small messages: the host-only figures everywhere, the device's modes on a GPU."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.scripts import import_script, run_script

SMALL = ("--threads", "2", "--copy-mib", "8", "--connections", "2", "--message-mib", "4", "--seconds", "0.5")


def test_without_a_device_it_reports_the_copy_and_the_receive_alone(tmp_path: Path) -> None:
    out = tmp_path / "host-memory.json"
    done = run_script("bench_host_memory", *SMALL, "--rounds", "2", "--no-device", "--out", str(out), timeout_s=60)
    report = json.loads(out.read_text())
    assert report["device"] is False
    assert report["copy"]["alone_gb_per_s"] > 0 and "beside_device_gb_per_s" not in report["copy"]
    assert [set(round_) for round_ in report["receive_gb_per_s"]] == [{"none"}, {"none"}]
    assert all(round_["none"] > 0 for round_ in report["receive_gb_per_s"])
    assert "| receive, 2 connections, round 2 |" in done.stdout and "device copies" not in done.stdout


@pytest.mark.gpu
def test_on_a_device_every_mode_runs_and_is_compared_with_the_receive_alone(tmp_path: Path) -> None:
    out = tmp_path / "host-memory.json"
    run_script("bench_host_memory", *SMALL, "--rounds", "1", "--out", str(out), timeout_s=120)
    report = json.loads(out.read_text())
    assert report["device"] is True
    assert report["copy"]["beside_device_gb_per_s"] > 0 and report["copy"]["device_copies_gb_per_s"] > 0
    (received,) = report["receive_gb_per_s"]
    assert set(received) == {"none", "after", "streamed"} and min(received.values()) > 0
    (ratios,) = report["receive_over_none"]
    assert ratios == pytest.approx({mode: received[mode] / received["none"] for mode in ("after", "streamed")})


@pytest.mark.parametrize("mode", ["after", "streamed"])
def test_a_mode_that_copies_to_the_device_is_refused_without_one(mode: str) -> None:
    bench = import_script("bench_host_memory")
    receiving, sending = socket.socketpair()
    with receiving, sending, pytest.raises(ValueError, match=f"the '{mode}' mode copies to a device"):
        bench.Receiver(receiving, 1 << 20, mode, 1 << 20, device=False)
