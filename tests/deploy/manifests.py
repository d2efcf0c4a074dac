"""Kubernetes manifests checked without a cluster (there is none here or in CI), and the checks the chart's pod and
KServe's predictor share.

Built-in kinds are validated by kubernetes-validate against the schemas it bundles for each release in
KUBERNETES_VERSIONS, strictly (an unknown field is an error, as `kubectl apply --validate=strict` makes it). Custom
resources are validated against the openAPIV3Schema of their CRD, vendored in tests/deploy/schemas with its licence,
made as strict. Then each pod is held to what it runs: the settings the service reads, the routes its app serves,
the port, user and cache of the Dockerfile, the shutdown timeout of matmul-service.
"""

from __future__ import annotations

import base64
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import kubernetes_validate
import yaml

from app import cli, host
from app.api.auth import OPEN_PATHS
from app.api.exchange import KEPT_BODY_BYTES
from app.config import Settings
from app.main import create_app
from app.metrics import ServiceMetrics
from tests.deploy.test_deploy_files import GRPC_PORT, SERVED_PORT, SERVICE, SERVICE_ENV

KUBERNETES_VERSIONS = ("1.30", "1.37")
"""The chart's kubeVersion floor and the newest release whose schemas kubernetes-validate bundles."""
SCHEMAS = Path(__file__).parent / "schemas"
CRD_FILES = [
    SCHEMAS / "kserve" / "serving.kserve.io_inferenceservices.yaml",
    SCHEMAS / "keda" / "keda.sh_scaledobjects.yaml",
    SCHEMAS / "prometheus-operator" / "monitoring.coreos.com_servicemonitors.yaml",
]
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML has it: the InferenceService CRD is 2 MB."""

ENV_PREFIX = Settings.model_config.get("env_prefix", "")
SETTING_VARIABLES = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}
IMAGE_VARIABLES = {name for name in SERVICE_ENV if name not in SETTING_VARIABLES}
"""What the image sets besides settings (CUPY_CACHE_DIR, UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN, ...): a pod may set
them too."""
[SECRET_SETTING] = [name for name, field in Settings.model_fields.items() if "SecretStr" in str(field.annotation)]
SECRET_VARIABLE = f"{ENV_PREFIX}{SECRET_SETTING}".upper()
"""MATMUL_API_KEYS: the one setting whose value is secret, so the one a pod takes from a Secret."""
USER_ID, GROUP_ID = (int(part) for part in [i for i in SERVICE if i.cmd == "USER"][-1].value[0].split(":"))
NODE_CPUS = 16
"""The CPUs of the node a pod's settings are derived for (the service derives its HTTP workers from the CPUs it may
use, and the pods set no CPU limit): the H100 host the defaults were measured on, where they reach their cap."""
NODE_CPU_COUNTS = (2, 5, NODE_CPUS, 128)
"""The nodes the memory limit is checked for: each derives its own HTTP workers and shared memory."""
NODE_MEMORY_BYTES = 256 << 30
"""The node's memory, for a pod without a memory limit (with one, the service derives from the limit)."""


def load_documents(text: str) -> list[dict[str, Any]]:
    return [document for document in yaml.load_all(text, Loader=LOADER) if document]


@functools.cache
def served_routes() -> set[str]:
    """The paths the service answers GET on: its OpenAPI description, from the app as create_app builds it."""
    paths = create_app(Settings(backend="cpu")).openapi()["paths"]
    return {path for path, operations in paths.items() if "get" in operations}


def exported_gauges() -> set[str]:
    """The gauges the service's /metrics exports (app.metrics' registry)."""
    return {family.name for family in ServiceMetrics().registry.collect() if family.type == "gauge"}


# ------------------------------------------------------------------------------------------- schemas


def _strict(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields refused wherever the API server would refuse them: objects that
    list their properties and neither preserve unknown fields nor say what other properties may hold."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    listed = "properties" in schema and "additionalProperties" not in schema
    if listed and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft4Validator]:
    """A validator per (apiVersion, kind) that the vendored CRDs serve. OpenAPI v3.0's schema objects are JSON
    Schema draft 4's, with extensions (x-kubernetes-*) that a validator ignores."""
    validators = {}
    for path in CRD_FILES:
        crd = yaml.load(path.read_text(), Loader=LOADER)
        for version in crd["spec"]["versions"]:
            if version["served"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                validators[key] = jsonschema.Draft4Validator(_strict(version["schema"]["openAPIV3Schema"]))
    return validators


def schema_errors(document: dict[str, Any], version: str) -> list[str]:
    """Why `document` would be refused by a cluster of `version` with the vendored CRDs installed; none if not."""
    where = f"{document.get('kind')} {document.get('metadata', {}).get('name')}"
    validator = crd_validators().get((document.get("apiVersion", ""), document.get("kind", "")))
    if validator is not None:
        errors = validator.iter_errors(document)
        return sorted(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{where}: {exc.message}"]
    return []


def check_schemas(objects: list[dict[str, Any]]) -> None:
    """A cluster of each of KUBERNETES_VERSIONS, with the vendored CRDs installed, takes every object."""
    errors = [error for version in KUBERNETES_VERSIONS for d in objects for error in schema_errors(d, version)]
    assert errors == [], "\n".join(errors)


# ----------------------------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class Pod:
    """One workload's pod as the manifests make it: its spec, the annotations it gets, and the objects beside it
    that its environment refers to (ConfigMaps, Secrets)."""

    spec: dict[str, Any]
    annotations: dict[str, str]
    objects: list[dict[str, Any]]

    @property
    def container(self) -> dict[str, Any]:
        containers: list[dict[str, Any]] = self.spec["containers"]
        [container] = containers
        return container

    def _data(self, kind: str, name: str) -> dict[str, str] | None:
        for document in self.objects:
            if document["kind"] == kind and document["metadata"]["name"] == name:
                data: dict[str, str] = document.get("data", {})
                return data
        return None

    def environment(self) -> dict[str, str]:
        """The container's environment variables (ConfigMaps through envFrom first, then env), Secrets' values read
        where the Secret is among the objects, a placeholder where it is not (an existing Secret)."""
        variables: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            name = source["configMapRef"]["name"]
            data = self._data("ConfigMap", name)
            assert data is not None, f"envFrom names ConfigMap {name}, which the manifests do not hold"
            variables.update(data)
        for variable in self.container.get("env", []):
            if "value" in variable:
                variables[variable["name"]] = variable["value"]
                continue
            reference = variable["valueFrom"]["secretKeyRef"]
            data = self._data("Secret", reference["name"])
            if data is None:
                variables[variable["name"]] = f"from-secret-{reference['name']}"
            else:
                assert reference["key"] in data, f"Secret {reference['name']} has no key {reference['key']}"
                variables[variable["name"]] = base64.b64decode(data[reference["key"]]).decode()
        return variables

    def port(self, reference: int | str) -> int:
        """A probe's or Service's port, by number or by the container port's name."""
        if isinstance(reference, int):
            return reference
        [port] = [p["containerPort"] for p in self.container["ports"] if p.get("name") == reference]
        return int(port)


def settings_of(pod: Pod, cpus: int = NODE_CPUS) -> Settings:
    """The settings the service builds in this pod, from its MATMUL_* variables alone (no .env file), on a node of
    `cpus` CPUs: the defaults it derives from the CPUs and memory it may use come from those CPUs and the pod's
    memory limit (its cgroup's), not from this machine."""
    outside = {name: value for name, value in os.environ.items() if not name.upper().startswith(ENV_PREFIX)}
    limit = pod.container.get("resources", {}).get("limits", {}).get("memory")
    memory = NODE_MEMORY_BYTES if limit is None else min(NODE_MEMORY_BYTES, quantity_bytes(limit))
    with (
        mock.patch.dict(os.environ, {**outside, **pod.environment()}, clear=True),
        mock.patch.object(host, "usable_cpus", return_value=cpus),
        mock.patch.object(host, "usable_memory_bytes", return_value=memory),
    ):
        return Settings(_env_file=None)


def graceful_shutdown_s(pod: Pod) -> int | None:
    """How long matmul-service in this pod gives in-flight requests on SIGTERM: its flag's default, read from the
    variable as the image and the pod set it (None: uvicorn's own, no limit)."""
    name = cli.GRACEFUL_SHUTDOWN_VARIABLE
    variables = {key: value for key, value in os.environ.items() if key != name}
    given = {**SERVICE_ENV, **pod.environment()}.get(name)
    with mock.patch.dict(os.environ, variables if given is None else {**variables, name: given}, clear=True):
        timeout = cli.uvicorn_options(cli.service_parser().parse_args([])).timeout_graceful_shutdown
    return timeout


QUANTITY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (`8Gi`, `512M`, `1073741824`) in bytes."""
    found = re.fullmatch(r"(\d+)([KMGT]i|[kMG])?", str(quantity))
    assert found, f"not a memory quantity this check reads: {quantity!r}"
    return int(found[1]) * QUANTITY_UNITS.get(found[2] or "", 1)


def probes(pod: Pod) -> dict[str, dict[str, Any]]:
    return {kind: pod.container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}


# The checks of one pod, shared by the chart's Deployment and KServe's predictor. Each raises AssertionError.


def check_environment(pod: Pod) -> None:
    """Every variable is a setting or one the image itself sets; the settings are valid, on the GPU backend, with
    one engine process per GPU the pod gets."""
    unknown = set(pod.environment()) - SETTING_VARIABLES - IMAGE_VARIABLES
    assert not unknown, f"{sorted(unknown)}: neither a setting ({ENV_PREFIX}*) nor a variable the image sets"
    settings = settings_of(pod)
    assert settings.backend.value == "gpu", "a GPU pod that found no GPU should fail to start, not serve on the CPU"
    gpus = int(pod.container["resources"]["limits"]["nvidia.com/gpu"])
    assert settings.devices == list(range(gpus)), f"{gpus} GPU(s), engines on devices {settings.devices}"


def check_probes(pod: Pod) -> None:
    """Probes on routes the app serves without a key (the kubelet sends none), on the served port; start-up and
    readiness on the route that waits for the kernels, liveness on one that does not; time for a cold start."""
    routes = served_routes()
    found = probes(pod)
    for kind, probe in found.items():
        path = probe["httpGet"]["path"]
        assert path in routes, f"{kind} probe: the app serves no GET {path}"
        assert path in OPEN_PATHS, f"{kind} probe: {path} needs an API key"
        assert pod.port(probe["httpGet"]["port"]) == int(SERVED_PORT), f"{kind} probe: not the served port"
    assert found["startup"]["httpGet"]["path"] == found["readiness"]["httpGet"]["path"]
    assert found["liveness"]["httpGet"]["path"] != found["readiness"]["httpGet"]["path"], (
        "liveness on readiness would restart a pod whose engine is compiling again after a lost GPU"
    )
    startup = found["startup"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "too short for a cold kernel cache"


def check_port(pod: Pod) -> None:
    """The container ports are those the image's CMD serves (and EXPOSEs): HTTP, and gRPC where the pod's
    MATMUL_GRPC_PORT leaves it on; Prometheus's annotations aim at HTTP."""
    grpc_port = settings_of(pod).grpc_port
    served = [int(SERVED_PORT), *([grpc_port] if grpc_port else [])]
    assert [p["containerPort"] for p in pod.container["ports"]] == served
    assert grpc_port in (0, int(GRPC_PORT)), "a gRPC port of its own: the chart's Service and the image expose 8001"
    if pod.annotations.get("prometheus.io/scrape") == "true":
        assert pod.annotations["prometheus.io/port"] == SERVED_PORT
        assert pod.annotations["prometheus.io/path"] in served_routes()


def check_shutdown(pod: Pod) -> None:
    """The kubelet's SIGKILL comes after the preStop sleep and matmul-service's graceful shutdown, not during."""
    graceful = graceful_shutdown_s(pod)
    assert graceful is not None, f"no {cli.GRACEFUL_SHUTDOWN_VARIABLE}: uvicorn would wait without limit"
    sleep = pod.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod.spec["terminationGracePeriodSeconds"] > sleep + graceful


def check_security(pod: Pod) -> None:
    """The image's unprivileged user, nothing to escalate to, a read-only root with /tmp writable, no API token."""
    context = pod.spec["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (USER_ID, GROUP_ID), "the Dockerfile's USER"
    container = pod.container["securityContext"]
    assert container["allowPrivilegeEscalation"] is False and container["capabilities"]["drop"] == ["ALL"]
    if container.get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts(pod), "a read-only root needs /tmp (the engines' sockets, cubins, metrics)"
    assert pod.spec["automountServiceAccountToken"] is False and pod.spec["enableServiceLinks"] is False


def mounts(pod: Pod) -> dict[str, dict[str, Any]]:
    """Each mount path of the container, with the volume mounted there."""
    volumes = {volume["name"]: volume for volume in pod.spec.get("volumes", [])}
    return {mount["mountPath"]: volumes[mount["name"]] for mount in pod.container.get("volumeMounts", [])}


def check_kernel_cache(pod: Pod) -> None:
    """CuPy's kernel cache is the image's CUPY_CACHE_DIR, and a volume is mounted there."""
    path = pod.environment().get("CUPY_CACHE_DIR", SERVICE_ENV["CUPY_CACHE_DIR"])
    assert path == SERVICE_ENV["CUPY_CACHE_DIR"], "the image's VOLUME, where its tests expect the cache"
    assert path in mounts(pod), f"nothing is mounted at {path}: the root is read-only, and a restart would recompile"


ENGINE_BYTES = 2 << 30
"""What the memory limit keeps for the engine process beside the HTTP workers' memory: its CUDA context, CuPy and
the compiled kernels, its pinned staging buffers."""


def check_memory(pod: Pod) -> None:
    """The memory limit holds every HTTP worker's shared memory (which the engines pin) and kept body buffers, and
    the engine's own, with the HTTP workers and shared memory the service sets or derives on small nodes and large
    ones (it derives fewer workers where the limit is small: the limit must still leave the engine its share)."""
    limit = quantity_bytes(pod.container["resources"]["limits"]["memory"])
    for cpus in NODE_CPU_COUNTS:
        settings = settings_of(pod, cpus)
        needed = settings.http_workers * (settings.slab_bytes + KEPT_BODY_BYTES) + ENGINE_BYTES
        assert limit > needed, (
            f"a {limit} B limit for {settings.http_workers} HTTP worker(s) needing {needed} B ({cpus} CPUs)"
        )


POD_CHECKS = [
    check_environment, check_probes, check_port, check_shutdown, check_security, check_kernel_cache, check_memory,
]  # fmt: skip


def query_selectors(query: str) -> Iterator[tuple[str, dict[str, tuple[str, str]]]]:
    """Each metric a PromQL query selects, with its label matchers (label -> (operator, value))."""
    for metric, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", query):
        found = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers)
        yield metric, {label: (operator, value) for label, operator, value in found}


def check_queue_depth_query(query: str, namespace: str, deployment: str) -> None:
    """The query reads a gauge the service exports, in the workload's namespace, from its Deployment's pods alone."""
    selected = list(query_selectors(query))
    assert selected, f"no metric selector in {query!r}"
    for metric, matchers in selected:
        assert metric in exported_gauges(), f"{metric} is not a gauge the service exports"
        assert matchers.get("namespace") == ("=", namespace), f"{metric}: not the namespace {namespace}"
        operator, pods = matchers["pod"]
        assert operator == "=~" and re.fullmatch(pods, f"{deployment}-7d9f8c6b5-x2x4z"), "misses the pods"
        assert not re.fullmatch(pods, f"{deployment}-canary-7d9f8c6b5-x2x4z"), "takes another Deployment's pods"


def check_queue_depth_target(pod: Pod, threshold: str) -> None:
    """Pods are added while the queues have room: the target per pod is below what its engines' queues hold
    (MATMUL_QUEUE_SIZE each), past which requests get 503."""
    settings = settings_of(pod)
    capacity = settings.queue_size * len(settings.devices)
    assert 0 < float(threshold) < capacity, f"target {threshold} waiting products per pod; its queues hold {capacity}"
