"""scripts/bench_shared_memory.py on a tiny cell on the CPU backend (system shared memory only; the ceilings and
the CUDA cell need a GPU): its JSON report read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import import_script, run_script

pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the test extra")


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_the_system_cell_is_measured_and_checked(tmp_path: Path) -> None:
    done = run_script(
        "bench_shared_memory",
        *("--backend", "cpu"),
        *("--size", "128", "--clients", "2", "--workers", "2", "--duration", "1", "--out", str(tmp_path)),
        timeout_s=240,
    )
    report = json.loads((tmp_path / "bench-shared-memory.json").read_text())
    assert report["ceilings"] == {}
    (cell,) = report["cells"]
    assert cell["kind"] == "system" and cell["clients"] == 2 and cell["products"] > 0 and cell["devices"] == "0"
    assert cell["products_per_s"] > 0 and cell["over_ceiling"] is None and cell["over_first_setting"] == 1.0
    assert cell["wrong"] == 0 and cell["answers_checked"] == cell["products"] + 2  # each client's first, then all
    assert cell["worst_relative_error"] < 1e-5  # float32 against float64, k = 128
    assert "devices 0     system" in done.stdout and "0 wrong" in done.stdout
    assert not list(Path("/dev/shm").glob("bench-*"))  # every client's regions destroyed


def test_device_settings_are_parsed() -> None:
    bench = import_script("bench_shared_memory")
    assert bench.parse_args(["--devices", "0", "0,1"]).devices == [[0], [0, 1]]
    assert bench.parse_args([]).devices == [[0]]
    with pytest.raises(SystemExit):
        bench.parse_args(["--devices", "zero"])
