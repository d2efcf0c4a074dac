"""scripts/scaleout_local.py for a few seconds: two CPU-backend replicas behind the distribution's nginx."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.scripts import import_script, run_script

scaleout = import_script("scaleout_local")
pytestmark = [
    pytest.mark.skipif(
        scaleout.find_nginx() is None, reason="nginx is not installed (apt-get install nginx): the test runs it"
    ),
    pytest.mark.timeout(300),  # its script runs 180 s at most, after starting nginx and two replicas
]


def test_two_replicas_behind_nginx_share_the_load_without_errors(tmp_path: Path) -> None:
    done = run_script(
        "scaleout_local",
        *("--out", str(tmp_path / "run"), "--replicas", "2", "--duration", "2", "--concurrency", "4"),
        *("--warmup", "4", "--sizes", "32"),
        timeout_s=180,
    )
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["errors"] == {} and report["ok"] == report["requests"] > 0
    replicas = report["scaleout"]["replicas"]
    assert len(replicas) == 2 and all(replica["matmul_requests"] > 0 for replica in replicas), replicas
    assert sum(replica["matmul_requests"] for replica in replicas) == report["requests"] + 4, (
        "every request reached one"
    )
    assert report["scaleout"]["request_id_passed_through"]
    assert "Requests per replica" in done.stdout and "X-Request-ID through nginx and back: yes" in done.stdout


def test_the_template_gets_one_upstream_line_per_replica() -> None:
    site = scaleout.render_site(scaleout.TEMPLATE.read_text(), "127.0.0.1:8080", ["127.0.0.1:1", "127.0.0.1:2"])
    servers = re.findall(r"^\s*server ([\d.:]+) max_fails", site, re.MULTILINE)
    assert servers == ["127.0.0.1:1", "127.0.0.1:2"] and "listen 127.0.0.1:8080;" in site
    assert "${" not in site
    with pytest.raises(ValueError, match="NGINX_UPSTREAM"):
        scaleout.render_site("server { listen ${NGINX_LISTEN}; }", "80", ["a:1"])
