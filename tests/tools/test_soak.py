"""scripts/soak.py: five seconds against a real CPU-backend server, its JSON report read back; and its verdicts."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from app import codecs
from matmul_tools.bodies import npy_bytes
from matmul_tools.service import free_port, running_server, uvicorn_command
from tests.scripts import ROOT, import_script

soak = import_script("soak")
MAX_BODY_BYTES = 1 << 20
LIMITS = codecs.Limits(max_dim=1024, max_elements=1 << 20, max_result_elements=1 << 20)


@pytest.mark.timeout(300)  # a server and a script in subprocesses, each with its own 120 s limit
def test_five_seconds_of_mixed_requests_over_capacity(tmp_path: Path) -> None:
    port = free_port()
    env = {"MATMUL_BACKEND": "cpu", "MATMUL_QUEUE_SIZE": "2", "MATMUL_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    command = [
        *(sys.executable, str(ROOT / "scripts" / "soak.py"), "--url", f"http://127.0.0.1:{port}"),
        *("--minutes", "0.08", "--rate", "150", "--max-body-bytes", str(MAX_BODY_BYTES)),
        *("--memory-every", "1", "--out", str(tmp_path / "soak.json")),
    ]
    with running_server(uvicorn_command(port), port, env=env):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["passed"] and "PASSED" in done.stdout
    assert report["requests"] == sum(report["by_status"].values()) == 720, "150/s for 4.8 s"
    assert report["server"]["backend"] == "cpu"
    assert report["requests_by_client"] == [180] * 4, "four client processes, a quarter of the load each"
    valid, invalid, oversized = (report["by_kind"][kind] for kind in soak.KINDS)
    assert set(valid) <= {"200", "503", "504"} and valid["200"] > 0, "504: the probes with a 1 ms deadline"
    assert invalid and all(400 <= int(status) < 500 or status == "503" for status in invalid), invalid
    assert "413" in oversized and "422" in oversized, "over the body limit, and headers claiming too much"
    checks = report["checks"]
    assert checks["no_5xx_but_503_504"] == {"count": 0, "passed": True}
    assert checks["no_wrong_results"]["checked"] == valid["200"] and checks["no_wrong_results"]["wrong"] == 0
    summary = done.stdout[done.stdout.index(f"soak http://127.0.0.1:{port}:") :]  # after the progress lines
    assert report["wrong_answers"] == 0 and summary.startswith(f"soak http://127.0.0.1:{port}: 0 wrong answers of")
    rss, device = checks["rss"], checks["device_pool"]
    assert len(report["rss_timeline"]) >= 4 and checks["rss_under_load"]["passed"]
    assert rss["start_mib"] > 10 and rss["passed"] and rss["growth_mib"] == rss["end_mib"] - rss["start_mib"]
    assert device["start_mib"] == device["end_mib"] == 0, "the CPU backend has no device pool"


def test_each_valid_shape_is_also_sent_with_a_deadline_it_may_miss() -> None:
    probes = soak.valid_probes(np.random.default_rng(0), MAX_BODY_BYTES)
    hurried = [probe for probe in probes if probe.deadline_s is not None]
    shapes = [f"{m}x{k}x{n}" for m, k, n in soak.VALID_SHAPES]
    assert [probe.name.split()[1] for probe in hurried] == shapes * soak.VARIANTS
    assert all(probe.deadline_s == soak.TIGHT_DEADLINE_S and probe.params == {"dtype": "float32"} for probe in hurried)
    assert all(probe.operands is not None and probe.operands[0].dtype == np.float32 for probe in hurried)


@pytest.mark.anyio
async def test_a_500_a_wrong_product_or_memory_growth_fail_the_soak() -> None:
    """A server that answers 500 to what it cannot read and a wrong product to the rest; 503s are fine."""
    answers = iter([503, 200, 500] * 10)

    def server(request: httpx.Request) -> httpx.Response:
        status = next(answers)
        if status == 200:
            return httpx.Response(
                200, content=npy_bytes(np.zeros((8, 8))), headers={"content-type": "application/x-npy"}
            )
        return httpx.Response(status, json={"code": "internal_error", "message": "boom"})

    rng = np.random.default_rng(0)
    probes = {"valid": soak.valid_probes(rng, MAX_BODY_BYTES)[:1], "invalid": [], "oversized": []}
    async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://soak") as http:
        run = soak.Soak(http, probes, [("valid", 1.0)], seed=0, limit=8)
        await soak.open_loop(run, 1000.0, 3, float("inf"), lambda: None)
    args = soak.parse_args(["--max-rss-growth-mib", "10"])
    rss = {soak.RSS_METRIC: 100 * soak.MIB, soak.DEVICE_METRIC: 0.0}
    seen = soak.ClientResult(run.issued, run.samples, run.server_errors, run.wrong_results, (0.0, 1.0))
    timeline: list[dict[str, float | None]] = [{"s": 15.0, "rss_mib": 105.0}, {"s": 30.0, "rss_mib": None}]
    report = soak.build_report(args, [seen], {}, (rss, {**rss, soak.RSS_METRIC: 111 * soak.MIB}), timeline)
    assert report["rss_timeline"] == timeline
    assert report["by_status"] == {"503": 1, "200": 1, "500": 1}
    checks = report["checks"]
    assert checks["no_5xx_but_503_504"] == {"count": 1, "passed": False}
    assert report["server_errors"][0]["status"] == "500" and "boom" in report["server_errors"][0]["body"]
    assert checks["no_wrong_results"] == {"checked": 1, "wrong": 1, "passed": False}
    assert "over the float32 bound" in report["wrong_results"][0]["error"]
    assert not checks["rss"]["passed"] and checks["device_pool"]["passed"] and not report["passed"]
    assert checks["rss_under_load"] == {"readings": 1, "passed": False, "error": "fewer than two readings under load"}
    growing = [{"s": 15.0, "rss_mib": 300.0}, {"s": 30.0, "rss_mib": None}, {"s": 45.0, "rss_mib": 400.0}]
    steady = soak.build_report(args, [seen], {}, (rss, rss), growing)["checks"]["rss_under_load"]
    assert steady["growth_mib"] == 100.0 and steady["bound_mib"] == 64.0 and not steady["passed"]
    missing = soak.build_report(args, [seen], {}, ({}, {}), [])["checks"]["rss"]
    assert not missing["passed"] and soak.RSS_METRIC in missing["error"]


@pytest.mark.anyio
async def test_an_answer_carrying_another_requests_product_is_caught() -> None:
    """A server that answers each product request with the product of the one before it: the answers are real
    products of the right shape, just not their own. Every one is checked, and the variants of each request's
    operands make almost all of them wrong."""
    previous: list[np.ndarray] = []

    def server(request: httpx.Request) -> httpx.Response:
        operands = codecs.decode(request.headers["content-type"], request.content, LIMITS, MAX_BODY_BYTES)
        product = operands.a.astype(np.float64) @ operands.b.astype(np.float64)
        answer = previous.pop() if previous else product
        previous.append(product)
        return httpx.Response(200, content=npy_bytes(answer), headers={"content-type": "application/x-npy"})

    probes = [
        p for p in soak.valid_probes(np.random.default_rng(1), MAX_BODY_BYTES) if p.name == "npy 64x64x64 float64"
    ]
    assert len(probes) == soak.VARIANTS
    async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://soak") as http:
        run = soak.Soak(http, {"valid": probes, "invalid": [], "oversized": []}, [("valid", 1.0)], seed=0, limit=1)
        await soak.open_loop(run, 1000.0, 64, float("inf"), lambda: None)
    checked = sum(sample.checked for sample in run.samples)
    assert checked == 64 and len(run.wrong_results) >= 40, (checked, len(run.wrong_results))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--max-requests", "0"], "--max-requests must be positive"),
        (["--max-requests", "-5"], "--max-requests must be positive"),
        (["--grace", "-1"], "--grace must be 0 or more"),
        (["--memory-every", "0"], "--memory-every must be at least 0.5"),
        (["--timeout", "0"], "--timeout must be over 0 and at most 86400"),
        (["--timeout", "1e9"], "--timeout must be over 0 and at most 86400"),
        (["--max-body-bytes", "0"], "--max-body-bytes 0 is too small for any product"),
    ],
)
def test_arguments_that_would_send_nothing_or_fail_later_are_refused(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        soak.parse_args(arguments)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_the_smallest_body_allowed_leaves_a_product_to_send() -> None:
    smallest = soak.smallest_product_bytes()
    assert soak.parse_args(["--max-body-bytes", str(smallest)]).max_body_bytes == smallest
    assert soak.build_probes(0, smallest)["valid"], "a body of that size holds a product"


def test_a_report_that_cannot_be_written_is_refused_before_the_soak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused on arguments, whoever runs the soak: root passes every permission check, and procfs lets no
    directory be made in it."""
    (tmp_path / "file").write_text("")
    assert soak.parse_args(["--out", str(tmp_path / "new" / "soak.json")]).out == str(tmp_path / "new" / "soak.json")
    assert (tmp_path / "new").is_dir(), "made before the soak, not after it"
    refused = [(tmp_path, "is a directory"), (tmp_path / "file" / "soak.json", "cannot be written")]
    if Path("/proc/self").is_dir():
        refused.append((Path("/proc/no-such-folder/soak.json"), "cannot be written"))
    for out, message in refused:
        with pytest.raises(SystemExit):
            soak.parse_args(["--out", str(out)])
        assert message in capsys.readouterr().err


def test_a_soak_that_gets_no_answer_fails() -> None:
    refused = soak.ClientResult(issued=3, samples=[], server_errors=[], wrong_results=[], load_window=(0.0, 1.0))
    rss = {soak.RSS_METRIC: 100 * soak.MIB, soak.DEVICE_METRIC: 0.0}
    timeline: list[dict[str, float | None]] = [{"s": 1.0, "rss_mib": 100.0}, {"s": 2.0, "rss_mib": 100.0}]
    report = soak.build_report(soak.parse_args([]), [refused], {}, (rss, rss), timeline)
    assert report["checks"]["answered"] == {"count": 0, "passed": False} and not report["passed"]
    assert report["by_status"] == {"abandoned": 3}


class Unavailable(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"code": "not_ready", "message": "warming up"}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unavailable() -> Iterator[str]:
    """A server that answers 503 to every GET."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("answer", ["nothing listening", "503"])
def test_a_server_that_does_not_answer_ends_the_soak_with_a_message(
    answer: str, unavailable: str, tmp_path: Path
) -> None:
    url = unavailable if answer == "503" else f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exit:
        soak.main(["--url", url, "--timeout", "5", "--out", str(tmp_path / "soak.json")])
    assert str(exit.value.code).startswith(f"soak: GET {url}/v1/info did not answer"), exit.value.code
    assert ("warming up" in str(exit.value.code)) == (answer == "503")
    assert not (tmp_path / "soak.json").exists()


def test_the_answer_rate_counts_the_time_under_load_not_the_client_processes_start_up() -> None:
    """Two client processes that started sending 0.5 s apart, seconds after the soak spawned them."""
    answered = [soak.Sample(0.0, 1.0, "valid", "npy", "200")] * 30
    first = soak.ClientResult(30, answered, [], [], load_window=(100.0, 102.0))
    second = soak.ClientResult(30, answered, [], [], load_window=(100.5, 103.0))
    report = soak.build_report(soak.parse_args([]), [first, second], {}, ({}, {}), [])
    assert report["duration_s"] == 3.0 and report["answered_rps"] == 20.0


@pytest.mark.anyio
async def test_a_load_shorter_than_the_reading_interval_is_read_twice() -> None:
    """Halfway through the load and at its end, whatever --memory-every says: two readings, which the check of RSS
    under load needs. The client process ends only once the first reading is taken."""
    loop = asyncio.get_running_loop()
    client: asyncio.Future[soak.ClientResult] = loop.create_future()
    reads = 0

    def server(request: httpx.Request) -> httpx.Response:
        nonlocal reads
        reads += 1
        if reads == 1:
            loop.call_later(0.05, client.set_result, soak.ClientResult(0, [], [], [], (0.0, 0.1)))
        return httpx.Response(200, text=f"{soak.RSS_METRIC} {(100 + reads) * soak.MIB}\n")

    load_started = multiprocessing.get_context("spawn").Event()
    load_started.set()
    async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://soak") as http:
        timeline = await soak.watch_memory(http, [client], load_started, load_s=0.1, every_s=600.0)
    assert [reading["rss_mib"] for reading in timeline] == [101.0, 102.0]
    assert soak.steady_rss_check(timeline, 64.0)["passed"]
