"""deploy/kserve/inferenceservice.yaml, checked without a cluster: the InferenceService against KServe's CRD (vendored),
the ConfigMap against the Kubernetes schemas, the predictor's pod against the service as the chart's is
(tests/deploy/manifests.py), and against what KServe reads of a custom container.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.deploy.manifests import (
    POD_CHECKS,
    Pod,
    check_queue_depth_query,
    check_queue_depth_target,
    check_schemas,
    load_documents,
)
from tests.deploy.test_helm_chart import render
from tests.scripts import ROOT

MANIFEST = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
# What KServe reads of a custom predictor (pkg/constants, pkg/apis/serving/v1beta1/predictor_custom.go): the model
# server is the container of this name, and its protocol is the value of this variable.
KSERVE_CONTAINER, KSERVE_PROTOCOL_VARIABLE = "kserve-container", "PROTOCOL"


def documents() -> list[dict[str, Any]]:
    return load_documents(MANIFEST.read_text())


def inference_service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [service] = [document for document in objects if document["kind"] == "InferenceService"]
    return service


def predictor_pod(objects: list[dict[str, Any]]) -> Pod:
    """The predictor's pod: KServe inlines a PodSpec in the predictor, and puts its annotations on the pod. The
    container's PROTOCOL is KServe's, not the service's, so it is left out of what the pod checks see."""
    predictor = dict(inference_service(objects)["spec"]["predictor"])
    [container] = predictor["containers"]
    environment = [v for v in container["env"] if v["name"] != KSERVE_PROTOCOL_VARIABLE]
    predictor["containers"] = [{**container, "env": environment}]
    return Pod(predictor, predictor.get("annotations", {}), objects)


def check_kserve(objects: list[dict[str, Any]]) -> None:
    """A custom container on the v2 protocol, in plain Deployments (Standard mode), its settings in its namespace."""
    service = inference_service(objects)
    [container] = service["spec"]["predictor"]["containers"]
    assert container["name"] == KSERVE_CONTAINER, "KServe would not take it for the model server"
    protocol = {v["name"]: v.get("value") for v in container["env"]}.get(KSERVE_PROTOCOL_VARIABLE)
    assert protocol == "v2", "KServe takes a custom container without PROTOCOL=v2 for a v1 one"
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    namespaces = {document["metadata"]["namespace"] for document in objects}
    assert namespaces == {service["metadata"]["namespace"]}, "envFrom reads ConfigMaps of the pod's namespace"
    for kind, probe in {k: container[f"{k}Probe"] for k in ("startup", "readiness", "liveness")}.items():
        assert probe["httpGet"]["path"].startswith("/v2/health/"), f"{kind}: the v2 protocol's own health route"


def check_autoscaler(objects: list[dict[str, Any]]) -> None:
    """KServe has KEDA keep the predictor's Deployment at the queue-depth target, through the trigger it makes of the
    External metric (its threshold is the target's value)."""
    service = inference_service(objects)
    assert service["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "keda"
    predictor = service["spec"]["predictor"]
    assert 1 <= predictor["minReplicas"] <= predictor["maxReplicas"]
    [metric] = predictor["autoScaling"]["metrics"]
    external = metric["external"]
    assert metric["type"] == "External" and external["metric"]["backend"] == "prometheus"
    deployment = f"{service['metadata']['name']}-predictor"
    check_queue_depth_query(external["metric"]["query"], service["metadata"]["namespace"], deployment)
    check_queue_depth_target(predictor_pod(objects), external["target"]["value"])


def pod_check(check: Callable[[Pod], None]) -> Callable[[list[dict[str, Any]]], None]:
    return lambda objects: check(predictor_pod(objects))


CHECKS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "schemas": check_schemas,
    "kserve": check_kserve,
    "autoscaler": check_autoscaler,
    **{check.__name__.removeprefix("check_"): pod_check(check) for check in POD_CHECKS},
}


@pytest.mark.parametrize("check", list(CHECKS), ids=list(CHECKS))
def test_the_inference_service_agrees_with_kserve_and_the_service(check: str) -> None:
    CHECKS[check](documents())


def test_the_predictor_runs_the_pod_of_the_charts_defaults() -> None:
    """One pod, two ways to deploy it: the settings, resources, user, probes' timing and shutdown are the chart's."""
    chart = render()
    [chart_settings] = chart.of_kind("ConfigMap")
    [kserve_settings] = [document for document in documents() if document["kind"] == "ConfigMap"]
    # KServe routes one port of a custom predictor: its pod serves no gRPC
    assert kserve_settings["data"] == {**chart_settings["data"], "MATMUL_GRPC_PORT": "0"}
    ours, theirs = predictor_pod(documents()), chart.pod
    for field in ("securityContext", "terminationGracePeriodSeconds", "tolerations", "volumes"):
        assert ours.spec[field] == theirs.spec[field], field
    for field in ("resources", "securityContext", "lifecycle", "volumeMounts", "env"):
        assert ours.container[field] == theirs.container[field], field
    for kind in ("startup", "readiness", "liveness"):
        timing = {key: value for key, value in ours.container[f"{kind}Probe"].items() if key != "httpGet"}
        assert timing == {key: value for key, value in theirs.container[f"{kind}Probe"].items() if key != "httpGet"}
