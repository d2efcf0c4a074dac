"""The service started as its users start it, answering over real HTTP."""

from __future__ import annotations

import itertools
import shutil

import httpx
import numpy as np
import pytest

from matmul_tools.bodies import load_npy, npy_bytes
from matmul_tools.raw_http import status_of_a_large_header
from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.precision import PRECISIONS_OF, Precision
from numerics.reference import assert_close_to_reference


def exercise(client: httpx.Client, backend: str) -> None:
    r = client.post("/matmul", json={"a": [[1, 2], [3, 4]], "b": [[5, 6], [7, 8]]})
    assert r.status_code == 200, r.text
    assert r.json()["result"] == [[19, 22], [43, 50]] and r.json()["backend"] == backend
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((65, 33)).astype(np.float32), rng.standard_normal((33, 17)).astype(np.float32)
    r = client.post(
        "/matmul",
        files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
        headers={"accept": "application/x-npy"},
    )
    assert r.status_code == 200, r.text
    assert_close_to_reference(load_npy(r.content), a, b, np.dtype(np.float32))
    big_a, big_b = rng.standard_normal((600, 500)), rng.standard_normal((500, 700))
    r = client.post(
        "/matmul",
        files={"a": ("a.npy", npy_bytes(big_a)), "b": ("b.npy", npy_bytes(big_b))},
        headers={"accept": "application/x-npy"},
    )
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content) > 600 * 700 * 8
    assert_close_to_reference(
        load_npy(r.content), big_a, big_b, np.dtype(np.float64)
    )  # 3.4 MB sent from the array itself
    assert client.get("/v1/info").json()["backend"] == backend


@pytest.mark.skipif(shutil.which("make") is None, reason="the README's command needs make")
def test_the_readme_command_starts_a_serving_process() -> None:
    port = free_port()
    with running_server(
        ["make", "run", f"PORT={port}", "HOST=127.0.0.1"], port, env={"MATMUL_BACKEND": "cpu"}
    ) as client:
        exercise(client, "cpu")
        assert status_of_a_large_header(port, 100 << 10)[0] == 431, "the headers' bound is installed"


@pytest.mark.gpu
def test_the_gpu_backend_serves_over_http() -> None:
    port = free_port()
    with running_server(uvicorn_command(port), port, env={"MATMUL_BACKEND": "gpu"}) as client:
        exercise(client, "gpu")
        for kernel in client.get("/v1/kernels").json()["kernels"]:
            for precision, dtype in itertools.product(kernel["precisions"], kernel["dtypes"]):
                if Precision(precision) not in PRECISIONS_OF[dtype]:
                    continue  # the tensor-core precisions take float32 operands, int8 is int32's alone
                asked = {"kernel": kernel["name"], "precision": precision, "dtype": dtype}
                # k = 4, zeros beyond 2: a k that every kernel takes (cuBLAS's int8 GEMM wants a multiple of 4)
                operands = {"a": [[1, 2, 0, 0], [3, 4, 0, 0]], "b": [[5, 6], [7, 8], [0, 0], [0, 0]]}
                r = client.post("/matmul", params=asked, json=operands)
                assert r.status_code == 200, f"{asked}: {r.text}"
                assert r.json()["result"] == [[19, 22], [43, 50]]  # exact in every precision
