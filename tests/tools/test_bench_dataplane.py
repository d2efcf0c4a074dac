"""scripts/bench_dataplane.py on tiny cells against this checkout (baseline: this checkout too; no LitServe, which is
not a dependency): its JSON report read back and checked against its own figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

# three servers and a script in subprocesses
pytestmark = pytest.mark.timeout(300)


def test_every_cell_measured_and_the_ratios_are_of_its_figures(tmp_path: Path) -> None:
    done = run_script(
        "bench_dataplane",
        *("--backend", "cpu", "--workers", "2"),
        *("--big", "64", "--small", "8", "--big-concurrency", "2", "--v2-concurrency", "4", "--json-concurrency", "4"),
        *("--baseline", str(ROOT), "--baseline-workers", "1", "--ready-workers", "1"),
        *("--client-processes", "2", "--duration", "0.5", "--warmup", "0.2", "--out", str(tmp_path)),
        timeout_s=240,
    )
    report = json.loads((tmp_path / "bench-dataplane.json").read_text())
    this = report["this"]
    assert set(this) == {"auto", "big", "echo", "big-v2", "v2", "json"}
    this.pop("auto")  # the server's table of what auto runs (empty on the CPU backend)
    for found in [*this.values(), report["baseline"]]:
        assert set(found["answers"]) == {"200"} and found["answers"]["200"] > 0
        assert found["ok_per_s"] == pytest.approx(found["answers"]["200"] / found["seconds"])
    for name in ("big", "big-v2", "v2", "json"):  # every product answer says the batch it ran in
        assert this[name]["mean_batch_size"] >= 1
    assert this["echo"]["mean_batch_size"] is None
    ratios = report["ratios"]
    assert ratios["big /matmul products/s over /v1/echo req/s"] == this["big"]["ok_per_s"] / this["echo"]["ok_per_s"]
    big_v2 = ratios["big v2 binary products/s over /v1/echo req/s"]
    assert big_v2 == this["big-v2"]["ok_per_s"] / this["echo"]["ok_per_s"]
    assert ratios["big /matmul, this over the baseline"] == this["big"]["ok_per_s"] / report["baseline"]["ok_per_s"]
    assert report["litserve"] == {} and set(report["ready_s"]) == {"1"} and report["ready_s"]["1"] > 0
    assert (tmp_path / "server-this.log").exists() and (tmp_path / "server-baseline.log").exists()
    assert "ready with 1 HTTP workers" in done.stdout
