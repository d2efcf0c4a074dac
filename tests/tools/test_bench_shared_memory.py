"""scripts/bench_shared_memory.py on a tiny cell on the CPU backend (system shared memory only; the ceilings and
the CUDA cell need a GPU): its JSON report read back, the clients measured alone against the stand-in, and a run that
measured its clients failing; the stand-in itself answering tritonclient as the service does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from matmul_tools.standin import standing_in
from tests.scripts import ROOT, import_script, run_script

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
    assert cell["kernels"] == ["numpy"]  # the service's own metrics, read before and after the cell
    assert "devices 0       system" in done.stdout and "0 wrong" in done.stdout
    assert not list(Path("/dev/shm").glob("bench-*"))  # every client's regions destroyed
    (alone,) = report["clients_alone"]
    assert alone["kind"] == "system" and alone["products_per_s"] > 0 and alone["client_cpu_seconds_per_s"] > 0
    assert cell["over_clients_alone"] == pytest.approx(cell["products_per_s"] / alone["products_per_s"])
    assert cell["client_bound"] is False and "clients alone system" in done.stdout


@pytest.mark.timeout(300)
def test_a_run_whose_cells_reach_the_clients_own_rate_fails_saying_so(tmp_path: Path) -> None:
    """--client-bound 0: every cell is at or above that share of the clients' rate, so the run measured its clients
    (as the head's script did, near 60 products/s, before its checks stopped waking BLAS threads): exit 2."""
    arguments = ["--backend", "cpu", "--size", "64", "--clients", "1", "--workers", "1", "--duration", "0.5"]
    command = [sys.executable, str(ROOT / "scripts" / "bench_shared_memory.py"), *arguments]
    command += ["--client-bound", "0", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CLIENT-BOUND: devices 0 system reached" in done.stderr and "run more --clients" in done.stderr
    (cell,) = json.loads((tmp_path / "bench-shared-memory.json").read_text())["cells"]
    assert cell["client_bound"] is True and cell["wrong"] == 0


def test_the_stand_in_answers_tritonclient_at_once_with_the_outputs_asked_for() -> None:
    import tritonclient.http as httpclient

    with standing_in() as url:
        triton = httpclient.InferenceServerClient(url=url.removeprefix("http://"))
        try:
            triton.register_system_shared_memory("region", "/region", 1024)
            inputs = [httpclient.InferInput("A", [3, 5], "FP32"), httpclient.InferInput("B", [5, 7], "FP32")]
            for tensor in inputs:
                tensor.set_data_from_numpy(np.ones(tensor.shape(), np.float32))
            wanted = httpclient.InferRequestedOutput("C")
            wanted.set_shared_memory("region", 84, offset=16)
            answer = triton.infer("matmul", inputs, outputs=[wanted]).get_response()
            triton.unregister_system_shared_memory("region")
        finally:
            triton.close()
    (output,) = answer["outputs"]
    assert answer["model_name"] == "matmul" and output["name"] == "C" and output["shape"] == [3, 7]
    assert output["parameters"] == {  # as the request asked, tritonclient's binary_data too
        "binary_data": False,
        "shared_memory_region": "region",
        "shared_memory_byte_size": 84,
        "shared_memory_offset": 16,
    }


def test_the_clients_check_their_answers_without_blas() -> None:
    """np.linalg.norm's dot wakes BLAS threads that spin idle between answers; the check is the same number."""
    bench = import_script("bench_shared_memory")
    rng = np.random.default_rng(3)
    found, expected = rng.standard_normal((64, 300)), rng.standard_normal((64, 300))
    wanted = np.linalg.norm(found - expected) / np.linalg.norm(expected)
    assert bench._relative_error(found, expected) == pytest.approx(wanted, rel=1e-12)
    assert bench.ONE_THREAD["OPENBLAS_NUM_THREADS"] == "1"


def test_device_settings_are_parsed() -> None:
    bench = import_script("bench_shared_memory")
    assert bench.parse_args(["--devices", "0", "0,1"]).devices == [[0], [0, 1]]
    assert bench.parse_args([]).devices == [[0]]
    with pytest.raises(SystemExit):
        bench.parse_args(["--devices", "zero"])
