"""SIGTERM: the server stops accepting, finishes what is in flight, and exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import numpy as np

from matmul_tools.bodies import load_npy, npy_bytes
from matmul_tools.service import free_port, serving, uvicorn_command, wait_ready
from numerics.reference import assert_close_to_reference
from tests.scripts import ROOT
from tests.server.conftest import HeldProduct, requests_in_flight


def accepts_connections(port: int) -> bool:
    """Whether a new connection to the port is accepted (one caught in the backlog as the listener closes is reset)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return False
    return True


def test_sigterm_lets_an_in_flight_product_finish() -> None:
    port = free_port()
    env = {**os.environ, "MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false"}
    command = [*uvicorn_command(port), "--timeout-graceful-shutdown", "60"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 60, process=process)
        a = np.random.default_rng(0).standard_normal((1500, 1500))
        files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(a))}
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{url}/matmul?dtype=float64", files=files,
                                                     headers={"accept": "application/x-npy"}, timeout=60))
        )  # fmt: skip
        sender.start()
        deadline = time.monotonic() + 30  # a hang guard: the product is in flight long before
        while requests_in_flight(url) < 2:  # our product and this scrape
            assert time.monotonic() < deadline and sender.is_alive(), "the product never reached the app"
        process.send_signal(signal.SIGTERM)
        sender.join(60)
        # uvicorn ends by re-raising the signal it handled, so "killed by SIGTERM" is its clean exit
        assert process.wait(60) in (0, -signal.SIGTERM)
        log = process.stderr.read().decode() if process.stderr else ""
        assert "Application shutdown complete" in log
        assert answers and answers[0].status_code == 200
        assert_close_to_reference(load_npy(answers[0].content), a, a, np.dtype(np.float64))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()


def test_after_sigterm_new_connections_are_refused_while_the_in_flight_request_is_answered() -> None:
    """A request whose body is still arriving when SIGTERM comes: the port refuses new connections while that
    request is open, and the rest of its body, sent after uvicorn's own 0.1 s pause, is still answered 200."""
    port = free_port()
    command = [*uvicorn_command(port), "--timeout-graceful-shutdown", "30"]
    with serving(command, port, env={"MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false"}) as server:
        held = HeldProduct(str(server.client.base_url))
        held.start()
        try:
            deadline = time.monotonic() + 10
            assert accepts_connections(port)
            server.process.send_signal(signal.SIGTERM)
            while accepts_connections(port):  # until uvicorn's main loop, which ticks every 0.1 s, sees the signal
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.01)
            assert not held.answered, "refused while the request was in flight"
            time.sleep(0.5)  # past the 0.1 s uvicorn gives every connection: from here only the grace period waits
        finally:
            held.finish()
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    held.assert_answered_right()
