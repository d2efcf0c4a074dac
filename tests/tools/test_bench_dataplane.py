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
    assert set(this) == {"auto", "big", "echo", "v2_rounds", "v2", "json"}
    this.pop("auto")  # the server's table of what auto runs (empty on the CPU backend)
    rounds = this.pop("v2_rounds")
    assert len(rounds) == 2
    cells = [*this.values(), *(found[name] for found in rounds for name in ("big-v2", "echo-v2"))]
    for found in [*cells, report["baseline"]]:
        assert set(found["answers"]) == {"200"} and found["answers"]["200"] > 0
        assert found["ok_per_s"] == pytest.approx(found["answers"]["200"] / found["seconds"])
        assert found["mean_latency_ms"] == pytest.approx(found["connections"] / found["ok_per_s"] * 1e3)
    for found in cells:  # the server's side, from its /metrics (the reads themselves left out)
        (route,) = found["request_ms"]
        assert route in {"/matmul", "/v1/echo", "/v2/models/{model}/infer"} and found["request_ms"][route] > 0
    for name in ("big", "v2", "json"):  # every product answer says the batch it ran in, and its stages
        assert this[name]["mean_batch_size"] >= 1
        timing = this[name]["server_timing_ms"]
        assert set(timing) == {"read", "decode", "stage", "handoff", "queue", "h2d", "kernel", "d2h", "encode", "total"}
        assert 0 < timing["total"] < this[name]["request_ms"][next(iter(this[name]["request_ms"]))]
    assert this["echo"]["mean_batch_size"] is None and this["echo"]["server_timing_ms"] == {}
    ratios = report["ratios"]
    assert ratios["big /matmul products/s over /v1/echo req/s"] == this["big"]["ok_per_s"] / this["echo"]["ok_per_s"]
    for found, by_rate, by_payload in zip(
        rounds,
        ratios["big v2 products/s over echoes/s of its bytes, by round"],
        ratios["big v2 payload GB/s over its echo's, by round"],
        strict=True,
    ):
        assert by_rate == found["big-v2"]["ok_per_s"] / found["echo-v2"]["ok_per_s"]
        assert by_payload == found["big-v2"]["payload_gb_per_s"] / found["echo-v2"]["payload_gb_per_s"]
        assert found["big-v2"]["mean_batch_size"] >= 1 and found["echo-v2"]["mean_batch_size"] is None
    together = ratios["big v2 products/s over echoes/s of its bytes, the rounds together"]
    assert together == sum(found["big-v2"]["ok_per_s"] for found in rounds) / sum(
        found["echo-v2"]["ok_per_s"] for found in rounds
    )
    assert f"{'big v2 products/s over echoes/s of its bytes, the rounds together':48s} {together:.3f}" in done.stdout
    # the echo of the v2 exchange's bytes moves what a product moves, within the answer's JSON header
    big_v2, echo_v2 = rounds[0]["big-v2"], rounds[0]["echo-v2"]
    per_product = big_v2["payload_gb_per_s"] / big_v2["ok_per_s"]
    assert echo_v2["payload_gb_per_s"] / echo_v2["ok_per_s"] == pytest.approx(per_product, rel=0.1)
    alone = report["clients_alone"]
    assert set(alone) == {"big", "echo", "big-v2", "echo-v2"}
    measured = {"big": this["big"], "echo": this["echo"], "big-v2": big_v2, "echo-v2": echo_v2}
    for name, found in alone.items():  # the stand-in answers each at once, with an answer of the same size
        assert set(found["answers"]) == {"200"} and "request_ms" not in found
        bytes_each = found["payload_gb_per_s"] / found["ok_per_s"]
        assert bytes_each == pytest.approx(measured[name]["payload_gb_per_s"] / measured[name]["ok_per_s"], rel=0.1)
    assert ratios["each big cell over its clients alone"] == [
        found["ok_per_s"] / alone[name]["ok_per_s"]
        for name, found in [("big", this["big"]), ("echo", this["echo"])]
        + [(name, found[name]) for found in rounds for name in ("big-v2", "echo-v2")]
    ]
    assert ratios["big /matmul, this over the baseline"] == this["big"]["ok_per_s"] / report["baseline"]["ok_per_s"]
    assert report["litserve"] == {} and set(report["ready_s"]) == {"1"} and report["ready_s"]["1"] > 0
    assert (tmp_path / "server-this.log").exists() and (tmp_path / "server-baseline.log").exists()
    assert "ready with 1 HTTP workers" in done.stdout
