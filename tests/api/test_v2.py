"""The Open Inference Protocol v2 through the ASGI app: every route, JSON and binary tensors, every error."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import orjson
import pytest

from app import codecs
from app.config import Settings
from matmul_client.client import encode_payload
from matmul_tools.bodies import load_npy
from numerics.reference import assert_close_to_reference
from tests.fakes import record_staging

pytestmark = pytest.mark.anyio


def tensor(name: str, array: np.ndarray, binary: bool = False) -> dict[str, object]:
    datatype = {"float32": "FP32", "float64": "FP64"}[array.dtype.name]
    t: dict[str, object] = {"name": name, "shape": list(array.shape), "datatype": datatype}
    if binary:
        t["parameters"] = {"binary_data_size": array.nbytes}
    else:
        t["data"] = array.reshape(-1).tolist()
    return t


def binary_request(a: np.ndarray, b: np.ndarray, **doc: object) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps({"inputs": [tensor("A", a, True), tensor("B", b, True)], **doc})
    body = header + a.astype(a.dtype.newbyteorder("<")).tobytes() + b.tobytes()
    return body, {"inference-header-content-length": str(len(header)), "content-type": "application/octet-stream"}


def split_binary(r: httpx.Response) -> tuple[dict[str, object], bytes]:
    size = int(r.headers["inference-header-content-length"])
    return orjson.loads(r.content[:size]), r.content[size:]


async def test_server_and_model_metadata(client: httpx.AsyncClient) -> None:
    server = (await client.get("/v2")).json()
    assert server["name"] == "matmul-service"
    assert {"binary_tensor_data", "statistics", "model_configuration"} <= set(server["extensions"])
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200
    meta = (await client.get("/v2/models/matmul")).json()
    assert meta["versions"] == ["1"]
    assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [("A", [-1, -1]), ("B", [-1, -1])]
    assert meta["outputs"][0]["name"] == "C"
    assert (await client.get("/v2/models/matmul_numpy/versions/1")).json()["name"] == "matmul_numpy"
    assert (await client.get("/v2/models/matmul/ready")).status_code == 200
    config = (await client.get("/v2/models/matmul/config")).json()
    assert config["max_batch_size"] == 0
    assert [t["name"] for t in config["input"]] == ["A", "B"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("nested", [False, True])
async def test_infer_with_json_tensors(client: httpx.AsyncClient, dtype: str, nested: bool) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 3)).astype(dtype), rng.standard_normal((3, 4)).astype(dtype)
    inputs = [tensor("A", a), tensor("B", b)]
    if nested:
        inputs[0]["data"], inputs[1]["data"] = a.tolist(), b.tolist()
    r = await client.post("/v2/models/matmul/infer", json={"id": "r1", "inputs": inputs})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_name"] == "matmul" and doc["id"] == "r1"
    (output,) = doc["outputs"]
    assert output["name"] == "C" and output["shape"] == [5, 4]
    assert output["datatype"] == {"float32": "FP32", "float64": "FP64"}[dtype]
    assert_close_to_reference(np.array(output["data"]).reshape(5, 4), a, b, np.dtype(dtype))
    assert "kernel;dur=" in r.headers["server-timing"]


@pytest.mark.parametrize("ask", ["request_parameter", "output_parameter"])
async def test_infer_with_binary_tensors_both_ways(client: httpx.AsyncClient, ask: str) -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((7, 9)).astype(np.float32), rng.standard_normal((9, 2)).astype(np.float32)
    doc: dict[str, object] = (
        {"parameters": {"binary_data_output": True}}
        if ask == "request_parameter"
        else {"outputs": [{"name": "C", "parameters": {"binary_data": True}}]}
    )
    body, headers = binary_request(a, b, **doc)
    r = await client.post("/v2/models/matmul_numpy/versions/1/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    header, data = split_binary(r)
    output = header["outputs"][0]  # type: ignore[index]
    assert output["parameters"] == {"binary_data_size": 7 * 2 * 4}
    assert_close_to_reference(np.frombuffer(data, "<f4").reshape(7, 2), a, b, np.dtype(np.float32))


async def test_mixed_binary_and_json_inputs(client: httpx.AsyncClient) -> None:
    a, b = np.eye(3, dtype=np.float64), np.arange(6, dtype=np.float64).reshape(3, 2)
    header = orjson.dumps({"inputs": [tensor("A", a), tensor("B", b, True)]})
    headers = {"inference-header-content-length": str(len(header))}
    r = await client.post("/v2/models/matmul/infer", content=header + b.tobytes(), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == b.reshape(-1).tolist()


def raw(name: str, shape: list[int], datatype: str, data: list[object]) -> dict[str, object]:
    """A tensor written out field by field, for what `tensor` would not write (a lying shape, a bad datatype)."""
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def ab(**override: object) -> dict[str, object]:
    return {"inputs": [tensor("A", np.ones((2, 3), np.float32)), tensor("B", np.ones((3, 2), np.float32))], **override}


@pytest.mark.parametrize("kernel", ["naive", "tiled"])
async def test_the_emulated_kernels_are_models_of_their_own(client: httpx.AsyncClient, kernel: str) -> None:
    assert (await client.get(f"/v2/models/matmul_{kernel}/ready")).status_code == 200
    r = await client.post(f"/v2/models/matmul_{kernel}/infer", json=ab())
    assert r.status_code == 200, r.text
    assert r.json()["parameters"]["kernel"] == kernel and r.json()["outputs"][0]["data"] == [3.0] * 4
    assert r.json()["parameters"]["batch_size"] == 1
    r = await client.post("/v2/models/matmul/infer", json=ab(parameters={"kernel": kernel, "tile": 8}))
    assert r.status_code == (200 if kernel == "tiled" else 422), r.text


async def test_a_model_of_one_kernel_keeps_the_requests_other_parameters(client: httpx.AsyncClient) -> None:
    """matmul_numpy fixes the kernel alone: the precision asked for is the one computed in, never dropped."""
    r = await client.post("/v2/models/matmul_numpy/infer", json=ab(parameters={"precision": "bf16"}))
    assert r.status_code == 200, r.text
    assert (r.json()["parameters"]["kernel"], r.json()["parameters"]["precision"]) == ("numpy", "bf16")


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "words"),
    [
        ("/v2/models/nope/infer", {"json": ab()}, 404, "unknown model 'nope'"),
        ("/v2/models/matmul/versions/2/infer", {"json": ab()}, 404, "no version '2'"),
        (
            "/v2/models/matmul/infer",
            {"content": b"{", "headers": {"content-type": "application/json"}},
            422,
            "not valid JSON",
        ),
        ("/v2/models/matmul/infer", {"json": {"inputs": "x"}}, 422, "needs a list 'inputs'"),
        (
            "/v2/models/matmul/infer",
            {"json": {"inputs": [tensor("A", np.ones((1, 1), np.float32))]}},
            422,
            "exactly ['A', 'B']",
        ),
        (
            "/v2/models/matmul/infer",
            {"json": {"inputs": [tensor("A", np.ones((2, 3), np.float32)), tensor("B", np.ones((2, 3), np.float32))]}},
            422,
            "inner dimensions differ",
        ),
        (
            "/v2/models/matmul/infer",
            {"json": {"inputs": [raw("A", [1, 1], "INT16", [1]), tensor("B", np.ones((1, 1)))]}},
            422,
            "datatype 'INT16'",
        ),
        (
            "/v2/models/matmul/infer",
            {"json": {"inputs": [raw("A", [2, 2], "FP32", [1]), tensor("B", np.ones((2, 1)))]}},
            422,
            "has 1 values but its shape [2, 2] needs 4",
        ),
        (
            "/v2/models/matmul/infer",
            {"json": {"inputs": [raw("A", [1, 2], "FP32", [1, True]), tensor("B", np.ones((2, 1)))]}},
            422,
            "booleans",
        ),
        (
            "/v2/models/matmul/infer",
            {"json": {"inputs": [raw("A", [1], "FP32", [1]), tensor("B", np.ones((1, 1)))]}},
            422,
            "shape of two non-negative integers (a matrix) or three",
        ),
        ("/v2/models/matmul/infer", {"json": ab(parameters={"kernel": "fast"})}, 422, "needs the GPU"),
        ("/v2/models/matmul_numpy/infer", {"json": ab(parameters={"kernel": "auto"})}, 422, "runs kernel 'numpy'"),
        ("/v2/models/matmul/infer", {"json": ab(outputs=[{"name": "D"}])}, 422, "exactly ['C']"),
    ],
)
async def test_errors_use_the_protocol_format(
    client: httpx.AsyncClient, path: str, kwargs: dict[str, object], status: int, words: str
) -> None:
    r = await client.post(path, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}
    assert words in r.json()["error"]


@pytest.mark.parametrize(
    ("lie", "words"),
    [
        ("header_length", "Inference-Header-Content-Length is '9999'"),
        ("size", "binary_data_size is 4"),
        ("extra", "belong to none"),
    ],
)
async def test_binary_framing_that_does_not_add_up(client: httpx.AsyncClient, lie: str, words: str) -> None:
    a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    body, headers = binary_request(a, b)
    if lie == "header_length":
        headers["inference-header-content-length"] = "9999"
    elif lie == "size":
        body = body.replace(b'"binary_data_size":16', b'"binary_data_size":4', 1)
        headers["inference-header-content-length"] = str(int(headers["inference-header-content-length"]) - 1)
    else:
        body += b"\0" * 8
    r = await client.post("/v2/models/matmul/infer", content=body, headers=headers)
    assert r.status_code == 422, r.text
    assert words in r.json()["error"]


@pytest.mark.parametrize(
    ("declared", "status", "words"),
    [
        ("0" * 4400 + "{length}", 200, ""),  # leading zeros are no length: read as the length they end with
        ("0" * 4400 + "9999", 422, "Inference-Header-Content-Length is '0000"),
        ("9" * 5000, 413, "the JSON header is a 5000-digit number of bytes, over the limit of"),
        ("1" + "0" * 19, 413, "the JSON header is a 20-digit number of bytes, over the limit of"),
        ("0" * 100 + "9" * 12, 413, "the JSON header is 999999999999 bytes, over the limit of"),
    ],
    ids=["zeros then the length", "zeros then too long", "5000 nines", "20 digits", "zeros then 12 nines"],
)
async def test_a_header_length_of_thousands_of_digits_is_read_or_refused_never_a_500(
    client: httpx.AsyncClient, declared: str, status: int, words: str
) -> None:
    """Python's int() refuses 4,301 digits and more (ValueError): a length is read from its significant digits
    only, and refused (413 over the JSON limit, 422 past the body's end) rather than converted."""
    a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    body, headers = binary_request(a, b)
    headers["inference-header-content-length"] = declared.format(length=headers["inference-header-content-length"])
    r = await client.post("/v2/models/matmul/infer", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert words in r.text


async def test_a_content_length_of_thousands_of_digits_is_read_or_refused_never_a_500(
    client: httpx.AsyncClient,
) -> None:
    """The same for Content-Length on the product routes: leading zeros aside, its value; past the limit, a 413."""
    a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    body, headers = binary_request(a, b)
    for declared, status in (("0" * 4400 + str(len(body)), 200), ("9" * 5000, 413)):
        sent = {**headers, "content-length": declared}
        r = await client.post("/v2/models/matmul/infer", content=body, headers=sent)
        assert r.status_code == status, r.text


async def test_statistics_count_successes_failures_and_stages(client: httpx.AsyncClient) -> None:
    for _ in range(3):
        assert (await client.post("/v2/models/matmul_numpy/infer", json=ab())).status_code == 200
    assert (await client.post("/v2/models/matmul_numpy/infer", json={"inputs": []})).status_code == 422
    (stats,) = (await client.get("/v2/models/matmul_numpy/stats")).json()["model_stats"]
    assert stats["name"] == "matmul_numpy" and stats["version"] == "1"
    assert stats["inference_count"] == 3 and stats["execution_count"] == 3
    assert abs(stats["last_inference"] - time.time() * 1e3) < 60e3  # milliseconds since the epoch
    parts = stats["inference_stats"]
    assert parts["success"]["count"] == 3 and parts["fail"]["count"] == 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert parts[stage]["count"] == 3 and parts[stage]["ns"] > 0
    every = (await client.get("/v2/models/stats")).json()["model_stats"]
    assert {s["name"] for s in every} == {"matmul", "matmul_naive", "matmul_tiled", "matmul_numpy"}


async def test_only_the_versioned_routes_take_a_version(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    for path, item in spec["paths"].items():
        if path.startswith("/v2/models/{model}"):
            names = {p["name"] for op in item.values() for p in op.get("parameters", [])}
            assert ("version" in names) == ("{version}" in path), path
    r = await client.get("/v2/models/matmul/versions/2/ready")
    assert r.status_code == 404 and "no version '2'" in r.json()["error"]
    r = await client.get("/v2/models/nope/versions/1/config")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v2/nope", 404), ("GET", "/v2/models/matmul/infer/more", 404), ("DELETE", "/v2/health/live", 405)],
)
async def test_unknown_routes_and_wrong_methods_answer_in_the_protocols_format(
    client: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    """Routing's own 404 and 405 under /v2 were in the service's format, which the protocol's clients do not parse."""
    r = await client.request(method, path)
    assert r.status_code == status and set(r.json()) == {"error"}, r.text
    if status == 405:
        assert r.headers["allow"] == "GET"


async def test_outside_v2_routing_answers_in_the_services_format(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


@pytest.mark.parametrize("request_id", [5, 1.5, True, ["x"], {"x": [1]}])
async def test_an_infer_id_that_is_not_a_string_is_a_400(client: httpx.AsyncClient, request_id: object) -> None:
    """It was echoed as its Python repr ("{'x': [1]}")."""
    r = await client.post("/v2/models/matmul/infer", json=ab(id=request_id))
    assert r.status_code == 400, r.text
    assert "the request's 'id' must be a string" in r.json()["error"]


async def test_a_string_infer_id_is_echoed(client: httpx.AsyncClient) -> None:
    r = await client.post("/v2/models/matmul/infer", json=ab(id="req-1"))
    assert r.status_code == 200 and r.json()["id"] == "req-1"


@pytest.mark.parametrize("route", ["matmul npy", "v2 binary"])
async def test_large_binary_operands_are_read_into_shared_memory_and_not_copied_again(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A body of at least 1 MiB is read into the HTTP worker's shared memory; float32 operands aligned there (the
    project's client aligns `.npy` data, the server aligns what follows a v2 JSON header) go to the engine where they
    lie: nothing is staged, and the product is right."""
    staged = record_staging(monkeypatch)
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((384, 512), dtype=np.float32), rng.standard_normal((512, 256), dtype=np.float32)
    if route == "matmul npy":
        payload = encode_payload(a, b)
        headers = {"content-type": payload.content_type, "accept": codecs.NPY_MEDIA_TYPE}
        r = await client.post("/matmul", content=payload.content, headers=headers)
        c = load_npy(r.content)
    else:
        body, headers = binary_request(a, b, parameters={"binary_data_output": True})
        r = await client.post("/v2/models/matmul/infer", content=body, headers=headers)
        c = np.frombuffer(split_binary(r)[1], "<f4").reshape(384, 256)
    assert r.status_code == 200 and len(r.request.content) >= 1 << 20
    assert staged == []
    assert_close_to_reference(c, a, b, np.dtype(np.float32))


@pytest.mark.parametrize("cpu_settings", [Settings(backend="cpu", inline_codec_bytes=64 << 10)])
async def test_binary_tensors_past_the_inline_size_are_decoded_on_the_loop_a_json_body_of_that_size_off_it(
    client: httpx.AsyncClient, cpu_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The codec reads a binary body's JSON header only (its tensors are views of the body): sending that to a thread
    cost a v2 product of 4096^2 about 2 ms of its time. A JSON body of as many bytes is parsed off the loop."""
    decoded_in: list[int] = []
    decode = codecs.decode_infer

    def spied(*args: object) -> object:
        decoded_in.append(threading.get_ident())
        return decode(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(codecs, "decode_infer", spied)
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((600, 500), np.float32), rng.standard_normal((500, 400), np.float32)  # 2 MiB body
    body, headers = binary_request(a, b, outputs=[{"name": "C", "parameters": {"binary_data": True}}])
    assert len(body) > 1 << 20
    binary = await client.post("/v2/models/matmul/infer", content=body, headers=headers)
    x, y = rng.standard_normal((90, 100), np.float32), rng.standard_normal((100, 80), np.float32)
    as_json = orjson.dumps({"inputs": [tensor("A", x), tensor("B", y)]})
    assert len(as_json) > 64 << 10
    json_answer = await client.post("/v2/models/matmul/infer", content=as_json)
    assert binary.status_code == 200 and json_answer.status_code == 200
    loop_thread = threading.get_ident()
    assert decoded_in[0] == loop_thread and decoded_in[1] != loop_thread
    _, c = split_binary(binary)
    assert_close_to_reference(np.frombuffer(c, np.float32).reshape(600, 400), a, b, np.float32)
