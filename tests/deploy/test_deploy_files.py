"""Dockerfile, docker-compose.yml and .dockerignore, checked without a Docker engine (there is none here or in CI).

The compose file is validated against the compose-spec JSON schema (check-jsonschema's vendored copy), the
Dockerfile is linted by hadolint and parsed by BuildKit's own parser (the `dockerfile` package); then both are
checked against what they deploy: the settings, the load-test script's flags, the files COPY needs.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import pytest
import yaml
from packaging.requirements import Requirement

from app import cli, host
from app.api import workers
from app.api.connection import GuardedHttpProtocol
from app.config import Settings
from app.dataplane.supervisor import ENGINE_SOCKETS_VARIABLE
from matmul_tools import loadtest
from tests.scripts import ROOT, import_script

SCRIPTS = Path(sys.executable).parent
scaleout = import_script("scaleout_local")
COMPOSE_PATH = ROOT / "docker-compose.yml"
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_PATH.read_text())
INSTRUCTIONS = dockerfile.parse_file(str(ROOT / "Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETTING_VARIABLES = {f"MATMUL_{name.upper()}" for name in Settings.model_fields}


def stages() -> dict[str, list[dockerfile.Command]]:
    """The instructions of each build stage, by stage name."""
    named: dict[str, list[dockerfile.Command]] = {}
    current: list[dockerfile.Command] = []
    for instruction in INSTRUCTIONS:
        if instruction.cmd == "FROM":
            current = named.setdefault(instruction.value[-1], [])
        current.append(instruction)
    return named


def one(stage: list[dockerfile.Command], cmd: str) -> dockerfile.Command:
    found = [instruction for instruction in stage if instruction.cmd == cmd]
    assert len(found) == 1, f"expected one {cmd} in the stage, found {len(found)}"
    return found[0]


def environment(stage: list[dockerfile.Command]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for instruction in stage:
        if instruction.cmd == "ENV":
            pairs.update(zip(instruction.value[::2], instruction.value[1::2], strict=True))
    return pairs


def image_of(stage: list[dockerfile.Command]) -> str:
    """The stage's base image, ARG defaults substituted."""
    defaults = dict(arg.value[0].split("=", 1) for arg in INSTRUCTIONS if arg.cmd == "ARG" and "=" in arg.value[0])
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], stage[0].value[0])


SERVICE, LOADTEST = stages()["service"], stages()["loadtest"]
SERVICE_ENV = environment(SERVICE)
SERVICE_ARGS = list(one(SERVICE, "CMD").value[1:])
SERVED_PORT = str(cli.service_parser().parse_args(SERVICE_ARGS).port)
GRPC_PORT = str(Settings.model_fields["grpc_port"].default)
"""The port of the inference protocol over gRPC the image serves (MATMUL_GRPC_PORT's default)."""
"""The port the image's CMD listens on: matmul-service's default unless the CMD names one."""


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A checker installed by the `test` extra into this interpreter's environment."""
    return subprocess.run([str(SCRIPTS / name), *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


# -------------------------------------------------------------------------------------------- linters


def test_compose_file_follows_the_compose_spec() -> None:
    done = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE_PATH))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_compose_spec_check_catches_a_misspelt_key(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_PATH.read_text().replace("capabilities:", "capability:"))
    done = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(broken))
    assert done.returncode == 1 and "'capabilities' is a required property" in done.stdout


def test_hadolint_finds_nothing() -> None:
    done = run_tool("hadolint", "--no-color", "Dockerfile")
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ Dockerfile


def test_the_service_runs_on_an_official_cuda_12_image_as_a_user() -> None:
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-\w+-ubuntu\d+\.\d+", image_of(SERVICE))
    assert image_of(stages()["build"]) == image_of(SERVICE), "the venv is built on the image it runs on"
    user = [instruction for instruction in SERVICE if instruction.cmd == "USER"][-1].value[0]
    assert user.split(":")[0] not in ("root", "0")
    assert [instruction.cmd for instruction in LOADTEST if instruction.cmd == "USER"], "the load test too"


def test_cupy_14_2_or_later_is_installed_with_only_the_cuda_wheels_it_loads_of_the_base_images_release() -> None:
    """The runtime (with the headers NVRTC needs), NVRTC and cuBLAS, each of CUDA_WHEELS, the release of the
    base image's tag: no cuSOLVER, cuSPARSE, cuFFT or cuRAND (`[ctk]` brought 1.4 GB of them)."""
    install = " ".join(i.value[0] for i in stages()["build"] if i.cmd == "RUN" and "pip install" in i.value[0])
    extras = PYPROJECT["project"]["optional-dependencies"]
    from_extras = [line for extra in re.findall(r'"\.\[(\w+)\]"', install) for line in extras[extra]]
    cupy = [r for r in map(Requirement, from_extras) if r.name.startswith("cupy")]
    assert [(r.name, r.extras) for r in cupy] == [("cupy-cuda12x", set())]
    assert "14.2" in cupy[0].specifier and "14.1" not in cupy[0].specifier
    defaults = dict(arg.value[0].split("=", 1) for arg in INSTRUCTIONS if arg.cmd == "ARG" and "=" in arg.value[0])
    named = [Requirement(word.strip('"\\').replace("${CUDA_WHEELS}", defaults["CUDA_WHEELS"])) for word in
             install.split() if word.startswith('"nvidia-')]  # fmt: skip
    assert {r.name for r in named} == {"nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cublas-cu12"}
    release = re.search(r"nvidia/cuda:(\d+\.\d+)\.", image_of(SERVICE))
    assert release and all(str(r.specifier) == f"=={release.group(1)}.*" for r in named)


def test_every_extra_installed_in_an_image_exists() -> None:
    runs = " ".join(i.value[0] for i in INSTRUCTIONS if i.cmd == "RUN")
    named = set(re.findall(r'"\.\[(\w+)\]"', runs))
    assert named == {"gpu", "loadtest"} and named <= set(PYPROJECT["project"]["optional-dependencies"])


def test_cmd_is_exec_form_matmul_service_with_settings_from_the_environment() -> None:
    cmd = one(SERVICE, "CMD")
    assert cmd.json and list(cmd.value) == ["matmul-service"]
    assert PYPROJECT["project"]["scripts"]["matmul-service"] == "app.cli:service_main"
    assert cli.service_parser().parse_args(SERVICE_ARGS).host == "0.0.0.0"
    assert one(SERVICE, "EXPOSE").value == (SERVED_PORT, GRPC_PORT)
    uvicorn_variables = {name for name in SERVICE_ENV if name.startswith("UVICORN_")}
    assert uvicorn_variables == {cli.GRACEFUL_SHUTDOWN_VARIABLE}, "matmul-service reads no other UVICORN_* variable"
    assert set(SERVICE_ENV) & SETTING_VARIABLES == {"MATMUL_BACKEND"} and SERVICE_ENV["MATMUL_BACKEND"] == "gpu"
    assert SERVICE_ENV["PATH"].startswith("/opt/venv/bin:")


def in_the_image_environment(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    """This process's environment as the image's CMD sees it: its MATMUL_* and UVICORN_* variables, no others. A
    copy of it, so that what service_main adds for its HTTP workers leaves with the test (the servers of later
    tests would look for the engines it named)."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in [*SETTING_VARIABLES, ENGINE_SOCKETS_VARIABLE, cli.METRICS_DIR_VARIABLE, cli.GRACEFUL_SHUTDOWN_VARIABLE]:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**SERVICE_ENV, **extra}.items():
        if name.startswith(("MATMUL_", "UVICORN_")):
            monkeypatch.setenv(name, value)


def test_matmul_service_gives_in_flight_requests_a_graceful_shutdown_in_the_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn.run reads no UVICORN_* variable; matmul-service's --timeout-graceful-shutdown takes its default from
    UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN, so on SIGTERM each HTTP worker waits that long for in-flight requests."""
    in_the_image_environment(monkeypatch)
    args = cli.service_parser().parse_args(SERVICE_ARGS)
    assert cli.uvicorn_options(args).timeout_graceful_shutdown == 30
    monkeypatch.delenv(cli.GRACEFUL_SHUTDOWN_VARIABLE)
    assert cli.uvicorn_options(args).timeout_graceful_shutdown is None, "uvicorn's default"


class FakeSupervisor:
    """An EngineSupervisor that starts no process."""

    def __init__(self, settings: Settings, directory: Path) -> None:
        self.settings, self.directory, self.stopped = settings, directory, False
        self.sockets = [str(directory / "device-0.sock")]

    def start(self) -> None:
        pass

    def make_directory(self, name: str) -> str:
        (self.directory / name).mkdir()
        return str(self.directory / name)

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("http_workers", ["1", "3"])
def test_matmul_service_in_the_image_runs_uvicorn_with_the_connection_protocol_that_bounds_headers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, http_workers: str
) -> None:
    """The image's CMD, with its environment and compose's MATMUL_HTTP_WORKERS, serves the app factory on the
    exposed port with app.api.connection's protocol, without uvicorn's access log, in that many HTTP workers."""
    in_the_image_environment(monkeypatch, MATMUL_HTTP_WORKERS=http_workers)
    supervisors: list[FakeSupervisor] = []
    runs: list[tuple[dict[str, Any], str | None]] = []

    def supervisor(settings: Settings) -> FakeSupervisor:
        supervisors.append(FakeSupervisor(settings, tmp_path))
        return supervisors[-1]

    monkeypatch.setattr(cli, "EngineSupervisor", supervisor)
    monkeypatch.setattr(workers, "serve", lambda served, metrics_dir: runs.append((dict(served), metrics_dir)))
    assert cli.service_main(SERVICE_ARGS) == 0

    [(kwargs, metrics_dir)] = runs
    assert kwargs["app"] == "app.main:create_app" and kwargs["factory"] is True
    # several workers keep their metrics in one folder, which their supervisor cleans of the dead ones' gauges
    assert (metrics_dir is None) is (http_workers == "1")
    assert kwargs["http"] is GuardedHttpProtocol and kwargs["access_log"] is False
    assert (kwargs["host"], str(kwargs["port"])) == ("0.0.0.0", SERVED_PORT)
    assert kwargs["timeout_graceful_shutdown"] == 30 and kwargs["workers"] == int(http_workers)
    [engines] = supervisors
    assert engines.settings.backend.value == "gpu" and engines.stopped
    assert os.environ[ENGINE_SOCKETS_VARIABLE] == engines.sockets[0], "the HTTP workers find the engines"


def test_matmul_service_in_the_image_derives_what_compose_passes_on_empty(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Compose passes MATMUL_HTTP_WORKERS and MATMUL_SLAB_BYTES on empty: on a 16-CPU host with 64 GiB the image's
    CMD, in compose's environment with nothing exported, starts 8 HTTP workers with 1 GiB of shared memory each and
    batching on, and logs them with where they came from."""
    unset = {name: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value) for name, value in compose_environment().items()}
    assert unset["MATMUL_HTTP_WORKERS"] == unset["MATMUL_SLAB_BYTES"] == ""
    in_the_image_environment(monkeypatch, **unset)
    monkeypatch.setattr(host, "usable_cpus", lambda: 16)
    monkeypatch.setattr(host, "usable_memory_bytes", lambda: 64 << 30)
    supervisors: list[FakeSupervisor] = []
    runs: list[dict[str, Any]] = []

    def supervisor(settings: Settings) -> FakeSupervisor:
        supervisors.append(FakeSupervisor(settings, tmp_path))
        return supervisors[-1]

    monkeypatch.setattr(cli, "EngineSupervisor", supervisor)
    monkeypatch.setattr(workers, "serve", lambda served, metrics_dir: runs.append(dict(served)))
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        assert cli.service_main(SERVICE_ARGS) == 0

    [kwargs], [engines] = runs, supervisors
    assert kwargs["workers"] == engines.settings.http_workers == 8
    assert engines.settings.slab_bytes == 1 << 30 and engines.settings.batching
    assert engines.settings.max_queue_delay_us == 0
    [line] = [record.getMessage() for record in caplog.records if record.name == cli.__name__]
    assert "8 HTTP worker(s) (half of 16 usable CPUs, at most 8 and as many as a quarter of 64.0 GiB holds" in line
    assert "batching on (default)" in line and "queue delay 0 us (default: no wait)" in line
    assert "1024 MiB of shared memory per HTTP worker (a quarter of 64.0 GiB usable memory" in line


def test_matmul_service_says_which_settings_it_was_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    in_the_image_environment(monkeypatch, MATMUL_SLAB_BYTES=str(300 << 20), MATMUL_BATCHING="false")
    monkeypatch.setattr(cli, "EngineSupervisor", lambda settings: FakeSupervisor(settings, tmp_path))
    monkeypatch.setattr(workers, "serve", lambda served, metrics_dir: None)
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        assert cli.service_main([*SERVICE_ARGS, "--workers", "3"]) == 0
    [line] = [record.getMessage() for record in caplog.records if record.name == cli.__name__]
    assert "3 HTTP worker(s) (--http-workers)" in line and "batching off ($MATMUL_BATCHING)" in line
    assert "300 MiB of shared memory per HTTP worker ($MATMUL_SLAB_BYTES)" in line


def test_healthcheck_probes_healthz_on_the_served_port() -> None:
    check = one(SERVICE, "HEALTHCHECK")
    assert check.json and check.value[0] == "CMD"
    assert f"http://127.0.0.1:{SERVED_PORT}/healthz" in " ".join(check.value)


def test_the_cupy_cache_is_a_volume() -> None:
    assert one(SERVICE, "VOLUME").value == (SERVICE_ENV["CUPY_CACHE_DIR"],)


# ------------------------------------------------------------------------------------------ .dockerignore


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as Docker reads it: (is an exception `!`, pattern); `*` stays within one path segment."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").strip("/")
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
        wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        rules.append((negate, re.compile("".join(wild.get(part, re.escape(part)) for part in parts))))
    return rules


def ignored(path: str) -> bool:
    """Whether Docker leaves `path` out of the build context: the last rule matching it or a parent decides."""
    prefixes = ["/".join(path.split("/")[: i + 1]) for i in range(path.count("/") + 1)]
    verdict = False
    for negate, pattern in dockerignore_rules():
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            verdict = not negate
    return verdict


def copied_files() -> Iterator[str]:
    for instruction in INSTRUCTIONS:
        if instruction.cmd == "COPY" and not any(flag.startswith("--from") for flag in instruction.flags):
            for source in instruction.value[:-1]:
                path = ROOT / source
                assert path.exists(), f"COPY {source}: no such file"
                files = sorted(path.rglob("*")) if path.is_dir() else [path]
                yield from (str(f.relative_to(ROOT)) for f in files if f.is_file() and "__pycache__" not in f.parts)


def test_the_build_context_holds_what_copy_needs_and_not_the_rest() -> None:
    needed = list(copied_files())
    assert "kernels/registry.py" in needed and "scripts/loadtest.py" in needed
    assert [path for path in needed if ignored(path)] == []
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/client/test_client.py",
        "app/__pycache__/main.cpython-312.pyc",
    ):
        assert ignored(path), path


# -------------------------------------------------------------------------------------------- compose


def test_the_service_reserves_a_gpu_and_is_health_checked() -> None:
    service = COMPOSE["services"]["matmul"]
    assert service["build"]["target"] == "service"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert service["healthcheck"]["start_period"] and "test" not in service["healthcheck"], "the image's probe"
    container_ports = {mapping.rsplit(":", 1)[1] for mapping in service["ports"]}
    assert container_ports == {SERVED_PORT, GRPC_PORT}


def compose_seconds(duration: str) -> float:
    """A compose duration (`40s`, `1m30s`, `2.5s`) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert "".join(number + unit for number, unit in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit] for number, unit in parts)


@pytest.mark.parametrize("name", ["matmul", "replica"])
def test_the_service_is_restarted_when_it_exits_and_stopped_only_after_its_graceful_shutdown(name: str) -> None:
    """A lost GPU ends only its engine process, which matmul-service restarts; the restart policy starts a fresh
    container if matmul-service itself exits. `docker stop` waits longer than the HTTP workers' graceful shutdown
    before it kills (Docker's default wait is 10 s)."""
    service = COMPOSE["services"][name]
    assert service["restart"] in ("always", "unless-stopped") or service["restart"].startswith("on-failure")
    graceful_s = int(SERVICE_ENV[cli.GRACEFUL_SHUTDOWN_VARIABLE])
    assert compose_seconds(service.get("stop_grace_period", "10s")) > graceful_s


def compose_environment() -> dict[str, str]:
    """The service's environment in docker-compose.yml, before compose substitutes the shell's variables."""
    variables: dict[str, str] = COMPOSE["services"]["matmul"]["environment"]
    return variables


def test_the_service_settings_are_real_settings() -> None:
    variables = compose_environment()
    assert set(variables) <= SETTING_VARIABLES and {"MATMUL_BACKEND", "MATMUL_QUEUE_SIZE"} <= set(variables)
    for variable in ("MATMUL_HTTP_WORKERS", "MATMUL_SLAB_BYTES", "MATMUL_BATCHING", "MATMUL_MAX_QUEUE_DELAY_US"):
        assert variables[variable] == f"${{{variable}:-}}", f"{variable} is passed on, empty if unset: the default"


def first_party_imports(path: Path, seen: set[Path] | None = None) -> set[str]:
    """The project's packages that `path` imports, and those its imports of them import in turn."""
    seen = seen if seen is not None else set()
    seen.add(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            if name.split(".")[0] not in PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
                continue
            found.add(name.split(".")[0])
            module = ROOT / (name.replace(".", "/") + ".py")
            if module.is_file() and module not in seen:
                found |= first_party_imports(module, seen)
    return found


def test_the_loadtest_stage_copies_every_package_the_script_imports() -> None:
    copied = {instruction.value[0] for instruction in LOADTEST if instruction.cmd == "COPY"}
    imported = first_party_imports(ROOT / "scripts" / "loadtest.py")
    assert "matmul_tools" in imported
    assert imported <= copied, f"the loadtest image lacks {imported - copied}"


def test_the_kernel_cache_is_a_named_volume_at_cupy_cache_dir() -> None:
    volumes = [mount.split(":") for mount in COMPOSE["services"]["matmul"]["volumes"]]
    assert [SERVICE_ENV["CUPY_CACHE_DIR"]] == [target for name, target in volumes if name in COMPOSE["volumes"]]


def test_the_loadtest_service_runs_the_script_against_the_service() -> None:
    service = COMPOSE["services"]["loadtest"]
    assert service["profiles"] == ["loadtest"] and service["build"]["target"] == "loadtest"
    assert service["depends_on"] == {"matmul": {"condition": "service_healthy"}}
    assert list(one(LOADTEST, "ENTRYPOINT").value) == ["/opt/venv/bin/python", "scripts/loadtest.py"]
    args = loadtest.parse_args(service["command"])
    url = urlsplit(args.url)
    assert url.hostname == "matmul" and str(url.port) == SERVED_PORT
    assert args.wait_ready > 0, (
        "the service is healthy before its kernels are compiled; the load test waits for /readyz"
    )
    mounts = {mount.split(":")[1] for mount in service["volumes"]}
    assert str(Path(args.out).parent) in mounts


@pytest.mark.parametrize("name", ["matmul", "loadtest", "replica"])
def test_each_build_target_is_a_stage(name: str) -> None:
    assert COMPOSE["services"][name]["build"]["target"] in stages()


# ------------------------------------------------------------------------------- scale-out (nginx)


def nginx_directives(text: str) -> dict[str, list[str]]:
    """Every one-line simple directive of an nginx config (`name args;`), by name: the argument strings in order."""
    directives: dict[str, list[str]] = {}
    for name, arguments in re.findall(r"^[ \t]*(\w+)(?:[ \t]+([^;#\n]*))?;", text, re.MULTILINE):
        directives.setdefault(name, []).append(arguments.strip())
    return directives


NGINX_TEMPLATE = (ROOT / "deploy" / "nginx.conf").read_text()
NGINX = nginx_directives(NGINX_TEMPLATE)


def test_the_scale_profile_puts_replicas_of_the_service_behind_the_official_nginx() -> None:
    services = COMPOSE["services"]
    replica, balancer = services["replica"], services["balancer"]
    assert replica["profiles"] == balancer["profiles"] == ["scale"]
    assert replica["image"] == services["matmul"]["image"] and replica["build"] == services["matmul"]["build"]
    assert replica["environment"] == services["matmul"]["environment"]
    assert replica["healthcheck"] == services["matmul"]["healthcheck"]
    assert re.fullmatch(r"nginx:\d+\.\d+", balancer["image"]), "the official image, a pinned minor version"
    mounts = {source: target for source, target, *_ in (mount.split(":") for mount in balancer["volumes"])}
    assert mounts == {"./deploy/nginx.conf": "/etc/nginx/templates/default.conf.template"}
    assert balancer["depends_on"] == {"replica": {"condition": "service_healthy"}}
    placeholders = set(re.findall(r"\$\{(\w+)\}", NGINX_TEMPLATE))
    assert placeholders == set(balancer["environment"]) == {"NGINX_LISTEN", "NGINX_UPSTREAM"}
    host, port = balancer["environment"]["NGINX_UPSTREAM"].split(":")
    assert host == "replica" and port == SERVED_PORT
    assert balancer["ports"] == ["${MATMUL_LB_PORT:-8080}:" + balancer["environment"]["NGINX_LISTEN"]]


def test_nginx_balances_by_least_connections_and_streams_bodies_up_to_the_service_limit() -> None:
    assert NGINX["least_conn"] == [""] and int(NGINX["keepalive"][0]) > 0
    assert NGINX_TEMPLATE.index("least_conn") < NGINX_TEMPLATE.index("keepalive"), "the method comes first"
    assert NGINX["proxy_request_buffering"] == NGINX["proxy_buffering"] == ["off"]
    assert NGINX["proxy_http_version"] == ["1.1"] and 'Connection ""' in NGINX["proxy_set_header"]
    size = NGINX["client_max_body_size"][0]
    assert int(size[:-1]) << {"k": 10, "m": 20, "g": 30}[size[-1]] == Settings.model_fields["max_body_bytes"].default
    assert "X-Request-ID $matmul_request_id" in NGINX["proxy_set_header"]
    assert "max_fails=" in NGINX["server"][0] and "fail_timeout=" in NGINX["server"][0]


def test_nginx_closes_its_idle_connections_to_the_replicas_before_they_would() -> None:
    """The upstream pool's keepalive_timeout is below the service's idle timeout, so nginx never sends a request into
    a connection the replica is closing (a 502 for a POST, which nginx does not retry)."""
    upstream = re.search(r"^upstream matmul \{$(.*?)^\}$", NGINX_TEMPLATE, re.MULTILINE | re.DOTALL)
    assert upstream is not None
    [keepalive_timeout] = nginx_directives(upstream[1])["keepalive_timeout"]
    assert int(keepalive_timeout.removesuffix("s")) < Settings.model_fields["keep_alive_timeout_s"].default


@pytest.mark.skipif(scaleout.find_nginx() is None, reason="nginx is not installed (apt-get install nginx)")
def test_nginx_accepts_the_template_as_the_local_script_renders_it(tmp_path: Path) -> None:
    scaleout.write_prefix(tmp_path, 8080, ["127.0.0.1:8001", "127.0.0.1:8002"])
    nginx = scaleout.find_nginx()
    done = subprocess.run(scaleout.nginx_command(nginx, tmp_path, "-t"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "test is successful" in done.stderr, done.stderr
