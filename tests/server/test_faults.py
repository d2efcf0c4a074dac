"""Integrity under faults: while client processes load `matmul-service` (CPU backend) and check every answer against
its own product, an HTTP worker is killed, the engine process is killed, clients leave mid-upload and mid-download,
and deadlines pass while products wait. Every answer a client receives is its own product or an error status (503,
504) or a closed connection, never a wrong 200; and the service serves again afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import httpx
import pytest

from matmul_tools.integrity import (
    FLOAT_PRECISIONS,
    HURRIED_WAYS,
    LEAVING_WAYS,
    LEFT,
    SYSTEM_SHM_WAYS,
    WAYS,
    Tally,
    checked_load,
)
from matmul_tools.service import LocalService
from tests.server.conftest import CLIENTS, GPU_SHAPES, Serve

pytestmark = pytest.mark.timeout(600)
MIB = 1 << 20
SHAPES = ((2048, 8, 2048), (1024, 16, 1024), (256, 256, 256), (128, 128, 128))
ENV = {
    "MATMUL_BACKEND": "cpu",
    "MATMUL_ACCESS_LOG": "false",
    "MATMUL_SHARED_MEMORY": "system",
    "MATMUL_BATCHING": "true",
    "MATMUL_SLAB_BYTES": str(40 * MIB),
}
"""Batching on, and shared memory for two of the largest requests at a time: products wait for each other."""
REQUESTS = 2 * len(WAYS)
PAUSE_S = 0.05
"""Between a client's requests, so that the load lasts the seconds the faults need."""
KILL_AFTER_S = 2.0
"""When the fault comes: clients have been sending for a while, with products in flight."""


def _info(service: LocalService) -> dict[str, object]:
    info: dict[str, object] = httpx.get(f"{service.url}/v1/info", timeout=10).json()
    return info


def _serves_again(service: LocalService) -> None:
    """After the fault: ready again, and a product answered right."""
    service.wait_ready(120)
    answer = httpx.post(f"{service.url}/matmul", json={"a": [[1, 2]], "b": [[3], [4]]}, timeout=30)
    assert answer.status_code == 200 and answer.json()["result"] == [[11.0]]


def _only_allowed(tally: Tally, allowed: set[str]) -> None:
    """No wrong answer, some right ones, and every other outcome one of `allowed`: a status or `closed` for any way,
    or `<way> <status>` for that way alone."""
    assert tally.wrong == [], f"{len(tally.wrong)} wrong answers of {tally.answers}: {tally.wrong[:5]}"
    unexpected = {outcome for outcome in tally.other if outcome not in allowed}
    assert {outcome.rsplit(" ", 1)[1] for outcome in unexpected} <= allowed, tally.as_dict()
    assert tally.answers > 0


def _kill_after(delay_s: float, pid: Callable[[], int]) -> Callable[[], None]:
    def kill() -> None:
        time.sleep(delay_s)
        os.kill(pid(), signal.SIGKILL)

    return kill


def test_clients_that_leave_or_hurry_spoil_no_other_answer(clients: ProcessPoolExecutor, serve: Serve) -> None:
    """A third of the requests leave before their answer (mid-upload, mid-download) or carry a 1 ms deadline."""
    service = serve(ENV, 1)
    ways = [*WAYS, *HURRIED_WAYS, *LEAVING_WAYS]
    tally = checked_load(clients, service.url, CLIENTS, requests=len(ways), ways=ways, shapes=SHAPES)
    # a 1 ms deadline may pass in the queue (504) or while the request waits for shared memory (503, Retry-After)
    _only_allowed(tally, {"504", LEFT, *(f"{way} 503" for way in HURRIED_WAYS)})
    assert sum(count for outcome, count in tally.other.items() if outcome.endswith(LEFT)) == CLIENTS * 2
    assert tally.answers >= CLIENTS * len(WAYS)
    _serves_again(service)


def _busy_http_worker(service: LocalService) -> int:
    """The pid of an HTTP worker with products in flight now (its shared memory in use), asked over new connections
    until one that answers has some."""
    for _ in range(1000):
        info = _info(service)
        if info["slabs"]["used_bytes"] > 0:  # type: ignore[index]
            return int(info["http_worker_pid"])  # type: ignore[call-overload]
        time.sleep(0.01)
    raise AssertionError("no HTTP worker had a product in flight")


def test_a_killed_http_worker_costs_only_its_own_connections(clients: ProcessPoolExecutor, serve: Serve) -> None:
    """Two HTTP workers; one with products in flight is killed with SIGKILL mid-load. Its clients see their
    connection close; uvicorn starts a new worker, the other goes on; no answer anyone receives is wrong."""
    service = serve(ENV, 2)
    victims: list[int] = []

    def kill_a_busy_worker() -> None:
        time.sleep(KILL_AFTER_S)
        victims.append(_busy_http_worker(service))
        os.kill(victims[0], signal.SIGKILL)

    tally = checked_load(
        clients, service.url, CLIENTS, REQUESTS, ways=list(WAYS), shapes=SHAPES, pause_s=PAUSE_S,
        during=kill_a_busy_worker,
    )  # fmt: skip
    _only_allowed(tally, {"closed", "503"})  # Triton's client sends again what a dropped keep-alive connection lost
    _serves_again(service)
    assert victims[0] not in {int(_info(service)["http_worker_pid"]) for _ in range(10)}  # type: ignore[call-overload]


def test_a_killed_engine_process_fails_what_it_held_and_a_new_one_serves(
    clients: ProcessPoolExecutor, serve: Serve
) -> None:
    """The engine process is killed with SIGKILL mid-load: what it held answers 503 device_lost (or not ready, while
    the new one starts), never a product of someone else's memory; the supervisor starts a new engine."""
    service = serve(ENV, 2)
    devices = _info(service)["devices"]
    victim = int(devices[0]["engine_pid"])  # type: ignore[index]
    kill = _kill_after(KILL_AFTER_S, lambda: victim)
    tally = checked_load(
        clients, service.url, CLIENTS, REQUESTS, ways=list(WAYS), shapes=SHAPES, pause_s=PAUSE_S, during=kill
    )
    # A new engine holds no region: a client's registration went with the old one, and the client is told so (400)
    lost_regions = {f"{way} 400" for way in SYSTEM_SHM_WAYS}
    _only_allowed(tally, {"closed", "503", *lost_regions})
    assert all("no shared-memory region named" in message for message in tally.messages if message.startswith("400"))
    assert any(message.startswith("503") for message in tally.messages), tally.as_dict()
    _serves_again(service)
    assert int(_info(service)["devices"][0]["engine_pid"]) != victim  # type: ignore[index]


def test_a_hung_engine_process_fails_what_waits_on_it_and_serves_again_once_it_speaks(serve: Serve) -> None:
    """The engine process is stopped (SIGSTOP: a hung engine keeps its socket open, so no end of it tells the HTTP
    worker anything). The product waiting on it gets 503 once the engine has said nothing for
    MATMUL_ENGINE_SILENCE_S, rather than waiting for ever; /readyz says why. Once the engine goes on (SIGCONT) the
    service serves again, and the given-up product's shared memory comes back when the engine answers it."""
    service = serve({**ENV, "MATMUL_ENGINE_SILENCE_S": "1"}, 1)
    engine = int(_info(service)["devices"][0]["engine_pid"])  # type: ignore[index]
    os.kill(engine, signal.SIGSTOP)
    try:
        answer = httpx.post(f"{service.url}/matmul", json={"a": [[1, 2]], "b": [[3], [4]]}, timeout=60)
        ready = httpx.get(f"{service.url}/readyz", timeout=10)
        held = _info(service)["slabs"]["used_bytes"]  # type: ignore[index]
    finally:
        os.kill(engine, signal.SIGCONT)
    said = f"the engine process {engine} has said nothing for more than 1 s"
    # given up while it waited (or, on a slow machine, refused at once if the silence came before it)
    assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
    assert answer.json()["code"] in {"engine_unresponsive", "not_ready"} and said in answer.json()["message"]
    assert ready.status_code == 503 and said in ready.json()["message"]
    # the engine may still write the product's C: its shared memory is not lent again while the engine is stopped
    assert answer.json()["code"] == "not_ready" or held > 0
    _serves_again(service)
    for _ in range(600):
        if _info(service)["slabs"]["used_bytes"] == 0:  # type: ignore[index]
            break
        time.sleep(0.05)
    assert _info(service)["slabs"]["used_bytes"] == 0  # type: ignore[index]


def _gpus() -> int:
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return len([line for line in listed.stdout.splitlines() if line.startswith("GPU ")])


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_on_two_gpus_a_killed_engine_leaves_the_other_serving_and_comes_back(
    clients: ProcessPoolExecutor, serve: Serve
) -> None:
    """MATMUL_DEVICES=0,1 under mixed sizes from every way in every float precision: the engine process of device 1
    is killed with SIGKILL mid-load. Device 0's engine keeps answering products while device 1's is away, the
    supervisor starts device 1's again, `/metrics` has each engine's queue depth, and no answer is anyone else's
    product, nor outside its precision's bound."""
    if _gpus() < 2:
        pytest.skip("needs two GPUs")
    env = {**ENV, "MATMUL_BACKEND": "gpu", "MATMUL_DEVICES": "0,1", "MATMUL_SLAB_BYTES": str(512 * MIB)}
    service = serve(env, 2)
    devices = _info(service)["devices"]
    assert [device["index"] for device in devices] == [0, 1]  # type: ignore[index]
    victim = int(devices[1]["engine_pid"])  # type: ignore[index]
    while_away: list[tuple[str, int]] = []

    def kill_then_multiply_until_it_is_back() -> None:
        time.sleep(KILL_AFTER_S)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            second = _info(service)["devices"][1]  # type: ignore[index]
            if second["state"] == "ready" and second["engine_pid"] not in (victim, None):
                return
            answer = httpx.post(f"{service.url}/matmul", json={"a": [[1, 2]], "b": [[3], [4]]}, timeout=30)
            ok = answer.status_code == 200 and answer.json()["result"] == [[11.0]]
            while_away.append((str(second["state"]), 200 if ok else answer.status_code))
            time.sleep(0.05)
        raise AssertionError(f"device 1's engine was not ready again within 120 s: {while_away[-5:]}")

    tally = checked_load(
        clients,
        service.url,
        CLIENTS,
        REQUESTS,
        ways=list(WAYS),
        shapes=GPU_SHAPES,
        pause_s=PAUSE_S,
        during=kill_then_multiply_until_it_is_back,
        precisions=FLOAT_PRECISIONS,
    )
    away = Counter(f"device 1 {state}, {status}" for state, status in while_away)
    print(f"two GPUs, device 1's engine killed: {tally.as_dict()}; products asked while it was away: {dict(away)}")
    lost_regions = {f"{way} 400" for way in SYSTEM_SHM_WAYS}
    _only_allowed(tally, {"closed", "503", *lost_regions})
    assert any(state != "ready" and status == 200 for state, status in while_away), while_away
    _serves_again(service)
    second = _info(service)["devices"][1]  # type: ignore[index]
    assert second["state"] == "ready" and int(second["engine_pid"]) != victim
    metrics = httpx.get(f"{service.url}/metrics", timeout=10).text
    assert all(f'matmul_engine_queue_depth{{device="{index}"}}' in metrics for index in (0, 1)), metrics[-2000:]
