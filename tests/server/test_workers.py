"""`matmul-service --workers N` as a real process tree on the CPU backend: a killed HTTP worker is replaced while the
engine process stays, every worker answers the whole server's inference statistics, new connections go to the
workers that hold the fewest (a replacement among them), and SIGTERM ends every process of the tree, leaving nothing
in /dev/shm or the engines' socket folder."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from matmul_tools.bodies import load_npy, npy_bytes
from matmul_tools.service import LocalService, free_port
from numerics.reference import assert_close_to_reference

# a process tree started and stopped per test
pytestmark = pytest.mark.timeout(180)

GUARD_S = 60
"""How long a test waits for the tree to change: a hang guard, far longer than it takes."""


def started(tmp_path: Path, workers: int) -> Iterator[LocalService]:
    # a hand-off far wider than its default, so that a worker slow to wake on a loaded machine still gets its turn
    env = {"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false", "MATMUL_ACCEPT_HANDOFF_MS": "200"}
    service = LocalService.matmul_service(free_port(), env, tmp_path / "service.log", workers=workers)
    try:
        service.wait_ready(GUARD_S)
        worker_pids(service, workers)  # every worker accepting: the ready probes may all have reached the first one up
        yield service
    finally:
        service.stop()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LocalService]:
    yield from started(tmp_path, workers=2)


@pytest.fixture
def four_workers(tmp_path: Path) -> Iterator[LocalService]:
    yield from started(tmp_path, workers=4)


def info(service: LocalService) -> dict[str, object]:
    """GET /v1/info over a new connection (so any worker may answer)."""
    answer: dict[str, object] = httpx.get(f"{service.url}/v1/info", timeout=10).json()
    return answer


def worker_pids(service: LocalService, wanted: int) -> set[int]:
    """The pids of the HTTP workers answering, asked until `wanted` different ones have answered."""
    deadline = time.monotonic() + GUARD_S
    seen: set[int] = set()
    while len(seen) < wanted:
        assert time.monotonic() < deadline, f"only workers {seen} answered"
        seen.add(int(info(service)["http_worker_pid"]))  # type: ignore[call-overload]
    return seen


def engine_of(found: dict[str, object]) -> dict[str, object]:
    devices = found["devices"]
    assert isinstance(devices, list) and len(devices) == 1
    engine: dict[str, object] = devices[0]
    return engine


def product_is_right(service: LocalService) -> None:
    a = np.random.default_rng(3).standard_normal((70, 50))
    b = np.random.default_rng(4).standard_normal((50, 30))
    answer = httpx.post(
        f"{service.url}/matmul?dtype=float64",
        files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
        headers={"accept": "application/x-npy"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert_close_to_reference(load_npy(answer.content), a, b, np.dtype(np.float64))


def test_a_killed_http_worker_is_replaced_and_the_engine_stays(service: LocalService) -> None:
    before = worker_pids(service, 2)
    deadline = time.monotonic() + GUARD_S
    while (engine := engine_of(info(service)))["engine_http_workers"] != 2:  # as of the engine's last status
        assert time.monotonic() < deadline, f"the engine counts {engine['engine_http_workers']} HTTP workers"
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + GUARD_S
    while True:  # until the replacement answers and has said hello to the engine
        assert time.monotonic() < deadline, "no worker replaced the killed one"
        try:
            found = info(service)
        except httpx.TransportError:
            continue  # a connection the dead worker had accepted
        if found["http_worker_pid"] not in before and engine_of(found)["engine_http_workers"] == 2:
            break
    assert engine_of(found)["engine_pid"] == engine["engine_pid"]  # the engine process was not restarted
    assert victim not in worker_pids(service, 2)
    product_is_right(service)


def test_every_worker_answers_the_whole_servers_inference_statistics(service: LocalService) -> None:
    """perf_analyzer reads a model's statistics before and after its run, each time on a connection of its own: the
    worker that answers must count the products every worker answered."""
    body = {
        "inputs": [
            {"name": "A", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "B", "shape": [2, 2], "datatype": "FP32", "data": [5, 6, 7, 8]},
        ]
    }
    served: Counter[int] = Counter()
    deadline = time.monotonic() + GUARD_S
    while len(served) < 2:  # until both workers have answered products, each on a connection of its own
        assert time.monotonic() < deadline, f"only workers {set(served)} answered"
        with httpx.Client(base_url=service.url, timeout=30) as connection:
            pid = connection.get("/v1/info").json()["http_worker_pid"]
            answer = connection.post("/v2/models/matmul/infer", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [19, 22, 43, 50]
            served[pid] += 1
    statistics: dict[int, dict[str, object]] = {}
    while len(statistics) < 2:  # the statistics as each worker answers them
        assert time.monotonic() < deadline, f"only workers {set(statistics)} answered the statistics"
        with httpx.Client(base_url=service.url, timeout=30) as connection:
            pid = connection.get("/v1/info").json()["http_worker_pid"]
            (statistics[pid],) = connection.get("/v2/models/matmul/stats").json()["model_stats"]
    for pid, stats in statistics.items():
        assert stats["inference_count"] == served.total(), f"worker {pid} counts {stats}; served {dict(served)}"


def open_connections(service: LocalService, count: int) -> list[tuple[httpx.Client, int]]:
    """`count` kept-alive connections opened one after another, each with the pid of the worker that holds it."""
    opened = []
    for _ in range(count):
        connection = httpx.Client(base_url=service.url, timeout=30)
        opened.append((connection, int(connection.get("/v1/info").json()["http_worker_pid"])))
    return opened


def test_connections_go_to_the_workers_that_hold_the_fewest(four_workers: LocalService) -> None:
    """Eight connections over four workers: two each (the workers accepting by themselves put three to six of them
    on one worker), and products on every one of them; then a killed worker's replacement takes the next."""
    opened = open_connections(four_workers, 8)
    try:
        held = Counter(pid for _, pid in opened)
        assert sorted(held.values()) == [2, 2, 2, 2], f"connections by worker: {dict(held)}"
        for connection, pid in opened:
            assert connection.get("/v1/info").json()["http_worker_pid"] == pid  # the same connection, kept
        victim = opened[0][1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + GUARD_S
        replacements: set[int] = set()
        while not replacements:  # new connections: the three others hold two each, so once it accepts, it answers
            assert time.monotonic() < deadline, "no worker replaced the killed one"
            with contextlib.suppress(httpx.TransportError):  # a connection the dead worker had accepted
                replacements = {int(info(four_workers)["http_worker_pid"])} - set(held)  # type: ignore[call-overload]
        # the three others hold two each and the replacement none (info's connections are closed)
        late = open_connections(four_workers, 2)
        opened += late
        assert {pid for _, pid in late} == replacements, f"the new connections went to {[p for _, p in late]}"
    finally:
        for connection, _ in opened:
            connection.close()
    product_is_right(four_workers)


def test_a_websocket_upgrade_is_answered_as_plain_http(service: LocalService) -> None:
    """The service has no WebSocket routes, and an upgraded connection would leave the protocol that counts it off
    its worker when it ends: an Upgrade request gets its plain answer and the connection stays HTTP."""
    request = (
        b"GET /v1/info HTTP/1.1\r\nHost: test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", service.port), timeout=GUARD_S) as connection:
        for _ in range(2):  # and again on the same connection
            connection.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += connection.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            head, _, body = answer.partition(b"\r\n\r\n")
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
            while len(body) < length:
                body += connection.recv(65536)
            assert b"http_worker_pid" in body


def exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_ends_the_whole_tree_and_leaves_nothing_behind(service: LocalService) -> None:
    product_is_right(service)
    engine_pid = int(engine_of(info(service))["engine_pid"])  # type: ignore[call-overload]
    workers = worker_pids(service, 2)
    arguments = Path(f"/proc/{engine_pid}/cmdline").read_bytes().split(b"\0")
    socket_folder = Path(os.fsdecode(arguments[arguments.index(b"--socket") + 1])).parent
    assert socket_folder.is_dir()
    shared_memory = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    service.process.send_signal(signal.SIGTERM)
    # uvicorn ends by re-raising the signal it handled, so "killed by SIGTERM" is its clean exit
    assert service.process.wait(GUARD_S) in (0, -signal.SIGTERM)
    deadline = time.monotonic() + GUARD_S
    while alive := [pid for pid in [engine_pid, *workers] if exists(pid)]:
        assert time.monotonic() < deadline, f"processes {alive} outlived the service"
        time.sleep(0.05)
    assert not socket_folder.exists()
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shared_memory


def running(pid: int) -> bool:
    """Whether `pid` runs (a process whose parent died and that no one has reaped yet is a zombie, not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_workers_end_with_matmul_service_even_when_it_is_killed(service: LocalService) -> None:
    """SIGKILL to matmul-service, which can do nothing about it: its HTTP workers are stopped by the kernel (they asked
    for SIGTERM at their parent's death) and the engine drains on its stdin's end, so that no orphaned worker keeps the
    port and answers /healthz while no engine ever comes back."""
    engine_pid = int(engine_of(info(service))["engine_pid"])  # type: ignore[call-overload]
    workers = worker_pids(service, 2)
    service.process.kill()
    service.process.wait(GUARD_S)
    deadline = time.monotonic() + GUARD_S
    while alive := [pid for pid in [*workers, engine_pid] if running(pid)]:
        assert time.monotonic() < deadline, f"processes {alive} outlived a killed matmul-service"
        time.sleep(0.05)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{service.url}/healthz", timeout=5)
