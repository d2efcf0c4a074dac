"""The Helm chart in deploy/kubernetes, rendered by the real `helm` (the `test` extra's helm-binary) and checked
without a cluster: `helm lint`, every object against the schemas of KUBERNETES_VERSIONS and the vendored CRDs, and
every object against the service (tests/deploy/manifests.py) for several sets of values.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from app import __version__
from app.config import BackendChoice
from app.main import create_app
from tests.conftest import _client_for
from tests.deploy.manifests import (
    KUBERNETES_VERSIONS,
    POD_CHECKS,
    SECRET_VARIABLE,
    Pod,
    check_queue_depth_query,
    check_queue_depth_target,
    check_schemas,
    exported_gauges,
    load_documents,
    probes,
    served_routes,
    settings_of,
)
from tests.deploy.test_deploy_files import run_tool
from tests.scripts import ROOT

CHART = ROOT / "deploy" / "kubernetes" / "matmul-service"
RELEASE, NAMESPACE = "matmul-service", "serving"
VALUES = {
    "defaults": [],
    "two GPUs, four HTTP workers, HPA, keys, ServiceMonitor": [
        "gpus=2",
        "httpWorkers=4",
        "autoscaling.mode=hpa",
        "apiKeys.keys={first-key,second-key}",
        "metrics.serviceMonitor.enabled=true",
        "settings.MATMUL_BATCHING=true",
    ],
    "an ingress on a host, a longer keep-alive": [
        "ingress.enabled=true",
        "ingress.host=gpu.example",
        "keepAliveTimeoutSeconds=900",
    ],
    "existing Secret, fixed replicas, a kernel-cache claim": [
        "apiKeys.existingSecret=matmul-keys",
        "autoscaling.mode=none",
        "replicaCount=3",
        "kernelCache.existingClaim=kernel-cache",
        "metrics.serviceMonitor.enabled=true",
        "metrics.podAnnotations=false",
    ],
}


@dataclass(frozen=True)
class Release:
    """The objects `helm template` renders for one set of values."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [document for document in self.objects if document["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        [document] = self.of_kind(kind)
        return document

    @property
    def deployment(self) -> dict[str, Any]:
        return self.one("Deployment")

    @property
    def pod(self) -> Pod:
        template = self.deployment["spec"]["template"]
        return Pod(template["spec"], template["metadata"].get("annotations", {}), self.objects)


def helm_arguments(values: Sequence[str]) -> list[str]:
    """--set for each value, --set-string for settings (which are strings, as the service reads them)."""
    return [argument for v in values for argument in ("--set-string" if v.startswith("settings.") else "--set", v)]


def render(values: Sequence[str] = ()) -> Release:
    kube_version = f"{KUBERNETES_VERSIONS[0]}.0"
    done = run_tool("helm", "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version,
                    *helm_arguments(values))  # fmt: skip
    assert done.returncode == 0, done.stderr
    return Release(load_documents(done.stdout))


# --------------------------------------------------------------------------------------- the checks


def check_secret(release: Release) -> None:
    """The API keys reach MATMUL_API_KEYS from a Secret, never from a ConfigMap; the ServiceMonitor presents one of
    them, from the same Secret."""
    assert all(SECRET_VARIABLE not in c.get("data", {}) for c in release.of_kind("ConfigMap")), "keys in a ConfigMap"
    environment = {variable["name"]: variable for variable in release.pod.container["env"]}
    monitors = release.of_kind("ServiceMonitor")
    if SECRET_VARIABLE not in environment:
        assert release.of_kind("Secret") == []
        assert all("authorization" not in monitor["spec"]["endpoints"][0] for monitor in monitors)
        return
    reference = environment[SECRET_VARIABLE]["valueFrom"]["secretKeyRef"]
    secrets = [s for s in release.of_kind("Secret") if s["metadata"]["name"] == reference["name"]]
    keys = [key.get_secret_value() for key in settings_of(release.pod).api_keys]
    for monitor in monitors:
        credentials = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
        assert credentials["name"] == reference["name"], "the ServiceMonitor reads another Secret"
        for secret in secrets:
            assert base64.b64decode(secret["data"][credentials["key"]]).decode() in keys, "not a key the pods take"
    for secret in secrets:
        assert reference["key"] in secret["data"] and keys, "the Secret lacks the keys the pods read"


def check_autoscaler(release: Release) -> None:
    """KEDA or the HPA scale the Deployment on the queue depth the service exports, to a target below what its
    queues hold; without them the Deployment's replicas hold."""
    name = release.deployment["metadata"]["name"]
    scaled, hpas = release.of_kind("ScaledObject"), release.of_kind("HorizontalPodAutoscaler")
    assert len(scaled) + len(hpas) <= 1, "two autoscalers would fight over the replicas"
    assert ("replicas" in release.deployment["spec"]) == (not scaled and not hpas), "the autoscaler owns replicas"
    for so in scaled:
        assert so["spec"]["scaleTargetRef"] == {"name": name}
        [trigger] = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        check_queue_depth_query(trigger["metadata"]["query"], NAMESPACE, name)
        check_queue_depth_target(release.pod, trigger["metadata"]["threshold"])
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        [metric] = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] in exported_gauges()
        assert metric["pods"]["target"]["type"] == "AverageValue"
        check_queue_depth_target(release.pod, metric["pods"]["target"]["averageValue"])


def check_wiring(release: Release) -> None:
    """The Service, PodDisruptionBudget and ServiceMonitor find the pods, and the port the service is served on."""
    pod_labels = release.deployment["spec"]["template"]["metadata"]["labels"]
    assert release.deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = release.one("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port, grpc_port = service["spec"]["ports"]
    assert port["name"] == "http" and release.pod.port(port["targetPort"]) == release.pod.port("http")
    assert grpc_port["name"] == "grpc" and release.pod.port(grpc_port["targetPort"]) == release.pod.port("grpc")
    for budget in release.of_kind("PodDisruptionBudget"):
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for monitor in release.of_kind("ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] == port["name"] and endpoint["path"] in served_routes()


INGRESS_NGINX_UPSTREAM_KEEPALIVE_S = 60
"""ingress-nginx's upstream-keepalive-timeout (its controller's ConfigMap): how long it keeps an idle connection to a
pod."""


def check_ingress(release: Release) -> None:
    """The pods hold idle connections longer than ingress-nginx's pool keeps them; an Ingress, where there is one,
    sends every path to the Service's HTTP port with deploy/nginx.conf's proxy settings: bodies streamed both ways up
    to the service's body limit, an answer waited for longer than a product may queue, no second pod for a POST."""
    assert settings_of(release.pod).keep_alive_timeout_s > INGRESS_NGINX_UPSTREAM_KEEPALIVE_S
    service = release.one("Service")
    for ingress in release.of_kind("Ingress"):
        [rule] = ingress["spec"]["rules"]
        [path] = rule["http"]["paths"]
        assert path["path"] == "/" and path["pathType"] == "Prefix"
        backend = path["backend"]["service"]
        assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
        annotations = {
            name.removeprefix("nginx.ingress.kubernetes.io/"): value
            for name, value in ingress["metadata"]["annotations"].items()
        }
        settings = settings_of(release.pod)
        assert annotations["proxy-body-size"] == "1g" and settings.max_body_bytes == 1 << 30
        assert annotations["proxy-request-buffering"] == annotations["proxy-buffering"] == "off"
        assert int(annotations["proxy-read-timeout"]) > settings.request_timeout_s
        assert "non_idempotent" not in annotations["proxy-next-upstream"]


def pod_check(check: Callable[[Pod], None]) -> Callable[[Release], None]:
    return lambda release: check(release.pod)


CHECKS: dict[str, Callable[[Release], None]] = {
    "schemas": lambda release: check_schemas(release.objects),
    "secret": check_secret,
    "autoscaler": check_autoscaler,
    "wiring": check_wiring,
    "ingress": check_ingress,
    **{check.__name__.removeprefix("check_"): pod_check(check) for check in POD_CHECKS},
}


# ---------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module", params=list(VALUES), ids=list(VALUES))
def release(request: pytest.FixtureRequest) -> Release:
    return render(VALUES[request.param])


@pytest.mark.parametrize("values", list(VALUES.values()), ids=list(VALUES))
def test_helm_lint_finds_nothing(values: list[str]) -> None:
    done = run_tool("helm", "lint", "--strict", "--namespace", NAMESPACE, str(CHART), *helm_arguments(values))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("check", list(CHECKS), ids=list(CHECKS))
def test_the_chart_agrees_with_kubernetes_and_the_service(release: Release, check: str) -> None:
    CHECKS[check](release)


def test_by_default_the_chart_deploys_the_service_its_settings_budget_and_autoscaler() -> None:
    kinds = sorted(document["kind"] for document in render().objects)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "ScaledObject", "Service"]


def test_by_default_the_service_derives_its_http_workers_and_shared_memory_from_the_node() -> None:
    """The chart leaves MATMUL_HTTP_WORKERS and MATMUL_SLAB_BYTES unset: on a node of 16 CPUs or more the service
    starts 8 HTTP workers, with 1 GiB of shared memory each within the pod's memory limit, batching without delay."""
    pod = render().pod
    assert {"MATMUL_HTTP_WORKERS", "MATMUL_SLAB_BYTES"}.isdisjoint(pod.environment())
    settings = settings_of(pod, cpus=16)
    assert (settings.http_workers, settings.slab_bytes) == (8, 1 << 30)
    assert settings.batching and settings.max_queue_delay_us == 0
    assert settings_of(pod, cpus=4).http_workers == 2
    assert settings_of(render(["httpWorkers=3"]).pod, cpus=16).http_workers == 3


def test_the_image_is_the_service_at_the_charts_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert render().pod.container["image"] == f"matmul-service:{__version__}"
    assert render(["image.repository=registry.example/matmul", "image.tag=v2"]).pod.container["image"] == (
        "registry.example/matmul:v2"
    )


@pytest.mark.parametrize(
    "value",
    [
        "settings.MATMUL_DEVICES=0",  # the chart derives it from gpus
        "settings.MATMUL_API_KEYS=in-a-configmap",  # keys belong in the Secret
        "resources.limits.nvidia\\.com/gpu=2",  # the chart derives it from gpus
        "settings.QUEUE_SIZE=64",  # not a MATMUL_* variable
        "gpus=0",
        "autoscaling.mode=vpa",
        "autoscaling.targetQueueDepthPerGPU=8",  # a misspelt value
        "keepAliveTimeoutSeconds=60",  # no longer than the pools in front keep a connection
        "settings.MATMUL_KEEP_ALIVE_TIMEOUT_S=900",  # the chart derives it from keepAliveTimeoutSeconds
    ],
)
def test_the_values_schema_refuses_what_cannot_work(value: str) -> None:
    done = run_tool("helm", "template", RELEASE, str(CHART), "--set", value)
    assert done.returncode != 0 and "values don't meet the specifications of the schema" in done.stderr


def test_a_setting_given_as_a_number_is_refused() -> None:
    """Helm reads large numbers as floats (1073741824 would render as 1.073741824e+09): settings are strings."""
    done = run_tool("helm", "template", RELEASE, str(CHART), "--set-json", "settings.MATMUL_SLAB_BYTES=1073741824")
    assert done.returncode != 0 and "settings.MATMUL_SLAB_BYTES" in done.stderr


# ------------------------------------------------------------------------------ the pod, answering


@pytest.fixture
async def keyed_pod() -> AsyncIterator[tuple[Release, httpx.AsyncClient]]:
    """The app with the settings of a pod rendered with API keys, on the CPU backend (no GPU here)."""
    release = render(["apiKeys.keys={first-key,second-key}", "metrics.serviceMonitor.enabled=true"])
    settings = settings_of(release.pod).model_copy(update={"backend": BackendChoice.CPU, "devices": []})
    async for client in _client_for(create_app(settings)):
        yield release, client


@pytest.mark.anyio
async def test_the_kubelet_and_prometheus_get_their_answers(keyed_pod: tuple[Release, httpx.AsyncClient]) -> None:
    """Probes answer without a key, as the kubelet sends none; /metrics needs one, which the ServiceMonitor takes
    from the Secret, and its answer holds the metric the autoscaler reads."""
    release, client = keyed_pod
    for kind, probe in probes(release.pod).items():
        assert (await client.get(probe["httpGet"]["path"])).status_code == 200, kind
    [endpoint] = release.one("ServiceMonitor")["spec"]["endpoints"]
    assert (await client.get(endpoint["path"])).status_code == 401
    key = base64.b64decode(release.one("Secret")["data"][endpoint["authorization"]["credentials"]["key"]]).decode()
    metrics = await client.get(endpoint["path"], headers={"authorization": f"Bearer {key}"})
    assert metrics.status_code == 200
    [trigger] = render().one("ScaledObject")["spec"]["triggers"]
    [metric] = {name for name in exported_gauges() if f"{name}{{" in trigger["metadata"]["query"]}
    assert f"\n{metric} " in metrics.text
