"""The images of the project's Dockerfile, built once a session by Podman (or Docker), and the commands to run them.

These tests run under `make container-test` (CI's `.ci/run` runs it after `make test`), which sets
MATMUL_CONTAINER_TEST=1; elsewhere they skip. Where they run, a step that cannot is a failure naming it, never a
skip. What they need and read:

- CONTAINER_ENGINE: podman or docker (default: whichever is installed, podman first);
- CONTAINER_BASE: the image the service and load-test stages start from. Unset, the Dockerfile's own
  (nvidia/cuda:12.8.1-base-ubuntu24.04 and python:3.12-slim, from a registry); `stand-in` (CI: no registry is
  reachable there) builds Debian bookworm with mmdebstrap (root) from Debian's mirror, with python3-venv, and
  builds both stages on it; any other value names an image to use for both.

Podman is run with a containers.conf of its own (CONTAINERS_CONF): limits on open files and processes that a sandbox
grants (podman's defaults, a million files and the host's process limit, were refused here), and runc as the OCI
runtime (crun refused this machine's hybrid cgroup layout). The build mounts the host's CA bundle and a pip.conf
naming it, so that pip trusts what the host trusts (a TLS-intercepting proxy's certificate included).

A build keeps no layer cache (`--layers=false`), and the images a session built are removed when it ends: a
machine that runs these tests again and again (CI's does) would otherwise gather two 1.8 GB images a run until its
disk is full. A build needs about BUILD_DISK_BYTES free where the engine keeps images; with less, the session fails
at once saying how much there is.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_TIMEOUT_S = 1200
RUNTIME = "runc"
PROCESSES = 32768
"""The process limit asked for containers: the service starts a few dozen threads and processes."""
BUILD_DISK_BYTES = 8 << 30
"""Free space a build needs: the service image (1.8 GB), its build stage's container, the layer blobs written while
committing them, and the load-test image, with room to spare."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Outside `make container-test` every test here skips, saying how to run it."""
    if os.environ.get("MATMUL_CONTAINER_TEST") == "1":
        return
    skip = pytest.mark.skip(reason="builds and runs the image: `make container-test` runs these")
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


@dataclass(frozen=True)
class Engine:
    """A container engine's command line, with what this environment needs."""

    command: str
    env: dict[str, str]

    def run(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.command, *args], capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **self.env}
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{self.command} {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    @property
    def is_podman(self) -> bool:
        return self.command == "podman"

    def remove(self, container: str, network: str, volume: str) -> None:
        """A test's container (stopped at once), its network and its volume, whichever exist."""
        self.run("rm", "--force", *(("--time", "0") if self.is_podman else ()), container, check=False)
        self.run("network", "rm", network, check=False)
        self.run("volume", "rm", "--force", volume, check=False)


@dataclass(frozen=True)
class Images:
    service: str
    loadtest: str
    base: str
    build_s: dict[str, float]


def _engine(tmp: Path) -> Engine:
    name = os.environ.get("CONTAINER_ENGINE") or next((e for e in ("podman", "docker") if shutil.which(e)), None)
    if name is None or shutil.which(name) is None:
        pytest.fail(
            "no container engine: install podman (apt-get install podman runc) or docker, or set CONTAINER_ENGINE"
        )
    if name != "podman":
        return Engine(name, {})
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    processes = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], PROCESSES)
    conf = tmp / "containers.conf"
    conf.write_text(
        f'[containers]\ndefault_ulimits = ["nofile={files}:{files}", "nproc={processes}:{processes}"]\n'
        f'[engine]\nruntime = "{RUNTIME}"\n'
    )
    return Engine("podman", {"CONTAINERS_CONF": str(conf)})


def _stand_in_base(engine: Engine, tmp: Path) -> str:
    """Debian bookworm (minbase, CA certificates, python3-venv), built by mmdebstrap and imported as an image."""
    if shutil.which("mmdebstrap") is None:
        pytest.fail("CONTAINER_BASE=stand-in needs mmdebstrap (apt-get install mmdebstrap): no base image otherwise")
    tarball = tmp / "base.tar"
    done = subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--include=ca-certificates,python3,python3-venv", "bookworm",
         str(tarball), DEBIAN_MIRROR],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"mmdebstrap could not build the stand-in base:\n{done.stderr[-3000:]}")
    name = "localhost/matmul-stand-in:bookworm"
    engine.run("import", str(tarball), name, timeout_s=300)
    return name


def _check_disk_space(engine: Engine) -> None:
    """Fails at once, naming the folder and its free space, where a build would run out of disk half-way."""
    where = "/var/lib/docker"
    if engine.is_podman:
        where = engine.run("info", "--format", "{{.Store.GraphRoot}}").stdout.strip()
    folders = {Path(where), Path(os.environ.get("TMPDIR", "/var/tmp"))}
    for folder in folders:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        if free < BUILD_DISK_BYTES:
            pytest.fail(
                f"{existing} has {free / 2**30:.1f} GiB free; building the images needs about "
                f"{BUILD_DISK_BYTES / 2**30:.0f} GiB (`{engine.command} system prune` removes unused images)"
            )


def _build(engine: Engine, target: str, tag: str, build_args: dict[str, str], tmp: Path) -> None:
    args = ["build", "--target", target, "--tag", tag, "--network", "host", "--force-rm"]
    args += [f"--build-arg={name}={value}" for name, value in build_args.items()]
    if engine.is_podman:
        args += ["--format", "docker", "--layers=false"]  # OCI drops HEALTHCHECK
        if HOST_CA_BUNDLE.exists():
            pip_conf = tmp / "pip.conf"
            pip_conf.write_text("[global]\ncert = /etc/ssl/certs/host-ca.crt\n")
            args += [
                f"--volume={HOST_CA_BUNDLE}:/etc/ssl/certs/host-ca.crt:ro",
                f"--volume={pip_conf}:/etc/pip.conf:ro",
            ]
    engine.run(*args, str(ROOT), timeout_s=BUILD_TIMEOUT_S)


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="session")
def images(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    """The service and load-test images, built from the Dockerfile as it is (on a stand-in base where asked), and
    removed, with the stand-in base, when the session ends."""
    _check_disk_space(engine)
    tmp = tmp_path_factory.mktemp("build")
    base = os.environ.get("CONTAINER_BASE", "")
    build_args = {}
    if base:
        base = _stand_in_base(engine, tmp) if base == "stand-in" else base
        build_args = {"CUDA_IMAGE": base, "PYTHON_IMAGE": base}
    tags = {
        "service": "localhost/matmul-service:container-test",
        "loadtest": "localhost/matmul-loadtest:container-test",
    }
    built = [*tags.values(), *((base,) if os.environ.get("CONTAINER_BASE") == "stand-in" else ())]
    try:
        took = {}
        for target, tag in tags.items():
            started = time.monotonic()
            _build(engine, target, tag, build_args, tmp)
            took[target] = time.monotonic() - started
        yield Images(tags["service"], tags["loadtest"], base or "the Dockerfile's", took)
    finally:
        engine.run("rmi", "--force", *built, check=False)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def container_env(pairs: dict[str, str]) -> Sequence[str]:
    return [f"--env={name}={value}" for name, value in pairs.items()]
