"""Probes, /v1/info, /v1/kernels and the OpenAPI document."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.anyio


async def test_probes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"status": "ready"}


async def test_info_names_backend_device_and_kernels(client: httpx.AsyncClient) -> None:
    info = (await client.get("/v1/info")).json()
    assert info["backend"] == "cpu" and info["state"] == "ready"
    (device,) = info["devices"]
    assert device["why_cpu"] == "MATMUL_BACKEND=cpu" and device["state"] == "ready" and device["queue_depth"] == 0
    assert info["queue"] == {"size": 64, "depth": 0}
    assert [k["name"] for k in info["kernels"]] == ["auto", "numpy"]


async def test_kernels(client: httpx.AsyncClient) -> None:
    listing = (await client.get("/v1/kernels")).json()
    assert listing["backend"] == "cpu" and listing["default"] == "auto" and listing["auto"] == []
    assert {k["name"]: k["kind"] for k in listing["kernels"]} == {"auto": "auto", "numpy": "library"}


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
    assert {p["name"] for p in post["parameters"]} == {"kernel", "tile", "dtype"}
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
