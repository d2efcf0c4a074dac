"""A connection that idles is never a failed request: the service keeps an idle connection for
MATMUL_KEEP_ALIVE_TIMEOUT_S (620 s by default), longer than the pools in front of it, so clients and proxies that
reuse a connection after a pause never send into a socket the server is closing; yet idle connections stay bounded
(closed after the setting, a few KiB each, closed at once on SIGTERM while the requests in flight finish).

Before, uvicorn's 5 s closed them: a client pausing about 5 s between requests met a closing socket now and then
(1 in 96 with httpx), and one pausing longer on a plain connection every time.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from matmul_tools.raw_http import read_until_closed
from matmul_tools.service import LocalService, free_port, stop_group, uvicorn_command, wait_ready
from tests.scripts import import_script
from tests.server.conftest import HeldProduct, Serve

pytestmark = pytest.mark.timeout(300)
CPU = {"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false"}
PAUSES_S = (4.9, 5.0, 5.1)
"""Just under, at and just over uvicorn's own keep-alive, which was the service's idle timeout (and httpx's pool
keeps an idle connection for 5 s too)."""
REQUESTS_PER_CLIENT = 10
GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"


def product_of(value: int) -> tuple[str, bytes, Callable[[bytes], bool]]:
    """A small JSON product whose answer names `value`: the path, body, and a check of the answer's body."""
    body = json.dumps({"a": [[value]], "b": [[2]]}).encode()
    return "/matmul", body, lambda answer: json.loads(answer)["result"] == [[2.0 * value]]


def pausing_client(
    url: str, kind: str, pauses: Iterator[float], requests: int, tally: Counter[str], ident: int
) -> None:
    """`requests` products over one client of `kind` (an httpx.Client with its default pool, or one plain
    http.client connection, which never reconnects by itself), pausing between them; each outcome counted in
    `tally` (`ok`, `wrong answer`, or the exception's name)."""
    host, port = url.removeprefix("http://").split(":")
    with ExitStack() as stack:
        if kind == "httpx":
            pooled = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        else:
            plain = http.client.HTTPConnection(host, int(port), timeout=30)
            stack.callback(plain.close)
        for index in range(requests):
            if index:
                time.sleep(next(pauses))
            path, body, right = product_of(ident * 1000 + index)
            headers = {"content-type": "application/json"}
            try:
                if kind == "httpx":
                    answer = pooled.post(path, content=body, headers=headers)
                    status, content = answer.status_code, answer.content
                else:
                    plain.request("POST", path, body=body, headers=headers)
                    reply = plain.getresponse()
                    status, content = reply.status, reply.read()
            except Exception as exc:  # every failure is counted, by kind: the test asserts there are none
                tally[type(exc).__name__] += 1
                if kind != "httpx":
                    plain.close()  # the next request on a new connection, so that one failure is counted once
                continue
            tally["ok" if status == 200 and right(content) else f"status {status}"] += 1


Client = tuple[str, Iterator[float], int]
"""A pausing client: its kind, its pauses, its requests."""


def run_clients(url: str, clients: list[Client]) -> Counter[str]:
    """Every (kind, pauses, requests) client at once, on threads; their outcomes together."""
    tally: Counter[str] = Counter()
    with ThreadPoolExecutor(len(clients)) as threads:
        running = [
            threads.submit(pausing_client, url, kind, pauses, requests, tally, ident)
            for ident, (kind, pauses, requests) in enumerate(clients)
        ]
        for client in running:
            client.result()
    return tally


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    """`matmul-service` with its defaults (the CPU backend), two HTTP workers."""
    log = tmp_path_factory.mktemp("keep-alive") / "server.log"
    service = LocalService.matmul_service(free_port(), CPU, log, workers=2)
    try:
        service.wait_ready(120)
        yield service
    finally:
        service.stop()


def test_clients_pausing_about_five_seconds_between_requests_never_fail(service: LocalService) -> None:
    """32 clients, half httpx.Client, half a plain http.client connection, each sending 10 products with pauses of
    4.9, 5.0 and 5.1 s in turn (each client starting at another one): 320 requests, every answer right."""
    clients: list[Client] = []
    for ident in range(32):
        pauses = itertools.islice(itertools.cycle(PAUSES_S), ident % 3, None)
        clients.append(("httpx" if ident % 2 else "http.client", pauses, REQUESTS_PER_CLIENT))
    tally = run_clients(service.url, clients)
    assert tally == {"ok": 32 * REQUESTS_PER_CLIENT}, tally


def test_a_connection_idle_for_65_seconds_is_served_on_the_same_connection(service: LocalService) -> None:
    """Longer than nginx's and the cloud load balancers' 60 s: the second request goes on the same socket."""
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=30)
    try:
        answers = []
        for value in (1, 2):
            if value == 2:
                time.sleep(65)
            path, body, right = product_of(value)
            connection.request("POST", path, body=body, headers={"content-type": "application/json"})
            reply = connection.getresponse()
            answers.append(reply.status == 200 and right(reply.read()) and not reply.will_close)
            if value == 1:
                assert connection.sock is not None
                first_socket = connection.sock.getsockname()
        assert connection.sock is not None and connection.sock.getsockname() == first_socket, "a new connection"
        assert answers == [True, True]
    finally:
        connection.close()


def idle_connection(port: int) -> socket.socket:
    """A connection that has had one answer (GET /healthz) and idles, kept alive."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(GET_HEALTHZ)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        body += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower() and len(body) == length
    return sock


def test_the_server_closes_an_idle_connection_after_the_keep_alive_setting(tmp_path: Path) -> None:
    """MATMUL_KEEP_ALIVE_TIMEOUT_S bounds how long an idle connection is held: at 1 s the server ends an idle
    connection's stream, sooner than uvicorn's own 5 s would."""
    port = free_port()
    env = {**CPU, "MATMUL_KEEP_ALIVE_TIMEOUT_S": "1"}
    service = LocalService(uvicorn_command(port), port, env, tmp_path / "server.log")
    try:
        service.wait_ready(120)
        with idle_connection(port) as sock:
            idled = time.monotonic()
            assert read_until_closed(sock) == b"", "closed by the server, with nothing sent"
            assert time.monotonic() - idled < 5
    finally:
        service.stop()


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def test_an_idle_connection_costs_the_http_worker_a_few_kib(tmp_path: Path) -> None:
    """500 idle connections, held after an answer each, add under 32 KiB apiece to the HTTP worker's resident memory
    (about 13 KiB were measured): an idle connection holds none of the buffers of the requests it carried."""
    port = free_port()
    service = LocalService(uvicorn_command(port), port, CPU, tmp_path / "server.log")
    try:
        service.wait_ready(120)
        with ExitStack() as stack:
            for _ in range(50):  # the first connections' one-off allocations
                stack.enter_context(idle_connection(port))
            time.sleep(0.5)
            before = rss_kib(service.process.pid)
            for _ in range(500):
                stack.enter_context(idle_connection(port))
            time.sleep(0.5)
            per_connection = (rss_kib(service.process.pid) - before) / 500
        assert per_connection < 32, f"{per_connection:.1f} KiB per idle connection"
    finally:
        service.stop()


def test_sigterm_closes_idle_connections_at_once_and_lets_the_request_in_flight_finish(serve: Serve) -> None:
    """`matmul-service` with two HTTP workers, eight idle kept-alive connections, and one request whose body is still
    arriving when SIGTERM comes: every idle connection is closed (end of stream) while that request is open, the
    request is then answered 200, right, and the service exits."""
    service = serve(CPU, 2)
    idle = [idle_connection(service.port) for _ in range(8)]
    held = HeldProduct(service.url)
    held.start()
    try:
        service.process.send_signal(signal.SIGTERM)
        for sock in idle:
            sock.settimeout(10)
            assert read_until_closed(sock) == b"", "an idle connection got something other than its end"
        assert not held.answered, "the request in flight ended before the idle connections did"
    finally:
        held.finish()
        for sock in idle:
            sock.close()
    assert service.process.wait(30) in (0, -signal.SIGTERM)
    held.assert_answered_right()


scaleout = import_script("scaleout_local")


@pytest.mark.skipif(scaleout.find_nginx() is None, reason="nginx is not installed (apt-get install nginx)")
def test_behind_the_nginx_recipe_pauses_past_its_upstream_idle_time_get_no_502(
    service: LocalService, tmp_path: Path
) -> None:
    """deploy/nginx.conf in front of the service, clients pausing about 5 s, 20 s, and 65 s (past nginx's own
    upstream keepalive_timeout of 60 s) between products: nginx reuses its pooled connections to the service or
    closes them itself first, and no request gets a 502."""
    nginx = scaleout.find_nginx()
    port = free_port()
    scaleout.write_prefix(tmp_path, port, [f"127.0.0.1:{service.port}"])
    with (tmp_path / "nginx.log").open("wb") as output:
        balancer = subprocess.Popen(scaleout.nginx_command(nginx, tmp_path), stdout=output, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 30, process=balancer, log=tmp_path / "nginx.log", interval_s=0.1)
        clients: list[Client] = [("httpx", itertools.cycle(PAUSES_S), REQUESTS_PER_CLIENT) for _ in range(12)]
        clients += [("httpx", itertools.repeat(20.0), 4) for _ in range(4)]
        clients += [("httpx", itertools.repeat(65.0), 2) for _ in range(2)]
        tally = run_clients(url, clients)
    finally:
        stop_group(balancer)
    assert tally == {"ok": 12 * REQUESTS_PER_CLIENT + 4 * 4 + 2 * 2}, tally
