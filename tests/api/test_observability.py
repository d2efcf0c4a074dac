"""Prometheus metrics, the JSON access log and X-Request-ID."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

pytestmark = pytest.mark.anyio


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        if metric.split("{")[0] == name and (not labels or "{" in metric):
            found = ",".join(sorted(metric[metric.index("{") + 1 : -1].split(","))) if "{" in metric else ""
            if found == wanted:
                return float(value)
    return 0.0


async def test_metrics_move_with_requests(client: httpx.AsyncClient) -> None:
    before = (await client.get("/metrics")).text
    for _ in range(3):
        assert (await client.post("/matmul", json={"a": [[1, 2]], "b": [[3], [4]]})).status_code == 200
    assert (await client.post("/matmul", json={"a": [[1]], "b": [[1, 2], [3, 4]]})).status_code == 422
    r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = r.text
    ok = {"route": "/matmul", "method": "POST", "status": "200", "kernel": "numpy"}
    assert sample(after, "matmul_requests_total", **ok) - sample(before, "matmul_requests_total", **ok) == 3
    refused = {"route": "/matmul", "method": "POST", "status": "422", "kernel": ""}
    assert sample(after, "matmul_requests_total", **refused) == 1
    assert sample(after, "matmul_request_duration_seconds_count", route="/matmul") == 4
    for stage in ("queue", "h2d", "kernel", "d2h"):
        assert sample(after, "matmul_stage_duration_seconds_count", stage=stage, kernel="numpy") == 3
    assert sample(after, "matmul_request_bytes_total", route="/matmul") > 0
    assert sample(after, "matmul_response_bytes_total", route="/matmul") > 0
    for gauge in (
        "matmul_queue_depth",
        "matmul_requests_in_flight",
        "matmul_device_memory_bytes",
        "matmul_kernels_compiled",
    ):
        assert f"# TYPE {gauge} gauge" in after
    assert sample(after, "matmul_requests_in_flight") == 1  # the scrape itself
    assert 'matmul_engine_queue_depth{device="cpu"} 0.0' in after.splitlines()  # one engine process, idle


async def test_access_log_is_one_json_line_per_request(client: httpx.AsyncClient) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("app.access").addHandler(handler)
    try:
        r = await client.post("/matmul", json={"a": [[1, 2]], "b": [[3], [4]]}, headers={"x-request-id": "job-42.a"})
    finally:
        logging.getLogger("app.access").removeHandler(handler)
    assert r.headers["x-request-id"] == "job-42.a"
    (line,) = [orjson.loads(record.getMessage()) for record in records]
    assert line["request_id"] == "job-42.a" and line["route"] == "/matmul" and line["status"] == 200
    assert line["shape"] == [1, 1] and line["dtype"] == "float32" and line["kernel"] == "numpy"
    assert set(line["timing"]) >= {"queue_ms", "h2d_ms", "kernel_ms", "d2h_ms", "total_ms"}


@pytest.mark.parametrize("sent", [None, "has spaces", "x" * 200, "a/b", "{evil}"])
async def test_a_request_id_is_made_when_none_usable_is_sent(client: httpx.AsyncClient, sent: str | None) -> None:
    headers = {"x-request-id": sent} if sent is not None else {}
    r = await client.get("/healthz", headers=headers)
    assert len(r.headers["x-request-id"]) == 32
    assert r.headers["x-request-id"] != sent


def test_metrics_are_merged_across_worker_processes(tmp_path: object) -> None:
    """`matmul-service --workers 2` with a PROMETHEUS_MULTIPROC_DIR of the operator's: any worker's /metrics counts
    every request."""
    import os

    import httpx as sync_httpx

    from matmul_tools.service import free_port, running_server, service_command

    port = free_port()
    directory = os.fspath(tmp_path)  # type: ignore[call-overload]
    env = {"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false", "PROMETHEUS_MULTIPROC_DIR": directory}
    with running_server(service_command(port, "--workers", "2"), port, env=env) as client:
        for _ in range(20):
            # a new connection each time, so both workers take requests
            assert sync_httpx.post(f"{client.base_url}/matmul", json={"a": [[1]], "b": [[2]]}).status_code == 200
        scrapes = [sync_httpx.get(f"{client.base_url}/metrics").text for _ in range(4)]
    ok = {"route": "/matmul", "method": "POST", "status": "200", "kernel": "numpy"}
    assert [sample(text, "matmul_requests_total", **ok) for text in scrapes] == [20] * 4
