"""scripts/profile_client.py on tiny products against a CPU-backend server it starts: the client's and the raw
socket's cost per request measured on the same request, and the client's functions listed from its profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from matmul_tools.service import free_port
from tests.scripts import ROOT, import_script, run_script

profile_client = import_script("profile_client")


@pytest.mark.timeout(300)  # a server started, then two small loops and a profiled one per size
def test_the_client_and_a_raw_socket_are_measured_on_the_same_request(tmp_path: Path) -> None:
    done = run_script(
        "profile_client", "--sizes", "8", "16", "--requests", "40", "--top", "5", "--out", str(tmp_path), timeout_s=240
    )
    report = json.loads((tmp_path / "profile-client.json").read_text())
    assert [cell["size"] for cell in report["cells"]] == [8, 16]
    for cell in report["cells"]:
        assert cell["requests"] == 40
        for way in ("client", "raw"):
            assert cell[way]["wall_us"] > 0 and cell[way]["cpu_us"] > 0
        functions = cell["client_functions"]
        assert len(functions) == 5 and all(row["calls_per_request"] > 0 for row in functions)
        assert [row["own_us"] for row in functions] == sorted((row["own_us"] for row in functions), reverse=True)
    assert "client's own CPU us a request" in done.stdout and "MatmulClient's functions" in done.stdout


@pytest.mark.parametrize(
    "bad", [["--requests", "0"], ["--requests", "-2"], ["--sizes", "0"], ["--sizes", "8", "-1"], ["--top", "0"]]
)
def test_counts_and_sizes_that_profile_nothing_are_refused(bad: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        profile_client.parse_args([*bad, "--out", str(tmp_path)])
    assert exited.value.code == 2


def test_an_out_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exited:
        profile_client.parse_args(["--out", str(tmp_path / "file")])
    assert exited.value.code == 2


@pytest.mark.timeout(90)  # the script in a subprocess, with its own 60 s limit
def test_a_server_that_does_not_answer_is_said_without_a_traceback(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    command = [sys.executable, str(ROOT / "scripts" / "profile_client.py"), "--url", url, "--out", str(tmp_path)]
    done = subprocess.run([*command, "--sizes", "8", "--requests", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "did not answer" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
