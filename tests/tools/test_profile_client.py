"""scripts/profile_client.py on tiny products against a CPU-backend server it starts: the client's and the raw
socket's cost per request measured on the same request, and the client's functions listed from its profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import run_script


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
