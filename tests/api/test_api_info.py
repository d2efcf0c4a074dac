"""Probes, /v1/info, /v1/kernels and the OpenAPI document."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys

import httpx
import pytest

from app.config import BackendChoice, Settings
from app.dataplane import devices
from app.dataplane.supervisor import EngineSupervisor
from app.main import create_app

pytestmark = pytest.mark.anyio


async def test_probes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"status": "ready"}


async def test_a_serving_worker_spares_its_start_ups_objects_full_collections(cpu_settings: Settings) -> None:
    """What the worker holds once started lives as long as it serves (gc.freeze: no full collection walks it), and
    goes back to the collector when the app stops, so that an app stopped in a process that goes on (a test's) is
    collected as any garbage is."""
    gc.unfreeze()  # from a known start, whatever an app still serving in this process froze
    app = create_app(cpu_settings)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


async def test_info_names_backend_device_and_kernels(client: httpx.AsyncClient) -> None:
    info = (await client.get("/v1/info")).json()
    assert info["backend"] == "cpu" and info["state"] == "ready"
    (device,) = info["devices"]
    assert device["why_cpu"] == "MATMUL_BACKEND=cpu" and device["state"] == "ready" and device["queue_depth"] == 0
    assert info["queue"] == {"size": 64, "depth": 0}
    assert [k["name"] for k in info["kernels"]] == ["auto", "naive", "tiled", "numpy"]


async def test_kernels(client: httpx.AsyncClient) -> None:
    listing = (await client.get("/v1/kernels")).json()
    assert listing["backend"] == "cpu" and listing["default"] == "auto" and listing["auto"] == []
    kinds = {"auto": "auto", "naive": "emulation", "tiled": "emulation", "numpy": "library"}
    assert {k["name"]: k["kind"] for k in listing["kernels"]} == kinds
    emulated = {k["name"]: k for k in listing["kernels"] if k["kind"] == "emulation"}
    assert all(k["summary"].startswith("An emulation of the GPU kernel") for k in emulated.values())
    assert (emulated["tiled"]["tiles"], emulated["tiled"]["default_tile"]) == ([8, 16, 32], 16)
    assert (emulated["naive"]["tiles"], emulated["naive"]["default_tile"]) == ([], None)


async def test_unknown_route_and_method_use_the_error_format(client: httpx.AsyncClient) -> None:
    r = await client.get("/nowhere")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = await client.get("/matmul")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


async def test_openapi_documents_every_route_parameter_and_error(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    v1 = {"/matmul", "/healthz", "/readyz", "/v1/kernels", "/v1/info", "/metrics"}
    assert v1 < set(spec["paths"])
    assert {"/v2", "/v2/models/{model}/infer", "/v2/models/{model}/stats"} < set(spec["paths"])
    post = spec["paths"]["/matmul"]["post"]
    assert {p["name"] for p in post["parameters"]} == {"kernel", "tile", "dtype", "precision"}
    assert set(post["requestBody"]["content"]) == {"application/json", "multipart/form-data", "application/x-npz"}
    assert set(post["responses"]) == {"200", "400", "401", "406", "408", "413", "415", "422", "500", "503", "504"}
    assert "application/x-npy" in post["responses"]["200"]["content"]
    infer = spec["paths"]["/v2/models/{model}/infer"]["post"]["responses"]
    assert {"400", "401", "408", "413", "415", "422", "500", "503", "504"} <= set(infer)
    assert infer["503"]["content"]["application/json"]["schema"]["required"] == ["error"]  # the protocol's format
    for path in ("/v1/info", "/v1/kernels", "/metrics", "/v2", "/v2/models/stats"):
        assert "401" in spec["paths"][path]["get"]["responses"], path
    for probe in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):  # open even with API keys
        assert "401" not in spec["paths"][probe]["get"]["responses"], probe
    assert all(op.get("description") for path in spec["paths"].values() for op in path.values())
    assert (await client.get("/docs")).status_code == 200


def _cuda_fails(monkeypatch: pytest.MonkeyPatch, status: int, driver_installed: bool) -> None:
    """CuPy's runtime raises `status` on its first call; libcuda loads or not."""
    import cupy

    def get_device_count() -> int:
        raise cupy.cuda.runtime.CUDARuntimeError(status)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", get_device_count)
    monkeypatch.setattr(devices, "_driver_installed", lambda: driver_installed)


@pytest.mark.parametrize(
    ("status", "driver_installed", "reason"),
    [
        (devices.CUDA_ERROR_INSUFFICIENT_DRIVER, False, devices.NO_GPU),
        (devices.CUDA_ERROR_NO_DEVICE, True, devices.NO_GPU),
        (devices.CUDA_ERROR_INSUFFICIENT_DRIVER, True, "The NVIDIA driver is older than CuPy's CUDA runtime needs"),
    ],
)
def test_why_there_is_no_gpu_in_plain_words_with_cupys_own_in_the_detail(
    monkeypatch: pytest.MonkeyPatch, status: int, driver_installed: bool, reason: str
) -> None:
    import cupy

    _cuda_fails(monkeypatch, status, driver_installed)
    assert devices.gpu_unavailable(0) == devices.GpuUnavailable(reason, str(cupy.cuda.runtime.CUDARuntimeError(status)))
    assert devices.NO_GPU == "No NVIDIA GPU or driver found"


def test_without_a_driver_the_probe_says_so_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _cuda_fails(monkeypatch, devices.CUDA_ERROR_INSUFFICIENT_DRIVER, driver_installed=False)
    assert devices.engines("auto", []) == {"cpu": "No NVIDIA GPU or driver found"}
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning == (
        "No NVIDIA GPU or driver found: running on the CPU backend "
        "(cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version)"
    )


def probe_devices(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`python -m app.dataplane.devices` as the supervisor runs it, on this machine (no GPU in CI)."""
    command = [sys.executable, "-m", "app.dataplane.devices", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_the_device_probe_answers_in_json_and_refuses_gpu_without_one() -> None:
    assert json.loads(probe_devices("--backend", "cpu", "--devices=0,1").stdout) == {"cpu": "MATMUL_BACKEND=cpu"}
    if devices.gpu_unavailable(0) is None:
        pytest.skip("this machine has a GPU: the refusals below need one missing")
    auto = probe_devices("--backend", "auto")
    assert auto.returncode == 0 and json.loads(auto.stdout) == {"cpu": devices.NO_GPU}
    assert f"{devices.NO_GPU}: running on the CPU backend" in auto.stderr
    gpu = probe_devices("--backend", "gpu")
    assert gpu.returncode == 1 and gpu.stdout == ""
    said = gpu.stderr.strip().splitlines()[-1]
    assert said.startswith(f"RuntimeError: MATMUL_BACKEND=gpu, but the GPU backend cannot start: {devices.NO_GPU}")
    wrong = probe_devices("--backend", "tpu")
    assert wrong.returncode == 2 and "invalid choice: 'tpu'" in wrong.stderr


def test_the_supervisor_gives_the_probe_the_devices_as_one_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--devices=LIST`: argparse reads it as the flag's value whatever the list begins with."""
    commands: list[list[str]] = []

    def run(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout='{"devices": [1, 0]}', stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    supervisor = EngineSupervisor(Settings(backend=BackendChoice.GPU, devices=[1, 0]))
    try:
        assert supervisor._probe() == {"devices": [1, 0]}
    finally:
        supervisor.stop()
    [command] = commands
    assert command[-3:] == ["--backend", "gpu", "--devices=1,0"]


def test_the_supervisor_says_why_the_gpu_backend_cannot_start() -> None:
    if devices.gpu_unavailable(0) is None:
        pytest.skip("this machine has a GPU")
    supervisor = EngineSupervisor(Settings(backend=BackendChoice.GPU))
    try:
        with pytest.raises(RuntimeError, match=r"^the engine cannot start: RuntimeError: MATMUL_BACKEND=gpu, but"):
            supervisor.start()
        assert supervisor.engines == []
    finally:
        supervisor.stop()
