"""scripts/bench_cold_start.py: the default service started cold and warm on the CPU backend, each start timed and
the engine's account of it read from its log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import import_script, run_script

bench = import_script("bench_cold_start")

GPU_START = """\
2026-11-27 21:03:18,941 supervisor INFO engine process 593 started for device 0
2026-11-27 21:03:21,002 engine[593] INFO app.engine.gpu: kernels loaded on device 0: 43 compiled now, the rest from a
2026-11-27 21:03:32,925 engine[593] INFO app.engine.device_worker: gpu backend ready on NVIDIA H100 80GB HBM3 in 12.28 s
"""


def test_the_engines_account_is_read_from_its_log() -> None:
    assert bench.engine_account(GPU_START) == {
        "device": "NVIDIA H100 80GB HBM3",
        "engine_ready_s": 12.28,
        "compiled": 43,
    }
    assert bench.engine_account("no engine here") == {"device": None, "engine_ready_s": None, "compiled": None}


@pytest.mark.timeout(300)  # kernels compiled ahead for one device, three servers started
def test_cold_and_warm_starts_are_timed_side_by_side(tmp_path: Path) -> None:
    done = run_script(
        "bench_cold_start", "--backend", "cpu", "--workers", "1", "--warm", "1", "--devices", "8.0",
        "--out", str(tmp_path), timeout_s=280,
    )  # fmt: skip
    report = json.loads((tmp_path / "cold-start.json").read_text())
    assert report["workers"] == 1 and report["devices_compiled_ahead"] == ["8.0"]
    assert [row["start"] for row in report["starts"]] == ["nothing compiled", "image", "warm 1"]
    for row in report["starts"]:
        assert row["ready_s"] > 0 and row["engine_ready_s"] is not None and row["compiled"] is None
        assert row["cupy_compiled"] == 0  # the CPU backend never imports CuPy
        assert (tmp_path / f"server-{row['start'].replace(' ', '-')}.log").is_file()  # no spaces in a file's name
    assert "nothing compiled" in done.stdout and "ready (s)" in done.stdout
