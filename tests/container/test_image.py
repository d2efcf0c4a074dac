"""The image a user deploys, built from the project's Dockerfile and run as the compose file and the Helm chart run
it: on the CPU backend (no GPU where these run), with a read-only root filesystem, no capabilities and no privilege
escalation, everything checked through the published port. What only a GPU host proves is said in docs/deployment.md
(`--gpus all`, the kernels compiled and run on a device): here NVRTC compiles every kernel inside the image, with no
driver, and the GPU backend's start fails at once with a clear message.

`make container-test` runs these (conftest.py says with what); each prints nothing on success, and pytest's
`--durations` shows what each step took.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from matmul_tools.bodies import inference_v2_body, load_npy, npy_bytes, npz_bytes
from matmul_tools.raw_http import read_until_closed
from tests.container.conftest import ROOT, Engine, Images, container_env, unique

pytestmark = pytest.mark.timeout(1500)
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CPU = {"MATMUL_BACKEND": "cpu"}
"""What the compose file's variables are given here: no GPU, so the CPU backend."""
AS_THE_CHART_RUNS_IT = ["--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges", "--tmpfs=/tmp"]
"""deploy/kubernetes: readOnlyRootFilesystem, capabilities dropped, no privilege escalation, /tmp a volume."""
READY_TIMEOUT_S = 120
CUDA_WHEELS = {"nvidia-cublas-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"}


def interpolated(environment: dict[str, str], given: dict[str, str]) -> dict[str, str]:
    """A compose service's environment with `${NAME:-default}` read as compose reads it, from `given`."""

    def value(match: re.Match[str]) -> str:
        return given.get(match["name"]) or match["default"] or ""

    pattern = re.compile(r"\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}")
    return {name: pattern.sub(value, str(text)) for name, text in environment.items()}


@dataclass(frozen=True)
class Running:
    name: str
    url: str
    network: str


@contextmanager
def started_service(engine: Engine, image: str) -> Iterator[Running]:
    """The `matmul` service of the compose file (its environment, the cache volume, its port), on a network of its
    own where it answers as `matmul`, as compose names it, and run as the chart runs it; ready. Removed, with its
    network and volume, at the end of the block."""
    service = COMPOSE["services"]["matmul"]
    network, name, cache = unique("matmul-net"), unique("matmul"), unique("cupy-cache")
    try:
        engine.run("network", "create", network)
        engine.run("volume", "create", cache)
        env = interpolated(service["environment"], CPU)
        args = ["run", "--detach", "--name", name, "--network", network, "--network-alias", "matmul"]
        args += ["--publish", "127.0.0.1::8000", f"--volume={cache}:/var/cache/cupy", *AS_THE_CHART_RUNS_IT]
        engine.run(*args, *container_env(env), image)
        port = engine.run("port", name, "8000").stdout.strip().rsplit(":", 1)[1]
        yield Running(name, _ready(engine, name, f"http://127.0.0.1:{port}"), network)
    finally:
        engine.remove(name, network, cache)


def _ready(engine: Engine, name: str, url: str) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    logs = engine.run("logs", name, check=False)
    raise AssertionError(f"the container was not ready in {READY_TIMEOUT_S} s:\n{logs.stdout[-2000:]}{logs.stderr}")


@pytest.fixture(scope="module")
def service(engine: Engine, images: Images) -> Iterator[Running]:
    with started_service(engine, images.service) as running:
        yield running


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


# --------------------------------------------------------------------------------------------- the image


def test_the_image_carries_the_cuda_wheels_the_service_loads_and_no_others(engine: Engine, images: Images) -> None:
    listed = engine.run("run", "--rm", "--entrypoint", "/opt/venv/bin/pip", images.service, "list", "--format=json")
    packages = {package["name"].lower(): package["version"] for package in json.loads(listed.stdout)}
    cuda = {name: version for name, version in packages.items() if name.startswith(("nvidia-", "cuda-toolkit"))}
    assert set(cuda) == CUDA_WHEELS, cuda
    assert all(version.startswith("12.8.") for version in cuda.values()), "the CUDA release of the base image's tag"
    assert packages["cupy-cuda12x"].startswith("14.")
    size = int(engine.run("image", "inspect", "--format", "{{.Size}}", images.service).stdout)
    print(f"\nimage {images.service} on {images.base} base: {size / 1e9:.2f} GB; built in {images.build_s}")


def test_nvrtc_compiles_every_kernel_inside_the_image_without_a_driver(engine: Engine, images: Images) -> None:
    program = (
        "from kernels.cuda import compile_ptx, compile_tensor_core_source\n"
        "from kernels.registry import KERNELS\n"
        "from kernels import tensorcore\n"
        "for spec in KERNELS.values():\n"
        "    compile_ptx(spec)\n"
        "sources = {tensorcore.WGMMA_SOURCE: tensorcore.WGMMA_CONFIGS, tensorcore.MMA_SYNC_SOURCE: "
        "tensorcore.MMA_SYNC_CONFIGS, tensorcore.DMMA_SOURCE: tensorcore.DMMA_CONFIGS, "
        "tensorcore.WGMMA_PINGPONG_SOURCE: {'turns': tensorcore.WGMMA_INT8_PINGPONG}}\n"
        "for source, configs in sources.items():\n"
        "    compile_tensor_core_source(source, [config.expression() for config in configs.values()])\n"
        "compile_tensor_core_source(tensorcore.OPERANDS_SOURCE, tensorcore.conversion_expressions())\n"
        "print(len(KERNELS) + len(sources) + 1)\n"
    )
    done = engine.run("run", "--rm", "--entrypoint", "python3", images.service, "-c", program, timeout_s=600)
    assert int(done.stdout.split()[-1]) >= 10, done.stdout


def test_the_image_carries_every_kernel_of_the_devices_it_was_built_for(engine: Engine, images: Images) -> None:
    """The build compiled the kernels of KERNEL_DEVICES into the package: a first start on those devices finds every
    program its Launcher loads there and compiles none (a cache folder of its own stays empty)."""
    program = (
        "from pathlib import Path\n"
        "from kernels.binaries import SHIPPED, KernelBinaries\n"
        "from kernels.cuda import programs_on\n"
        "binaries = KernelBinaries(cache=Path('/tmp/kernels'), shipped=SHIPPED)\n"
        "for device in ((8, 0), (8, 6), (8, 9), (9, 0)):\n"
        "    binaries.of(programs_on(device))\n"
        "print(binaries.compiled, len(list(SHIPPED.glob('*.json'))), Path('/tmp/kernels').exists())\n"
    )
    done = engine.run(
        "run", "--rm", *AS_THE_CHART_RUNS_IT, "--entrypoint", "python3", images.service, "-c", program, timeout_s=120
    )
    compiled, shipped, cache_made = done.stdout.split()[-3:]
    assert (compiled, cache_made) == ("0", "False"), done.stdout + done.stderr
    assert int(shipped) >= 43, "the H100's 43 programs at least"


def test_without_a_gpu_the_image_as_shipped_exits_at_once_saying_why(engine: Engine, images: Images) -> None:
    """Its default MATMUL_BACKEND=gpu: on a host without a GPU, exit 1 with the reason, not a CPU fallback."""
    started = time.monotonic()
    done = engine.run("run", "--rm", *AS_THE_CHART_RUNS_IT, images.service, check=False, timeout_s=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MATMUL_BACKEND=gpu, but the GPU backend cannot start" in done.stdout + done.stderr
    assert time.monotonic() - started < 60


# ------------------------------------------------------------------------------------------ the service


def test_ready_and_each_body_format_answers_its_product(service: Running) -> None:
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((65, 33), dtype=np.float32), rng.standard_normal((33, 17), dtype=np.float32)
    expected = _product(a, b)
    with httpx.Client(base_url=service.url, timeout=60) as http:
        answers = {
            "json": np.array(http.post("/matmul", json={"a": a.tolist(), "b": b.tolist()}).json()["result"]),
            "npy": load_npy(
                http.post(
                    "/matmul",
                    files={"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))},
                    headers={"accept": "application/x-npy"},
                ).content
            ),
            "npz": load_npy(
                http.post(
                    "/matmul",
                    content=npz_bytes(a=a, b=b),
                    headers={"content-type": "application/x-npz", "accept": "application/x-npy"},
                ).content
            ),
        }
        body, header_length = inference_v2_body(a, b)
        v2 = http.post(
            "/v2/models/matmul/infer", content=body, headers={"inference-header-content-length": str(header_length)}
        )
        split = int(v2.headers["inference-header-content-length"])
        answers["v2 binary"] = np.frombuffer(v2.content[split:], "<f4").reshape(65, 17)
    for name, c in answers.items():
        np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_healthcheck_of_the_image_passes(engine: Engine, service: Running) -> None:
    if engine.is_podman:  # no systemd here to run the timer: run the image's check as it would
        assert engine.run("healthcheck", "run", service.name).returncode == 0
        return
    deadline = time.monotonic() + 60
    while engine.run("inspect", "--format", "{{.State.Health.Status}}", service.name).stdout.strip() != "healthy":
        assert time.monotonic() < deadline, "the HEALTHCHECK did not report healthy within a minute"
        time.sleep(2)


def test_it_runs_as_the_images_user_read_only_with_no_capabilities(engine: Engine, service: Running) -> None:
    assert engine.run("exec", service.name, "id", "-u").stdout.strip() == "10001"
    status = engine.run("exec", service.name, "cat", "/proc/1/status").stdout
    capabilities = dict(re.findall(r"^(Cap\w+):\s+(\w+)$", status, re.MULTILINE))
    assert capabilities["CapEff"] == capabilities["CapPrm"] == "0000000000000000", capabilities
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.MULTILINE)
    touched = engine.run("exec", service.name, "touch", "/opt/venv/written", check=False)
    assert touched.returncode != 0 and "Read-only file system" in touched.stderr


def test_the_load_test_runs_against_the_service_as_compose_starts_it(
    engine: Engine, images: Images, service: Running, tmp_path: Path
) -> None:
    """The compose file's `loadtest` service (its image, command and report volume) on the service's network, where
    `matmul` is the service, for 5 s instead of 60."""
    command = [
        argument for argument in COMPOSE["services"]["loadtest"]["command"] if not argument.startswith("--duration")
    ]
    reports = tmp_path / "reports"
    reports.mkdir()
    os.chmod(reports, 0o777)  # the image's user (uid 10002) writes there
    name = unique("loadtest")
    done = engine.run(
        "run", "--rm", "--name", name, "--network", service.network, f"--volume={reports}:/reports",
        images.loadtest, *command, "--duration=5", timeout_s=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((reports / "loadtest.json").read_text())
    assert report["ok"] > 0 and report["errors"] == {}, (report["ok"], report["errors"])


def test_a_graceful_stop_finishes_the_product_in_flight_closes_idle_connections_and_exits_0(
    engine: Engine, images: Images
) -> None:
    """`stop` (SIGTERM, then 40 s as compose's stop_grace_period) while a 4096^2 product runs and four kept-alive
    connections idle: the idle ones are closed at once (their end of stream within 5 s of the stop, though the
    service keeps idle connections for 620 s), the product is answered, right, and the container exits 0."""
    with started_service(engine, images.service) as running:
        rng = np.random.default_rng(8)
        a, b = rng.standard_normal((4096, 4096), dtype=np.float32), rng.standard_normal((4096, 64), dtype=np.float32)
        b = np.tile(b, (1, 64))  # 4096^2, with a product cheap to check: 64 copies of one 4096x64 block
        answer: dict[str, httpx.Response] = {}

        def ask() -> None:
            files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))}
            answer["it"] = httpx.post(
                f"{running.url}/matmul", files=files, headers={"accept": "application/x-npy"}, timeout=120
            )

        idle = [_idle_connection(running.url) for _ in range(4)]
        asking = threading.Thread(target=ask)
        asking.start()
        _until_in_flight(running.url)
        stopped = time.monotonic()
        stop = ("stop", "--time", "40", running.name)
        stopping = threading.Thread(target=engine.run, args=stop, kwargs={"timeout_s": 120})
        stopping.start()
        closed_s = []
        for sock in idle:
            with sock:
                assert read_until_closed(sock) == b""
            closed_s.append(time.monotonic() - stopped)
        stopping.join(120)
        stop_s = time.monotonic() - stopped
        asking.join(timeout=120)
        exit_code = engine.run("inspect", "--format", "{{.State.ExitCode}}", running.name).stdout.strip()
    assert answer["it"].status_code == 200, answer["it"].text
    c, block = load_npy(answer["it"].content), _product(a, b[:, :64])
    for i in range(64):  # every block, each computed apart (BLAS need not round them alike, bit for bit)
        np.testing.assert_allclose(c[:, 64 * i : 64 * (i + 1)], block, rtol=1e-3, atol=1e-2, err_msg=f"block {i}")
    assert max(closed_s) < 5, closed_s
    assert exit_code == "0" and stop_s < 40, (exit_code, stop_s)


def _idle_connection(url: str) -> socket.socket:
    """A connection that has had one answer (GET /healthz, read whole) and idles, kept alive."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    reply = http.client.HTTPResponse(sock)
    reply.begin()
    assert reply.status == 200 and not reply.will_close
    reply.read()
    reply.close()  # its file, not the socket
    return sock


def _until_in_flight(url: str) -> None:
    """Until the server holds the product (its shared memory in use), a minute at most."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/v1/info", timeout=10).json()["slabs"]["used_bytes"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError("the product never reached the server")
