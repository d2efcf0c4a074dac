"""scripts/bench_stacks.py on the CPU backend, briefly: every cell answered and checked, its ratios taken; and the
stand-in answering stacks with answers of their size, as the benchmark's clients-alone cells need."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from matmul_client.client import MatmulClient
from matmul_tools.standin import standing_in
from tests.scripts import ROOT, import_script


def test_the_stand_in_answers_a_stack_with_the_stack_s_shape() -> None:
    with standing_in() as url, MatmulClient(url) as client:
        assert client.matmul(np.ones((5, 3, 4), np.float32), np.ones((4, 2), np.float32)).shape == (5, 3, 2)
        assert client.matmul(np.ones((3, 4), np.float32), np.ones((1, 4, 2), np.float32)).shape == (1, 3, 2)


def test_the_stand_in_echoes_the_first_answer_bytes_as_the_service_does() -> None:
    body = bytes(range(200))
    with standing_in() as url:
        assert httpx.post(f"{url}/v1/echo", content=body).content == body
        assert httpx.post(f"{url}/v1/echo", params={"answer_bytes": 7}, content=body).content == body[:7]


def test_single_products_and_stacks_are_measured_against_each_other_and_the_echo(tmp_path: Path) -> None:
    """Run as users run it (its client processes spawned import it as their main module), two rounds: each cell's
    ratios against its own round's cells, and the rounds' ratios to the echo together."""
    bench = import_script("bench_stacks")
    out = tmp_path / "bench-stacks.json"
    argv = ["--backend", "cpu", "--sizes", "16", "--stacks", "1,50", "--duration", "0.5", "--warmup", "0.2"]
    argv += ["--client-processes", "1", "--connections", "1:2,50:2", "--standin-processes", "1", "--rounds", "2"]
    command = [sys.executable, str(ROOT / "scripts" / "bench_stacks.py"), *argv, "--out", str(out)]
    done = subprocess.run(command, timeout=240, text=True, capture_output=True)
    assert done.returncode in (0, 2), done.stderr  # 2: a cell at its clients' own rate, which a 2-core runner may reach
    assert "Server-Timing, mean ms a request:" in done.stdout
    assert "Over the echo of its bytes, round by round and the rounds together:" in done.stdout
    report = json.loads(out.read_text())
    cells = {(cell["kind"], cell["batch"], cell["round"]): cell for cell in report["cells"]}
    assert set(cells) == {(kind, batch, round_) for kind in bench.CLIENTS for batch in (1, 50) for round_ in (0, 1)}
    for (kind, batch, round_), cell in cells.items():
        assert cell["answers_per_s"] > 0 and cell["errors"] == {} and cell.get("wrong", []) == []
        if kind != "echo":
            assert cell["products_per_s"] == cell["answers_per_s"] * batch
            assert cell["over_single"] == cell["products_per_s"] / cells[(kind, 1, round_)]["products_per_s"]
            assert cell["over_echo"] == cell["answers_per_s"] / cells[("echo", batch, round_)]["answers_per_s"]
        assert "over_clients_alone" in cell
        # the raw product cells say where the server's time went, each stage's mean over the cell's answers
        stages = cell.get("server_timing_ms", {})
        if kind in ("raw-npy", "raw-v2"):
            assert {"read", "decode", "handoff", "kernel", "total"} <= set(stages)
            assert 0 <= stages["kernel"] <= stages["total"]
        else:
            assert stages == {}  # the echo reports no stages; the client's cells are not read this way
    # each (n, B)'s clients in order, then in reverse the next round, so that no client always goes first
    order = [(cell["batch"], cell["round"], cell["kind"]) for cell in report["cells"]]
    for batch in (1, 50):
        assert [kind for b, r, kind in order if (b, r) == (batch, 0)] == list(bench.CLIENTS)
        assert [kind for b, r, kind in order if (b, r) == (batch, 1)] == list(bench.CLIENTS)[::-1]
    # the stand-in's cells are measured once, against which every round's cell is taken
    assert {cell["round"] for cell in report["clients_alone"]} == {0}
    together = {(row["kind"], row["batch"]): row for row in report["over_echo_by_rounds"]}
    assert set(together) == {(kind, batch) for kind in bench.CLIENTS if kind != "echo" for batch in (1, 50)}
    for (kind, batch), row in together.items():
        rounds = [cells[(kind, batch, round_)] for round_ in (0, 1)]
        echoes = [cells[("echo", batch, round_)] for round_ in (0, 1)]
        assert row["over_echo_by_round"] == [cell["over_echo"] for cell in rounds]
        answers, echoed = sum(cell["answers_per_s"] for cell in rounds), sum(echo["answers_per_s"] for echo in echoes)
        assert row["over_echo"] == answers / echoed


def test_rounds_must_be_at_least_one() -> None:
    bench = import_script("bench_stacks")
    assert bench.parse_args([]).rounds == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
