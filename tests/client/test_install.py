"""matmul-client installed on its own, as on a laptop that only sends products: a fresh virtual environment, the
client's distribution from client/ and whatever it pulls in, and its CLI multiplying on the suite's server."""

from __future__ import annotations

import json
import subprocess
import venv
from pathlib import Path

import numpy as np
import pytest

CLIENT = Path(__file__).resolve().parents[2] / "client"
SERVER_ONLY = {"fastapi", "uvicorn", "starlette", "pydantic", "grpcio", "tritonclient", "prometheus-client", "orjson"}
"""What the server needs and a client must not bring."""
CLIENT_DEPENDENCIES = {"numpy", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio", "typing-extensions"}
"""NumPy and httpx, and httpx's own (some only on older Pythons)."""


@pytest.fixture(scope="module")
def client_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the client and its dependencies alone: its bin folder."""
    where = tmp_path_factory.mktemp("client-only")
    venv.create(where, with_pip=True, system_site_packages=False)
    python = where / "bin" / "python"
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(CLIENT)], capture_output=True, text=True, timeout=240
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    return where / "bin"


@pytest.mark.timeout(300)  # a virtual environment and NumPy's wheel installed into it
def test_the_client_installs_with_numpy_and_httpx_only(client_only: Path) -> None:
    listed = subprocess.run(
        [client_only / "python", "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, check=True
    )
    names = {package["name"].lower().replace("_", "-") for package in json.loads(listed.stdout)}
    names -= {"pip", "setuptools"}  # what venv itself installs on older Pythons
    assert "matmul-client" in names
    assert not names & SERVER_ONLY, names & SERVER_ONLY
    assert names - {"matmul-client"} <= CLIENT_DEPENDENCIES, sorted(names - CLIENT_DEPENDENCIES)


@pytest.mark.timeout(300)
def test_its_cli_multiplies_on_the_server(client_only: Path, served_url: str, tmp_path: Path) -> None:
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    argv = [tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy", "--url", served_url, "--dtype", "float64"]
    done = subprocess.run([client_only / "matmul-client", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert np.load(tmp_path / "c.npy").tolist() == (a @ b).tolist()
    assert "2x4 float64" in done.stderr


@pytest.mark.timeout(300)
def test_its_library_sends_json_that_the_server_reads(client_only: Path, served_url: str) -> None:
    """Its JSON bodies are the standard library's: numbers as the server reads them; a NaN, which JSON cannot carry,
    is refused before anything is sent, naming the element."""
    script = (
        "import numpy as np; from matmul_client import MatmulClient\n"
        f"with MatmulClient({served_url!r}, format='json') as client:\n"
        "    print(client.matmul(np.float32([[0.1, 2]]), np.float32([[3], [4]])).tolist())\n"
        "    try:\n"
        "        client.matmul(np.array([[1.0, np.nan]]), np.array([[2.0], [3.0]]))\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run([client_only / "python", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    product, refused = done.stdout.splitlines()
    assert product == str((np.float32([[0.1, 2]]) @ np.float32([[3], [4]])).tolist())
    assert refused == "a[0][1] is nan, which JSON cannot carry: send it as .npy or .npz (format='npy')"
