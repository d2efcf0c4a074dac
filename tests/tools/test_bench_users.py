"""scripts/bench_users.py on its smallest grid (CPU backend, one server, every client kind): its JSON report read
back and checked, its chart drawn again from that JSON; and the pieces it checks answers and reads raw ones with."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from matmul_tools.raw_load import read_whole_answer
from tests.scripts import import_script, run_script

bench = import_script("bench_users")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)  # a server and client processes in subprocesses
def test_every_cell_of_the_smallest_grid_answers_right(tmp_path: Path) -> None:
    out = tmp_path / "bench-users.json"
    done = run_script(
        "bench_users",
        *("--backend", "cpu", "--servers", "workers=1", "--sizes", "16,64"),
        *("--concurrency", "16:2,64:3", "--processes", "2", "--seconds", "0.5", "--warmup", "0.2"),
        *("--out", str(out), "--logs", str(tmp_path / "logs")),
        timeout_s=150,
    )
    report = json.loads(out.read_text())
    alone = [cell for cell in report["cells"] if cell["server"] == "stand-in"]
    cells = [cell for cell in report["cells"] if cell["server"] != "stand-in"]
    assert [(cell["size"], cell["client"]) for cell in alone] == [
        (n, kind) for n in (16, 64) for kind in ("client", "triton", "raw-npy", "raw-v2")
    ]  # first, and with no triton-grpc: the stand-in speaks HTTP only
    assert "triton-grpc is not measured alone: the stand-in speaks HTTP only" in report["notes"]
    for cell in alone:  # the stand-in's answers are zeros: taken, not checked
        assert cell["failure"] is None and cell["errors"] == {} and cell["products_per_s"] > 0, cell
        assert cell["checked_connections"] == 0 and cell["unchecked_connections"] == 0
    assert [(cell["size"], cell["client"]) for cell in cells] == [
        (n, kind) for n in (16, 64) for kind in ("client", "triton", "triton-grpc", "raw-npy", "raw-v2")
    ]
    ceilings = {(cell["size"], cell["client"]): cell["products_per_s"] for cell in alone}
    for cell in cells:
        if cell["client"] == "triton-grpc":
            assert "over_clients_alone" not in cell
        else:
            ceiling = ceilings[cell["size"], cell["client"]]
            assert cell["over_clients_alone"] == cell["products_per_s"] / ceiling
            assert cell["client_bound"] == (cell["over_clients_alone"] >= bench.CLIENT_BOUND)
    for cell in cells:
        assert cell["failure"] is None and cell["wrong"] == [] and cell["errors"] == {}, cell
        assert cell["products_per_s"] > 0 and cell["products_per_s"] == cell["products"] / cell["seconds"]
        assert 0 < cell["latency_ms"]["p50"] <= cell["latency_ms"]["p99"]
        assert cell["checked_connections"] == cell["concurrency"] and cell["unchecked_connections"] == 0
        assert cell["processes"] == 2
    for cell in report["cells"]:  # the client processes' CPU over the window, a product: never none, never more
        cpu = cell["client_cpu_us"]  # than every core of the machine for the whole window
        assert cpu["user"] > 0 and cpu["system"] >= 0, cell
        assert (cpu["user"] + cpu["system"]) * cell["products"] <= 1e6 * cell["seconds"] * (os.cpu_count() or 1) * 1.1
    by_kind = {(cell["size"], cell["client"]): cell for cell in cells}
    for n in (16, 64):
        client, raw = by_kind[n, "client"], by_kind[n, "raw-npy"]
        assert client["ratio_to_raw"] == client["products_per_s"] / raw["products_per_s"]
        raw_v2 = by_kind[n, "raw-v2"]
        for over_v2 in ("triton", "triton-grpc"):
            triton = by_kind[n, over_v2]
            assert triton["ratio_to_raw"] == triton["products_per_s"] / raw_v2["products_per_s"]
        assert raw["ratio_to_raw"] is None
        for sender in (client, raw, raw_v2):  # each one's own cost, from its answers' Server-Timing
            cost = sender["client_cost"]
            assert cost["products"] == sender["products"] and cost["server_total_ms"] > 0
            assert cost["client_ms"] + cost["server_total_ms"] == pytest.approx(sender["latency_ms"]["mean"])
        assert "client_cost" not in by_kind[n, "triton"]
    server = report["servers"]["workers=1"]
    assert server["http_workers"] == 1 and server["backend"] == "cpu"
    assert server["settings"] == {"MATMUL_HTTP_WORKERS": "1", "MATMUL_BACKEND": "cpu"}
    assert report["host"]["cpu_count"] >= 1 and report["server_failures"] == {}
    assert "| workers=1 |   64 |    3 | triton-grpc |" in done.stdout
    assert "Each sender's own cost per product" in done.stdout and "processes' CPU a product (us)" in done.stdout
    assert "| workers=1 |   64 |    3 | raw-v2  |" in done.stdout.split("over its clients alone")[1]
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)

    again = tmp_path / "again.png"
    run_script("bench_users", "--plot-only", str(out), "--png", str(again), timeout_s=60)
    assert again.read_bytes().startswith(PNG_MAGIC)


def test_rounds_reverse_the_clients_every_other_time_and_ratios_stay_within_their_round(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench._schedule([64, 512], ["client", "raw-npy"], 2) == [
        (64, 0, "client"), (64, 0, "raw-npy"), (64, 1, "raw-npy"), (64, 1, "client"),
        (512, 0, "client"), (512, 0, "raw-npy"), (512, 1, "raw-npy"), (512, 1, "client"),
    ]  # fmt: skip
    figures = {(0, "client"): 90.0, (0, "raw-npy"): 100.0, (1, "client"): 120.0, (1, "raw-npy"): 100.0}
    cells = [
        {"server": "default", "size": 64, "concurrency": 4, "client": kind, "round": round_, "products_per_s": found}
        | {"failure": None, "errors": {}, "wrong": []}
        for (round_, kind), found in figures.items()
    ]
    bench.add_ratios(cells)
    assert [cell["ratio_to_raw"] for cell in cells] == [0.9, None, 1.2, None]
    assert bench.mean_products(cells) == {("default", 64, "client"): 105.0, ("default", 64, "raw-npy"): 100.0}
    bench.print_report({"cells": cells, "servers": {"default": {}}, "notes": []})
    assert "| default |   64 | client | 0.900 / 1.200   |         1.050 |" in capsys.readouterr().out


def test_a_cell_at_its_clients_own_rate_is_client_bound_and_the_stand_in_cells_are_not_judged() -> None:
    def cell(server: str, client: str, products_per_s: float) -> dict[str, object]:
        return {"server": server, "size": 64, "client": client, "products_per_s": products_per_s}

    cells = [
        cell("stand-in", "client", 1000.0),
        cell("stand-in", "raw-npy", 4000.0),
        cell("default", "client", 800.0),
        cell("default", "raw-npy", 1000.0),
        cell("default", "triton", 500.0),  # no stand-in cell of its kind: not judged
    ]
    bench.add_clients_alone(cells)
    assert cells[2]["over_clients_alone"] == 0.8 and cells[2]["client_bound"] is True
    assert cells[3]["over_clients_alone"] == 0.25 and cells[3]["client_bound"] is False
    assert "over_clients_alone" not in cells[0] and "over_clients_alone" not in cells[4]


def test_servers_and_sizes_are_parsed_with_their_settings() -> None:
    args = bench.parse_args(["--servers", "default,tuned,workers=4,workers=4", "--sizes", "64,512"])
    assert [(c.name, dict(c.settings), c.workers) for c in args.servers] == [
        ("default", {}, None),
        ("tuned", {"MATMUL_HTTP_WORKERS": "8", "MATMUL_BATCHING": "true", "MATMUL_MAX_QUEUE_DELAY_US": "500"}, 8),
        ("workers=4", {"MATMUL_HTTP_WORKERS": "4"}, 4),
    ]
    assert args.concurrency == {64: 64, 512: 16, 2048: 8, 4096: 8} and args.processes == 8
    assert args.out == Path("docs/bench/bench-users.json") and args.png == Path("docs/bench/bench-users.png")
    for wrong in (["--servers", "workers=0"], ["--sizes", "100"], ["--clients", "curl"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(wrong)


def test_connections_are_shared_out_over_the_processes() -> None:
    assert bench.split(64, 8) == [8] * 8
    assert bench.split(2, 8) == [1, 1], "no process without a connection"
    assert bench.split(7, 3) == [3, 2, 2]


def test_an_answer_off_by_one_term_or_of_another_shape_is_wrong() -> None:
    operands = bench.Operands(32, (0, 32, 0))
    c = (operands.a.astype(np.float64) @ operands.b).astype(np.float32)
    assert operands.mismatch(c) is None
    c[3, 4] += operands.a[3, 7] * operands.b[7, 4]
    assert "element (3, 4)" in (operands.mismatch(c) or "")
    assert operands.mismatch(c[:16]) == "the answer is 16x32, not 32x32"
    same, other = bench.Operands(32, (0, 32, 0)), bench.Operands(32, (0, 32, 1))
    assert np.array_equal(same.a, operands.a) and not np.array_equal(other.a, operands.a), "each connection its own"


def test_a_raw_answer_is_read_whole_to_be_checked() -> None:
    body = bytes(range(256)) * 20
    whole = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    ours, theirs = socket.socketpair()
    with ours, theirs:

        def send() -> None:
            for start in range(0, len(whole), 1000):
                theirs.sendall(whole[start : start + 1000])

        sender = threading.Thread(target=send)
        sender.start()
        answer, read = read_whole_answer(ours)
        sender.join()
    assert (answer.status, answer.size, bytes(read)) == (200, len(whole), body)


def test_a_plot_of_a_missing_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--plot-only", str(tmp_path / "missing.json")])
    assert exited.value.code == 2
