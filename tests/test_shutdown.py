"""SIGTERM: the server stops accepting, finishes what is in flight, and exits cleanly."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import threading
import time

import httpx
import numpy as np

from tests.conftest import npy_bytes
from tests.server import ROOT, free_port, uvicorn_command


def test_sigterm_lets_an_in_flight_product_finish() -> None:
    port = free_port()
    env = {**os.environ, "MATMUL_BACKEND": "cpu", "MATMUL_ACCESS_LOG": "false"}
    command = [*uvicorn_command(port), "--timeout-graceful-shutdown", "60"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        a = np.random.default_rng(0).standard_normal((1500, 1500))
        files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(a))}
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{url}/matmul?dtype=float64", files=files,
                                                     headers={"accept": "application/x-npy"}, timeout=60))
        )  # fmt: skip
        sender.start()
        in_flight = 0.0
        while in_flight < 2:  # our product and this scrape
            metrics = httpx.get(f"{url}/metrics").text
            line = next(line for line in metrics.splitlines() if line.startswith("matmul_requests_in_flight "))
            in_flight = float(line.split()[1])
        process.send_signal(signal.SIGTERM)
        sender.join(60)
        # uvicorn ends by re-raising the signal it handled, so "killed by SIGTERM" is its clean exit
        assert process.wait(60) in (0, -signal.SIGTERM)
        log = process.stderr.read().decode() if process.stderr else ""
        assert "Application shutdown complete" in log
        assert answers and answers[0].status_code == 200
        np.testing.assert_allclose(np.load(io.BytesIO(answers[0].content)), a @ a, rtol=1e-10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()
