"""Stacks of products (app/shapes.py) through the real ASGI app and its engine process on the CPU backend: every
encoding of /matmul and v2 over HTTP, NumPy's broadcasting of a matrix or a stack of one, B = 1 and B = 0, and what
is refused; every answer against the float64 product of its own operands."""

from __future__ import annotations

import httpx
import numpy as np
import orjson
import pytest

from app.config import Settings
from matmul_tools.bodies import MULTIPART_CONTENT_TYPE, load_npy, multipart_body, npy_bytes, npz_bytes
from numerics.reference import assert_close_to_reference

pytestmark = pytest.mark.anyio

# (a's shape, b's shape, the answer's)
STACKS = [
    ((3, 4, 5), (3, 5, 2), (3, 4, 2)),
    ((3, 4, 5), (5, 2), (3, 4, 2)),  # a matrix broadcast against a stack, on either side
    ((4, 5), (3, 5, 2), (3, 4, 2)),
    ((1, 4, 5), (3, 5, 2), (3, 4, 2)),  # a stack of one, too
    ((3, 4, 5), (1, 5, 2), (3, 4, 2)),
    ((1, 4, 5), (1, 5, 2), (1, 4, 2)),
    ((0, 4, 5), (0, 5, 2), (0, 4, 2)),
    ((0, 4, 5), (5, 2), (0, 4, 2)),
    ((2, 0, 5), (2, 5, 3), (2, 0, 3)),  # degenerate matrices inside a stack
    ((2, 3, 0), (2, 0, 4), (2, 3, 4)),
]


def stack_operands(a_shape: tuple[int, ...], b_shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)


@pytest.mark.parametrize(("a_shape", "b_shape", "answer"), STACKS[:6], ids=str)  # JSON has no empty stack's shape
async def test_a_json_stack_is_multiplied_as_numpy_matmul_multiplies_it(
    client: httpx.AsyncClient, a_shape: tuple[int, ...], b_shape: tuple[int, ...], answer: tuple[int, ...]
) -> None:
    a, b = stack_operands(a_shape, b_shape)
    r = await client.post("/matmul", json={"a": a.tolist(), "b": b.tolist()})
    assert r.status_code == 200, r.text
    doc = r.json()
    c = np.array(doc["result"], np.float32).reshape(answer)
    assert doc["shape"] == list(answer) and np.matmul(a, b).shape == answer
    assert_close_to_reference(c, a, b, np.float32)
    assert doc["batch_size"] == answer[0]  # the whole stack in one launch
    assert r.headers["x-matmul-shape"] == "x".join(map(str, answer))


@pytest.mark.parametrize(("a_shape", "b_shape", "answer"), STACKS, ids=str)
@pytest.mark.parametrize("container", ["npy", "npz"])
async def test_an_npy_or_npz_stack_comes_back_as_a_stack(
    client: httpx.AsyncClient,
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    answer: tuple[int, ...],
    container: str,
) -> None:
    a, b = stack_operands(a_shape, b_shape, seed=1)
    if container == "npy":
        body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))])
        headers = {"content-type": MULTIPART_CONTENT_TYPE, "accept": "application/x-npy"}
    else:
        body = npz_bytes(a=a, b=b)
        headers = {"content-type": "application/x-npz", "accept": "application/x-npy"}
    r = await client.post("/matmul", content=body, headers=headers)
    assert r.status_code == 200, r.text
    c = load_npy(r.content)
    assert c.shape == answer and r.headers["x-matmul-shape"] == "x".join(map(str, answer))
    assert_close_to_reference(c, a, b, np.float32)


@pytest.mark.parametrize(("a_shape", "b_shape"), [((0, 4, 5), (0, 5, 2)), ((0, 4, 5), (5, 2)), ((3, 4, 5), (3, 5, 2))])
async def test_a_stacks_rates_are_its_launchs_and_an_empty_one_has_none(
    client: httpx.AsyncClient, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> None:
    """roofline.md: `flops` is each product's, `batch_size` the products of the launch, and the rates the launch's;
    an empty stack ran no arithmetic, so it has no rates to give (null, their headers left out), not rates of 0."""
    a, b = stack_operands(a_shape, b_shape)
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))])
    r = await client.post("/matmul", content=body, headers={"content-type": MULTIPART_CONTENT_TYPE})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["batch_size"] == a_shape[0] and answer["roofline"]["flops"] == 2 * 4 * 2 * 5
    rates = (answer["gflops"], answer["roofline"]["global_gbps"], answer["roofline"]["peak_fraction"])
    if a_shape[0] == 0:
        assert rates == (None, None, None)
    else:
        kernel_s = answer["timing"]["kernel_ms"] / 1e3
        assert answer["gflops"] == pytest.approx(3 * 2 * 4 * 2 * 5 / kernel_s / 1e9)
    npy = await client.post(
        "/matmul", content=body, headers={"content-type": MULTIPART_CONTENT_TYPE, "accept": "application/x-npy"}
    )
    assert ("x-matmul-gflops" in npy.headers) is (a_shape[0] > 0)
    assert ("x-matmul-roofline-global-gbps" in npy.headers) is (a_shape[0] > 0)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_a_v2_stack_keeps_its_batch_dimension(client: httpx.AsyncClient, binary: bool) -> None:
    a, b = stack_operands((5, 3, 4), (4, 6), seed=2)
    inputs, blobs = [], []
    for name, x in (("A", a), ("B", b)):
        tensor: dict[str, object] = {"name": name, "shape": list(x.shape), "datatype": "FP32"}
        if binary:
            tensor["parameters"] = {"binary_data_size": x.nbytes}
            blobs.append(x.tobytes())
        else:
            tensor["data"] = x.ravel().tolist()
        inputs.append(tensor)
    header = orjson.dumps({"inputs": inputs, "outputs": [{"name": "C", "parameters": {"binary_data": binary}}]})
    headers = {"inference-header-content-length": str(len(header))} if binary else {}
    r = await client.post("/v2/models/matmul/infer", content=header + b"".join(blobs), headers=headers)
    assert r.status_code == 200, r.text
    if binary:
        length = int(r.headers["inference-header-content-length"])
        output = orjson.loads(r.content[:length])["outputs"][0]
        c = np.frombuffer(r.content[length:], np.float32).reshape(output["shape"])
    else:
        output = r.json()["outputs"][0]
        c = np.array(output["data"], np.float32).reshape(output["shape"])
    assert output["shape"] == [5, 3, 6]
    assert_close_to_reference(c, a, b, np.float32)


@pytest.mark.parametrize(
    ("a", "b", "says", "location"),
    [
        (np.ones((3, 2, 2)), np.ones((2, 2, 2)), "'a' holds 3 matrices and 'b' 2", ["b", 0]),
        (np.ones((3, 2, 2)), np.ones((3, 3, 2)), "inner dimensions differ: 'a' is 2x2 and 'b' is 3x2", ["b", 1]),
        (np.ones((2, 1, 2, 2)), np.ones((2, 2)), "got 4-D with shape [2, 1, 2, 2]", ["a"]),
    ],
    ids=["batches differ", "inner dimensions", "two leading dimensions"],
)
async def test_stacks_that_do_not_pair_up_are_refused_saying_why(
    client: httpx.AsyncClient, a: np.ndarray, b: np.ndarray, says: str, location: list[object]
) -> None:
    for body, headers in (
        (orjson.dumps({"a": a.tolist(), "b": b.tolist()}), {"content-type": "application/json"}),
        (multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))]), {"content-type": MULTIPART_CONTENT_TYPE}),
    ):
        r = await client.post("/matmul", content=body, headers=headers)
        assert r.status_code == 422, r.text
        error = r.json()
        assert says in error["message"] and error["location"] == location


@pytest.mark.parametrize("cpu_settings", [Settings(backend="cpu", max_result_elements=1000)])
async def test_the_result_limit_counts_every_matrix_of_the_stack(
    client: httpx.AsyncClient, cpu_settings: Settings
) -> None:
    """Each matrix of the answer is small (2 x 2); the stack of 251 of them is not."""
    a, b = stack_operands((251, 2, 1), (1, 2))
    body = multipart_body([("a", npy_bytes(a)), ("b", npy_bytes(b))])
    r = await client.post("/matmul", content=body, headers={"content-type": MULTIPART_CONTENT_TYPE})
    assert r.status_code == 422, r.text
    assert r.json()["message"] == "matrix 'result' has 1004 elements, over the limit of 1000"
